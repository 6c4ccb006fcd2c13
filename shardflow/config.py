"""Pipeline configs: one YAML file that rebuilds a dataset and its loader exactly.

A config names the source and every option that changes what a training loop
receives (order, decoding, fields, splitting, batching, error policy) plus where
and how shards are read. The same file run twice gives the same batches::

    # configs/images.yaml (a list of sources with weights mixes them:
    #   source: [{url: data/a, weight: 3}, {url: data/b, weight: 1}] plus samples_per_epoch)
    source: data/imagenet/shardflow.json
    shuffle: 1000
    seed: 0
    decode: torch
    fields: [jpg, cls]
    batch_size: 64
    num_workers: 4

    ds = shardflow.config.dataset_from_config("configs/images.yaml")
    loader = shardflow.config.loader_from_config("configs/images.yaml", num_workers=8)

``${VAR}`` in any string value is replaced by the environment variable ``VAR``
when the file is loaded (``${VAR:-default}`` gives a default), so credentials
and endpoints stay out of the file; an unset variable without a default is an
error that names it. ``$$`` is a literal ``$``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .codecs import IMAGE_FIELD
from .errors import ShardflowError
from .policy import ON_ERROR

__all__ = ["PipelineConfig", "ConfigError", "load_config", "dataset_from_config", "loader_from_config", "usable_cpus"]

DECODE_CHOICES = ("numpy", "torch", "pil", None)
PARTIAL_CHOICES = ("pad", "drop")

_ENV = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(ShardflowError, ValueError):
    """A pipeline config is invalid: unknown key, wrong type or value, unset variable."""

    default_reason = "config"


@dataclass(frozen=True)
class PipelineConfig:
    """Everything that defines a data pipeline, validated on creation.

    Attributes:
        source: folder, manifest URL, shard pattern (``s3://b/train-{000000..000099}.tar``),
            or a list of sources, each a URL or a mapping ``{url, weight, storage_options,
            name}`` (a union, or with weights and ``samples_per_epoch`` a weighted mixture).
        shuffle: False (stored order), True (shard shuffle and a 1,000-sample
            buffer) or a shuffle buffer size in samples.
        seed: seed of every shuffle.
        decode: ``"numpy"`` (images uint8, shape (H, W, 3)), ``"torch"`` (uint8,
            shape (3, H, W)), ``"pil"``, or None / ``"none"`` for raw bytes.
        fields: field names to keep (``"jpg;png"`` takes the first present), or None for all.
        partial: ``"pad"`` or ``"drop"``: how ranks get equal sample counts.
        batch_size: samples per batch.
        num_workers: DataLoader worker processes per rank, or ``"auto"``: one per CPU this
            process may use (``os.sched_getaffinity``, else ``os.cpu_count()``; the count
            above which torch warns), resolved when the config is built.
        drop_last: drop each rank's last incomplete batch.
        on_error: ``"raise"``, ``"skip"`` or ``"warn"``.
        cache_dir: local folder caching remote shards, or None.
        storage_options: fsspec options (credentials, ``client_kwargs.endpoint_url``, ...).
        trust_manifest_urls: open shard, index and sizes URLs that a manifest names outside
            its own folder (refused by default; see :class:`shardflow.storage.IOOptions`).
        allow_incomplete: read a folder that a writer is still writing, or whose conversion
            did not finish (refused by default; see :class:`shardflow.storage.IOOptions`).
        samples_per_epoch: samples per rank per epoch when training by steps, or None.
        resize: ``[height, width]`` (or one int) in pixels: every decoded image is
            resized to it (:class:`shardflow.transforms.Resize`, before any
            ``transform=``), so that images of different sizes batch; None keeps sizes.

    Raises:
        ConfigError: a value has the wrong type or is out of range (the
            message names the key, what was expected and what was found).
    """

    source: str | tuple[str | Mapping[str, Any], ...]
    shuffle: bool | int = False
    seed: int = 0
    decode: str | None = "numpy"
    fields: tuple[str, ...] | None = None
    partial: str = "pad"
    batch_size: int = 32
    num_workers: int | str = 0
    drop_last: bool = False
    on_error: str = "raise"
    cache_dir: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    trust_manifest_urls: bool = False
    allow_incomplete: bool = False
    samples_per_epoch: int | None = None
    resize: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        def bad(key: str, expected: str) -> ConfigError:
            return ConfigError(f"config key {key!r}: expected {expected}, got {getattr(self, key)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        src = self.source
        if isinstance(src, os.PathLike):
            src = os.fspath(src)
        if isinstance(src, (list, tuple)) and src:
            src = tuple(_source_entry(u, f"source[{i}]") for i, u in enumerate(src))
        elif not isinstance(src, str) or not src:
            raise bad("source", "a non-empty URL, path or pattern, or a list of sources")
        object.__setattr__(self, "source", src)
        if not (isinstance(self.shuffle, bool) or (is_int(self.shuffle) and self.shuffle >= 0)):
            raise bad("shuffle", "true, false or a shuffle buffer size >= 0")
        if not is_int(self.seed):
            raise bad("seed", "an int")
        decode = self.decode
        if isinstance(decode, str) and decode.lower() == "none":
            decode = None
            object.__setattr__(self, "decode", None)
        if decode not in DECODE_CHOICES:
            raise bad("decode", "one of numpy, torch, pil, none")
        if self.fields is not None:
            if isinstance(self.fields, str) or not isinstance(self.fields, Sequence) or not all(
                isinstance(f, str) and f for f in self.fields
            ):
                raise bad("fields", "a list of field names, e.g. [jpg, cls]")
            object.__setattr__(self, "fields", tuple(self.fields))
        if self.partial not in PARTIAL_CHOICES:
            raise bad("partial", "pad or drop")
        if not is_int(self.batch_size) or self.batch_size < 1:
            raise bad("batch_size", "an int >= 1")
        if self.num_workers == "auto":
            object.__setattr__(self, "num_workers", usable_cpus())
        if not is_int(self.num_workers) or self.num_workers < 0:
            raise bad("num_workers", "an int >= 0 or auto")
        if not isinstance(self.drop_last, bool):
            raise bad("drop_last", "true or false")
        if self.on_error not in ON_ERROR:
            raise bad("on_error", ", ".join(ON_ERROR[:-1]) + " or " + ON_ERROR[-1])
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)) or not os.fspath(self.cache_dir):
                raise bad("cache_dir", "a local folder path")
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        if self.storage_options is None:
            object.__setattr__(self, "storage_options", {})
        if not isinstance(self.storage_options, Mapping):
            raise bad("storage_options", "a mapping of fsspec options")
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        for flag in ("trust_manifest_urls", "allow_incomplete"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "true or false")
        if self.samples_per_epoch is not None and (not is_int(self.samples_per_epoch) or self.samples_per_epoch < 1):
            raise bad("samples_per_epoch", "an int >= 1 or null")
        if self.resize is not None:
            size = [self.resize, self.resize] if is_int(self.resize) else self.resize
            if isinstance(size, str) or not isinstance(size, Sequence) or len(size) != 2 or not all(
                is_int(d) and d > 0 for d in size
            ):
                raise bad("resize", "[height, width] in pixels, one int, or null")
            if decode is None:
                raise ConfigError("config key 'resize': images must be decoded to be resized (decode is none)")
            object.__setattr__(self, "resize", (size[0], size[1]))

    @classmethod
    def keys(cls) -> list[str]:
        """The valid config keys, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineConfig:
        """Build from a mapping, refusing unknown keys.

        Raises:
            ConfigError: an unknown key (the message lists the valid ones and
                the closest match), a missing ``source``, or an invalid value.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a pipeline config must be a mapping of keys to values, got {type(data).__name__}")
        valid = cls.keys()
        unknown = [k for k in data if k not in valid]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(str(k), valid, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(f"unknown config key(s) {', '.join(hints)}; the valid keys are {', '.join(valid)}")
        if "source" not in data:
            raise ConfigError(f"the config has no 'source' (the dataset to read); the valid keys are {', '.join(valid)}")
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        """Plain, YAML/JSON-ready values (lists, not tuples); ``from_dict`` gives it back."""
        out = dataclasses.asdict(self)
        for k in ("source", "fields", "resize"):
            if isinstance(out[k], tuple):
                out[k] = [dict(v) if isinstance(v, Mapping) else v for v in out[k]]
        return out

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with some keys changed (validated; unknown keys refused)."""
        return PipelineConfig.from_dict({**self.to_dict(), **changes})


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


_SOURCE_KEYS = ("url", "weight", "storage_options", "name")


def _source_entry(entry: Any, where: str) -> str | Mapping[str, Any]:
    """One entry of a list of sources: a URL or path, or a mapping with ``url``
    and optionally ``weight``, ``storage_options`` and ``name`` (see :class:`shardflow.Source`)."""
    if isinstance(entry, (str, os.PathLike)) and os.fspath(entry):
        return os.fspath(entry)
    if not isinstance(entry, Mapping):
        raise ConfigError(f"config key {where!r}: expected a URL or a mapping with 'url' (and 'weight', ...), got {entry!r}")
    unknown = [k for k in entry if k not in _SOURCE_KEYS]
    if unknown or not isinstance(entry.get("url"), (str, os.PathLike)) or not os.fspath(entry["url"]):
        raise ConfigError(
            f"config key {where!r}: a source mapping needs 'url' and may have {', '.join(_SOURCE_KEYS[1:])}; got {dict(entry)!r}"
        )
    w = entry.get("weight")
    if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0 or w == float("inf")):
        raise ConfigError(f"config key {where}.weight: expected a positive number, got {w!r}")
    if not isinstance(entry.get("storage_options") or {}, Mapping):
        raise ConfigError(f"config key {where}.storage_options: expected a mapping of fsspec options")
    return {k: (os.fspath(v) if k == "url" else v) for k, v in entry.items()}


