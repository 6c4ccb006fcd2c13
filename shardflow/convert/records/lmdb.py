"""``convert lmdb``: one sample per key of an LMDB database, the value's bytes unchanged.

``SRC`` is a local LMDB environment: a folder holding ``data.mdb``, or the data
file itself (an environment opened with ``subdir=False``). It is opened
read-only and without its lock file (``lmdb.open(readonly=True, lock=False)``),
so a read-only copy works and nothing is written there; it must not be written
to while the conversion runs. Only the main (unnamed) database is read.

Samples, in a seeded shuffle of the keys or in key order (LMDB's byte order; see Order
below). Each value becomes one field,
its bytes unchanged: named from the content by magic bytes (JPEG ``jpg``, PNG
``png``, WebP ``webp``, GIF ``gif``, TIFF ``tif``, BMP ``bmp``, a ``.npy`` array
``npy``; see :mod:`shardflow.convert.records.content`) or, for every value, ``field``
(``--field``). A value of no known format without ``field`` is an error naming
the key. A pickled value (``\\x80`` and a protocol number) is refused with
:class:`~shardflow.errors.PickledValueError` naming the key, unless
``allow_pickle`` (``--allow-pickle``): then it is stored, still unchanged and
never unpickled, under ``field`` or ``pickle`` (which a reader unpickles only
when it opts in too: ``ShardDataset(..., decode=DecodeOptions(allow_pickle=True))``).

Key rule (reversible: ``original_key(key) == raw``, see :func:`tar_key`). The key
is the LMDB key decoded as UTF-8, with ``%XX`` escapes for what a tar key cannot
hold unchanged: ``%`` itself, ``.`` (the webdataset key/field split stops at the
first dot of a basename), ``~``, control characters, bytes that are not UTF-8,
a ``/`` that would leave an empty path component (leading, trailing or doubled)
and the first ``_`` of a basename starting with ``__`` (metadata members).
``n01440764/img_42.JPEG`` becomes ``n01440764/img_42%2EJPEG``; a key that needs
no escape stays as it is (``00000042``). Since the rule is reversible and keys
are unique in LMDB, keys never collide. The manifest's ``meta["keys"]`` says
how many keys were changed, with the first ones as examples.

Parallel over key ranges. This process walks the keys only (LMDB keeps keys in
its B-tree pages, values apart), :data:`SCAN_CHUNK` at a time with the
environment closed in between (an environment open across ``fork`` cannot be
opened in the child); the inputs are the keys, ``max_count`` per task (one
shard), and each worker reads its range of values with one cursor, in order.
Memory: the keys of the tasks in flight here, one value at a time in a worker.
A re-run keeps the finished shards whose keys are unchanged and only if the
database's last transaction id is the same (any write changes it).

Order: by default a seeded shuffle of the keys (``order="shuffled"``,
:mod:`~shardflow.convert.engine.mixorder`), so that a database whose keys sort class by class
(``n01440764/...``) gives shards that mix the classes: every key is listed first (the scan
above), kept packed (:class:`~shardflow.convert.engine.mixorder.PackedInputs`: the key's bytes
plus about 20 bytes each: 64 MB for 1.28 million keys of 30 bytes), then given out in
:func:`~shardflow.convert.engine.mixorder.input_order`'s permutation; a worker reads each value
by its key (one B-tree lookup each). ``order="walk"`` writes in key order with one cursor, as
above. ``meta`` records ``order`` and ``order_seed``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import ConversionError, PickledValueError, missing_dependency
from ...format.keys import check_field
from ...format.manifest import Manifest
from ...storage.urls import is_local, local_path
from .content import content_field, describe_head, is_pickle
from ..engine.engine import ConvertOptions, run_conversion
from ..engine.mixorder import DEFAULT_ORDER, check_order, in_order, order_meta

__all__ = ["convert_lmdb", "count_entries", "tar_key", "original_key", "SCAN_CHUNK", "PICKLE_FIELD"]

log = logging.getLogger(__name__)

SCAN_CHUNK = 4096
"""Keys this process reads from the database at once while it lists them."""

PICKLE_FIELD = "pickle"
"""The field of pickled values stored with ``allow_pickle`` and no ``field``."""

_EXAMPLES = 10
_ESCAPE = re.compile(r"[%.~\x00-\x1f\x7f]|[\udc80-\udcff]")


def _lmdb() -> Any:
    try:
        import lmdb
    except ImportError as e:
        raise missing_dependency("lmdb", "lmdb", "convert lmdb") from e
    return lmdb


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    code = ord(c) - 0xDC00 if "\udc80" <= c <= "\udcff" else ord(c)  # surrogateescape: the raw byte
    return f"%{code:02X}"


def tar_key(raw: bytes) -> str:
    """The sample key of an LMDB key (see the module docstring for the rule).

    Args:
        raw: the LMDB key.

    Returns:
        A key that :func:`shardflow.format.keys.check_key` accepts and that
        :func:`original_key` turns back into ``raw``.
    """
    text = _ESCAPE.sub(_escape_char, raw.decode("utf-8", "surrogateescape"))
    parts = text.split("/")
    out = [parts[0]]
    for part in parts[1:]:
        # a "/" that would leave an empty component (leading, doubled, trailing) is escaped
        if out[-1] == "" or part == "":
            out[-1] += "%2F" + part
        else:
            out.append(part)
    if out[-1].startswith("__"):
        out[-1] = "%5F" + out[-1][1:]
    return "/".join(out)


def original_key(key: str) -> bytes:
    """The LMDB key a sample key was made from (the inverse of :func:`tar_key`)."""
    from urllib.parse import unquote_to_bytes

    return unquote_to_bytes(key)


def _shown(raw: bytes) -> str:
    try:
        return repr(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(raw)


@contextlib.contextmanager
def _environment(path: str) -> Iterator[Any]:
    """The environment, opened read-only without a lock file, closed on exit."""
    lmdb = _lmdb()
    try:
        env = lmdb.open(path, readonly=True, lock=False, subdir=os.path.isdir(path), max_dbs=0, readahead=True)
    except lmdb.Error as e:
        raise ConversionError(f"{path}: cannot open as an LMDB environment: {e}") from e
    try:
        yield env
    finally:
        env.close()


@dataclass(frozen=True)
class _Context:
    path: str
    field: str | None
    allow_pickle: bool
    by_key: bool = False  # the keys are shuffled: look each one up


def _field_of(ctx: _Context, raw: bytes, value: bytes) -> str:
    if is_pickle(value):
        if not ctx.allow_pickle:
            raise PickledValueError(
                f"{ctx.path}: the value of key {_shown(raw)} is a pickle (protocol {value[1]}); shardflow never "
                "unpickles. Pass allow_pickle=True (--allow-pickle) to store it unchanged under the field "
                f"{ctx.field or PICKLE_FIELD!r}, or store the values as raw bytes (images, .npy)"
            )
        return ctx.field or PICKLE_FIELD
    if ctx.field is not None:
        return ctx.field
    ext = content_field(value)
    if ext is None:
        raise ConversionError(
            f"{ctx.path}: the value of key {_shown(raw)} ({describe_head(value)}) is no image or .npy; "
            "name its field with field= (--field), e.g. 'bin' to keep the bytes as they are"
        )
    return ext


def _build(inputs: list[tuple[int, bytes]], ctx: _Context) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Worker: read one key range with one cursor, in order (or, shuffled, each key by a
    lookup), one sample per key."""
    with _environment(ctx.path) as env, env.begin(buffers=False) as txn:
        txnid = env.info()["last_txnid"]
        if ctx.by_key:
            for listed, raw in inputs:
                value = txn.get(raw)
                if listed != txnid or value is None:
                    raise ConversionError(f"{ctx.path}: key {_shown(raw)} is not there as listed: "
                                          "the database changed during the conversion")  # fmt: skip
                yield tar_key(raw), {_field_of(ctx, raw, value): value}
            return
        cursor = txn.cursor()
        positioned = cursor.set_key(inputs[0][1]) if inputs else False
        for listed, raw in inputs:
            if listed != txnid or not positioned or cursor.key() != raw:
                raise ConversionError(f"{ctx.path}: key {_shown(raw)} is not where it was listed: "
                                      "the database changed during the conversion")  # fmt: skip
            value = cursor.value()
            yield tar_key(raw), {_field_of(ctx, raw, value): value}
            positioned = cursor.next()


