"""The key rule of ``convert imagefolder``: a file's path -> a tar-safe, reversible key.

The key is the file's path relative to ``SRC`` with the extension removed,
``/``-separated. Its last component is escaped so that it holds no dot (the
webdataset key/field split stops at the first dot of the basename): ``%`` ->
``%25``, ``.`` -> ``%2E``, ``~`` -> ``%7E``, and a leading ``__`` -> ``%5F_``
(``__`` marks metadata members). When two images in one directory share a stem
(``x.jpg`` and ``x.png``), each of them gets its original extension appended
after a ``~`` (``cat/x~jpg``, ``cat/x~png``), so keys never collide:
``cat/a.b.jpg`` is key ``cat/a%2Eb``, ``cat/x.jpg`` beside ``cat/x.PNG`` is
``cat/x~jpg`` and the other ``cat/x~PNG``. :func:`key_to_path` inverts it.
"""

from __future__ import annotations

import re
from collections import Counter

__all__ = ["key_names", "odd_key_names", "key_to_path"]

_ESCAPES = str.maketrans({"%": "%25", ".": "%2E", "~": "%7E"})
_UNESCAPE = re.compile(r"%([0-9A-F]{2})")


def _escape(stem: str) -> str:
    out = stem.translate(_ESCAPES)
    if out.startswith("__"):
        out = "%5F" + out[1:]
    return out


def key_names(images: list[str]) -> list[str]:
    """The key basenames of one directory's image files (names with an extension), in order.

    See the module docstring: the stem escaped, plus ``~<extension>`` when several
    images of the directory share the stem.
    """
    return _key_names(images)[0]


def odd_key_names(images: list[str]) -> dict[int, str]:
    """``{position: key basename}`` for those of one directory's images whose key basename
    (:func:`key_names`) is not their stem (the name before its last dot): ``{}`` for the
    usual directory, whose names need no escape and share no stem."""
    names, plain = _key_names(images)
    if plain:
        return {}
    return {i: base for i, (base, name) in enumerate(zip(names, images)) if base != name.rpartition(".")[0]}


def _key_names(images: list[str]) -> tuple[list[str], bool]:
    """:func:`key_names`, and whether they are the stems as they are."""
    stems = [name.rpartition(".") for name in images]
    plain = [stem for stem, _, _ in stems]
    if len(set(plain)) == len(plain):  # no stem shared (the usual directory): no suffix
        joined = "/" + "/".join(plain)  # and, mostly, nothing to escape either
        if "%" in joined or "." in joined or "~" in joined or "/__" in joined:
            return [_escape(stem) for stem in plain], False
        return plain, True
    shared = Counter(plain)
    return [_escape(stem) + (f"~{ext}" if shared[stem] > 1 else "") for stem, _, ext in stems], False


def key_to_path(key: str) -> tuple[str, str | None]:
    """Invert the key rule of this module.

    Args:
        key: a key written by :func:`shardflow.convert.images.imagefolder.convert_imagefolder`.

    Returns:
        ``(path, extension)``: the file's path relative to ``SRC`` without its
        extension (``/``-separated), and its extension as spelled on disk when
        the key records it (stems shared by several images of one directory),
        else None (the extension is then the sample's image field, lower-cased).
    """
    head, slash, base = key.rpartition("/")
    stem, tilde, ext = base.partition("~")
    name = _UNESCAPE.sub(lambda m: chr(int(m.group(1), 16)), stem)
    return head + slash + name, (ext if tilde else None)
