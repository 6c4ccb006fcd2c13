"""The tar reader and writer: formats, names, checksums, truncation (golden: CPython tarfile, GNU tar)."""

import io
import subprocess
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.errors import SampleError, ShardFormatError, TruncatedShardError
from shardflow.format.keys import check_key, split_name
from shardflow.format.tar import END_OF_ARCHIVE, encode_member, encode_sample, iter_members, iter_samples


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
    for bad in ["a.b", "x/y.z", "__x", "/abs", "a//b", "", "a/../b"]:
        with pytest.raises(SampleError):
            check_key(bad)
    assert check_key("cat/0001") == "cat/0001"
