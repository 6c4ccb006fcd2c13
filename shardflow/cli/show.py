"""``shardflow show URL --out grid.png``: a PNG grid of images or graphs with labels and keys."""

from __future__ import annotations

import argparse

from .options import add_io_arguments, io_options


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "show",
        help="draw samples as a PNG grid: images with labels and keys, or graphs",
        description="Draw N samples (spread over the dataset when the manifest gives counts) as a grid: "
        "images with their label and key under each tile, or, for 'pyg' fields, node-link drawings "
        "titled with key, nodes and edges (needs matplotlib and networkx: pip install 'shardflow[show]').",
    )
    parser.add_argument("url", help="dataset folder, manifest URL, shard pattern or URL")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--n", type=int, default=16, help="samples to draw (default 16)")
    parser.add_argument("--cols", type=int, default=4, help="tiles per row (default 4)")
    parser.add_argument("--field", default=None, help="image or pyg field; 'image' stands for whichever image field a sample has "
                        "(default: the image field(s), else the graph field)")
    parser.add_argument("--label", default="cls", help="field shown as label (default cls; '' for none)")
    parser.add_argument("--tile", type=int, default=160, help="tile size in pixels (default 160)")
    parser.add_argument("--first", action="store_true", help="draw the first N samples instead of N spread over the dataset")
    add_io_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..show import save_grid
    io = io_options(args)
    grid = save_grid(
        args.out, args.url, n=args.n, cols=args.cols, field=args.field, label=args.label or None,
        tile=args.tile, spread=not args.first, io=io,
    )
    print(f"wrote {args.out} ({grid.width}x{grid.height} px)")
    return 0