def _expand_env(value: Any, where: str, environ: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name, default = m.group(1), m.group(2)
            if name in environ:
                return environ[name]
            if default is not None:
                return default
            raise ConfigError(f"config key {where!r}: environment variable {name!r} is not set (use ${{{name}:-default}} for a default)")

        return _ENV.sub(sub, value)
    if isinstance(value, Mapping):
        return {k: _expand_env(v, f"{where}.{k}" if where else str(k), environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{where}[{i}]", environ) for i, v in enumerate(value)]
    return value


def load_config(
    path_or_mapping: str | os.PathLike | Mapping[str, Any] | PipelineConfig,
    *,
    environ: Mapping[str, str] | None = None,
) -> PipelineConfig:
    """Read a pipeline config.

    Args:
        path_or_mapping: a YAML file (read with ``yaml.safe_load``), a mapping,
            or a :class:`PipelineConfig` (returned as is).
        environ: variables for ``${VAR}`` substitution (default ``os.environ``).

    Returns:
        The validated config. A relative local ``source`` or ``cache_dir`` in a
        file is kept as written (relative to the working directory).

    Raises:
        ConfigError: unknown keys, invalid values, an unset variable, or a
            file that is not a YAML mapping.
        FileNotFoundError: no such file.
    """
    if isinstance(path_or_mapping, PipelineConfig):
        return path_or_mapping
    where = "<mapping>"
    if isinstance(path_or_mapping, Mapping):
        data: Any = dict(path_or_mapping)
    else:
        import yaml

        where = os.fspath(path_or_mapping)
        with open(where, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ConfigError(f"{where}: not valid YAML: {e}") from e
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: a pipeline config must be a YAML mapping of keys to values")
    try:
        return PipelineConfig.from_dict(_expand_env(data, "", os.environ if environ is None else environ))
    except ConfigError as e:
        if where == "<mapping>":
            raise
        raise ConfigError(f"{where}: {e}") from e


def _split_overrides(cfg: PipelineConfig, overrides: Mapping[str, Any]) -> tuple[PipelineConfig, dict[str, Any]]:
    """Config keys in ``overrides`` change the config; the rest pass through."""
    keys = set(PipelineConfig.keys())
    changes = {k: v for k, v in overrides.items() if k in keys}
    extra = {k: v for k, v in overrides.items() if k not in keys}
    return (cfg.replace(**changes) if changes else cfg), extra


def dataset_from_config(cfg: str | os.PathLike | Mapping[str, Any] | PipelineConfig, **overrides: Any) -> Any:
    """Build the :class:`~shardflow.ShardDataset` a config describes.

    Args:
        cfg: a config, a YAML path or a mapping (see :func:`load_config`).
        **overrides: config keys to change (``seed=1``), or other
            ``ShardDataset`` arguments (``transform=``, ``rank=``,
            ``world_size=``, ``max_pixels=``).

    Returns:
        The dataset, equal to ``ShardDataset(cfg.source, shuffle=cfg.shuffle, ...)``.

    Raises:
        ConfigError: invalid config or override.
    """
    from .dataset import ShardDataset
    from .storage import IOOptions

    cfg, extra = _split_overrides(load_config(cfg), overrides)
    io = extra.pop("io", None)
    if io is None:
        io = IOOptions(storage_options=cfg.storage_options, cache_dir=cfg.cache_dir,
                       trust_manifest_urls=cfg.trust_manifest_urls, allow_incomplete=cfg.allow_incomplete)
    source: Any = cfg.source
    if isinstance(source, tuple):
        from .sources.source import Source

        source = [Source(**e) if isinstance(e, Mapping) else e for e in source]
    if cfg.resize is not None:
        from .transforms import Chain, Resize, map_fields

        resize = map_fields({IMAGE_FIELD: Resize(cfg.resize)})
        user = extra.get("transform")
        if isinstance(user, Mapping):
            user = map_fields(user)
        extra["transform"] = resize if user is None else Chain(resize, user)
    return ShardDataset(
        source,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        decode=cfg.decode,
        fields=cfg.fields,
        on_error=cfg.on_error,
        partial=cfg.partial,
        samples_per_epoch=cfg.samples_per_epoch,
        io=io,
        **extra,
    )


def loader_from_config(cfg: str | os.PathLike | Mapping[str, Any] | PipelineConfig, **overrides: Any) -> Any:
    """Build the dataset and its :class:`~shardflow.loading.shardloader.ShardLoader` from a config.

    Args:
        cfg: a config, a YAML path or a mapping.
        **overrides: config keys to change (``num_workers=8``), any other
            :func:`shardflow.loader` argument (``collate_fn=``, ``max_cost=``,
            ``cost=``, ``pin_memory=``, ...), or other ``ShardDataset``
            arguments (``transform=``).

    Returns:
        The loader; its dataset is ``loader.dataset``.
    """
    from .loading.shardloader import loader, options

    cfg, extra = _split_overrides(load_config(cfg), overrides)
    loader_args = options()
    loader_extra = {k: extra.pop(k) for k in list(extra) if k in loader_args}
    ds = dataset_from_config(cfg, **extra)
    return loader(ds, batch_size=cfg.batch_size, num_workers=cfg.num_workers, drop_last=cfg.drop_last, **loader_extra)
