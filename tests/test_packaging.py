"""The install the README describes: one torch version named by README, pyproject and .ci/run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _dev_pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for req in project["optional-dependencies"]["dev"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^;\s]+)", req.strip())
        if m:
            pins[m.group(1).lower()] = m.group(3)
    return pins


def test_readme_pyproject_and_ci_name_one_torch():
    pins = _dev_pins()
    readme = set(re.findall(r"pip install torch==([0-9.]+)", (ROOT / "README.md").read_text()))
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme == {pins["torch"]}
    assert f"pip install -q torch=={pins['torch']}" in ci
    assert f'want = "{pins["torch"]}"' in ci  # the check after the dev install


def test_dev_extra_pins_the_resolver_heavy_stack_consistently():
    pins = _dev_pins()
    # the packages pip backtracked over for many minutes when left open
    for name in ("fsspec", "s3fs", "aiobotocore", "botocore", "boto3", "moto", "gcsfs", "adlfs"):
        assert name in pins, f"{name} is not pinned in the dev extra"
    # s3fs releases require the fsspec of the same date exactly
    assert pins["s3fs"] == pins["fsspec"]
    # boto3 x.y.z requires botocore x.y.*
    assert pins["boto3"].split(".")[:2] == pins["botocore"].split(".")[:2]
