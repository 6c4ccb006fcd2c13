"""Pipeline configs: shipped YAML files load, bad keys are refused, configs rebuild the same pipeline."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from shardflow import ShardDataset, ShardWriter
from shardflow.config import ConfigError, PipelineConfig, dataset_from_config, load_config, loader_from_config, usable_cpus
from shardflow.loading.shardloader import loader as make_loader  # `shardflow.loader` is shadowed by the submodule once imported

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
N = 20


def jpeg(i: int) -> bytes:
    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def images(tmp_path: Path) -> Path:
    folder = tmp_path / "images"
    with ShardWriter(str(folder / "train-%06d.tar"), max_count=6) as w:
        for i in range(N):
            w.write({"__key__": f"k{i:03d}", "jpg": jpeg(i), "cls": i % 3, "txt": f"sample {i}"})
    return folder


def plain(sample: dict) -> dict:
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in sample.items()}


def test_shipped_images_and_graphs_configs() -> None:
    images = load_config(CONFIGS / "images.yaml")
    assert images.source == "/tmp/shardflow-demo/shards"  # what tools/demo.py writes (test_hostile_surface)
    assert images.shuffle == 1000 and images.decode == "torch" and images.fields == ("image", "cls")
    assert images.resize == (224, 224)
    assert images.batch_size == 64 and images.on_error == "raise"
    assert images.num_workers == usable_cpus() == load_config(CONFIGS / "bucket.yaml",
                                                              environ={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}).num_workers
    assert set(yaml.safe_load((CONFIGS / "images.yaml").read_text())) == set(PipelineConfig.keys())  # documents every key
    # every shipped config fits this machine: no more workers than its CPUs, or it says what it assumes
    for path in sorted(CONFIGS.glob("*.yaml")):
        text = path.read_text()
        line = next(x for x in text.splitlines() if x.startswith("num_workers:"))
        assert "auto" in line or "assumes" in line, (path.name, line)
    graphs = load_config(CONFIGS / "graphs.yaml")
    assert graphs.fields == ("graph.pyg",) and graphs.batch_size == 128 and graphs.shuffle == 5000


def test_shipped_bucket_config_takes_credentials_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "S3_ENDPOINT_URL", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"bucket.yaml: config key 'storage_options.key': environment variable 'AWS_ACCESS_KEY_ID' is not set"):
        load_config(CONFIGS / "bucket.yaml")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    cfg = load_config(CONFIGS / "bucket.yaml")
    assert cfg.source.startswith("s3://")
    assert cfg.storage_options == {
        "key": "AKIAEXAMPLE",
        "secret": "s3cr3t",
        "client_kwargs": {"endpoint_url": "https://s3.amazonaws.com", "region_name": "us-east-1"},
    }
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert load_config(CONFIGS / "bucket.yaml").storage_options["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9000"


def test_environment_substitution_rules() -> None:
    cfg = load_config(
        {"source": "s3://${BUCKET}/x-$${literal}.tar", "storage_options": {"a": ["${A:-one}", "${B}"]}},
        environ={"BUCKET": "b", "B": "two"},
    )
    assert cfg.source == "s3://b/x-${literal}.tar"
    assert cfg.storage_options == {"a": ["one", "two"]}


def test_unknown_key_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as e:
        load_config({"source": "x", "shufle": True})
    msg = str(e.value)
    assert "unknown config key(s) 'shufle' (did you mean 'shuffle'?)" in msg
    assert "the valid keys are source, shuffle, seed, decode, fields, partial, batch_size, num_workers, drop_last, " \
           "on_error, cache_dir, storage_options, trust_manifest_urls, allow_incomplete, samples_per_epoch" in msg
    assert isinstance(e.value, ValueError)


def test_unknown_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("source: data\nworkers: 4\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown config key\(s\) 'workers'"):
        load_config(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(path)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("decode", "jpeg", "one of numpy, torch, pil, none"),
        ("batch_size", 0, "an int >= 1"),
        ("batch_size", True, "an int >= 1"),
        ("shuffle", -1, "true, false or a shuffle buffer size"),
        ("fields", "jpg", "a list of field names"),
        ("on_error", "ignore", "raise, skip or warn"),
        ("partial", "even", "pad or drop"),
        ("num_workers", -2, "an int >= 0 or auto"),
        ("storage_options", "key=1", "a mapping"),
        ("samples_per_epoch", 0, "an int >= 1 or null"),
    ],
)
def test_invalid_values_name_the_key(key: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"config key '{key}': expected {expected}"):
        load_config({"source": "data", key: value})


def test_missing_source_and_defaults() -> None:
    with pytest.raises(ConfigError, match="no 'source'"):
        load_config({"seed": 1})
    cfg = load_config({"source": "data", "decode": "none"})
    assert cfg.decode is None and cfg.shuffle is False and cfg.batch_size == 32 and cfg.storage_options == {}
    assert PipelineConfig.from_dict(cfg.to_dict()) == cfg
    assert load_config(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


def test_dataset_from_config_yields_the_same_samples(images: Path, tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"source: {images}\nshuffle: 7\nseed: 11\ndecode: numpy\nfields: [jpg, cls]\n")
    from_cfg = dataset_from_config(path)
    direct = ShardDataset(str(images), shuffle=7, seed=11, decode="numpy", fields=["jpg", "cls"])
    got = [plain(s) for s in from_cfg]
    want = [plain(s) for s in direct]
    assert len(got) == N and got == want
    assert set(got[0]) == {"__key__", "__url__", "__source__", "jpg", "cls"}
    assert [s["__key__"] for s in got] != sorted(s["__key__"] for s in got)  # really shuffled
    # overrides: a config key changes the config, other arguments pass through to ShardDataset
    reseeded = [plain(s) for s in dataset_from_config(path, seed=12)]
    assert reseeded != got and sorted(s["__key__"] for s in reseeded) == sorted(s["__key__"] for s in got)
    keys = list(dataset_from_config(path, shuffle=False, transform=lambda s: s["__key__"]))
    assert keys == [f"k{i:03d}" for i in range(N)]


def test_loader_from_config_yields_the_same_batches(images: Path) -> None:
    cfg = {"source": str(images), "shuffle": 5, "seed": 2, "decode": "torch", "fields": ["jpg", "cls"],
           "batch_size": 6, "drop_last": True, "num_workers": 0}
    loader = loader_from_config(cfg)
    assert len(loader) == 3
    direct = make_loader(
        ShardDataset(str(images), shuffle=5, seed=2, decode="torch", fields=["jpg", "cls"]), batch_size=6, drop_last=True
    )
    got, want = list(loader), list(direct)
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        assert a["__key__"] == b["__key__"]
        assert a["jpg"].shape == (6, 3, 8, 8) and bool((a["jpg"] == b["jpg"]).all())
        assert a["cls"].tolist() == b["cls"].tolist()
    assert loader_from_config(cfg, batch_size=10).batch_size == 10


def test_storage_options_and_cache_dir_reach_the_dataset(images: Path, tmp_path: Path) -> None:
    ds = dataset_from_config({"source": str(images), "cache_dir": str(tmp_path / "cache"), "storage_options": {"anon": True}})
    assert ds.io.cache_dir == str(tmp_path / "cache")
    assert ds.io.storage_options == {"anon": True}


def test_loader_from_config_forwards_every_loader_argument(images: Path, monkeypatch) -> None:
    """Each shardflow.loader keyword given to loader_from_config reaches the loader
    (max_cost and cost used to fall through to ShardDataset)."""
    import functools

    import shardflow.loading.shardloader

    real = shardflow.loading.shardloader.loader
    seen: dict = {}

    @functools.wraps(real)
    def recording(ds, **kwargs):
        seen.update(kwargs)
        return real(ds, **kwargs)

    monkeypatch.setattr(shardflow.loading.shardloader, "loader", recording)
    extra = {"max_cost": 1000, "cost": "num_nodes", "timeout": 5.0, "pin_memory": False, "collate_fn": list}
    loader = loader_from_config({"source": str(images), "batch_size": 4}, **extra)
    assert {k: seen[k] for k in extra} == extra
    assert seen["batch_size"] == 4 and loader.batch_size == 4
    # every keyword of ShardLoader (its own and torch DataLoader's, which it forwards) that is not a
    # config key is forwarded as given
    forwarded = set(shardflow.loading.shardloader.options()) - set(PipelineConfig.keys())
    assert set(extra) <= forwarded


def test_config_and_loader_class_are_reachable_after_import_shardflow(images: Path) -> None:
    import subprocess
    import sys

    code = (
        "import shardflow\n"
        f"loader = shardflow.config.loader_from_config({{'source': {str(images)!r}, 'batch_size': 4}})\n"
        "assert type(loader) is shardflow.ShardLoader\n"
        "assert shardflow.collate is shardflow.loading.collation.collate\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_transforms_are_reachable_after_a_plain_import_shardflow() -> None:
    import subprocess
    import sys

    code = ("import sys, shardflow; assert 'shardflow.config' not in sys.modules; "
            "print(shardflow.config.loader_from_config.__name__, shardflow.transforms.Resize.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["loader_from_config", "Resize"]


def test_num_workers_auto_is_the_usable_cpu_count() -> None:
    import os

    cfg = PipelineConfig(source="x", num_workers="auto")
    want = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert cfg.num_workers == want and cfg.to_dict()["num_workers"] == want
    with pytest.raises(ConfigError, match="an int >= 0 or auto"):
        PipelineConfig(source="x", num_workers="many")
