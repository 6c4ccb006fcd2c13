"""Base of the streaming readers (HTTP, S3): a response body read on fsspec's event
loop, and the ``Content-Range`` parser both use."""

from __future__ import annotations

import logging
import re
from typing import Any

from shardflow.errors import RemoteReadError

logger = logging.getLogger(__name__)

_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def range_total(value: str | None, url: str, offset: int) -> int | None:
    """The object's size from the ``Content-Range`` of a response to a request for
    the bytes from ``offset`` on (None for ``*``).

    Raises:
        RemoteReadError: the header is missing or malformed, or the range starts
            elsewhere (the bytes would be taken for the wrong ones).
    """
    match = _CONTENT_RANGE.fullmatch((value or "").strip())
    if match is None or int(match.group(1)) != offset:
        raise RemoteReadError(f"reading {url}: asked for bytes from {offset}, the store answered Content-Range {value!r}")
    return None if match.group(3) == "*" else int(match.group(3))


class StreamReader:
    """A response body streamed on fsspec's event loop, read ``n`` bytes per call.

    Subclasses open the response in ``__init__`` and implement ``_part`` (one read
    of at most ``n`` bytes, ``b""`` at the end) and ``_release``.
    """

    _fs: Any
    _open = False
    _error: Exception | None = None
    _timeout: float = 30.0  # seconds a read may wait for its first byte (IOOptions.request_timeout)

    async def _part(self, n: int) -> bytes:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    async def _read(self, n: int) -> bytes:
        """Up to ``n`` bytes; within ``_timeout`` seconds, what came by then (none: TimeoutError)."""
        import asyncio  # here, not at import: local reading never runs a loop

        parts = []
        got = 0
        loop = asyncio.get_running_loop()
        until = loop.time() + self._timeout
        while got < n:
            try:
                left = until - loop.time()
                if left <= 0:
                    raise asyncio.TimeoutError
                part = await asyncio.wait_for(self._part(n - got), left)
            except asyncio.TimeoutError as exc:
                if not parts:
                    raise TimeoutError(f"no byte from the store within {self._timeout:g} s "
                                       "(IOOptions.request_timeout)") from exc
                break  # a slow store: return what came, the stream stays usable
            except Exception as exc:
                if not parts:
                    raise
                # keep the bytes received before the failure: they count as progress
                self._error = exc
                break
            if not part:
                break
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read(self, n: int) -> bytes:
        from fsspec.asyn import sync
        from fsspec.exceptions import FSTimeoutError

        if self._error is not None:
            raise self._error
        if not self._open:
            return b""
        try:
            return sync(self._fs.loop, self._read, n)
        except FSTimeoutError as exc:  # fsspec renames any TimeoutError: keep the message
            raise (exc.__cause__ if isinstance(exc.__cause__, TimeoutError) else exc) from None

    def close(self) -> None:
        from fsspec.asyn import sync

        if not self._open:
            return
        self._open = False

        async def _close() -> None:
            self._release()

        try:
            sync(self._fs.loop, _close, timeout=5)
        except Exception:  # loop gone (interpreter exit): the socket dies with it
            logger.debug("could not close a streamed response cleanly", exc_info=True)
