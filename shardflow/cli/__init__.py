"""The ``shardflow`` command line.

Each command lives in its own module that exposes ``register(subparsers)``;
the module's handler receives the parsed ``argparse.Namespace`` and returns
the process exit code. Library code never prints: progress reaches it as a
callback (:mod:`shardflow.cli.progress`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from ..errors import ShardflowError

__all__ = ["main", "build_parser"]

# command modules, in the order `shardflow --help` lists them
COMMANDS = ("convert", "index", "inspect", "verify", "show", "bench")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (every command registered)."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="shardflow",
        description="Pack training data into tar shards and stream them into PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"shardflow {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            continue  # command not built yet
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardflow`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ShardflowError as e:
        print(f"shardflow {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"shardflow {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `shardflow inspect ... | head`
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
