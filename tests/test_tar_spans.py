"""The indexed header walk (format/spans.py): the same samples, bytes and errors with or without an index."""

from __future__ import annotations

import io
import random
import tarfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardflow.format.spans as spans_module
import shardflow.format.tar as tar_module
from shardflow.errors import SampleError, ShardFormatError
from shardflow.format.keys import split_name
from shardflow.format.limits import Limits
from shardflow.format.tar import END_OF_ARCHIVE, encode_member, encode_sample, iter_samples, scan_shard

pytestmark = pytest.mark.usefixtures("fast_paths")  # the reader tests run with the fast paths on and off

sample_kinds = st.sampled_from(["plain", "three", "big", "pax", "dir", "empty", "upper", "dup", "again", "meta", "nodot",
                                "long100", "dotted_dir"])


def _shard(kinds: list[str], seed: int) -> bytes:
    rng = random.Random(seed)
    parts = []
    for i, kind in enumerate(kinds):
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 1500)))
        if kind == "big":
            payload = payload * 40
        if kind == "pax":
            parts.append(encode_member(f"k{i:03d}/é{'x' * 120}.bin", payload) + encode_member(f"k{i:03d}/é{'x' * 120}.cls", b"1"))
        elif kind == "dir":
            info = tarfile.TarInfo(f"d{i}")
            info.type = tarfile.DIRTYPE
            parts.append(info.tobuf(format=tarfile.USTAR_FORMAT) + encode_sample(f"k{i:03d}", {"jpg": payload}))
        elif kind == "empty":
            parts.append(encode_sample(f"k{i:03d}", {"txt": b"", "cls": b"3"}))
        elif kind == "upper":
            parts.append(encode_member(f"K{i:03d}.JPG", payload))
        elif kind == "dup":  # a field twice in a sample
            parts.append(encode_member(f"k{i:03d}.jpg", payload) + encode_member(f"k{i:03d}.jpg", b"2"))
        elif kind == "again":  # the first sample's key once more: not adjacent
            parts.append(encode_sample("k000", {"txt": payload}))
        elif kind == "meta":  # not a sample's member, then a sample
            parts.append(encode_member(f"__meta{i}__.json", b"{}") + encode_sample(f"k{i:03d}", {"jpg": payload}))
        elif kind == "nodot":
            parts.append(encode_member(f"k{i:03d}noext", payload) + encode_sample(f"k{i:03d}", {"cls": b"1"}))
        elif kind == "long100":  # a ustar name of exactly 100 bytes: no NUL ends it
            name = f"k{i:03d}" + "d" * 92 + ".cls"
            assert len(name) == 100
            parts.append(encode_member(name, b"5"))
        elif kind == "dotted_dir":  # the key keeps the dots of its folders
            parts.append(encode_sample(f"a.b/c.d/k{i:03d}", {"seg.png": payload, "cls": b"4"}))
        elif kind == "three":
            parts.append(encode_sample(f"k{i:03d}", {"jpg": payload, "cls": b"7", "json": b"{}"}))
        else:
            parts.append(encode_sample(f"k{i:03d}", {"jpg": payload, "cls": str(i).encode()}))
    return b"".join(parts) + END_OF_ARCHIVE


def _samples(data: bytes, chunk: int, walk=None, start: int = 0, end: int | None = None, **kw) -> list:
    chunks = [data[j : j + chunk] for j in range(start, end if end is not None else len(data), chunk)]
    out = []
    for key, offset, fields in iter_samples(iter(chunks), "s.tar", start, end=end, walk_starts=walk,
                                            sample_errors="yield", **kw):
        out.append((key, offset, (str(fields), fields.reason) if isinstance(fields, SampleError) else
                    {k: (type(v), bytes(v)) for k, v in fields.items()}))
    return out


def _general(data: bytes, chunk: int, **kw) -> list:
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(spans_module, "plain_members", lambda buf, pos, *rest: ([], pos))
        mp.setattr(spans_module, "indexed_heads", lambda *a: ([], []))
        return _samples(data, chunk, **kw)
    finally:
        mp.undo()


def _starts(data: bytes) -> list[int]:
    """Where a key starts (as an index would say, also in shards that scan_shard refuses), and the end."""
    out, last = [], None
    members = tar_module.iter_members([data], "s.tar")
    while True:
        try:
            name, offset, _ = next(members)
        except StopIteration as stop:
            return out + [stop.value]
        split = split_name(name)
        if split is not None and split[0] != last:
            out.append(offset)
            last = split[0]


