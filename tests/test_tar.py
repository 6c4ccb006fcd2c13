"""The tar reader and writer: formats, names, checksums, truncation (golden: CPython tarfile, GNU tar)."""

import io
import subprocess
import tarfile

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shardflow.errors import SampleError, ShardFormatError, TruncatedShardError
from shardflow.format.keys import check_key, split_name
from shardflow.format.tar import END_OF_ARCHIVE, encode_member, encode_sample, iter_members, iter_samples

pytestmark = pytest.mark.usefixtures("fast_paths")  # the reader tests run with the fast paths on and off


def chunked(data: bytes, size: int = 7777):
    return [data[i : i + size] for i in range(0, len(data), size)]


def tarfile_bytes(members, fmt=tarfile.PAX_FORMAT, extra=None):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tf.addfile(info)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_reads_what_tarfile_writes(fmt):
    names = ["a/000001.jpg", "a/000001.cls", "b/000002.txt"]
    if fmt != tarfile.USTAR_FORMAT:
        names.append("deep/" + "x" * 150 + "/000003.txt")  # needs GNU long name or PAX
    if fmt == tarfile.PAX_FORMAT:
        names.append("ünïcödé/日本語/000004.txt")
    members = [(n, f"data of {n}".encode()) for n in names]
    data = tarfile_bytes(members, fmt)
    got = [(name, payload) for name, _, payload in iter_members(chunked(data), "mem.tar")]
    assert got == members


def test_skips_directories_symlinks_and_dunder_members():
    d = tarfile.TarInfo("dir")
    d.type = tarfile.DIRTYPE
    s = tarfile.TarInfo("link.txt")
    s.type = tarfile.SYMTYPE
    s.linkname = "000001.txt"
    data = tarfile_bytes([("000001.txt", b"one"), ("__meta__.json", b"{}"), ("README", b"no dot")], extra=[d, s])
    got = list(iter_samples(chunked(data), "x.tar"))
    assert [(k, f) for k, _, f in got] == [("000001", {"txt": b"one"})]


def test_key_field_split_follows_webdataset():
    assert split_name("a/b.v1/0001.seg.png") == ("a/b.v1/0001", "seg.png")
    assert split_name("x/0001.JPG") == ("x/0001", "jpg")
    assert split_name("x/__key__.txt") is None
    assert split_name("noext") is None
    assert split_name("dir.d/noext") is None


def test_writer_bytes_read_by_tarfile_and_gnu_tar(tmp_path):
    fields = {"txt": b"hello", "cls": b"3", "seg.png": b"\x89PNG..."}
    names = ["plain/000001", "long/" + "y" * 200 + "/000002", "ünï/日本/000003"]
    data = b"".join(encode_sample(k, fields) for k in names) + END_OF_ARCHIVE
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        got = {m.name: tf.extractfile(m).read() for m in tf}
    assert got == {f"{k}.{f}": v for k in names for f, v in fields.items()}
    path = tmp_path / "s.tar"
    path.write_bytes(data)
    listed = subprocess.run(["tar", "tf", str(path)], capture_output=True, check=True).stdout.decode().split("\n")
    assert sorted(x for x in listed if x) == sorted(got)
    # members of a sample are adjacent and sorted by field
    order = [n for n, _, _ in iter_members(chunked(data), "s.tar")]
    assert order[:3] == ["plain/000001.cls", "plain/000001.seg.png", "plain/000001.txt"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="./\\"), min_size=1, max_size=120),
        min_size=1,
        max_size=4,
        unique=True,
    ),
    st.binary(max_size=2000),
)
def test_any_unicode_name_of_any_length_round_trips(parts, payload):
    key = "/".join(p.strip() or "k" for p in parts)
    try:
        check_key(key)
    except SampleError:
        return
    data = encode_sample(key, {"bin": payload}) + END_OF_ARCHIVE
    assert [(k, f) for k, _, f in iter_samples(chunked(data, 1000), "h.tar")] == [(key, {"bin": payload})]
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        (m,) = tf.getmembers()
        assert m.name == f"{key}.bin" and tf.extractfile(m).read() == payload


