"""Fuzzing every reader with mutated real shards: byte-equal samples or a ShardflowError, never a hang.

A real shard (written by ShardWriter, with manifest and offset index) is mutated the ways damage and
attackers do: bytes of a header flipped, the file cut anywhere, a header's size or type rewritten with a
valid checksum (negative, huge or non-octal sizes; types shardflow does not read), a member renamed (valid
checksum) to the name of an earlier member: a key that reappears or a field twice, which the grouped
runs of the bulk parser must leave to the member path (the shard spans two such runs). Every reader then runs
on it: ShardDataset (raise and skip, from the start and through the index), IndexedShardDataset for every
sample, head, summarize and verify. Each must yield samples byte-equal to the original's (the same key
with the same fields; after a rename, a subset of them), never one key twice, or raise a ShardflowError; each example has a time limit (SIGALRM) and the process's
peak RSS must stay under a bound.

Mutations of member *data* are not made: a tar carries no checksum of its data, so only ``shardflow
verify`` (against the manifest's sha256) can tell them, and it is covered by its own tests.
"""

from __future__ import annotations

import resource
import shutil
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shardflow import IndexedShardDataset, ShardDataset
from shardflow.errors import ShardflowError
from shardflow.inspect import head, summarize, verify

from .helpers import make_shards

N = 12  # samples in the fuzzed shard: 24 members, two bulk runs (16 + 8)
EXAMPLE_SECONDS = 10  # a reader that takes longer hangs
RSS_GROWTH = 256 << 20  # bytes the whole fuzz run may add to the peak RSS

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("fast_paths")]


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory):
    folder = make_shards(tmp_path_factory.mktemp("fuzz"), [N], fields=lambda i: {"txt": f"text of {i}" * (i + 1)})
    shard = folder / "train-000000.tar"
    samples = {s["__key__"]: {k: bytes(v) for k, v in s.items() if not k.startswith("__")}
               for s in ShardDataset(folder, decode=None)}
    assert len(samples) == N
    from shardflow.format.tar import iter_members

    headers = [offset for _, offset, _ in iter_members([shard.read_bytes()], str(shard))]
    return folder, shard.read_bytes(), samples, headers


def _rewrite_header(data: bytearray, at: int, field: slice | None, value: bytes) -> None:
    header = bytearray(data[at : at + 512])
    header[field] = value
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % sum(header)
    data[at : at + 512] = header


mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 511), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10**6)),
    st.tuples(st.just("size"), st.integers(0, 10**6), st.sampled_from([
        b"\xff" * 11 + b"\x00",  # base-256 -256
        b"\xff" * 12,  # base-256 -1
        b"\x80" + (1 << 80).to_bytes(11, "big"),  # base-256 huge
        b"77777777777\0",  # 8 GiB - 1
        b"-0000000010\0", b"0000000009\0\0", b"12 34\0\0\0\0\0\0\0",  # not octal digits
    ])),
    st.tuples(st.just("type"), st.integers(0, 10**6), st.sampled_from([b"S", b"V", b"M", b"D", b"X", b"Q", b"\x80"])),
    st.tuples(st.just("name"), st.integers(1, 10**6), st.integers(0, 10**6)),
)


def _mutate(data: bytes, headers: list[int], m: tuple) -> bytes:
    out = bytearray(data)
    kind = m[0]
    if kind == "cut":
        return bytes(out[: m[1] % len(out)])
    if kind == "name":  # member a takes the name of member b < a
        a = 1 + (m[1] - 1) % (len(headers) - 1)
        b = headers[m[2] % a]
        _rewrite_header(out, headers[a], slice(0, 100), bytes(out[b : b + 100]))
        return bytes(out)
    at = headers[m[1] % len(headers)]
    if kind == "flip":
        out[at + m[2]] ^= m[3]
    elif kind == "size":
        _rewrite_header(out, at, slice(124, 136), m[2])
    else:
        _rewrite_header(out, at, slice(156, 157), m[2])
    return bytes(out)


class _Hang(Exception):
    pass


def _alarm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise _Hang(f"a reader ran past {EXAMPLE_SECONDS} s")


def _check_samples(items, samples: dict, partial: bool) -> None:
    seen = set()
    for s in items:
        got = {k: bytes(v) for k, v in s.items() if not k.startswith("__")}
        assert s["__key__"] in samples, f"a sample with a key the shard never had: {s['__key__']!r}"
        assert s["__key__"] not in seen, f"key {s['__key__']!r} yielded twice"
        seen.add(s["__key__"])
        want = samples[s["__key__"]]
        if partial:  # a renamed member: the sample it left may lack it, nothing else
            assert got and got.items() <= want.items(), f"sample {s['__key__']!r} has bytes the original had not"
        else:
            assert got == want, f"sample {s['__key__']!r} is not byte-equal to the original"


def _run(reader, samples: dict, partial: bool = False) -> None:
    try:
        _check_samples(reader(), samples, partial)
    except ShardflowError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(m=mutations)
@example(m=("name", 18, 14))  # 000009.cls -> 000007.cls: the first run's open sample reappears in the second
def test_every_reader_yields_originals_or_raises(original, tmp_path_factory, m) -> None:
    folder, data, samples, headers = original
    partial = m[0] == "name"
    work = tmp_path_factory.mktemp("case")
    for p in folder.iterdir():
        shutil.copy(p, work / p.name)
    (work / "train-000000.tar").write_bytes(_mutate(data, headers, m))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(EXAMPLE_SECONDS)
    try:
        _run(lambda: list(ShardDataset(work, decode=None)), samples, partial)
        _run(lambda: list(ShardDataset(work, decode=None, on_error="skip")), samples, partial)
        _run(lambda: list(ShardDataset(work, decode=None, on_error="skip", rank=1, world_size=2)), samples, partial)
        _run(lambda: list(ShardDataset(str(work / "train-000000.tar"), decode=None, on_error="skip")), samples, partial)
        try:
            indexed = IndexedShardDataset(work, decode=None)
        except ShardflowError:
            indexed = None
        for i in range(N if indexed is not None else 0):
            _run(lambda i=i: [indexed[i]], samples, partial)
        _run(lambda: head(work, N), samples, partial)
        try:
            summarize(work, workers=1)
        except ShardflowError:
            pass
        report = verify(work, workers=1)  # reports, never aborts
        assert report, f"verify found nothing wrong after {m}"  # every mutation changes the shard's bytes
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        shutil.rmtree(work, ignore_errors=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    assert peak - base < RSS_GROWTH, f"peak RSS grew by {(peak - base) >> 20} MiB on {m}"
