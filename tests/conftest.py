from tests.servers import *  # noqa: F403 - shared server fixtures
from tests.emulators import *  # noqa: F403 - GCS and Azure emulator fixtures
from tests.lanes import pytest_runtest_protocol, pytest_sessionfinish  # noqa: F401 - hooks


import gc  # noqa: E402
import os  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from shardflow import fastpath  # noqa: E402
from tests import lanes  # noqa: E402

# Hypothesis defaults that fail by chance on a loaded machine (CI: 2 cores shared with other
# jobs), not because of a bug: a 200 ms deadline per example and the too_slow health check on
# data generation. And the same examples on every run (derandomize), as the differential suite
# does, so that CI cannot fail on a case no earlier run tried; SHARDFLOW_HYPOTHESIS_RANDOM=1
# explores new ones. Tests' own @settings override only what they name.
settings.register_profile(
    "shardflow",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=os.environ.get("SHARDFLOW_HYPOTHESIS_RANDOM", "") in ("", "0"),
)
settings.load_profile("shardflow")


@pytest.fixture(params=[True, False], ids=["fast", "general"])
def fast_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Run a test with every fast path on, then off (shardflow.fastpath): the reader's
    tests hold for both, so a difference between them is a bug in one."""
    before = fastpath.enabled()
    monkeypatch.setenv(fastpath.ENV, "1" if request.param else "0")  # for spawned workers
    fastpath.set_enabled(request.param)
    yield request.param
    fastpath.set_enabled(before)


@pytest.fixture(scope="module")
def others_garbage_collected():
    """Collect the garbage earlier modules left before a module that turns every warning into an
    error: a file or socket they left unclosed would otherwise warn (ResourceWarning) whenever a
    collection happens to run inside one of its tests, which would then fail for another's leak."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests that use a server or start processes (tests/lanes.py), for the quick lane."""
    lanes.mark(items)


def pytest_terminal_summary(terminalreporter) -> None:
    """Name the emulators that were missing and how to install them: ``pytest -q`` shows a skip
    as an ``s`` only (tests/emulators.py). Under ``SHARDFLOW_CHECK_MARKS=1``, name the tests that
    started a process or a server without its mark (tests/lanes.py)."""
    from tests.emulators import MISSING

    for message in sorted(MISSING):
        terminalreporter.write_line(f"note: {message}")
    lanes.summary(terminalreporter)
