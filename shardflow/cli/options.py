"""Options every reading command shares: ``--storage-option`` and ``--trust-manifest-urls``.

One definition, so that ``inspect``, ``verify``, ``show``, ``index`` and ``bench`` spell,
parse and document them alike, and build the same :class:`~shardflow.storage.IOOptions`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_io_arguments", "io_options", "source_and_io", "storage_options"]

STORAGE_OPTION_HELP = (
    "fsspec storage option, repeatable: KEY=VALUE, dotted keys nest "
    "(client_kwargs.endpoint_url=URL), JSON values and objects accepted"
)


def add_io_arguments(parser: argparse.ArgumentParser, *, manifests: bool = True) -> None:
    """Add ``--storage-option`` (and, where the command reads manifests, ``--trust-manifest-urls``)."""
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help=STORAGE_OPTION_HELP)
    if manifests:
        parser.add_argument(
            "--trust-manifest-urls", action="store_true",
            help="open shard, index and sizes URLs that a manifest names outside its own folder "
            "(refused by default: a manifest is untrusted input, see docs/security.md)",
        )


def io_options(args: argparse.Namespace) -> Any:
    """The :class:`~shardflow.storage.IOOptions` of the parsed ``add_io_arguments`` flags."""
    from ..storage import IOOptions  # lazily: `shardflow --help` imports no storage layer

    return IOOptions(
        storage_options=storage_options(args.storage_option),
        trust_manifest_urls=bool(getattr(args, "trust_manifest_urls", False)),
    )


def source_and_io(args: argparse.Namespace) -> tuple[Any, Any, int | None]:
    """What a reading command reads: ``(source, io, samples per epoch)``.

    ``args.url`` is a dataset (returned as given, with the flags' options), or a
    pipeline config (``.yaml``/``.yml``): then its sources, resolved with each
    source's own ``storage_options`` (read with them merged over the config's and
    the flags'), the config's options with the flags' merged over them, and its
    ``samples_per_epoch``.
    """
    io = io_options(args)
    if not str(args.url).endswith((".yaml", ".yml")):
        return args.url, io, None
    from ..config import dataset_from_config, load_config

    cfg = load_config(args.url)
    changes: dict[str, Any] = {}
    if io.storage_options:
        changes["storage_options"] = {**cfg.storage_options, **io.storage_options}
    if io.trust_manifest_urls:
        changes["trust_manifest_urls"] = True
    ds = dataset_from_config(cfg.replace(**changes) if changes else cfg)
    return ds.shards, ds.io, ds.samples_per_epoch


def storage_options(pairs: list[str]) -> dict[str, Any]:
    """Parse repeated ``--storage-option`` values into one nested mapping.

    Each value is ``KEY=VALUE`` or a JSON object. A dotted key nests
    (``client_kwargs.endpoint_url=http://127.0.0.1:9000`` gives
    ``{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}``); a VALUE that is
    JSON (an object, a list, a number, ``true``/``false``/``null``, a quoted string)
    is taken as that value, anything else as a string. Later values merge into
    earlier ones, nested mappings key by key.

    Raises:
        ValueError: a value that is neither ``KEY=VALUE`` nor a JSON object, or a key
            that is set both to a mapping and to a plain value.
    """
    out: dict[str, Any] = {}
    for p in pairs:
        if p.lstrip().startswith("{"):
            try:
                value = json.loads(p)
            except ValueError as e:
                raise ValueError(f"--storage-option {p!r}: not a JSON object ({e})") from e
            _merge_option(out, value, p)
            continue
        k, sep, v = p.partition("=")
        if not sep or not k or any(not part for part in k.split(".")):
            raise ValueError(f"--storage-option needs KEY=VALUE (KEY may be dotted: a.b=c) or a JSON object, got {p!r}")
        try:
            value = json.loads(v)
        except ValueError:
            value = v
        for part in reversed(k.split(".")):
            value = {part: value}
        _merge_option(out, value, p)
    return out


def _merge_option(into: dict[str, Any], new: Any, given: str) -> None:
    if not isinstance(new, dict):
        raise ValueError(f"--storage-option {given!r}: expected a JSON object, got {type(new).__name__}")
    for k, v in new.items():
        old = into.get(k)
        if isinstance(old, dict) and isinstance(v, dict):
            _merge_option(old, v, given)
        elif isinstance(old, dict) or (k in into and isinstance(v, dict)):
            raise ValueError(f"--storage-option {given!r}: {k!r} is set both to a mapping and to a value")
        else:
            into[k] = v
