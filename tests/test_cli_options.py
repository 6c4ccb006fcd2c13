"""Shared CLI pieces: nested --storage-option values, --trust-manifest-urls, counts with the right plural."""

from __future__ import annotations

import pytest

from shardflow.cli.options import storage_options
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


def _dataset_listing_a_shard_outside(tmp_path):
    """A manifest in ``ds/`` whose one shard lives in ``elsewhere/`` (an absolute path)."""
    import json

    import shardflow

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with shardflow.ShardWriter(str(elsewhere / "train-%06d.tar")) as w:
        for i in range(3):
            w.write({"__key__": f"{i:03d}", "cls": i})
    manifest = json.loads((elsewhere / "shardflow.json").read_text())
    for shard in manifest["shards"]:
        shard["url"] = str(elsewhere / shard["url"])
        shard.pop("index", None)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "shardflow.json").write_text(json.dumps(manifest))
    return str(tmp_path / "ds")


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_trust_manifest_urls_flag_opens_a_manifest_listing_shards_elsewhere(tmp_path, capsys, command):
    from shardflow.cli import main

    ds = _dataset_listing_a_shard_outside(tmp_path)
    assert main([command, ds]) == 1
    err = capsys.readouterr().err
    assert "is an absolute path" in err and "--trust-manifest-urls" in err
    assert main([command, ds, "--trust-manifest-urls"]) == 0
    assert "3 samples" in capsys.readouterr().out


def test_trust_manifest_urls_config_key(tmp_path):
    from shardflow.config import ConfigError, PipelineConfig, dataset_from_config
    from shardflow.errors import ManifestError

    ds = _dataset_listing_a_shard_outside(tmp_path)
    with pytest.raises(ManifestError, match="is an absolute path"):
        dataset_from_config({"source": ds, "decode": None})
    got = [int(s["cls"]) for s in dataset_from_config({"source": ds, "decode": None, "trust_manifest_urls": True})]
    assert got == [0, 1, 2]
    with pytest.raises(ConfigError, match="trust_manifest_urls"):
        PipelineConfig(source=ds, trust_manifest_urls="yes")


def test_index_refuses_a_manifest_given_as_a_shard(tmp_path, capsys):
    import shardflow
    from shardflow.cli import main

    with shardflow.ShardWriter(str(tmp_path / "train-%06d.tar")) as w:
        w.write({"__key__": "a", "cls": 1})
    before = (tmp_path / "shardflow.json").read_bytes()
    assert main(["index", str(tmp_path / "shardflow.json")]) == 1
    assert "this is a manifest, not a shard" in capsys.readouterr().err
    assert (tmp_path / "shardflow.json").read_bytes() == before
