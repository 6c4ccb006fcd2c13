"""convert lines: text and JSON-lines files (plain, gzip, zstd) -> one sample per line."""

from __future__ import annotations

import gzip
import json

import fsspec
import numpy as np
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

import shardflow
from shardflow.cli import main
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.records.lines import convert_lines, iter_lines
from shardflow.errors import ConversionError
from tests.order_reference import reference_window

WINDOW = 16_384  # the documented default window of a JSON-lines file's shuffle


def windowed(items: list) -> list:
    """``items`` (the samples in the file's order) in the default JSON-lines order."""
    return [items[j] for j in reference_window(len(items), WINDOW)]


def records(n: int) -> list[object]:
    """Deterministic JSON values of several kinds (objects, lists, strings, numbers, null)."""
    rng = np.random.default_rng(99)
    out: list[object] = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            out.append({"id": i, "text": f"ligne n°{i} — ✓", "score": float(rng.random())})
        elif kind == 1:
            out.append([i, None, True, {"nested": [1.5, -2]}])
        elif kind == 2:
            out.append(f"plain string {i} with \"quotes\" and \\ backslash")
        elif kind == 3:
            out.append(int(rng.integers(-(2**62), 2**62)))
        else:
            out.append(None)
    return out


def stream(dst):
    return list(shardflow.ShardDataset(str(dst), decode="numpy"))


def test_jsonl_100k_lines_exact_in_window_order(tmp_path):
    values = records(100_000)
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps(v, ensure_ascii=False) + "\n" for v in values), encoding="utf-8")
    m = convert_lines(src, str(tmp_path / "out"), options=ConvertOptions(max_count=10_000, workers=2))
    assert m.num_samples == 100_000 and len(m.shards) == 10
    assert m.meta["field"] == "json" and m.meta["lines"] == 100_000 and m.meta["compression"] is None
    assert m.meta["order"] == "shuffled" and m.meta["order_seed"] == 0 and m.meta["order_window"] == WINDOW
    got = stream(tmp_path / "out")
    assert [s["__key__"] for s in got] == windowed([f"line-{i:09d}" for i in range(1, 100_001)])
    assert [s["json"] for s in got] == windowed(values)


def test_gzip_text_lines_exact(tmp_path):
    rng = np.random.default_rng(5)
    lines = []
    for i in range(20_000):
        r = i % 7
        if r == 0:
            lines.append("")  # empty lines are kept
        elif r == 1:
            lines.append("  indented\twith tab  ")
        elif r == 2:
            lines.append("unicode: 日本語 ñ 🙂 \u2028 separator")
        elif r == 3:
            lines.append("lone \r carriage return")
        else:
            lines.append("x" * int(rng.integers(1, 3000)))
    lines.append("last line, no newline after it")
    body = "\r\n".join(lines[:100]) + "\r\n" + "\n".join(lines[100:])  # CRLF, then LF; no final newline
    src = tmp_path / "corpus.txt.gz"
    src.write_bytes(gzip.compress(body.encode("utf-8")))
    m = convert_lines(src, str(tmp_path / "out"), options=ConvertOptions(max_count=3000, workers=2))
    assert m.meta["compression"] == "gzip" and m.meta["field"] == "txt" and m.meta["empty_lines"] == "kept"
    got = stream(tmp_path / "out")
    assert [s["txt"] for s in got] == lines
    assert got[41]["__key__"] == "line-000000042"
    # sample i is line i + 1, empty lines included
    ds = shardflow.IndexedShardDataset(str(tmp_path / "out"))
    for i in (0, 1, 99, 100, 12_345, 19_999, 20_000):
        assert ds[i]["txt"] == lines[i] and ds[i]["__key__"] == f"line-{i + 1:09d}"


def test_zstd_and_name_detection(tmp_path):
    values = records(500)
    src = tmp_path / "a.ndjson.zst"
    src.write_bytes(zstandard.ZstdCompressor().compress("\n".join(json.dumps(v) for v in values).encode()))
    m = convert_lines(src, str(tmp_path / "out"), options=ConvertOptions(max_count=128, workers=1))
    assert m.meta["compression"] == "zstd" and m.meta["field"] == "json"
    assert [s["json"] for s in stream(tmp_path / "out")] == windowed(values)
    # the same bytes forced to text mode (whose default order is the file's)
    m = convert_lines(src, str(tmp_path / "txt"), json_lines=False, options=ConvertOptions(workers=1))
    assert [s["txt"] for s in stream(tmp_path / "txt")] == [json.dumps(v) for v in values]
    assert m.meta["order"] == "walk" and "order_window" not in m.meta