def test_bad_checksum_names_url_and_offset():
    data = bytearray(encode_sample("000001", {"txt": b"a"}) + encode_sample("000002", {"txt": b"b"}) + END_OF_ARCHIVE)
    data[1024 + 10] ^= 0xFF  # corrupt the second header's name
    with pytest.raises(ShardFormatError, match=r"s3://b/x\.tar: bad tar header checksum at byte 1024"):
        list(iter_samples(chunked(bytes(data)), "s3://b/x.tar"))


def _with_checksum(header: bytearray) -> bytes:
    """Set a ustar header's checksum field the way POSIX defines it (tarfile's calc_chksums)."""
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


@given(st.binary(min_size=100, max_size=100), st.integers(0, 511), st.integers(1, 255))
@settings(max_examples=300, deadline=None)
def test_checksum_is_exact_for_any_header_bytes(name_bytes, where, flip):
    """Any header bytes (high bytes included: the per-half sums reach 65,280) read back with a
    correct checksum, and any change to one byte outside the checksum field is caught."""
    header = bytearray(encode_member("000001.bin", b"x")[:512])
    header[0:100] = name_bytes.replace(b"\0", b"a")  # a full-width name; no NUL, so no prefix split
    header[257:263] = b"ustar\0"
    header[345:500] = b"\xff" * 155  # high bytes in the prefix: per-half sums near their maximum
    good = _with_checksum(header) + b"x" + b"\0" * 511 + END_OF_ARCHIVE
    assert [d for _, _, d in iter_members([good], "c.tar")] == [b"x"]
    if 148 <= where < 156:
        return  # the checksum field itself
    bad = bytearray(good)
    bad[where] ^= flip
    with pytest.raises(ShardFormatError, match="bad tar header checksum at byte 0|non-octal"):
        list(iter_members([bytes(bad)], "c.tar"))


def test_garbage_is_not_a_tar():
    with pytest.raises(ShardFormatError, match="checksum"):
        list(iter_samples([b"this is not a tar file" * 40], "junk.tar"))


def test_truncation_and_empty_files():
    data = b"".join(encode_sample(f"{i:06d}", {"cls": b"1", "jpg": b"\xff" * 3000}) for i in range(10)) + END_OF_ARCHIVE
    per = len(encode_sample("000000", {"cls": b"1", "jpg": b"\xff" * 3000}))
    cut = data[: 6 * per + 512 + 512 + 1500]  # 1,500 bytes into 000006.jpg
    got = []
    with pytest.raises(TruncatedShardError, match=r"t\.tar: truncated inside member '000006\.jpg'"):
        for key, _, _ in iter_samples(chunked(cut), "t.tar"):
            got.append(key)
    assert got == [f"{i:06d}" for i in range(6)]  # never the partial 000006
    with pytest.raises(TruncatedShardError, match="empty file"):
        list(iter_samples([], "zero.tar"))
    assert list(iter_samples([b"\0" * 1024], "empty.tar")) == []


def test_non_adjacent_members_raise_with_key_and_shard():
    data = b"".join(encode_member(n, b"x") for n in ["000000.a", "000001.a", "000000.b", "000001.b"]) + END_OF_ARCHIVE
    with pytest.raises(SampleError, match=r"c06\.tar: key '000000' reappears"):
        list(iter_samples(chunked(data), "c06.tar"))
    got = list(iter_samples(chunked(data), "c06.tar", sample_errors="yield"))
    assert [k for k, _, _ in got] == ["000000", "000001", "000000", "000001"]
    assert [type(f).__name__ for _, _, f in got] == ["dict", "dict", "SampleError", "SampleError"]


def test_duplicate_field_is_a_sample_error():
    data = b"".join(encode_member(n, b"x") for n in ["000000.a", "000000.a", "000001.a"]) + END_OF_ARCHIVE
    got = list(iter_samples(chunked(data), "d.tar", sample_errors="yield"))
    assert isinstance(got[0][2], SampleError) and got[0][2].reason == "duplicate_field"
    assert got[1][:1] == ("000001",) and got[1][2] == {"a": b"x"}


def test_offsets_and_ranges():
    samples = [encode_sample(f"{i:06d}", {"txt": str(i).encode() * (i + 1)}) for i in range(5)]
    data = b"".join(samples) + END_OF_ARCHIVE
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + len(s))
    got = list(iter_samples(chunked(data), "o.tar"))
    assert [o for _, o, _ in got] == offsets[:5]
    part = data[offsets[2] : offsets[4]]
    got = list(iter_samples([part], "o.tar", offsets[2], end=offsets[4]))
    assert [k for k, _, _ in got] == ["000002", "000003"]
    assert [k for k, _, _ in iter_samples(chunked(data), "o.tar", limit=2)] == ["000000", "000001"]


