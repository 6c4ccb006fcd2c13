"""Which read failures are transient, the backoff between retries, and the error
raised when a read cannot go on."""

from __future__ import annotations

import logging
import sys
import time

from shardflow.accounting import count
from shardflow.errors import RemoteReadError, ShardflowError, redact, redact_cause

from .errors import ShardNotFoundError
from .options import MAX_BACKOFF, IOOptions

logger = logging.getLogger(__name__)

_RETRY_S3_CODES = frozenset(
    {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling",
     "ThrottlingException", "RequestTimeTooSkewed"}
)


def _http_errors() -> tuple[type[BaseException], ...]:
    """``http.client.HTTPException`` if it is imported (before that, nothing raised one)."""
    client = sys.modules.get("http.client")
    return (client.HTTPException,) if client is not None else ()


def shardflow_cause(exc: BaseException) -> ShardflowError | None:
    """The first :class:`ShardflowError` in ``exc``'s cause chain (fsspec wraps the errors our
    hooks raise, such as a refused redirect, in a ``FileNotFoundError``), or None."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, ShardflowError):
            return exc
        exc, seen = exc.__cause__, seen + 1
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether a failed read is worth retrying after reopening."""
    if shardflow_cause(exc) is not None:
        return False  # named already: a refused redirect, a changed object
    if isinstance(exc, FileNotFoundError):
        # fsspec's HTTP info() reports any failure, a 503 too, as FileNotFoundError
        cause = exc.__cause__
        return (cause is not None and not isinstance(cause, FileNotFoundError)
                and is_transient(cause))
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        if isinstance(exc, aiohttp.ClientResponseError):
            return exc.status >= 500 or exc.status in (408, 425, 429)
        if isinstance(exc, aiohttp.ClientError):
            return True
    boto = sys.modules.get("botocore.exceptions")
    if boto is not None:
        if isinstance(exc, boto.ClientError):
            response = getattr(exc, "response", None) or {}
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            code = response.get("Error", {}).get("Code", "")
            return status >= 500 or status in (408, 429) or code in _RETRY_S3_CODES
        streaming = tuple(
            getattr(boto, name)
            for name in ("HTTPClientError", "IncompleteReadError", "ResponseStreamingError")
            if hasattr(boto, name)
        )
        if streaming and isinstance(exc, streaming):
            return True
    return isinstance(exc, (OSError, TimeoutError, EOFError, *_http_errors()))


def is_io_error(exc: BaseException) -> bool:
    """Whether an exception is about reading from the store (and so worth naming the
    URL and offset in a :class:`RemoteReadError`); others propagate as they are."""
    if isinstance(exc, (OSError, TimeoutError, EOFError, *_http_errors())):
        return True
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientError):
        return True
    boto = sys.modules.get("botocore.exceptions")
    return boto is not None and isinstance(exc, (boto.BotoCoreError, boto.ClientError))


def retry_delay(options: IOOptions, failures: int) -> float:
    """Seconds to wait before retry number ``failures`` (each call counts one retry,
    :mod:`shardflow.accounting`)."""
    count("retries")
    return min(options.backoff * 2 ** (failures - 1), max(MAX_BACKOFF, options.backoff))


def read_error(url: str, offset: int, exc: BaseException, failures: int) -> ShardflowError:
    """The error to raise for a read of ``url`` that cannot go on."""
    cause = shardflow_cause(exc)
    if cause is not None:
        return cause
    if isinstance(exc, FileNotFoundError) and not is_transient(exc):
        return ShardNotFoundError(f"shard not found: {url}")
    if failures:
        return RemoteReadError(
            f"reading {url} failed at byte {offset} after {failures - 1} retries: "
            f"{type(exc).__name__}: {exc}"
        )
    return RemoteReadError(f"reading {url} failed at byte {offset}: {type(exc).__name__}: {exc}")


def call_with_retries(url: str, offset: int, options: IOOptions, fn):
    """Call ``fn()`` until it succeeds, retrying transient errors with backoff."""
    failures = 0
    while True:
        try:
            return fn()
        except ShardflowError:
            raise
        except Exception as exc:
            if not is_transient(exc):
                if not is_io_error(exc):
                    raise
                raise read_error(url, offset, exc, 0) from redact_cause(exc)
            failures += 1
            if failures > options.retries:
                raise read_error(url, offset, exc, failures) from redact_cause(exc)
            wait = retry_delay(options, failures)
            logger.warning("reading %s at byte %d failed (%r); retry %d/%d in %.2fs",
                           redact(url), offset, redact(repr(exc)), failures, options.retries, wait)
            time.sleep(wait)