def test_malformed_json_names_the_line(tmp_path):
    good = [json.dumps({"i": i}) for i in range(5000)]
    good[4241] = '{"i": 4241, "broken": }'
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(good) + "\n")
    with pytest.raises(ConversionError, match=r"line 4242 is not valid JSON"):
        convert_lines(src, str(tmp_path / "out"), options=ConvertOptions(max_count=1000, workers=2))


def test_invalid_utf8_names_the_line(tmp_path):
    src = tmp_path / "bad.txt"
    src.write_bytes(b"fine\nalso fine\nbad \xff byte\n")
    with pytest.raises(ConversionError, match=r"line 3 is not valid UTF-8"):
        convert_lines(src, str(tmp_path / "out"), options=ConvertOptions(workers=1))


def test_blank_json_lines_are_skipped_and_bom_dropped(tmp_path):
    src = tmp_path / "b.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n   \n[2]\r\n"three"')
    m = convert_lines(src, str(tmp_path / "out"), options=ConvertOptions(workers=1))
    got = stream(tmp_path / "out")
    assert [(s["__key__"], s["json"]) for s in got] == windowed([("line-000000001", {"a": 1}),
                                                                  ("line-000000004", [2]), ("line-000000005", "three")])
    assert m.meta["lines"] == 5 and m.meta["samples"] == 3 and m.meta["empty_lines"] == "skipped"


def test_remote_source_and_empty_file(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe("/lines-test/src.txt", b"a\nb\nc\n")
    m = convert_lines("memory://lines-test/src.txt", str(tmp_path / "out"), options=ConvertOptions(workers=1))
    assert [s["txt"] for s in stream(tmp_path / "out")] == ["a", "b", "c"] and m.meta["lines"] == 3
    (tmp_path / "empty.txt").write_bytes(b"")
    m = convert_lines(tmp_path / "empty.txt", str(tmp_path / "e"), options=ConvertOptions(workers=1))
    assert m.num_samples == 0 and m.meta["lines"] == 0
    with pytest.raises(FileNotFoundError):
        convert_lines(tmp_path / "missing.txt", str(tmp_path / "m"))


def reference_lines(data: bytes) -> list[bytes]:
    """Lines by the documented rules, computed on the whole buffer."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if not data:
        return []
    parts = data.split(b"\n")
    if parts[-1] == b"":
        parts.pop()
    return [p[:-1] if p.endswith(b"\r") else p for p in parts]


@given(st.binary(max_size=300).map(lambda b: b.replace(b"z", b"\n").replace(b"y", b"\r")), st.data())
def test_iter_lines_independent_of_chunking(data, draw):
    cuts = sorted(draw.draw(st.lists(st.integers(0, len(data)), max_size=8)))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    assert list(iter_lines(chunks)) == reference_lines(data)
    assert list(iter_lines([b"\xef\xbb", b"\xbfx\n"])) == [b"x"]
    assert list(iter_lines([b"\xef\xbb\xbf"])) == [] and list(iter_lines([b"\xef\xbb\xbf\n"])) == [b""]


def test_cli(tmp_path, capsys):
    src = tmp_path / "t.log"
    src.write_text('{"a": 1}\n{"a": 2}\n')
    assert main(["convert", "lines", str(src), str(tmp_path / "out"), "--jsonl", "--workers", "1"]) == 0
    assert "2 samples from 2 lines" in capsys.readouterr().out
    assert [s["json"] for s in stream(tmp_path / "out")] == windowed([{"a": 1}, {"a": 2}])
    assert main(["convert", "lines", str(src), str(tmp_path / "txt"), "--max-count", "1", "--workers", "1"]) == 0
    got = stream(tmp_path / "txt")
    assert [s["txt"] for s in got] == ['{"a": 1}', '{"a": 2}'] and len({s["__url__"] for s in got}) == 2
    src.write_text('{"a": 1}\nnot json\n')
    assert main(["convert", "lines", str(src), str(tmp_path / "bad"), "--jsonl", "--workers", "1"]) == 1
    assert "line 2 is not valid JSON" in capsys.readouterr().err