def test_check_key_refuses_unreadable_keys():
    for bad in ["a.b", "x/y.z", "__x", "/abs", "a//b", "", "a/../b", "\x00", "cat/\x000001"]:
        with pytest.raises(SampleError, match=r"invalid sample key|non-empty str"):
            check_key(bad)
    assert check_key("cat/0001") == "cat/0001"


# ------------------------------------------------------------ the bulk path for plain members


def _general_only(monkeypatch):
    """Disable the bulk parser: every header then goes through the general path."""
    import shardflow.format.spans as spans_module

    monkeypatch.setattr(spans_module, "plain_members", lambda buf, pos, *rest: ([], pos))


member_kinds = st.sampled_from(["plain", "big", "pax", "dir", "empty", "upper"])


@settings(max_examples=120, deadline=None)
@given(kinds=st.lists(member_kinds, min_size=0, max_size=30), chunk=st.sampled_from([512, 700, 4096, 1 << 20]),
       seed=st.integers(0, 1000))
def test_bulk_path_reads_exactly_what_the_general_path_reads(kinds, chunk, seed):
    import random

    rng = random.Random(seed)
    parts = []
    for i, kind in enumerate(kinds):
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 1500)))
        if kind == "big":
            payload = payload * 40
        if kind == "pax":
            parts.append(encode_member(f"k{i:03d}/é{'x' * 120}.bin", payload))
        elif kind == "dir":
            info = tarfile.TarInfo(f"d{i}")
            info.type = tarfile.DIRTYPE
            parts.append(info.tobuf(format=tarfile.USTAR_FORMAT))
        elif kind == "empty":
            parts.append(encode_member(f"k{i:03d}.txt", b""))
        elif kind == "upper":
            parts.append(encode_member(f"K{i:03d}.JPG", payload))
        else:
            parts.append(encode_member(f"k{i:03d}.bin", payload))
    data = b"".join(parts) + END_OF_ARCHIVE
    chunks = [data[j : j + chunk] for j in range(0, len(data), chunk)]

    def members():
        gen = iter_members(iter(chunks), "s.tar")
        out = []
        while True:
            try:
                name, offset, payload = next(gen)
            except StopIteration as stop:
                return out, stop.value
            out.append((name, offset, bytes(payload)))

    fast = members()
    mp = pytest.MonkeyPatch()
    try:
        _general_only(mp)
        slow = members()
    finally:
        mp.undo()
    assert fast == slow
    assert [m[0] for m in fast[0]] == [m.name for m in tarfile.open(fileobj=io.BytesIO(data)) if m.isfile()]


@pytest.mark.parametrize("field", ["checksum", "size8", "size_sign"])
@pytest.mark.parametrize("at", [0, 7, 19])
def test_bulk_path_leaves_a_bad_header_to_the_checks(field, at):
    parts = [encode_member(f"{i:04d}.bin", b"x" * (100 + i)) for i in range(20)]
    offset = sum(len(p) for p in parts[:at])
    header = bytearray(parts[at][:512])
    if field == "checksum":
        header[0] ^= 0x01  # the stored checksum no longer matches
    elif field == "size8":
        header[124:136] = b"00000000198\0"  # a digit that is not octal
    else:
        header[124:136] = b"-0000000144\0"
    if field != "checksum":  # keep the checksum right so that the size check is the one that fires
        header[148:156] = b"        "
        header[148:156] = b"%06o\0 " % sum(header)
    parts[at] = bytes(header) + parts[at][512:]
    data = b"".join(parts) + END_OF_ARCHIVE
    got = []
    with pytest.raises(ShardFormatError, match=f"byte {offset}"):
        for name, _, _ in iter_members([data], "bad.tar"):
            got.append(name)
    assert got == [f"{i:04d}.bin" for i in range(at)]  # every member before the bad one, none after


