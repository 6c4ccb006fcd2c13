"""HTTP redirects: followed on the same host, refused to another one unless allowed.

fsspec's HTTP filesystem follows every redirect with the request's headers, so a server
(or a manifest's host) could send every read elsewhere, with the user's ``X-Api-Key``.
Every request of shardflow's HTTP filesystems (``HEAD``/``info``, ``GET``, listings) goes
through an aiohttp session made by :func:`same_host_client` or, with
``IOOptions(cross_host_redirects=True)``, :func:`any_host_client`, whose redirect hook:

- follows a redirect to the same origin (scheme, host, port) as it is, at most
  :data:`MAX_REDIRECTS` times per request (then a :class:`RedirectError`);
- refuses one to another origin with :class:`RedirectError` (not retried), before any
  request reaches it;
- or, when allowed, follows it with only the headers that carry no credential
  (:data:`SAFE_HEADERS`: ``Range``, ``Accept-Encoding``, ...): custom headers,
  ``Authorization`` and cookies stay with the first host (aiohttp itself drops the
  URL's userinfo and ``Authorization`` across origins).
"""

from __future__ import annotations

from typing import Any

from shardflow.errors import RemoteReadError, redact

__all__ = ["MAX_REDIRECTS", "SAFE_HEADERS", "RedirectError", "any_host_client", "same_host_client", "redirect_options"]

MAX_REDIRECTS = 5
"""Redirects one HTTP request may follow."""
SAFE_HEADERS = frozenset({"range", "accept", "accept-encoding", "user-agent", "if-match", "if-none-match",
                          "if-modified-since", "if-unmodified-since", "if-range"})


class RedirectError(RemoteReadError):
    """An HTTP server redirected a read to another host, which shardflow refuses by default."""

    default_reason = "redirect"


def _origin(url: Any) -> tuple[str, str, int | None]:
    return (url.scheme, (url.host or "").lower(), url.port)


def _hook(allow_other_hosts: bool):
    async def on_redirect(session: Any, ctx: Any, params: Any) -> None:
        from yarl import URL

        ctx.redirects = getattr(ctx, "redirects", 0) + 1  # ctx lives as long as the request
        if ctx.redirects > MAX_REDIRECTS:
            raise RedirectError(f"{redact(str(params.url.with_query(None)))}: more than {MAX_REDIRECTS} redirects "
                                "(shardflow.storage.backends.redirects.MAX_REDIRECTS)")
        location = params.response.headers.get("Location") or params.response.headers.get("URI")
        if location is None:
            return
        target = params.url.join(URL(location))
        if _origin(target) == _origin(params.url):
            return
        if not allow_other_hosts:
            raise RedirectError(
                f"{redact(str(params.url.with_query(None)))} redirected to another host, "
                f"{redact(str(target.with_query(None)))}; refused (IOOptions.cross_host_redirects)"
            )
        for name in list(params.headers):  # the headers the redirected request is sent with
            if name.lower() not in SAFE_HEADERS:
                params.headers.popall(name, None)

    return on_redirect


def _client(allow_other_hosts: bool, kwargs: dict[str, Any]) -> Any:
    import aiohttp

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(_hook(allow_other_hosts))
    kwargs = dict(kwargs)
    kwargs["trace_configs"] = [trace, *kwargs.get("trace_configs", ())]
    return aiohttp.ClientSession(**kwargs)


async def same_host_client(**kwargs: Any) -> Any:
    """fsspec's ``get_client``: an aiohttp session that refuses cross-host redirects."""
    return _client(False, kwargs)


async def any_host_client(**kwargs: Any) -> Any:
    """fsspec's ``get_client``: an aiohttp session that follows cross-host redirects
    without credentials or custom headers."""
    return _client(True, kwargs)


def redirect_options(kwargs: dict[str, Any], allow_other_hosts: bool) -> dict[str, Any]:
    """The HTTP filesystem's options with the redirect policy (module-level functions, so
    that fsspec's filesystem cache and pickling into DataLoader workers keep working)."""
    out = dict(kwargs)
    out.setdefault("get_client", any_host_client if allow_other_hosts else same_host_client)
    return out
