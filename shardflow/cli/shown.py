"""What the command line shows of names it did not choose, and how its log lines reach the terminal.

- :func:`shown`: a file name, URL or other outside text as printed: its secrets redacted
  (:func:`shardflow.errors.redact`) and every control character escaped as ``repr`` does
  (``\\x1b``, ``\\n``, ``\\u202e``), so that a name can neither send escape sequences to the
  terminal nor forge an output line. Names that differ only in such characters print differently.
- :class:`ShownFormatter`: the log format of the command line; the values a message is built from
  are shown the same way (the message's own text is shardflow's and keeps its line breaks).
- :func:`on_sigterm`: SIGTERM raises :class:`Terminated` in the main thread, so that a stopped
  conversion cleans up and says that a re-run resumes instead of ending without a word.
"""

from __future__ import annotations

import logging
import os
import signal
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import redact

__all__ = ["shown", "escaped", "ShownFormatter", "Terminated", "on_sigterm"]

# control (Cc), format (Cf: bidi overrides, zero-width characters), line and paragraph separators
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp"})


def escaped(text: str, keep: str = "") -> str:
    """``text`` with each control, format and separator character written as ``repr`` writes it.

    Args:
        text: any text.
        keep: characters left as they are (``"\\n"`` for a message's own line breaks).

    Returns:
        The text; printable characters (accented letters included) unchanged.
    """
    if text.isprintable() and not keep:
        return text
    out = []
    for ch in text:
        if ch in keep or unicodedata.category(ch) not in _HIDDEN:
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1] if ch not in "'\"" else ch)
    return "".join(out)


def shown(value: Any) -> str:
    """A name, path or URL as the command line prints it: secrets redacted, control
    characters escaped (``'a\\x1b[31m.jpg'`` prints as ``a\\x1b[31m.jpg``, a newline as ``\\n``)."""
    return escaped(redact(str(value)))


class ShownFormatter(logging.Formatter):
    """The command line's log format: every value a message is built from is :func:`shown`,
    and the whole message redacted."""

    def format(self, record: logging.LogRecord) -> str:
        if record.args:
            args = record.args
            if isinstance(args, tuple):
                args = tuple(shown(a) if isinstance(a, str) else a for a in args)
            record = logging.makeLogRecord({**record.__dict__, "args": args})
        record = logging.makeLogRecord({**record.__dict__, "msg": escaped(redact(record.getMessage()), keep="\n"),
                                        "args": None})  # fmt: skip
        return super().format(record)


class Terminated(BaseException):
    """SIGTERM reached the command line (a BaseException, as KeyboardInterrupt: cleanup code
    that catches ``Exception`` lets it through)."""


_MAIN_PID = [0]


def _raise_terminated(signum: int, frame: Any) -> None:
    if os.getpid() != _MAIN_PID[0]:  # a forked worker inherited the handler: end it as SIGTERM would
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise Terminated(signum)


@contextmanager
def on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (the previous
    handler is restored after it)."""
    _MAIN_PID[0] = os.getpid()
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: leave the signal alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
