"""Exception hierarchy.

Every error raised by shardflow for bad input or failed I/O subclasses
:class:`ShardflowError` and the builtin that fits (``ValueError`` for bad data,
``OSError`` for I/O, ``KeyError`` for missing fields), so callers can catch
either. Messages name where (shard URL, key, member) and what was wrong.
"""

from __future__ import annotations


class ShardflowError(Exception):
    """Base class of all shardflow errors.

    Attributes:
        reason: a short, constant tag for the kind of problem (``"truncated_shard"``,
            ``"missing_field"``, ...), used as the counter name in ``dataset.stats``.
    """

    default_reason = "error"

    def __init__(self, *args: object, reason: str | None = None) -> None:
        super().__init__(*args)
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
