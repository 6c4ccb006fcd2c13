"""``convert lines``: one sample per line of a text or JSON-lines file.

The file is a local path or any fsspec URL, plain or compressed with gzip or
zstd (found by magic bytes, not by suffix). Line ``n`` (1-based, as editors,
``grep -n`` and ``sed -n 'Np'`` count) becomes the sample with key
``line-%09d % n`` (``line-000000042``; wider past 999,999,999 lines) and

- text mode: the field ``txt``, the line's bytes without its line ending;
- JSON-lines mode: the field ``json``, the line's bytes as written (each line is
  checked to parse as JSON; reading back gives ``json.loads(line)``).

Line rules: lines end at ``\\n``; a ``\\r`` right before it (CRLF files) is part
of the line ending and dropped; a lone ``\\r`` is kept. A final line without a
newline is a line; a file ending in ``\\n`` has no extra empty line after it (as
``wc -l`` and Python's line iteration). A UTF-8 byte-order mark at the start of
the file is dropped. Lines must be valid UTF-8; a line that is not (or, in
JSON-lines mode, does not parse) stops the conversion with an error naming the
line number.

Empty lines: in text mode an empty line is kept as a sample with an empty
``txt``, so (in the walk order, text mode's default) sample ``i`` (0-based, in stream order) is
always line ``i + 1`` of the file, which is what a line-offset text dataset expects. In JSON-lines mode
lines holding only whitespace are skipped (JSON Lines has no empty value); the
keys keep the file's line numbers, so a skipped line shows as a gap.

Descriptors. Lines cannot be found by number without reading everything before
them, and a compressed stream cannot be entered in the middle, so the main
process reads the file once, as a stream, and the descriptors carry each line's
number and bytes to the workers, which validate and write them. Memory stays at
the lines of the shards in flight (``2 x workers x max_count`` lines). The
alternative, byte offsets that workers re-read themselves, would read the file
twice, would not work for compressed files, and saves only the pickling of text
that the workers have to read anyway. Since the descriptor hash covers the
lines' bytes, a resumed run keeps exactly the shards whose lines are unchanged.

Order. A stream allows no permutation of the whole file, so ``order="shuffled"`` (the default
in JSON-lines mode, where each line is a record and a file sorted by label is common) puts the
lines through a seeded window shuffle of ``window`` lines
(:func:`~shardflow.convert.engine.mixorder.window_shuffled`, default
:data:`~shardflow.convert.engine.mixorder.DEFAULT_WINDOW`, 16,384): a line moves by less than
``window`` positions from its place in the file, either way, and the lines of any stretch of
``window`` are shuffled together, within and across shards. Memory: at most ``window`` lines
held by the shuffle (16 MiB at 1 KiB a line), on top of the lines of the shards in flight. A file
sorted on a longer scale than the window stays sorted on that scale: shuffle it beforehand, or
raise ``window``. ``order="walk"`` (the default in text mode: the lines of a text are often the
sentences or paragraphs of a document, their order part of it, and sample ``i`` is line ``i + 1``
only in this order) writes the lines as they come. Keys stay the line numbers;
``meta`` records ``order``, ``order_seed`` and ``order_window``. The same file, seed and window
give the same shards, so a re-run resumes.

Note: each sample costs at least 1 KiB in a tar (a 512-byte header and data
padded to 512 bytes), so a file of short lines grows about ``1 KiB / line``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ... import storage
from ...errors import ConversionError
from ...format.manifest import Manifest
from ..engine.engine import ConvertOptions, run_conversion
from ..engine.mixorder import DEFAULT_ORDER, DEFAULT_WINDOW, check_order, in_window_order, order_meta

__all__ = ["convert_lines", "iter_lines", "JSON_SUFFIXES"]

log = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".ndjson", ".jsonlines")
"""Suffixes (before any ``.gz``/``.zst``) that select JSON-lines mode when ``json_lines=None``."""

_COMPRESSED_SUFFIXES = (".gz", ".gzip", ".zst", ".zstd")
_BOM = b"\xef\xbb\xbf"
_KEY_WIDTH = 9


def iter_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Split a byte stream into lines (see the module docstring for the rules).

    Args:
        chunks: the file's (decompressed) bytes in chunks of any size.

    Yields:
        Each line's bytes without its ``\\n`` / ``\\r\\n`` ending; the BOM of the
        first line removed.
    """
    pending: list[bytes] = []
    first = True
    for chunk in chunks:
        if not chunk:
            continue
        parts = chunk.split(b"\n")
        if len(parts) == 1:
            pending.append(chunk)
            continue
        head = b"".join([*pending, parts[0]]) if pending else parts[0]
        pending = [parts[-1]] if parts[-1] else []
        for i, line in enumerate([head, *parts[1:-1]]):
            if first and i == 0:
                first = False
                if line.startswith(_BOM):
                    line = line[len(_BOM) :]
            yield line[:-1] if line.endswith(b"\r") else line
    if pending:
        line = b"".join(pending)
        if first and line.startswith(_BOM):
            line = line[len(_BOM) :]
            if not line:  # a file holding only a byte-order mark has no lines, as an empty file
                return
        yield line[:-1] if line.endswith(b"\r") else line