@settings(max_examples=80, deadline=None)
@given(kinds=st.lists(sample_kinds, min_size=0, max_size=25), chunk=st.sampled_from([512, 700, 4096, 1 << 20]),
       seed=st.integers(0, 1000), shift=st.sampled_from([0, 512, -512, 7]))
def test_the_indexed_walk_reads_what_the_general_path_reads_with_any_index(kinds, chunk, seed, shift):
    data = _shard(kinds, seed)
    offsets = _starts(data)
    reference = _general(data, chunk)
    assert _samples(data, chunk, walk=offsets) == reference
    # a stale or wrong index changes nothing that is read
    assert _samples(data, chunk, walk=[o + shift for o in offsets[:1]] + [o + shift for o in offsets[1:]]) == reference
    assert _samples(data, chunk, walk=offsets[::2] + [offsets[-1]]) == reference
    # and a range read through the index (as the dataset seeks) reads the same samples as without the walk
    if len(offsets) > 3:
        lo, hi = offsets[1], offsets[-2]
        seek = dict(start=lo, end=hi, starts=offsets[1:-1])
        assert _samples(data, chunk, walk=offsets[1:-1], **seek) == _samples(data, chunk, **seek)


def test_plain_samples_are_walked_with_the_index_not_member_by_member(monkeypatch):
    data = b"".join(encode_sample(f"{i:05d}", {"jpg": b"j" * (300 + i), "cls": b"%d" % i}) for i in range(500))
    data += END_OF_ARCHIVE
    _, offsets, _ = scan_shard([data], "s.tar")
    walked = []
    plain = spans_module.plain_members

    def counted(*args):
        members, pos = plain(*args)
        walked.extend(members)
        return members, pos

    monkeypatch.setattr(spans_module, "plain_members", counted)
    got = list(iter_samples([data], "s.tar", walk_starts=offsets))
    assert [k for k, _, _ in got] == [f"{i:05d}" for i in range(500)]
    assert got[7][2] == {"jpg": b"j" * 307, "cls": b"7"} and all(type(v) is bytes for v in got[7][2].values())
    assert walked == []  # every member came from the indexed walk
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        assert [m.name for m in tf if m.isfile()] == [f"{k}.{f}" for k, _, s in got for f in s]


@pytest.mark.parametrize("damage", ["checksum", "size8", "past_index", "too_large"])
@pytest.mark.parametrize("at", [0, 9, 19])
def test_a_bad_header_inside_an_indexed_span_goes_to_the_general_checks(damage, at):
    parts = [encode_sample(f"{i:04d}", {"jpg": b"x" * (600 + i), "cls": b"1"}) for i in range(20)]
    data = b"".join(parts) + END_OF_ARCHIVE
    _, offsets, _ = scan_shard([data], "s.tar")
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        second = next(m.offset for m in tf if m.name == f"{at:04d}.jpg")  # the sample's second member (after .cls)
    assert offsets[at] < second < offsets[at + 1]
    raw = bytearray(data)
    header = raw[second : second + 512]
    if damage == "checksum":
        header[0] ^= 0x01
    elif damage == "size8":
        header[124:136] = b"00000000198\0"
    elif damage == "past_index":
        header[124:136] = b"%011o\0" % 2000  # its data runs into the next sample
    if damage != "checksum":
        header[148:156] = b"        "
        header[148:156] = b"%06o\0 " % sum(header)
    raw[second : second + 512] = header
    data = bytes(raw)
    limits = Limits(max_member_bytes=1000) if damage == "too_large" else Limits()
    if damage == "too_large":
        data = data[:second] + encode_member(f"{at:04d}.jpg", b"y" * 1001) + data[offsets[at + 1]:]
        _, offsets, _ = scan_shard([data], "s.tar")

    def outcome(start=0, **kw):
        got = []
        try:
            for key, offset, fields in iter_samples([data[start:]], "s.tar", start, sample_errors="yield",
                                                    limits=limits, **kw):
                got.append((key, offset, type(fields).__name__))
        except ShardFormatError as e:
            got.append((type(e).__name__, e.offset, e.reason))
        return got

    indexed = outcome(walk_starts=offsets)
    assert indexed == outcome()
    assert indexed[:at] == [(f"{i:04d}", offsets[i], "dict") for i in range(at)]
    seek = dict(end=offsets[-1], starts=offsets)
    sought = outcome(walk_starts=offsets, **seek)
    assert sought == outcome(**seek)
    if damage == "too_large":
        assert indexed[at] == (f"{at:04d}", offsets[at], "SampleError") and len(indexed) == 20
    elif damage == "past_index":  # read whole, the member's size is believed; read by the index, it is stale
        one = dict(start=offsets[at], end=offsets[at + 1], starts=offsets[at : at + 2])
        assert outcome(walk_starts=offsets, **one) == outcome(**one) == [("ShardFormatError", second, "stale_index")]
    else:
        assert indexed[at:] == [("ShardFormatError", second, "bad_shard")]