def test_bulk_path_stops_at_end_and_refuses_a_member_past_it():
    parts = [encode_member(f"{i:04d}.bin", b"y" * 700) for i in range(10)]
    data = b"".join(parts) + END_OF_ARCHIVE
    cut = sum(len(p) for p in parts[:4])
    gen = iter_members([data[cut:]], "s.tar", cut, end=cut + 3 * len(parts[0]))
    names = []
    with pytest.raises(StopIteration) as stop:
        while True:
            names.append(next(gen)[0])
    assert names == ["0004.bin", "0005.bin", "0006.bin"] and stop.value.value == cut + 3 * len(parts[0])
    with pytest.raises(ShardFormatError, match="runs past byte"):
        list(iter_members([data[cut:]], "s.tar", cut, end=cut + len(parts[0]) + 512))


def test_bulk_path_keeps_the_member_size_limit():
    from shardflow.format.limits import Limits

    parts = [encode_member(f"{i:04d}.bin", b"z" * (1000 if i != 3 else 5000)) for i in range(6)]
    data = b"".join(parts) + END_OF_ARCHIVE
    out = list(iter_members([data], "s.tar", limits=Limits(max_member_bytes=4096)))
    assert [n for n, _, _ in out] == [f"{i:04d}.bin" for i in range(6)]
    assert isinstance(out[3][2], SampleError) and out[3][2].reason == "member_too_large"
    assert all(isinstance(d, bytes) for i, (_, _, d) in enumerate(out) if i != 3)


