"""What every ``shardflow convert KIND`` sub-command shares: the shard options, the
progress bar, the Dask client and the one-line summary (:func:`run_converter`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import redact
from .options import storage_options
from .progress import progress_bar

__all__ = ["add_shard_options", "add_order_options", "options_from_args", "dask_client", "run_converter", "rate"]


def add_shard_options(parser: argparse.ArgumentParser, *, max_count: int | None = 10_000) -> None:
    """Options every converter shares: shard size, workers, resume, storage.

    ``max_count=None`` lets the converter choose the shard size (its help says how).
    """
    default = f"default {max_count}" if max_count is not None else "default: chosen by the converter"
    parser.add_argument("--max-count", type=int, default=max_count, help=f"samples per shard ({default})")
    parser.add_argument("--prefix", default="train", help="shard name prefix: PREFIX-000000.tar (default train)")
    parser.add_argument("--max-bytes", type=int, default=None, help="shard size limit in bytes (default: none)")
    parser.add_argument(
        "--compression", choices=("none", "zstd"), default="none",
        help="zstd: .tar.zst shards in independent zstd frames, plain tar inside, seekable through a frame "
        "table beside the offset index (needs shardflow[zstd]; default none: .tar)",
    )  # fmt: skip
    parser.add_argument(
        "--group-size", type=int, default=None, metavar="N",
        help="inputs per task (default: --max-count); shards never span two tasks",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, default=None, help="writer processes (default: number of CPUs)")
    parser.add_argument(
        "--scheduler", metavar="ADDRESS", default=None,
        help="run on a Dask cluster: its scheduler's address, e.g. tcp://10.0.0.1:8786 (needs shardflow[dask])",
    )  # fmt: skip
    parser.add_argument("--no-resume", action="store_true", help="rewrite every shard instead of keeping finished ones")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace a dataset DST already holds (default: refuse a DST that holds another dataset)",
    )  # fmt: skip
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option for a remote SRC or DST (repeatable)",
    )


def add_order_options(parser: argparse.ArgumentParser, shuffled: str, walk: str, *, default: str | None = "shuffled",
                      window: str | None = None) -> None:  # fmt: skip
    """``--order {shuffled,walk}`` and ``--seed`` (and, for a stream, ``--window``), the same for
    every converter (:mod:`shardflow.convert.engine.mixorder`); ``shuffled`` and ``walk`` say
    what each order means for this input, ``default=None`` lets the converter choose."""
    shown = f"default {default}" if default is not None else "default: as said"
    parser.add_argument("--order", choices=["shuffled", "walk"], default=default,
                        help=f"shuffled: {shuffled}; walk: {walk} ({shown}; recorded in meta.order)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffled order (default 0; meta.order_seed)")
    if window is not None:
        from ..convert.engine.mixorder import DEFAULT_WINDOW

        parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, metavar="N",
                            help=f"{window} (default {DEFAULT_WINDOW:,}; meta.order_window)")  # fmt: skip


def options_from_args(args: argparse.Namespace, *, max_count: int | None = None) -> Any:
    """The :class:`~shardflow.convert.engine.engine.ConvertOptions` of the shared shard options.

    ``max_count`` overrides ``--max-count`` (a converter that picks the shard size itself).
    """
    from ..convert.engine.engine import ConvertOptions

    return ConvertOptions(
        max_count=max_count if max_count is not None else args.max_count,
        prefix=args.prefix,
        max_bytes=args.max_bytes,
        group_size=args.group_size,
        workers=args.workers,
        resume=not args.no_resume,
        overwrite=args.overwrite,
        storage_options=storage_options(args.storage_option),
        compression=None if getattr(args, "compression", "none") == "none" else args.compression,
    )


class ConverterProgress:
    """The progress callback given to a converter: ``progress(n)`` advances the bar, and
    ``progress.kept(n)`` (called by the engine) counts the finished shards a re-run kept."""

    def __init__(self, update: Callable[[int], Any]) -> None:
        self.update = update
        self.shards_kept = 0

    def __call__(self, n: int) -> None:
        self.update(n)

    def kept(self, shards: int) -> None:
        self.shards_kept += shards


@contextmanager
def dask_client(address: str | None) -> Iterator[Any]:
    """A ``dask.distributed.Client`` connected to ``address`` (None: yield None, no Dask)."""
    if address is None:
        yield None
        return
    try:
        from distributed import Client
    except ImportError as e:
        from ..errors import missing_dependency

        raise missing_dependency("distributed", "dask", "--scheduler") from e
    with Client(address) as client:
        yield client


def run_converter(
    convert: Callable[[Callable[[int], None], Any], Any],
    summary: Callable[[Any, float], str],
    *,
    args: argparse.Namespace,
    desc: str,
    unit: str,
    total: int | None = None,
) -> int:
    """Run one converter under a progress bar and print its one-line summary.

    Args:
        convert: ``convert(progress, client)`` runs the conversion (on the Dask
            cluster of ``client`` when it is not None) and returns its manifest.
        summary: ``summary(manifest, seconds)`` is the line printed at the end;
            a re-run that kept finished shards says how many.
        args: the parsed arguments (``--scheduler``).
        desc, unit, total: the progress bar's label, unit and total (None: unknown).

    Returns:
        The exit status, 0.
    """
    start = time.perf_counter()
    with dask_client(args.scheduler) as client, progress_bar(desc, total, unit=unit) as update:
        progress = ConverterProgress(update)
        manifest = convert(progress, client)
    line = summary(manifest, time.perf_counter() - start)
    if progress.shards_kept:
        n = progress.shards_kept
        line += f" (kept {n} finished shard{'s' if n != 1 else ''} of an earlier run)"
    print(redact(line))  # the names in it are escaped by each summary (shardflow.cli.shown)
    return 0


def rate(n: int, seconds: float, unit: str) -> str:
    """``"in 1.2 s (3,456 files/s)"``: the time and rate of a summary line."""
    return f"in {seconds:.1f} s ({n / max(seconds, 1e-9):,.0f} {unit}/s)"
