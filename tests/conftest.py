from tests.servers import *  # noqa: F403 - shared server fixtures
from tests.emulators import *  # noqa: F403 - GCS and Azure emulator fixtures


import pytest  # noqa: E402

from shardflow import fastpath  # noqa: E402


@pytest.fixture(params=[True, False], ids=["fast", "general"])
def fast_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Run a test with every fast path on, then off (shardflow.fastpath): the reader's
    tests hold for both, so a difference between them is a bug in one."""
    before = fastpath.enabled()
    monkeypatch.setenv(fastpath.ENV, "1" if request.param else "0")  # for spawned workers
    fastpath.set_enabled(request.param)
    yield request.param
    fastpath.set_enabled(before)