def test_plain_samples_come_grouped_and_anything_unusual_goes_member_by_member():
    from shardflow.format.spans import SampleRun, checked_samples

    def run_of(data: bytes):
        starts = _starts(data)
        heads, sizes = spans_module.indexed_heads(data, 0, 0, -1, 1 << 20, 4096, np.asarray(starts, dtype=np.int64))
        return checked_samples(data, 0, heads, sizes)

    data = b"".join(encode_sample(f"a.b/{i:03d}", {"jpg": b"j" * i, "cls": b"%d" % i}) for i in range(30)) + END_OF_ARCHIVE
    got = run_of(data)
    assert isinstance(got, SampleRun)
    assert got.keys == [f"a.b/{i:03d}" for i in range(30)]
    assert got.sample(5) == {"cls": b"5", "jpg": b"jjjjj"} and list(got.sample(5)) == ["cls", "jpg"]
    assert got.offsets == _starts(data)[:-1]
    assert [m[0] for m in got][:2] == ["a.b/000.cls", "a.b/000.jpg"]  # its members, one by one
    three = b"".join(encode_sample(f"{i:03d}", {"a": b"1", "b": b"2", "c": b"3"}) for i in range(4)) + END_OF_ARCHIVE
    assert run_of(three).sample(3) == {"a": b"1", "b": b"2", "c": b"3"}
    for odd in (encode_member("k.jpg", b"1") + encode_member("k.jpg", b"2"),  # a field twice
                encode_member("k.JPG", b"1"),  # upper case field: lower-cased by the general path
                encode_member("k/__x.json", b"{}"),  # not a sample's member
                encode_member("k" * 96 + ".cls", b"1"),  # 100 bytes: no NUL ends the name
                encode_member("a.jpg", b"1") + encode_member("b.jpg", b"1") + encode_member("a.cls", b"1")):
        assert run_of(odd + END_OF_ARCHIVE) is None


def test_grouped_runs_make_the_same_samples_taken_one_by_one_or_in_a_row():
    from shardflow.format.spans import checked_samples

    def run_of(data: bytes):
        starts = _starts(data)
        heads, sizes = spans_module.indexed_heads(data, 0, 0, -1, 1 << 20, 4096, np.asarray(starts, dtype=np.int64))
        return checked_samples(data, 0, heads, sizes)

    cases = {
        "pairs, keys of one length": [(f"{i:03d}", {"jpg": b"j" * i, "cls": b"%d" % i}) for i in range(20)],
        "pairs, keys of many lengths": [("k" * (1 + i % 5) + f"/{i}", {"jpg": b"j" * i, "cls": b"c"}) for i in range(20)],
        "pairs, fields differ": [(f"{i:03d}", {("png" if i % 3 else "jpg"): b"p", "cls": b"c"}) for i in range(20)],
        "threes": [(f"{i:03d}", {"a": b"1" * i, "b": b"2", "json": b"{}"}) for i in range(12)],
        "uneven": [(f"{i:03d}", {f"f{j}": b"x" * j for j in range(1 + i % 3)}) for i in range(12)],
        "upper-case keys": [(f"Class_A/{i:03d}", {"jpg": b"j", "cls": b"c"}) for i in range(12)],
    }
    for name, samples in cases.items():
        data = b"".join(encode_sample(k, f) for k, f in samples) + END_OF_ARCHIVE
        got = run_of(data)
        assert got is not None, name
        assert got.keys == [k for k, _ in samples], name
        want = [{f: v for f, v in sorted(f.items())} for _, f in samples]
        assert [got.sample(j) for j in range(len(samples))] == want, name
        items = list(got.items(0, len(samples)))
        assert [f for _, _, f in items] == want and [f for _, _, f in got.items(3, 7)] == want[3:7], name
        assert [list(f) for _, _, f in items] == [list(s) for s in want], name  # field order
        assert [(k, o) for k, o, _ in items] == list(zip(got.keys, got.offsets)), name
        # whole: the dict a reader hands on, in one step (the keys in raw_sample's order, __source__ last)
        framed = list(got.items(2, 9, ("u", 3)))
        assert [s for _, _, s in framed] == [{**tar_module.raw_sample(k, "u", f), "__source__": 3} for k, f in zip(got.keys[2:9], want[2:9])], name
        assert [list(s) for _, _, s in framed] == [["__key__", "__url__", *f, "__source__"] for f in want[2:9]], name