class _Keys:
    """The keys, read :data:`SCAN_CHUNK` at a time with the environment closed in between."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.count = self.changed = 0
        self.examples: dict[str, str] = {}

    def inputs(self, txnid: int) -> Iterator[tuple[int, bytes]]:
        last: bytes | None = None
        while True:
            chunk = self._chunk(last)
            if not chunk:
                return
            for raw in chunk:
                key = tar_key(raw)
                self.count += 1
                if key.encode("utf-8", "surrogateescape") != raw:
                    self.changed += 1
                    if len(self.examples) < _EXAMPLES:
                        self.examples[key] = raw.decode("utf-8", "backslashreplace")
                yield txnid, raw
            last = chunk[-1]

    def _chunk(self, after: bytes | None) -> list[bytes]:
        with _environment(self.path) as env, env.begin() as txn:
            cursor = txn.cursor()
            if not (cursor.first() if after is None else cursor.set_range(after)):
                return []
            if after is not None and cursor.key() == after and not cursor.next():
                return []
            keys = []
            for raw in cursor.iternext(keys=True, values=False):
                keys.append(raw)
                if len(keys) == SCAN_CHUNK:
                    break
            return keys

    def summary(self) -> dict[str, Any]:
        return {
            "entries": self.count,
            "keys": {"changed": self.changed, "examples": self.examples,
                     "rule": "UTF-8 with %XX escapes; the LMDB key is urllib.parse.unquote_to_bytes(key)"},
        }  # fmt: skip


def convert_lmdb(
    src: str | os.PathLike[str],
    dst: str,
    *,
    field: str | None = None,
    allow_pickle: bool = False,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
    client: Any = None,
    order: str = DEFAULT_ORDER,
    seed: int = 0,
) -> Manifest:
    """Convert an LMDB database into shards, one sample per key (see the module docstring).

    Args:
        src: the LMDB environment: a local folder holding ``data.mdb``, or the data file.
        dst: destination folder (local or fsspec URL).
        field: the field of every value (None: from each value's magic bytes).
        allow_pickle: store pickled values (unchanged, never unpickled) instead
            of refusing them; under ``field`` or ``pickle``.
        options: shard size (keys per shard), workers, resume, storage options
            for ``dst``.
        progress: ``progress(n)`` after every finished shard of ``n`` samples.
        client: a ``dask.distributed.Client``: write the shards as tasks on its
            cluster (its workers must reach ``src`` at the same path, and ``dst``).
        order, seed: ``"shuffled"`` (default: the keys in a seeded permutation, see the
            module docstring) or ``"walk"`` (key order).

    Returns:
        The manifest; ``meta`` holds ``source``, ``field``, ``allow_pickle``,
        ``entries``, ``last_txnid``, ``keys`` (how many keys the key rule
        changed, examples, the rule), ``order`` and ``order_seed``.

    Raises:
        FileNotFoundError: no LMDB environment at ``src``.
        ImportError: the ``lmdb`` package is missing (extra ``lmdb``).
        PickledValueError: a value is a pickle and not ``allow_pickle`` (names the key).
        ConversionError: ``src`` is not a local path or not an LMDB environment;
            a value of no known format without ``field`` (names the key).
        ValueError: an unknown ``order``.
    """
    check_order(order)
    src = os.fspath(src)
    if not is_local(src):
        raise ConversionError(f"{src}: an LMDB database is memory-mapped and must be a local path; copy it first")
    path = os.path.abspath(local_path(src))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{src}: no such LMDB environment")
    if field is not None:
        check_field("<any>", field)
        if field.startswith("__"):
            raise ValueError(f"field names starting with '__' are metadata, got {field!r}")
    with _environment(path) as env:
        txnid, entries = env.info()["last_txnid"], env.stat()["entries"]
    keys = _Keys(path)
    meta = {
        "converter": "lmdb",
        "source": path,
        "field": field if field is not None else "from each value's magic bytes",
        "allow_pickle": allow_pickle,
        "last_txnid": txnid,
        **order_meta(order, seed),
    }
    log.info("%s: %d entries", path, entries)
    return run_conversion(
        dst,
        in_order(keys.inputs(txnid), order, int(seed)),
        _build,
        context=_Context(path, field, allow_pickle, by_key=order != "walk"),
        meta=meta,
        meta_at_end=keys.summary,
        options=options,
        progress=progress,
        client=client,
    )


def count_entries(src: str | os.PathLike[str]) -> int:
    """The number of keys of an LMDB environment (the progress bar's total)."""
    with _environment(os.path.abspath(local_path(os.fspath(src)))) as env:
        return int(env.stat()["entries"])
