"""Exception hierarchy.

Every error raised by shardflow for bad input or failed I/O subclasses
:class:`ShardflowError` and the builtin that fits (``ValueError`` for bad data,
``OSError`` for I/O, ``KeyError`` for missing fields), so callers can catch
either. Messages name where (shard URL, key, member) and what was wrong; the
URLs in them are redacted (:func:`redact`).
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import Any


class ShardflowError(Exception):
    """Base class of all shardflow errors.

    Attributes:
        reason: a short, constant tag for the kind of problem (``"truncated_shard"``,
            ``"missing_field"``, ...), used as the counter name in ``dataset.stats``.
    """

    default_reason = "error"

    def __init__(self, *args: object, reason: str | None = None) -> None:
        # a message never shows a URL's credentials or signature (see redact below)
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))
        self.reason = reason or self.default_reason


class ShardFormatError(ShardflowError, ValueError):
    """A shard is not a valid tar stream (bad header, checksum, truncation).

    Attributes:
        offset: byte offset in the shard where the damaged member's first header
            starts, when the tar reader knows it (else None).
        member: the name of the member being read, when its header was sound.
    """

    default_reason = "bad_shard"
    offset: int | None = None
    member: str | None = None


class TruncatedShardError(ShardFormatError):
    """A shard ends in the middle of a header or of a member's data."""

    default_reason = "truncated_shard"


class SampleError(ShardflowError, ValueError):
    """A sample is malformed: duplicated field, non-adjacent members, undecodable field."""

    default_reason = "bad_sample"


class MissingFieldError(SampleError, KeyError):
    """A requested field is absent from a sample."""

    default_reason = "missing_field"

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class DecodeError(SampleError):
    """A field's bytes could not be decoded by its codec."""

    default_reason = "decode"


class ManifestError(ShardflowError, ValueError):
    """A manifest is missing, malformed, or does not match the shards."""

    default_reason = "manifest"


class StateError(ShardflowError, ValueError):
    """A saved ``state_dict`` does not fit the dataset or loader it is loaded into."""

    default_reason = "state"


class SourceError(ShardflowError, ValueError):
    """Dataset sources that cannot be read together (the same shard reached twice, weights on some only)."""

    default_reason = "source"


class RemoteReadError(ShardflowError, OSError):
    """Reading a shard failed after all retries, or the object changed while being read."""

    default_reason = "remote_read"


class ConversionError(ShardflowError, ValueError):
    """A converter's source is unusable (for example an ImageFolder class with no images)."""

    default_reason = "conversion"


class DestinationExistsError(ConversionError, FileExistsError):
    """A conversion's destination holds another dataset (pass ``overwrite=True`` to replace it)."""

    default_reason = "destination_exists"


class PickledValueError(ConversionError):
    """A converter met a pickled value and the user did not opt in to storing pickles."""

    default_reason = "pickle"


def missing_dependency(package: str, extra: str, purpose: str) -> ImportError:
    """Build the ImportError raised when an optional dependency is absent.

    Args:
        package: the import name that failed (``"torch_geometric"``).
        extra: the pip extra that installs it (``"graphs"``).
        purpose: what needed it (``"decoding 'pyg' fields"``).
    """
    return ImportError(
        f"{purpose} needs the optional package {package!r}; install it with "
        f"`pip install 'shardflow[{extra}]'`"
    )


# ------------------------------------------------------------ keeping secrets out of what is shown
# Keeping credentials out of every error, log line, repr, manifest and conversion record.
#
# One helper for every place shardflow shows a URL or an option: a URL's userinfo
# (``https://user:password@host/``) and its query values named like a secret
# (``X-Amz-Signature``, ``X-Amz-Credential``, Azure SAS ``sig``, ``token``,
# ``access_token``, ``api_key``, ...) become ``***``; so do the values of storage
# options whose name says key, secret, token, password or credential (``key``,
# ``secret``, ``aws_secret_access_key``, ``headers={"X-Api-Key": ...}``,
# ``Authorization``). Redaction is for showing only: the real URL and options
# are what shardflow opens.

MASK = "***"

_SECRET_PARTS = frozenset({
    "key", "secret", "token", "password", "passwd", "pwd", "credential", "credentials", "signature",
    "sig", "auth", "authorization", "apikey", "cookie", "sas",
})
_SECRET_ENDS = ("key", "secret", "token", "password", "credential", "credentials", "signature")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{1,15}://[^\s'\"<>]+")
# a URL's userinfo, whatever it holds (a quote in a password must not end it): up to the last @
# before the first / ? # or white space
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{1,15}://)[^/?#\s]*@")
# ``Name=value`` pairs of a connection string (``AccountKey=...;``, ``SharedAccessSignature=...``)
_PAIR = re.compile(r"(?<![A-Za-z0-9_.-])([A-Za-z][A-Za-z0-9_]*)=([^;&\s'\"]+)")


