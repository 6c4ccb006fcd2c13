"""``shardflow plan URL --world-size N --workers W``: what each epoch will read, before reading.

From the deterministic plan of every rank and epoch and the manifest (and, for shard parts
that start inside a shard, its offset index), the GETs and bytes of shard data each rank
will take over the network, the local disk the staging area and a cache will hold, and a
cost when prices are given (no built-in price list). The rules are those of
:mod:`shardflow.reader.epochcost`; ``loader.report()`` measures the same counters.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from .options import add_io_arguments, io_options
from .units import counted, human_bytes

HELP = "predict each epoch's GETs and bytes per rank from the plan, and their cost"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan", help=HELP,
        description="Print, per epoch and rank, the GETs and bytes of shard data the epoch will take over the "
        "network (one streaming GET per shard part, each byte once per rank when staged), the staging and cache "
        "disk, and the cost for the prices given. Reads only the manifest (and offset indexes of shards split "
        "inside). Give the options the training uses: the plan depends on them.",
    )
    parser.add_argument("url", help="dataset folder, manifest URL or pattern")
    parser.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks (default 1)")
    parser.add_argument("--workers", type=int, default=0, metavar="W", help="DataLoader workers per rank (default 0)")
    parser.add_argument("--epochs", type=int, default=1, metavar="E", help="epochs (default 1)")
    parser.add_argument("--batch-size", type=int, default=64, metavar="B", help="samples per batch (default 64)")
    parser.add_argument("--drop-last", action="store_true", help="drop each rank's last incomplete batch")
    parser.add_argument("--shuffle", type=int, default=0, metavar="BUF",
                        help="shuffle buffer in samples, shards shuffled too (default 0: stored order)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    parser.add_argument("--affinity", action="store_true", help="shard affinity (ShuffleConfig(affinity=True))")
    parser.add_argument("--cache", action="store_true",
                        help="each rank reads through a cache_dir large enough for its shards")
    parser.add_argument("--no-staging", action="store_true", help="IOOptions(staging=False): each worker streams")
    parser.add_argument("--price-per-gb", type=float, metavar="X", help="price per 10**9 bytes transferred")
    parser.add_argument("--price-per-1k-requests", type=float, metavar="Y", help="price per 1,000 GETs")
    parser.add_argument("--json", action="store_true", help="print JSON")
    add_io_arguments(parser)
    parser.set_defaults(func=run)


def predict(args: argparse.Namespace) -> dict[str, Any]:
    """The prediction as plain data (what ``--json`` prints)."""
    from dataclasses import replace

    from .. import ShardDataset, loader
    from ..planning.plan import ShuffleConfig
    from ..reader.epochcost import rank_cost

    io = replace(io_options(args), staging=not args.no_staging)
    shuffle: Any = ShuffleConfig(buffer=args.shuffle, affinity=args.affinity) if args.shuffle else (
        ShuffleConfig.off() if not args.affinity else ShuffleConfig(buffer=0, shards=False, affinity=True))
    ds = ShardDataset(args.url, shuffle=shuffle, seed=args.seed, io=io, rank=0, world_size=args.world_size)
    loader(ds, batch_size=args.batch_size, drop_last=args.drop_last)  # the batching the plan splits by
    interleave = ds.shuffle.interleave if ds.shuffle.enabled else 1
    caches: list[set[int] | None] = [set() if args.cache else None for _ in range(args.world_size)]
    epochs = []
    for epoch in range(args.epochs):
        ranks = []
        for rank in range(args.world_size):
            cost = rank_cost(ds.plan(epoch, rank), ds.shards, io, args.workers, interleave, caches[rank])
            ranks.append({"rank": rank, **asdict(cost)})
        epochs.append({"epoch": epoch, "requests": sum(r["requests"] for r in ranks),
                       "bytes": sum(r["bytes"] for r in ranks), "ranks": ranks})
    out: dict[str, Any] = {
        "source": args.url, "world_size": args.world_size, "workers": args.workers, "epochs": args.epochs,
        "shards": len(ds.shards.urls), "stored_bytes": sum(int(s.bytes) for s in ds.shards.manifest.shards),
        "requests": sum(e["requests"] for e in epochs), "bytes": sum(e["bytes"] for e in epochs),
        "requests_max": sum(r["requests_max"] for e in epochs for r in e["ranks"]),
        "bytes_max": sum(r["bytes_max"] for e in epochs for r in e["ranks"]),
        "cache_bytes": sum(r["cache_bytes"] for e in epochs for r in e["ranks"]),
        "staging_bytes": max((r["staging_bytes"] for e in epochs for r in e["ranks"]), default=0),
        "per_epoch": epochs,
    }
    if args.price_per_gb is not None or args.price_per_1k_requests is not None:
        transfer = out["bytes"] / 1e9 * (args.price_per_gb or 0.0)
        requests = out["requests"] / 1000 * (args.price_per_1k_requests or 0.0)
        out["cost"] = {"transfer": round(transfer, 6), "requests": round(requests, 6), "total": round(transfer + requests, 6)}
    return out


def run(args: argparse.Namespace) -> int:
    out = predict(args)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"plan         {out['source']}: {counted(out['shards'], 'shard')}, {human_bytes(out['stored_bytes'])} stored; "
          f"{counted(out['world_size'], 'rank')} x {counted(out['workers'], 'worker')}")
    for e in out["per_epoch"]:
        for r in e["ranks"]:
            print(f"epoch {e['epoch']:<3d} rank {r['rank']:<4d} {r['requests']:>8,} GETs  {human_bytes(r['bytes']):>10}"
                  f"  ({counted(r['parts'], 'part')}; cache +{human_bytes(r['cache_bytes'])}, "
                  f"staging <= {human_bytes(r['staging_bytes'])})")
    most = f" (up to {out['requests_max']:,}: parts read from inside shards)" if out["requests_max"] > out["requests"] else ""
    print(f"total        {out['requests']:,} GETs{most}, {human_bytes(out['bytes'])} of shard data over the network")
    if "cost" in out:
        c = out["cost"]
        print(f"cost         {c['total']:.4f} ({c['transfer']:.4f} transfer + {c['requests']:.4f} requests)")
    return 0
