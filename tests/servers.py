"""Local test servers (loopback only) and their pytest fixtures.

Fixtures (available to every test through ``tests/conftest.py``):

- ``http_server``: a threaded HTTP/1.1 file server on ``127.0.0.1`` serving a fresh
  temporary directory, with Range requests (206, Content-Range, Accept-Ranges),
  HEAD, ETag (content hash) and Last-Modified, and HTML directory listings (so
  fsspec's HTTP ``glob`` works). ``srv.put("a/b.tar", data)`` writes a file and
  returns its URL; ``srv.url`` is the base URL, ``srv.root`` the directory.
- ``flaky_http_server``: the same server with fault injection turned on by
  attributes (see :class:`Faults`): drop the connection after N body bytes or at
  an absolute file offset, answer 503 to the next N requests, rewrite a file
  after a drop, slow down. ``srv.stats`` counts requests, GETs, HEADs, drops...
- ``moto_server`` (session): moto's S3 server on ``127.0.0.1``, with fake AWS
  credentials and ``AWS_ENDPOINT_URL`` pointing at it for the whole session (no
  real AWS can be reached). ``.endpoint_url``, ``.bucket``, ``.storage_options``
  (for s3fs), ``.fs()`` (an ``S3FileSystem``), ``.url(key)``.
- ``s3_proxy``: a TCP proxy on ``127.0.0.1`` in front of the moto server that
  cuts connections on demand (``proxy.drop_after(n)``: the next ``n`` bytes sent
  to clients pass, then the connection is closed), for dropped S3 streams;
  ``.storage_options`` reach moto through it.
- ``s3_prefix``: a fresh ``s3://<bucket>/<unique>/`` prefix per test (uses
  ``moto_server``); ``s3_options`` the matching storage options.
"""

from __future__ import annotations

import contextlib
import email.utils
import html
import itertools
import os
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "Faults",
    "FileHTTPServer",
    "MotoS3",
    "Stats",
    "DroppingProxy",
    "flaky_http_server",
    "http_server",
    "moto_server",
    "s3_options",
    "s3_prefix",
    "s3_proxy",
    "wait_until",
]

_PIECE = 64 << 10  # bytes written per socket write


@dataclass
class Faults:
    """Fault injection knobs of a :class:`FileHTTPServer` (all off by default).

    Attributes:
        drop_after: drop the connection after this many body bytes of a GET.
        drop_at: drop the connection when the body reaches this absolute offset
            in the file (a reopened read starting there is dropped at once).
        max_drops: drop at most this many times (``None``: no limit).
        drop_every: only every k-th GET is eligible for a drop.
        drop_only: only GETs of this relative path are eligible (``None``: any),
            so that a drop does not depend on which shard a read-ahead thread
            requests first.
        fail_next: answer this many next requests (GET or HEAD) with ``fail_status``.
        fail_status: the status used by ``fail_next``.
        change_on_drop: after the first drop, replace the served file's content by
            these bytes (to test the changed-object error).
        reset: drop with a TCP reset (data in flight may be lost) instead of a
            clean close after the bytes sent.
        linger: seconds to wait between the last byte sent and a clean close, so
            that the client reads those bytes before it sees the close (aiohttp
            discards bytes it buffered once it sees the response cut short).
        delay: seconds to sleep before each 64 KiB piece of a body.
        latency: seconds to sleep before answering any request (time to first byte).
        ignore_range: answer Range requests with the whole object (200), as
            servers without range support do.
        content_encoding: extra ``Content-Encoding`` header per relative path
            (``{"x.tar.gz": "gzip"}``), as misconfigured servers send for ``.gz``.
        stall_after: on every GET, send this many body bytes, then stall (send
            nothing, keep the connection open) for ``stall_for`` seconds.
        stall_headers: on every GET, stall before sending the response headers.
        stall_head: seconds to stall before answering a HEAD.
        stall_for: how long a stall lasts (cut short when the server stops).
        no_validators: send neither ETag nor Last-Modified (a plain file server).
    """

    drop_after: int | None = None
    drop_at: int | None = None
    max_drops: int | None = None
    drop_every: int = 1
    drop_only: str | None = None
    fail_next: int = 0
    fail_status: int = 503
    change_on_drop: bytes | None = None
    reset: bool = False
    linger: float = 0.02
    delay: float = 0.0
    latency: float = 0.0
    ignore_range: bool = False
    content_encoding: dict[str, str] = field(default_factory=dict)
    stall_after: int | None = None
    stall_headers: bool = False
    stall_head: float = 0.0
    stall_for: float = 60.0
    no_validators: bool = False