def is_secret_name(name: str) -> bool:
    """Whether an option or query-parameter name holds a secret.

    ``X-Amz-Signature``, ``sig``, ``access_token``, ``aws_secret_access_key``,
    ``X-Api-Key``, ``Authorization`` and ``password`` do; ``endpoint_url``,
    ``region`` and ``version_aware`` do not. The name is split at every
    non-alphanumeric character and camel-case hump; any part that is one of
    key/secret/token/password/credential/signature/sig/auth (or a name that ends
    so, as ``apikey``) makes it secret.
    """
    if not isinstance(name, str):
        return False
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    parts = [p for p in re.split(r"[^a-z0-9]+", spaced) if p]
    return any(p in _SECRET_PARTS or p.endswith(_SECRET_ENDS) for p in parts)


def redact_url(url: str) -> str:
    """``url`` with its userinfo and secret query values replaced by ``***``.

    ``https://bob:pw@h/x.tar?sig=abc&part=1`` becomes ``https://***@h/x.tar?sig=***&part=1``.
    Anything that does not parse as a URL with a host is returned as it is.
    """
    if "://" not in url:
        return url
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return re.sub(r"(://)[^/?#]*@", r"\1" + MASK + "@", url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = MASK + "@" + netloc.rsplit("@", 1)[1]
    query = parts.query
    if query:
        pieces = []
        for piece in query.split("&"):
            name, eq, _ = piece.partition("=")
            secret = is_secret_name(urllib.parse.unquote_plus(name))
            pieces.append(f"{name}={MASK}" if eq and secret else piece)
        query = "&".join(pieces)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact(text: str) -> str:
    """``text`` with every secret in it redacted: each URL's userinfo (whatever characters the
    password holds) and secret query values (see :func:`redact_url`), and the secret values of
    ``Name=value`` pairs (an Azure connection string's ``AccountKey=...;``).

    The one function for every text shardflow shows (errors, log lines, summaries).
    """
    if not isinstance(text, str):
        return text
    if "=" in text:
        text = _PAIR.sub(lambda m: f"{m.group(1)}={MASK}" if is_secret_name(m.group(1)) else m.group(0), text)
    if "://" not in text:
        return text
    text = _USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)
    return _URL.sub(lambda m: redact_url(m.group(0)), text)


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of storage options whose secret-named values are ``***``, nested mappings too
    (``client_kwargs``, ``headers``), headers given as ``(name, value)`` pairs too, and whose
    text values (``endpoint_url``, ``connection_string``) are redacted (:func:`redact`)."""
    return {k: MASK if is_secret_name(k) and v is not None else redact_value(v) for k, v in options.items()}


def redact_value(value: Any) -> Any:
    """An option value (dicts, lists, strings) with every secret redacted, for a repr; a
    ``(name, value)`` pair whose name is a secret's (``("Authorization", "Bearer ...")``) keeps
    only its name."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return redact_options(value)
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and isinstance(value[0], str) and is_secret_name(value[0]) and value[1] is not None:
            return type(value)((value[0], MASK))
        return type(value)(redact_value(v) for v in value)
    return value


def redact_data(value: Any) -> Any:
    """A JSON-like value of data (a manifest's ``meta``, a conversion record) with the secrets
    in its texts redacted (:func:`redact`: URLs, connection strings); unlike
    :func:`redact_value`, no value is masked for its key's name (a ``key`` or a class named
    ``token`` is data, not a credential)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {k: redact_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_data(v) for v in value)
    return value


def redact_cause(exc: BaseException | None) -> BaseException | None:
    """``exc`` (and its causes and contexts), safe to chain with ``raise ... from``.

    An exception whose message shows a secret gets its string arguments redacted in
    place; one whose message still shows it then (a message built from attributes,
    as aiohttp's) is replaced by a plain ``Exception`` naming its type and the
    redacted message, without its traceback.
    """
    seen: set[int] = set()
    return _redact_chain(exc, seen)


def _redact_chain(exc: BaseException | None, seen: set[int]) -> BaseException | None:
    if exc is None or id(exc) in seen:
        return exc
    seen.add(id(exc))
    exc.__cause__ = _redact_chain(exc.__cause__, seen)
    exc.__context__ = _redact_chain(exc.__context__, seen)
    try:
        text = str(exc)
    except Exception:  # a broken __str__ shows nothing
        return exc
    if redact(text) == text:
        return exc
    try:
        exc.args = tuple(redact(a) if isinstance(a, str) else a for a in exc.args)
        if isinstance(exc, OSError) and isinstance(exc.filename, str):
            exc.filename = redact(exc.filename)
    except (AttributeError, TypeError):
        pass
    if redact(str(exc)) == str(exc):
        return exc
    plain = Exception(f"{type(exc).__name__}: {redact(text)}")
    plain.__cause__ = exc.__cause__
    plain.__suppress_context__ = True
    return plain


def redacted_repr(obj: Any) -> str:
    """A dataclass's repr with every field value redacted (:func:`redact_value`);
    the ``__repr__`` of the option objects that may hold credentials."""
    import dataclasses

    fields = ", ".join(
        f"{f.name}={redact_value(getattr(obj, f.name))!r}" for f in dataclasses.fields(obj) if f.repr
    )
    return f"{type(obj).__name__}({fields})"
