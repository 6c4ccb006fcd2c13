"""``shardflow bench URL``: stream a dataset through ``shardflow.loader`` and measure it.

Reports samples/s, MiB/s (2**20 bytes/s, as every CLI size) of shard bytes (from the manifest's shard sizes, or the
shard files' sizes after a full pass without one), time to the first batch
(worker start-up, first shard open, first decode) and the rate after it. With
``--plot`` it saves throughput over time as a PNG. ``--config`` takes a
pipeline config (:mod:`shardflow.config`); flags given on the command line
override its keys.

Without ``--config`` the bench works on every dataset ``convert`` makes: when the
manifest lists image fields and images are decoded, every image is resized to
:data:`DEFAULT_RESIZE` for the measurement (images of different sizes then batch;
the output says so; ``--resize none`` keeps sizes), and bad samples are skipped
and counted (``on_error="skip"``; ``--on-error`` as in a training config).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ..codecs import IMAGE_FIELD, is_image_field
from ..config import PipelineConfig, load_config, loader_from_config
from ..errors import SampleError, missing_dependency
from ..policy import ON_ERROR
from . import error_text
from .options import add_io_arguments, storage_options
from .progress import progress_bar
from .units import counted, human_bytes


DEFAULT_RESIZE = (224, 224)
"""Image size (height, width) of a bench without ``--config`` or ``--resize`` on a dataset of images."""

DEFAULT_ON_ERROR = "skip"
"""Bad-sample policy of a bench without ``--config`` or ``--on-error``."""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure streaming throughput: samples/s, MiB/s, time to first batch",
        description="Stream a dataset through shardflow.loader (one epoch, or --seconds) and print "
        "samples/s, MiB/s of shard bytes and time to first batch. Flags override --config keys; "
        "without a config, defaults are those of shardflow.config.PipelineConfig with "
        "min(4, CPUs) workers, images resized to 224x224 (so that images of different sizes batch) "
        "and bad samples skipped and counted.",
    )
    parser.add_argument("url", nargs="?", help="dataset folder, manifest URL or pattern (default: the config's source)")
    parser.add_argument("--config", help="pipeline config YAML (see configs/)")
    parser.add_argument("--decode", choices=["numpy", "torch", "pil", "none"], help="image form (none: raw bytes)")
    parser.add_argument("--workers", type=int, metavar="N", help="DataLoader workers")
    parser.add_argument("--batch-size", type=int, metavar="B", help="samples per batch")
    parser.add_argument("--shuffle", type=int, metavar="BUF", help="shuffle buffer in samples (0: stored order)")
    parser.add_argument("--seed", type=int, help="shuffle seed")
    parser.add_argument("--fields", help="comma-separated fields to keep (e.g. jpg,cls)")
    parser.add_argument("--resize", metavar="H[,W]",
                        help="resize every decoded image to H x W pixels, or 'none' to keep sizes (default without "
                        "--config: 224x224 when the dataset holds images, so that images of different sizes batch)")
    parser.add_argument("--on-error", choices=ON_ERROR,
                        help="bad samples: raise, skip or warn, as in a training config (default without --config: "
                        "skip; skipped samples are counted in the output)")
    parser.add_argument("--seconds", type=float, metavar="S", help="stop after S seconds (default: one full epoch)")
    parser.add_argument("--plot", metavar="OUT.png", help="save throughput over time as a PNG")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_io_arguments(parser)
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    """The pipeline config: ``--config`` (or defaults), then the flags given."""
    if args.config:
        cfg = load_config(args.config)
        changes: dict[str, Any] = {}
        if args.url:
            changes["source"] = args.url
    elif args.url:
        cfg = PipelineConfig(source=args.url, num_workers=min(4, os.cpu_count() or 1), on_error=DEFAULT_ON_ERROR)
        changes = {}
    else:
        raise ValueError("give a dataset URL or --config")
    if args.decode is not None:
        changes["decode"] = None if args.decode == "none" else args.decode
    if args.workers is not None:
        changes["num_workers"] = args.workers
    if args.batch_size is not None:
        changes["batch_size"] = args.batch_size
    if args.shuffle is not None:
        changes["shuffle"] = args.shuffle
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.fields:
        changes["fields"] = [f.strip() for f in args.fields.split(",") if f.strip()]
    if args.on_error is not None:
        changes["on_error"] = args.on_error
    if args.resize and args.resize.lower() == "none":
        changes["resize"] = None
    elif args.resize:
        try:
            dims = [int(d) for d in args.resize.replace("x", ",").split(",")]
        except ValueError:
            raise ValueError(f"--resize takes H or H,W in pixels, or none, got {args.resize!r}") from None
        changes["resize"] = dims[0] if len(dims) == 1 else dims
    if args.storage_option:
        changes["storage_options"] = {**cfg.storage_options, **storage_options(args.storage_option)}
    if args.trust_manifest_urls:
        changes["trust_manifest_urls"] = True
    return cfg.replace(**changes) if changes else cfg


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        keys = batch.get("__key__")
        if isinstance(keys, list):
            return len(keys)
        for v in batch.values():
            return _batch_len(v)
    if isinstance(batch, (list, tuple)):
        return len(batch)
    shape = getattr(batch, "shape", None)
    if shape:
        return int(shape[0])
    num_graphs = getattr(batch, "num_graphs", None)
    return int(num_graphs) if num_graphs is not None else 1


def measure(batches: Iterable[Any], *, seconds: float | None = None, progress: Any = None) -> dict[str, Any]:
    """Iterate ``batches`` (until exhausted or ``seconds`` passed) and time it.

    Returns:
        ``samples``, ``batches``, ``seconds`` (wall time from ``iter()`` to the
        end of the pass, without the workers' shut-down),
        ``first_batch_s``, ``stopped_early`` and ``timeline``: a list of
        ``(seconds, cumulative samples)`` after each batch.
    """
    t0 = time.perf_counter()
    it = iter(batches)
    timeline: list[tuple[float, int]] = []
    n = 0
    stopped = False
    try:
        for batch in it:
            now = time.perf_counter() - t0
            k = _batch_len(batch)
            n += k
            timeline.append((now, n))
            if progress is not None:
                progress(k)
            if seconds is not None and now >= seconds:
                stopped = True
                break
        # the end of the pass (worker shut-down after it is not part of the rate)
        elapsed = time.perf_counter() - t0
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return {
        "samples": n,
        "batches": len(timeline),
        "seconds": elapsed,
        "first_batch_s": timeline[0][0] if timeline else None,
        "stopped_early": stopped,
        "timeline": timeline,
    }


def _shard_bytes(ds: Any, samples: int, complete: bool) -> tuple[int | None, str | None]:
    """Shard bytes behind ``samples`` samples, and where the number comes from."""
    m = ds.manifest
    if m is not None and m.num_samples and all(s.bytes >= 0 for s in m.shards):
        return round(samples * sum(s.bytes for s in m.shards) / m.num_samples), "manifest shard sizes"
    if complete:
        from ..storage import object_size

        return sum(object_size(u, ds.io) for u in ds.urls), "shard file sizes"
    return None, None


def batchable_fields(manifest_fields: Iterable[str]) -> list[str] | None:
    """The fields to keep when none were asked for: all, with several image fields
    (a folder of JPEGs and PNGs) read as the one alias ``image``; None when the
    samples need no selection to batch (at most one image field)."""
    names = sorted(manifest_fields)
    images = [f for f in names if is_image_field(f)]
    if len(images) < 2:
        return None
    return [IMAGE_FIELD] + [f for f in names if f not in images]


def _defaults(cfg: PipelineConfig, manifest: Any, args: argparse.Namespace) -> tuple[PipelineConfig, bool]:
    """The config with the bench's defaults for a dataset of images: the fields to batch,
    and (no ``--config``, no ``--resize``) :data:`DEFAULT_RESIZE`; and whether that resize applies."""
    changes: dict[str, Any] = {}
    if cfg.fields is None:
        fields = batchable_fields(manifest.fields)
        if fields is not None:
            changes["fields"] = fields
    resized = (not args.config and args.resize is None and cfg.resize is None and cfg.decode is not None
               and any(is_image_field(f) for f in (cfg.fields or manifest.fields)))  # fmt: skip
    if resized:
        changes["resize"] = list(DEFAULT_RESIZE)
    return (cfg.replace(**changes) if changes else cfg), resized


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    loader = loader_from_config(cfg)
    ds = loader.dataset
    manifest = getattr(ds, "manifest", None)
    resized = False
    if manifest is not None:
        new, resized = _defaults(cfg, manifest, args)
        if new != cfg:
            cfg = new
            loader = loader_from_config(cfg)
            ds = loader.dataset
    try:
        total: int | None = len(ds)
    except TypeError:
        total = None
    try:
        with progress_bar("bench", total=total, unit="sample") as update:
            result = measure(loader, seconds=args.seconds, progress=update)
    except SampleError as e:
        if "cannot batch field" not in str(e):
            raise
        raise SampleError(f"{error_text(e)}. In shardflow bench: --resize H,W (or a config with resize:)",
                          reason=e.reason) from None  # fmt: skip
    complete = not result["stopped_early"] or (total is not None and result["samples"] >= total)
    nbytes, bytes_from = _shard_bytes(ds, result["samples"], complete)
    secs = result["seconds"]
    first = result["first_batch_s"]
    out: dict[str, Any] = {
        "source": cfg.source if isinstance(cfg.source, str) else list(cfg.source),
        "shards": len(ds.urls),
        "samples": result["samples"],
        "batches": result["batches"],
        "epoch_complete": complete,
        "seconds": round(secs, 4),
        "first_batch_s": round(first, 4) if first is not None else None,
        "samples_per_s": round(result["samples"] / secs, 2) if secs > 0 else None,
        "steady_samples_per_s": None,
        "bytes": nbytes,
        "bytes_from": bytes_from,
        "mib_per_s": round(nbytes / secs / 2**20, 3) if nbytes is not None and secs > 0 else None,
        "skipped": int(ds.stats.get("skipped", 0)),
        "skipped_by_reason": _reasons(ds.stats),
        "resize": list(cfg.resize) if cfg.resize is not None else None,
        "resize_is_bench_default": resized,
        "config": cfg.to_dict(),
    }
    report = loader.report().to_dict()  # the workers' stages (shardflow.accounting)
    out["stages"], out["wait_fraction"], out["verdict"] = report["stages"], report["wait_fraction"], report["sentence"]
    timeline = result["timeline"]
    if len(timeline) > 1 and secs > timeline[0][0]:
        out["steady_samples_per_s"] = round((timeline[-1][1] - timeline[0][1]) / (timeline[-1][0] - timeline[0][0]), 2)
    if args.plot:
        plot_throughput(timeline, args.plot, title=_title(cfg), mean=out["samples_per_s"],
                        stages=out["stages"], verdict=out["verdict"])
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out, indent=1, ensure_ascii=False))
    else:
        print(format_result(out, cfg))
    return 0


def _reasons(stats: Any) -> dict[str, int]:
    """The per-reason counters of dropped samples (everything but the totals)."""
    totals = ("samples", "skipped", "filtered", "lost_samples", "repeated_batches", "bad_shards")
    return {k: int(v) for k, v in sorted(stats.items()) if k not in totals and isinstance(v, int) and v}


def _title(cfg: PipelineConfig) -> str:
    src = cfg.source if isinstance(cfg.source, str) else f"{len(cfg.source)} URLs"
    fields = f" · fields {','.join(cfg.fields)}" if cfg.fields is not None else ""
    return (f"{src} · decode {cfg.decode or 'none'}{fields} · batch {cfg.batch_size} · "
            f"{cfg.num_workers} workers · shuffle {cfg.shuffle}")


def format_result(out: dict[str, Any], cfg: PipelineConfig) -> str:
    """The human-readable form of a bench result."""
    lines = [f"bench        {_title(cfg)}"]
    if out.get("resize") is not None:
        h, w = out["resize"]
        why = (" (bench default, so that images of different sizes batch; --resize H,W or --resize none)"
               if out.get("resize_is_bench_default") else "")
        lines.append(f"resize       every image to {h}x{w}{why}")
    span = "one epoch" if out["epoch_complete"] else "stopped by --seconds"
    lines.append(f"samples      {out['samples']:,} in {counted(out['batches'], 'batch', 'batches')}, {out['seconds']:.2f} s ({span})")
    if out["first_batch_s"] is not None:
        lines.append(f"first batch  {out['first_batch_s']:.3f} s")
    if out["samples_per_s"] is not None:
        lines.append(f"throughput   {out['samples_per_s']:,.1f} samples/s")
    if out["steady_samples_per_s"] is not None:
        lines.append(f"after first  {out['steady_samples_per_s']:,.1f} samples/s")
    if out["mib_per_s"] is not None:
        lines.append(f"read         {out['mib_per_s']:,.2f} MiB/s ({human_bytes(out['bytes'])}, from {out['bytes_from']})")
    else:
        lines.append("read         ? MiB/s (no manifest and the pass was cut short; see `shardflow index`)")
    if out.get("skipped"):
        reasons = ", ".join(f"{k} {v:,}" for k, v in out["skipped_by_reason"].items())
        lines.append(f"skipped      {counted(out['skipped'], 'sample')} (on_error={cfg.on_error}: {reasons or 'see the log'})")
    if out.get("stages"):
        lines.append(f"stages       {stage_line(out['stages'])} of the workers' time")
    if out.get("plot"):
        lines.append(f"plot         {out['plot']}")
    return "\n".join(lines)


def plot_throughput(timeline: list[tuple[float, int]], path: str, *, title: str = "",
                    mean: float | None = None, stages: dict[str, float] | None = None, verdict: str = "") -> None:
    """Save samples/s over time as a PNG at ``path``.

    Windows are 1/40 of the run, widened to three typical batch intervals so
    that each holds several batches. ``mean`` (samples/s) is drawn as the dashed
    line; pass the rate that is printed beside the plot (default: samples over the
    time of the last batch). ``stages``: the workers' seconds per stage, drawn below as bars
    (:func:`draw_stages`), with ``verdict`` (the report's sentence) as their title.
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend, PNG through Agg
    except ImportError as e:
        raise missing_dependency("matplotlib", "show", "plotting throughput (--plot)") from e
    fig = Figure(figsize=(8, 4 if stages is None else 7), dpi=100)
    ax = fig.add_subplot(1 if stages is None else 2, 1, 1)
    if stages is not None:
        draw_stages(fig.add_subplot(2, 1, 2), stages, verdict)
    if timeline:
        end = timeline[-1][0]
        gaps = sorted(b[0] - a[0] for a, b in zip(timeline, timeline[1:]))
        width = max(end / 40, 3 * gaps[len(gaps) // 2] if gaps else 0.0, 0.05)
        edges = [i * width for i in range(math.ceil(end / width) + 1)]
        if edges[-1] < end:
            edges.append(edges[-1] + width)
        rates = []
        j, prev = 0, 0
        for lo, hi in zip(edges, edges[1:]):
            count = prev
            while j < len(timeline) and timeline[j][0] <= hi:
                count = timeline[j][1]
                j += 1
            rates.append((count - prev) / (hi - lo))
            prev = count
        ax.stairs(rates, edges, fill=True, alpha=0.35, color="#4477aa", label=f"samples/s (windows of {width:.2f} s)")
        ax.stairs(rates, edges, color="#4477aa")
        if mean is None:
            mean = timeline[-1][1] / end if end > 0 else 0.0
        ax.axhline(mean, color="#ee6677", linestyle="--", linewidth=1, label=f"mean {mean:,.0f} samples/s")
        ax.axvline(timeline[0][0], color="#228833", linestyle=":", linewidth=1, label=f"first batch {timeline[0][0]:.2f} s")
        ax.legend(loc="upper left", fontsize=8)
    ax.set_xlabel("seconds since iter(loader)")
    ax.set_ylabel("samples/s")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


def draw_stages(ax: Any, stages: Mapping[str, float], sentence: str = "") -> None:
    """Draw worker seconds per stage (:mod:`shardflow.accounting`) as horizontal bars on a
    matplotlib ``ax``, each labelled with its share; ``sentence``: the report's verdict, as the
    title."""
    names = list(stages)
    secs = [stages[n] for n in names]
    total = sum(secs) or 1.0
    bars = ax.barh(names, secs, color="#4477aa", alpha=0.7)
    for bar, s in zip(bars, secs):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {s / total:.0%}", va="center", fontsize=8)
    ax.invert_yaxis()  # innermost stage (fetch) on top, in pipeline order
    ax.set_xlabel("worker seconds (all workers)")
    ax.set_title(sentence, fontsize=7, wrap=True)
    ax.grid(axis="x", alpha=0.3)


def stage_line(stages: Mapping[str, float]) -> str:
    """``"fetch 2%, read 10%, ..."``: each stage's share of the workers' time."""
    total = sum(stages.values())
    if total <= 0:
        return "not timed"
    return ", ".join(f"{k} {v / total:.0%}" for k, v in stages.items())
