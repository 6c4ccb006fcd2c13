"""aiohttp and aiobotocore internals that shardflow's storage uses (both optional: imported here
only when called).

* ``aiohttp.ClientSession._request``: the method every request goes through; its
  signature says whether ``auto_decompress`` can be set per request (aiohttp 3.9+), which
  the HTTP reader needs to read a ``.tar.gz`` as stored.
* ``aiobotocore.session.AioSession._credentials``: the session's resolved credentials;
  refreshable ones hold an asyncio lock bound to the loop they were made on, so a forked
  child drops them and resolves them again on its own loop.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["REQUIRED", "request_parameters", "drop_credentials", "missing"]

REQUIRED = ("aiohttp.ClientSession._request", "aiobotocore.session.AioSession._credentials")
"""The private names used here (``tests/test_compat.py`` checks each one exists)."""


def request_parameters() -> frozenset[str]:
    """The keyword arguments an aiohttp request takes (those of ``ClientSession._request``)."""
    import aiohttp

    return frozenset(inspect.signature(aiohttp.ClientSession._request).parameters)


def drop_credentials(session: Any) -> None:
    """Forget the resolved credentials of the aiobotocore session ``session`` (resolved again on next use)."""
    session._credentials = None


def missing() -> list[str]:
    """The names of :data:`REQUIRED` that the installed aiohttp and aiobotocore do not have
    (a package's all, without it)."""
    out = []
    try:
        import aiohttp

        if not hasattr(aiohttp.ClientSession, "_request"):
            out.append(REQUIRED[0])
    except ImportError:
        out.append(REQUIRED[0])
    try:
        from aiobotocore.session import AioSession

        if "_credentials" not in vars(AioSession()):
            out.append(REQUIRED[1])
    except ImportError:
        out.append(REQUIRED[1])
    return out
