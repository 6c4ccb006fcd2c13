"""``shardflow verify URL``: check every shard and sample; exit 1 on any problem."""

from __future__ import annotations

import argparse
import json

from ..inspect import verify
from .options import add_io_arguments, source_and_io
from .progress import progress_bar, total_samples
from .units import counted, human_bytes


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "verify",
        help="check every shard against the manifest and decode every sample",
        description="Read every shard (in parallel) and check it against the manifest: sha256, byte size, "
        "sample count and offset index; parse every sample and decode every field. Each problem is "
        "printed with its shard, key and reason; the exit status is 1 if there is any, else 0.",
    )
    parser.add_argument("url", help="dataset folder, manifest URL, shard pattern or URL, or a pipeline config "
                        "(.yaml): its sources, each read with its own storage options")
    parser.add_argument("--workers", type=int, default=None, metavar="N", help="processes (default: CPUs)")
    parser.add_argument("--no-decode", action="store_true", help="check structure and manifest only, skip decoding")
    parser.add_argument("--mixed-fields", action="store_true",
                        help="allow samples to lack fields that most samples have")
    parser.add_argument("--max-problems", type=int, default=50, metavar="N",
                        help="problems to print (default 50; all are counted)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_io_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    source, io, _ = source_and_io(args)
    with progress_bar("verifying", total=total_samples(source, io), unit="sample") as update:
        report = verify(
            source, decode=not args.no_decode, uniform_fields=not args.mixed_fields,
            workers=args.workers, io=io, progress=update,
        )
    if args.json:
        print(json.dumps({
            "ok": report.ok,
            "shards": report.shards,
            "samples": report.samples,
            "bytes": report.bytes,
            "manifest": report.manifest,
            "decoded": report.decoded,
            "seconds": round(report.seconds, 3),
            "problems": [p.to_json() for p in report],
        }, indent=1, ensure_ascii=False))
        return 0 if report.ok else 1
    checks = "sha256, sizes, sample counts, offset indexes" if report.manifest else "no manifest: structure only"
    checks += "; every field decoded" if report.decoded else "; fields not decoded"
    if report.ok:
        print(
            f"OK: {counted(report.shards, 'shard')}, {counted(report.samples, 'sample')}, {human_bytes(report.bytes)} verified "
            f"({checks}) in {report.seconds:.1f} s"
        )
        return 0
    for p in report[: args.max_problems]:
        print(f"FAIL {p}")
    if len(report) > args.max_problems:
        print(f"... and {len(report) - args.max_problems:,} more (--max-problems to see them)")
    print(
        f"verify: {counted(len(report), 'problem')} in {len(report.bad_shards()):,} of {counted(report.shards, 'shard')} "
        f"({counted(report.samples, 'sample')} read; {checks})"
    )
    return 1