@dataclass(frozen=True)
class _Context:
    source: str
    field: str  # "txt" or "json"


def _build(descriptors: list[tuple[int, bytes]], ctx: _Context) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Worker: check each line and write it as one sample."""
    for number, line in descriptors:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConversionError(f"{ctx.source}: line {number} is not valid UTF-8 ({e})") from None
        if ctx.field == "json":
            try:
                json.loads(text)
            except ValueError as e:
                shown = text if len(text) <= 80 else text[:77] + "..."
                raise ConversionError(f"{ctx.source}: line {number} is not valid JSON ({e}): {shown!r}") from None
        yield f"line-{number:0{_KEY_WIDTH}d}", {ctx.field: line}


def _is_json_name(src: str) -> bool:
    name = src.lower()
    for suffix in _COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name.endswith(JSON_SUFFIXES)


def _compression(src: str, io: storage.IOOptions) -> str | None:
    head = storage.read_range(src, 0, 4, io)
    if head.startswith(storage.GZIP_MAGIC):
        return "gzip"
    if head.startswith(storage.ZSTD_MAGIC):
        return "zstd"
    return None


def convert_lines(
    src: str | os.PathLike,
    dst: str,
    *,
    json_lines: bool | None = None,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
    client: Any = None,
    order: str | None = None,
    seed: int = 0,
    window: int = DEFAULT_WINDOW,
) -> Manifest:
    """Convert a text or JSON-lines file into shards, one sample per line, as a stream.

    Sample keys are ``line-%09d`` of the 1-based line number; the field is
    ``txt`` (text mode) or ``json`` (JSON-lines mode), holding the line's bytes
    without the line ending. See the module docstring for line endings, the
    byte-order mark and empty lines (kept in text mode, skipped in JSON-lines
    mode).

    Args:
        src: a local path or fsspec URL; plain, gzip or zstd (by magic bytes).
        dst: destination folder (local or fsspec URL).
        json_lines: True for JSON lines, False for text; None decides by the
            name: ``.jsonl``, ``.ndjson``, ``.jsonlines`` (optionally followed
            by ``.gz``/``.zst``) are JSON lines.
        options: shard size, workers, resume, storage options (used for both
            ``src`` and ``dst``).
        progress: ``progress(n)`` after every finished shard of ``n`` lines.
        client: a ``dask.distributed.Client``: write the shards as tasks on its
            cluster (its workers must reach the source and ``dst``); None: local
            processes.
        order, seed, window: ``"shuffled"`` (a seeded window shuffle of ``window`` lines, see
            the module docstring) or ``"walk"`` (the file's order); None: shuffled in
            JSON-lines mode, walk in text mode.

    Returns:
        The manifest; its ``meta`` holds ``source``, ``field``, ``compression``,
        ``lines`` (lines in the file), ``samples``, ``order``, ``order_seed`` and
        ``order_window``.

    Raises:
        FileNotFoundError: ``src`` does not exist.
        ConversionError: a line is not UTF-8 or (JSON lines) not JSON; the
            message names the line number.
        ShardFormatError: corrupt or truncated compressed data.
        ValueError: an unknown ``order``, ``window < 1``.
    """
    if order is not None:
        check_order(order)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    src = os.fspath(src)
    io = options.io
    if not storage.exists(src, io):
        raise FileNotFoundError(f"{src}: no such file")
    if json_lines is None:
        json_lines = _is_json_name(src)
    field = "json" if json_lines else "txt"
    order = order or (DEFAULT_ORDER if json_lines else "walk")
    counts = {"lines": 0, "samples": 0}

    def descriptors() -> Iterator[tuple[int, bytes]]:
        chunks = storage.decompressing_chunks(storage.iter_chunks(src, 0, None, io), src)
        for number, line in enumerate(iter_lines(chunks), 1):
            counts["lines"] = number
            if json_lines and not line.strip():
                continue
            counts["samples"] += 1
            yield number, line

    meta: dict[str, Any] = {
        "converter": "lines",
        "source": src,
        "field": field,
        "compression": _compression(src, io),
        "empty_lines": "skipped" if json_lines else "kept",
        **order_meta(order, seed, window),
    }
    return run_conversion(
        dst,
        in_window_order(descriptors(), order, int(seed), window),
        _build,
        context=_Context(src, field),
        meta=meta,
        meta_at_end=lambda: dict(counts),
        options=options,
        progress=progress,
        client=client,
    )
