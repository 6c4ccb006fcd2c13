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
from collections.abc import Iterable, Sequence

from ..errors import ShardflowError, redact

__all__ = ["COMMANDS", "main", "build_parser", "command_in", "error_text"]

# command modules, in the order `shardflow --help` lists them, with the one-line help each module's
# register() gives its parser (tests/test_cli_startup.py checks that the two agree). A command's module
# (and what it imports: storage, numpy, fsspec, torch) is imported only when that command runs, so
# `shardflow --help` starts in well under a second.
COMMANDS: dict[str, str] = {
    "convert": "convert an image folder, a PyG dataset, arrays, text lines, Parquet or LMDB into shards",
    "index": "write shardflow.json (counts, bytes, sha256, offsets) for existing shards",
    "inspect": "summarize a dataset: shards, samples, fields, classes, graphs, first keys",
    "verify": "check every shard against the manifest and decode every sample",
    "show": "draw samples as a PNG grid: images with labels and keys, or graphs",
    "bench": "measure streaming throughput: samples/s, MiB/s, time to first batch",
    "plan": "predict each epoch's GETs and bytes per rank from the plan, and their cost",
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser.

    Args:
        commands: the commands whose modules are imported and whose full arguments are registered;
            the others get a stub parser that only names them in ``shardflow --help``. ``None``
            registers every command fully.

    Returns:
        The parser; a fully registered command's handler is ``args.func``.
    """
    from .. import __version__

    wanted = set(COMMANDS if commands is None else commands)
    parser = argparse.ArgumentParser(
        prog="shardflow",
        description="Pack training data into tar shards and stream them into PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"shardflow {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, summary in COMMANDS.items():
        if name in wanted:
            try:
                module = importlib.import_module(f".{name}", __name__)
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":
                    raise
                continue  # command not built yet
            module.register(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def command_in(argv: Sequence[str]) -> str | None:
    """The command an argument list names: its first word that is not an option.

    The top-level options (``-v``, ``--version``, ``-h``) take no value, so that word is the command
    (or a misspelling of one, which the parser then reports). ``None`` when there is none.
    """
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardflow`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = command_in(argv)
    parser = build_parser([command] if command in COMMANDS else [])
    args = parser.parse_args(argv)
    from .shown import ShownFormatter, Terminated, escaped, on_sigterm

    level = logging.WARNING - 10 * min(args.verbose, 2)
    console = logging.StreamHandler()  # names escaped, secrets redacted (shardflow.cli.shown)
    console.setFormatter(ShownFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[console])
    try:
        with on_sigterm():
            return int(args.func(args) or 0)
    except (ShardflowError, FileNotFoundError, FileExistsError, ValueError, ImportError) as e:  # ImportError: names the extra
        print(f"shardflow {args.command}: error: {escaped(redact(error_text(e)), keep=chr(10))}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as e:
        why = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        more = "; the shards finished so far are kept: re-running the same command resumes" if args.command == "convert" else ""
        print(f"shardflow {args.command}: interrupted ({why}){more}", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except BrokenPipeError:  # `shardflow inspect ... | head`
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        return 0


def error_text(error: BaseException) -> str:
    """An error's message without the worker traceback that torch's DataLoader puts in it.

    An exception raised in a DataLoader worker is re-raised in the parent with the message
    ``Caught X in DataLoader worker process N.\nOriginal Traceback ...``; what the user needs
    is the original message (the exception line and what follows it) and the worker.
    """
    text = str(error)
    head, sep, rest = text.partition("\nOriginal Traceback (most recent call last):\n")
    if not sep:
        return text
    lines = rest.rpartition("Traceback (most recent call last):\n")[2].splitlines()  # the last of a chain
    start = next((i for i, line in enumerate(lines) if line and not line[0].isspace()), None)
    if start is None:
        return text
    first = lines[start].split(": ", 1)[-1] if ": " in lines[start] else lines[start]
    where = head.removeprefix("Caught ").split(" in ", 1)[-1].rstrip(".")
    return "\n".join([first, *lines[start + 1 :]]) + f" (in {where})"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
