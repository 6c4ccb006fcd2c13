"""Shared CLI pieces: nested --storage-option values, counts with the right plural."""

from __future__ import annotations

import pytest

from shardflow.cli.convert import storage_options
from shardflow.cli.units import counted


def test_flat_dotted_and_json_storage_options_merge():
    got = storage_options([
        "key=AKIA", "secret=a=b", "anon=false", "default_block_size=1048576",
        "client_kwargs.endpoint_url=http://127.0.0.1:9000",
        '{"client_kwargs": {"region_name": "us-east-1"}, "config_kwargs": {"retries": {"max_attempts": 3}}}',
        'token="0123"',
    ])
    assert got == {
        "key": "AKIA",
        "secret": "a=b",  # only the first '=' splits
        "anon": False,
        "default_block_size": 1048576,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 3}},
        "token": "0123",  # a quoted JSON string stays a string
    }
    assert storage_options([]) == {}
    assert storage_options(["a.b.c=1", "a.b.d=x"]) == {"a": {"b": {"c": 1, "d": "x"}}}


@pytest.mark.parametrize("bad, message", [
    ("novalue", "needs KEY=VALUE"),
    ("a..b=1", "needs KEY=VALUE"),
    ("=1", "needs KEY=VALUE"),
    ("{not json", "not a JSON object"),
])
def test_bad_storage_options_say_what_is_expected(bad, message):
    with pytest.raises(ValueError, match=message):
        storage_options([bad])


def test_a_key_cannot_be_both_a_mapping_and_a_value():
    with pytest.raises(ValueError, match="'client_kwargs' is set both to a mapping and to a value"):
        storage_options(["client_kwargs=x", "client_kwargs.endpoint_url=y"])
    with pytest.raises(ValueError, match="both to a mapping and to a value"):
        storage_options(["client_kwargs.endpoint_url=y", "client_kwargs=x"])


def test_counted():
    assert counted(1, "shard") == "1 shard"
    assert counted(0, "shard") == "0 shards"
    assert counted(1200, "sample") == "1,200 samples"
    assert counted(2, "batch", "batches") == "2 batches"
