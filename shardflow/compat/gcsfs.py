"""gcsfs internals that shardflow's GCS reader uses (gcsfs is optional: imported by the caller).

* ``GCSFileSystem._set_session()``: the filesystem's aiohttp session, created on first use.
* ``GCSFileSystem._get_headers(headers)``: ``headers`` with the filesystem's
  authorization (and user project) added, as gcsfs sends them itself.
"""

from __future__ import annotations

from typing import Any

__all__ = ["REQUIRED", "session", "request_headers", "missing"]

REQUIRED = ("gcsfs.GCSFileSystem._set_session", "gcsfs.GCSFileSystem._get_headers")
"""The private names used here (``tests/test_compat.py`` checks each one exists)."""


async def session(fs: Any) -> Any:
    """The aiohttp session of the gcsfs filesystem ``fs``, created if need be."""
    await fs._set_session()
    return fs.session


def request_headers(fs: Any, headers: dict[str, str]) -> dict[str, str]:
    """``headers`` as ``fs`` would send them (its credentials added)."""
    return fs._get_headers(headers)


def missing() -> list[str]:
    """The names of :data:`REQUIRED` that the installed gcsfs does not have (all, without gcsfs)."""
    try:
        import gcsfs
    except ImportError:
        return list(REQUIRED)
    return [n for n in REQUIRED if not hasattr(gcsfs.GCSFileSystem, n.rsplit(".", 1)[1])]