@dataclass
class Stats:
    """Request counters of a :class:`FileHTTPServer`."""

    requests: int = 0
    gets: int = 0
    heads: int = 0
    ranged_gets: int = 0
    drops: int = 0
    failures: int = 0
    changes: int = 0
    body_bytes: int = 0
    gets_by_path: dict[str, int] = field(default_factory=dict)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FileHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        srv = self.server
        rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        with srv.lock:
            srv.stats.requests += 1
            if head:
                srv.stats.heads += 1
            else:
                srv.stats.gets += 1
                srv.stats.gets_by_path[rel] = srv.stats.gets_by_path.get(rel, 0) + 1
            get_number = srv.stats.gets
            fail = srv.faults.fail_next > 0
            if fail:
                srv.faults.fail_next -= 1
                srv.stats.failures += 1
        if srv.faults.latency:
            time.sleep(srv.faults.latency)
        if head and srv.faults.stall_head:
            srv.stopping.wait(srv.faults.stall_head)
        if not head and srv.faults.stall_headers:
            srv.stopping.wait(srv.faults.stall_for)
            self.close_connection = True
            return
        if fail:
            self._empty(srv.faults.fail_status)
            return
        target = (srv.root / rel).resolve()
        if srv.root.resolve() not in (target, *target.parents):
            self._empty(HTTPStatus.FORBIDDEN)
            return
        if target.is_dir():
            self._listing(target, rel, head)
            return
        try:
            file = open(target, "rb")  # noqa: SIM115 - closed below
        except (FileNotFoundError, IsADirectoryError):
            self._empty(HTTPStatus.NOT_FOUND)
            return
        with file:
            self._serve_file(file, rel, head, get_number, target)

    def _serve_file(self, file, rel: str, head: bool, get_number: int, target: Path) -> None:
        srv = self.server
        st = os.fstat(file.fileno())
        size = st.st_size
        # size, mtime and a generation bumped by put() and change_on_drop: a rewrite
        # within the file system's timestamp granularity still changes the ETag
        etag = f'"{size:x}-{st.st_mtime_ns:x}-{srv.generation(rel)}"'
        start, stop = 0, size
        status = HTTPStatus.OK
        header = self.headers.get("Range")
        if header is not None and not srv.faults.ignore_range:
            parsed = _parse_range(header, size)
            if parsed is None:
                self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, stop = parsed
            status = HTTPStatus.PARTIAL_CONTENT
            if not head:
                with srv.lock:
                    srv.stats.ranged_gets += 1
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(stop - start))
        self.send_header("Accept-Ranges", "bytes")
        if not srv.faults.no_validators:
            self.send_header("ETag", etag)
            self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        if rel in srv.faults.content_encoding:
            self.send_header("Content-Encoding", srv.faults.content_encoding[rel])
        if status == HTTPStatus.PARTIAL_CONTENT:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.end_headers()
        if head:
            return
        self._body(file, start, stop, rel, get_number, target)

    def _body(self, file, start: int, stop: int, rel: str, get_number: int,
              target: Path) -> None:
        srv = self.server
        faults = srv.faults
        cut = None
        with srv.lock:
            # a drop is reserved when its response starts, so that responses served at once
            # cannot all see a free one and drop max_drops + 1 times (seen with 4 workers: 5 == 4)
            eligible = (faults.max_drops is None or srv.stats.drops + srv.pending_drops < faults.max_drops) and (
                get_number % max(faults.drop_every, 1) == 0
            ) and faults.drop_only in (None, rel)
            if eligible:
                cuts = []
                if faults.drop_after is not None:
                    cuts.append(start + faults.drop_after)
                if faults.drop_at is not None and start <= faults.drop_at < stop:
                    cuts.append(faults.drop_at)
                cuts = [c for c in cuts if c < stop]
                cut = min(cuts) if cuts else None
                srv.pending_drops += cut is not None
        end = stop if cut is None else cut
        sent, change = False, None
        try:
            sent = self._send(file, start, end)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            with srv.lock:
                srv.pending_drops -= cut is not None
                dropping = sent and cut is not None  # not when the client went away first
                if dropping:
                    srv.stats.drops += 1
                    change = faults.change_on_drop
                    if change is not None:
                        faults.change_on_drop = None
                        srv.stats.changes += 1
        if dropping:
            self._drop(target, rel, change)

    def _send(self, file, start: int, end: int) -> bool:
        """Send the file's bytes ``[start, end)``; False when a stall (Faults.stall_after) ended
        the response instead. Each piece is counted before it is sent: a client that read the
        last piece and then reads the stats must find it counted."""
        srv = self.server
        faults = srv.faults
        pos = start
        file.seek(start)
        while pos < end:
            if faults.stall_after is not None and pos - start >= faults.stall_after:
                self.wfile.flush()
                srv.stopping.wait(faults.stall_for)
                self.close_connection = True
                return False
            if faults.delay:
                time.sleep(faults.delay)
            room = _PIECE if faults.stall_after is None else max(1, start + faults.stall_after - pos)
            piece = file.read(min(_PIECE, end - pos, room))
            if not piece:  # the file shrank under us: cut the response
                break
            with srv.lock:
                srv.stats.body_bytes += len(piece)
            try:
                self.wfile.write(piece)
            except OSError:
                with srv.lock:  # not sent after all
                    srv.stats.body_bytes -= len(piece)
                raise
            pos += len(piece)
        self.wfile.flush()
        return True

    def _drop(self, target: Path, rel: str, change: bytes | None) -> None:
        """Cut the connection in the middle of the body (after rewriting the file if asked)."""
        srv = self.server
        faults = srv.faults
        if change is not None:
            target.write_bytes(change)
            srv.bump_generation(rel)
        self.close_connection = True
        if not faults.reset and faults.linger:
            time.sleep(faults.linger)
        try:
            if faults.reset:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _listing(self, directory: Path, rel: str, head: bool) -> None:
        base = "/" + rel.rstrip("/") + "/" if rel.strip("/") else "/"
        links = "".join(
            '<a href="{}">{}</a>\n'.format(
                html.escape(base + urllib.parse.quote(p.name) + ("/" if p.is_dir() else "")),
                html.escape(p.name),
            )
            for p in sorted(directory.iterdir())
        )
        body = f"<html><body>\n{links}</body></html>\n".encode()
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` -> (start, stop), None if unsatisfiable."""
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return 0, size  # unsupported: serve everything (as 206 of the whole, still valid)
    first, _, last = spec.strip().partition("-")
    if not first:
        n = int(last)
        return (max(size - n, 0), size) if n > 0 and size else None
    start = int(first)
    stop = size if not last else min(int(last) + 1, size)
    if start >= size or stop <= start:
        return None
    return start, stop


class FileHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP file server on 127.0.0.1 (random port) with fault injection."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, root: str | os.PathLike[str], faults: Faults | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = Path(root)
        self.faults = faults if faults is not None else Faults()
        self.stats = Stats()
        self.lock = threading.Lock()
        self.pending_drops = 0  # drops decided for responses still being sent (Faults.max_drops)
        self._generations: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self.stopping = threading.Event()  # ends the stalls of Faults.stall_*

    def generation(self, rel: str) -> int:
        with self.lock:
            return self._generations.get(rel, 0)

    def bump_generation(self, rel: str) -> None:
        with self.lock:
            self._generations[rel] = self._generations.get(rel, 0) + 1

    @property
    def url(self) -> str:
        """Base URL, without a trailing slash."""
        return f"http://127.0.0.1:{self.server_address[1]}"

    def url_for(self, rel: str) -> str:
        return f"{self.url}/{urllib.parse.quote(rel)}"

    def put(self, rel: str, data: bytes) -> str:
        """Write ``data`` at ``root/rel`` and return its URL."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.bump_generation(rel)
        return self.url_for(rel)

    def reset_stats(self) -> None:
        with self.lock:
            self.stats = Stats()

    def start(self) -> FileHTTPServer:
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05},
            name="test-http-server", daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> FileHTTPServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@pytest.fixture
def http_server(tmp_path_factory: pytest.TempPathFactory) -> FileHTTPServer:
    """A Range-capable HTTP file server on loopback serving a fresh directory."""
    with FileHTTPServer(tmp_path_factory.mktemp("http-root")) as srv:
        yield srv


@pytest.fixture
def flaky_http_server(tmp_path_factory: pytest.TempPathFactory) -> FileHTTPServer:
    """Like ``http_server``; set ``srv.faults.*`` to inject drops, 503s and changes."""
    with FileHTTPServer(tmp_path_factory.mktemp("flaky-root"), Faults()) as srv:
        yield srv


# --------------------------------------------------------------------------- S3 (moto)


@dataclass
class MotoS3:
    """A running moto S3 server."""

    endpoint_url: str
    bucket: str
    server: Any

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec / s3fs storage options reaching this server."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
        }

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key.lstrip('/')}"



class DroppingProxy:
    """A TCP proxy to ``target`` (host, port) that closes connections on demand.

    ``drop_after(n)`` arms it: the next ``n`` bytes sent from the target to
    clients (over any connection) are forwarded, then that connection is shut
    down, as a network drop would; ``drops`` counts the cuts. With ``hold=True``
    the connection stalls after those bytes until :meth:`release` cuts it, so a
    test can act between "the client has these bytes" and "the stream broke".
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.drops = 0
        self.sent = 0  # bytes forwarded from the target to clients
        self._budget: int | None = None
        self._hold = False
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def drop_after(self, n: int, hold: bool = False) -> None:
        with self._lock:
            self._budget = n
            self._hold = hold
            self._released.clear()

    def release(self) -> None:
        """Cut the connection held by ``drop_after(n, hold=True)``."""
        self._released.set()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        try:
            while True:
                data = src.recv(16 << 10)
                if not data:
                    break
                cut = False
                if downstream:
                    with self._lock:
                        if self._budget is not None:
                            if len(data) >= self._budget:
                                data, cut = data[: self._budget], True
                                self._budget = None
                                self.drops += 1
                            else:
                                self._budget -= len(data)
                        self.sent += len(data)
                dst.sendall(data)
                if cut:
                    if self._hold:
                        self._released.wait(30)
                    break
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._closed = True
        self._released.set()
        self._listener.close()


_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> MotoS3:
    """moto's S3 server on 127.0.0.1 with one bucket; fake credentials for the session."""
    pytest.importorskip("s3fs")
    moto_threaded = pytest.importorskip("moto.moto_server.threaded_moto_server")
    empty = tmp_path_factory.mktemp("aws-config") / "none"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _AWS_ENV.items():
            mp.setenv(name, value)
        mp.setenv("AWS_CONFIG_FILE", str(empty))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
        mp.delenv("AWS_PROFILE", raising=False)
        import logging

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        server = moto_threaded.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            _host, port = server.get_host_and_port()
            endpoint = f"http://127.0.0.1:{port}"
            mp.setenv("AWS_ENDPOINT_URL", endpoint)
            mp.setenv("AWS_ENDPOINT_URL_S3", endpoint)
            moto = MotoS3(endpoint_url=endpoint, bucket="shardflow-test", server=server)
            # s3fs' mkdir sends a LocationConstraint, which us-east-1 refuses
            moto.fs().call_s3("create_bucket", Bucket=moto.bucket)
            yield moto
        finally:
            server.stop()


_prefix_counter = itertools.count()


@pytest.fixture
def s3_prefix(moto_server: MotoS3, request: pytest.FixtureRequest) -> str:
    """A fresh ``s3://bucket/<test>-<n>/`` prefix (with trailing slash)."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"s3://{moto_server.bucket}/{name}-{next(_prefix_counter)}/"


@pytest.fixture
def s3_options(moto_server: MotoS3) -> dict[str, Any]:
    """Storage options for the moto server."""
    return moto_server.storage_options


@pytest.fixture
def s3_proxy(moto_server: MotoS3) -> DroppingProxy:
    """A :class:`DroppingProxy` in front of the moto server; ``.storage_options`` use it."""
    host, port = urllib.parse.urlsplit(moto_server.endpoint_url).netloc.split(":")
    proxy = DroppingProxy((host, int(port)))
    proxy.storage_options = {  # type: ignore[attr-defined]
        **moto_server.storage_options,
        "client_kwargs": {"endpoint_url": proxy.endpoint_url, "region_name": "us-east-1"},
    }
    yield proxy
    proxy.close()


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; return its last value.

    The default deadline is generous on purpose: it is only reached when the condition never
    comes (the test fails then), while on a loaded machine (CI: 2 cores shared with other jobs)
    a thread or process can be descheduled for seconds before it does what the test waits for.
    """
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
