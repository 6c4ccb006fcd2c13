"""HTTP redirects (issue 25, case h): a redirect to another host is refused by default; with
``IOOptions(cross_host_redirects=True)`` it is followed without credentials or custom headers;
same-host redirects are followed up to a limit. Two real servers on 127.0.0.1.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shardflow import IOOptions, ShardDataset
from shardflow.errors import RemoteReadError
from shardflow.format.tar import END_OF_ARCHIVE, encode_sample
from shardflow.storage import MAX_REDIRECTS

pytestmark = pytest.mark.timeout(60)

SHARD = b"".join(encode_sample(f"{i:06d}", {"txt": f"sample {i}".encode()}) for i in range(3)) + END_OF_ARCHIVE
OTHER = b"".join(encode_sample(f"{i:06d}", {"txt": b"from the other host"}) for i in range(3)) + END_OF_ARCHIVE


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, routes) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes = routes  # path -> bytes (served, with Range) or ("redirect", location)
        self.seen: list[dict[str, str]] = []  # the headers of every request

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        self.server.seen.append({k.lower(): v for k, v in self.headers.items()})
        route = self.server.routes.get(self.path.split("?")[0])
        if isinstance(route, tuple):
            self.send_response(302)
            self.send_header("Location", route[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if route is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0] or 0)
        body = route[start:]
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(route) - 1}/{len(route)}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"v1"')
        self.end_headers()
        if not head:
            self.wfile.write(body)


@pytest.fixture
def servers():
    other = _Server({"/x.tar": OTHER})
    home = _Server({"/x.tar": SHARD, "/old/x.tar": ("redirect", "/x.tar"),
                    "/loop.tar": ("redirect", "/loop.tar")})
    home.routes["/away.tar"] = ("redirect", other.url + "/x.tar")
    threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True) for s in (home, other)]
    for t in threads:
        t.start()
    yield home, other
    for s in (home, other):
        s.shutdown()
        s.server_close()


SECRET_HEADERS = {"X-Api-Key": "apikey-42", "Cookie": "session=tok3n"}


def _io(**kw) -> IOOptions:
    return IOOptions(storage_options={"headers": dict(SECRET_HEADERS)}, retries=0, **kw)


def _txt(url: str, io: IOOptions) -> list[str]:
    return [s["txt"] for s in ShardDataset(url, io=io)]


def test_a_redirect_to_another_host_is_refused_and_sends_it_nothing(servers) -> None:
    home, other = servers
    with pytest.raises(RemoteReadError, match=r"redirected to another host, http://127\.0\.0\.1:\d+/x\.tar; "
                                              r"refused \(IOOptions\.cross_host_redirects\)"):
        _txt(home.url + "/away.tar", _io())
    assert other.seen == []  # not one request reached the other host


def test_a_cross_host_redirect_allowed_forwards_no_secret(servers) -> None:
    home, other = servers
    url = home.url.replace("http://", "http://alice:hunter2@") + "/away.tar"
    assert _txt(url, _io(cross_host_redirects=True)) == ["from the other host"] * 3
    assert other.seen, "the other host was asked"
    for headers in other.seen:
        assert "x-api-key" not in headers and "authorization" not in headers and "cookie" not in headers, headers
    assert all(h.get("authorization", "").startswith("Basic ") for h in home.seen)  # alice:hunter2, home only
    assert all(h.get("x-api-key") == "apikey-42" for h in home.seen)  # the home host got them


def test_same_host_redirects_are_followed_up_to_a_limit(servers) -> None:
    home, _ = servers
    assert _txt(home.url + "/old/x.tar", _io()) == [f"sample {i}" for i in range(3)]
    home.seen.clear()
    with pytest.raises(RemoteReadError, match=r"loop.tar: more than 5 redirects"):
        _txt(home.url + "/loop.tar", _io())
    # the manifest looked for beside it, then fsspec's HEAD and its GET fallback, each cut after 6 requests
    assert MAX_REDIRECTS == 5 and len(home.seen) <= 1 + 2 * (MAX_REDIRECTS + 1)