class _Sized:
    """A payload that only has a length: enough for the writer to build its header."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("size", [0, 1, 511, 512, 8**11 - 1, 8**11, 8**11 + 12345])
@pytest.mark.parametrize("length", [1, 37, 96])
def test_written_headers_parse_in_tarfile_with_their_checksum(size, length):
    # the writer's header template (only name, size, checksum and type vary); tarfile checks the
    # checksum and decodes octal and GNU base-256 (8 GiB and more) sizes
    from shardflow.format.tar import sample_parts

    key = "k" * length
    head = sample_parts(key, {"bin": _Sized(size)})[0]
    info = tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
    assert (info.name, info.size, info.mode, info.mtime, info.uid, info.type) == (f"{key}.bin", size, 0o644, 0, 0, tarfile.REGTYPE)
    assert len(head) == 512 and head[257:265] == b"ustar\x0000"


# a NUL ends a tar name (tarfile reads "\x00" back as ""): check_key refuses such keys before any
# shard is written, so this layer is tried with the keys a writer hands it
@given(st.text(min_size=1, max_size=140).filter(lambda k: "\x00" not in k),
       st.dictionaries(st.sampled_from(["jpg", "cls", "json", "a.b"]), st.binary(max_size=1500), min_size=1, max_size=3))
@settings(max_examples=60, deadline=None)
def test_sample_parts_join_to_the_encoded_sample_that_tarfile_reads(key, fields):
    from shardflow.format.tar import sample_parts

    parts = sample_parts(key, fields)
    encoded = encode_sample(key, fields)
    assert b"".join(parts) == encoded
    with tarfile.open(fileobj=io.BytesIO(encoded + END_OF_ARCHIVE)) as tf:
        got = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    assert got == [(f"{key}.{f}", fields[f]) for f in sorted(fields)]


def _samples(data: bytes, chunk: int, sample_errors: str) -> list:
    """``iter_samples`` as (key, fields) or (key, reason), then ("raised", reason) if it raised."""
    chunks = [data[j : j + chunk] for j in range(0, len(data), chunk)]
    out = []
    try:
        for key, _, fields in iter_samples(iter(chunks), "s.tar", sample_errors=sample_errors):
            out.append((key, fields.reason if isinstance(fields, SampleError) else dict(fields)))
    except SampleError as e:
        out.append(("raised", e.reason))
    return out


def test_the_open_sample_reappearing_in_the_next_grouped_run_is_non_adjacent():
    """The first bulk run (16 members) ends with k07 open; the next run closes it and has k07
    again: the same error as member by member, never k07 yielded twice."""
    names = [f"k{i:02d}.{f}" for i in range(8) for f in "ab"]
    names += ["k08.a", "k08.b", "k07.c"] + [f"k{i:02d}.{f}" for i in range(9, 30) for f in "ab"]
    data = b"".join(encode_member(n, n.encode()) for n in names) + END_OF_ARCHIVE
    got = _samples(data, 1 << 20, "raise")
    assert [k for k, _ in got] == [f"k{i:02d}" for i in range(9)] + ["raised"] and got[-1][1] == "non_adjacent"
    got = _samples(data, 1 << 20, "yield")
    assert [k for k, _ in got].count("k07") == 2 and ("k07", "non_adjacent") in got
    assert len(got) == 31 and got[-1] == ("k29", {"a": b"k29.a", "b": b"k29.b"})


_grouping_names = st.sampled_from(
    ["a.x", "a.y", "b.x", "b.y", "c.x", "c.x.y", "d/e.x", "d/e.y", "d/f.x", "A.X", "a.Y", "__m.x", "noext", "a.",
     ".x", "d/.x", "a_b.x", "d/__e.x"]
)


@settings(max_examples=150, deadline=None)
@given(blocks=st.lists(st.tuples(_grouping_names, st.integers(0, 9)), min_size=1, max_size=16),
       chunk=st.sampled_from([700, 4096, 1 << 20]), sample_errors=st.sampled_from(["raise", "yield"]))
@example(blocks=[("b.x", 0), ("a.x", 7), ("a.y", 1)], chunk=1 << 20, sample_errors="raise")  # a open at the run's end
@example(blocks=[("b.x", 0), ("a.x", 7), ("a.y", 1)], chunk=1 << 20, sample_errors="yield")
@example(blocks=[("b.x", 0), ("a.x", 7), ("a.x", 1)], chunk=1 << 20, sample_errors="yield")
def test_grouped_runs_give_what_member_by_member_gives(blocks, chunk, sample_errors):
    """Runs of names repeated (samples of one key split, keys reappearing across the bulk
    runs' bounds, fields twice, names that are not samples' members): the grouped path
    yields exactly the samples, or the errors, of the member-by-member path."""
    names = []
    for i, (name, count) in enumerate(blocks):  # a block: `count` numbered samples, then `name`
        names += [f"n{i}_{j}.{f}" for j in range(count) for f in ("p", "q")]
        names.append(name)
    data = b"".join(encode_member(n, f"{n}#{j}".encode()) for j, n in enumerate(names)) + END_OF_ARCHIVE
    fast = _samples(data, chunk, sample_errors)
    mp = pytest.MonkeyPatch()
    try:
        _general_only(mp)
        slow = _samples(data, chunk, sample_errors)
    finally:
        mp.undo()
    assert fast == slow


def test_iter_samples_returns_where_the_walk_stopped_and_scan_shard_takes_its_samples():
    from shardflow.format.tar import scan_shard

    samples = [(f"{i:04d}", {"cls": b"%d" % i, "txt": b"x" * (100 * i)}) for i in range(20)]
    body = b"".join(encode_sample(k, f) for k, f in samples)
    data = body + END_OF_ARCHIVE
    walk = iter_samples(chunked(data), "r.tar")
    got = []
    with pytest.raises(StopIteration) as stop:
        while True:
            got.append(next(walk))
    assert [(k, f) for k, _, f in got] == samples
    assert stop.value.value == len(body)  # the end-of-archive marker's offset
    assert list(iter_samples(chunked(data), "r.tar", limit=3)) == got[:3]
    keys, offsets, fields = scan_shard(chunked(data), "r.tar")
    assert (keys, offsets, fields) == ([k for k, _ in samples], [o for _, o, _ in got] + [len(body)], {"cls": 20, "txt": 20})


@settings(max_examples=400, deadline=None)
@given(
    st.text(st.sampled_from("ab.~%_/0\u00e9\udc80"), min_size=1, max_size=110),
    st.dictionaries(st.text(st.sampled_from("abcxyz.\u00e9"), min_size=1, max_size=12), st.binary(max_size=1100),
                    min_size=1, max_size=3),
)
@example("k" * 95, {"cls": b"7", "jpeg": b"x"})  # one member name fits ustar, the other needs a PAX record
def test_encode_sample_is_its_members_encoded_one_by_one(key: str, fields: dict[str, bytes]) -> None:
    # the ASCII fast path (ustar.ascii_sample) gives exactly the bytes of the general path
    assert encode_sample(key, fields) == b"".join(encode_member(f"{key}.{f}", fields[f]) for f in sorted(fields))
