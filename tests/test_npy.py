"""shardflow.format.npy: the one .npy header reader, with the fast paths on and off, against
numpy's own reading; and the named fast-path switch that turns one fast path off alone."""

from __future__ import annotations

import io

import numpy as np
import pytest

from shardflow import fastpath
from shardflow.codecs import DecodeOptions, decode_field
from shardflow.format.npy import header_of, read_header

ARRAYS = [
    np.arange(7, dtype="<i8"),  # shardflow's own offset index form (the pattern)
    np.zeros((0,), dtype="<u4"),
    np.ones((3, 2), dtype=">f4"),
    np.zeros((4, 3), dtype=np.dtype([("a", "<i4"), ("b", "<f8")]), order="F"),
    np.array(5, dtype="<i2"),  # shape ()
]


def _npy(arr: np.ndarray, version: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, version=version, allow_pickle=False)
    return buf.getvalue()


@pytest.mark.usefixtures("fast_paths")
@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize("i", range(len(ARRAYS)))
def test_header_of_reads_what_numpy_reads(version: tuple[int, int], i: int) -> None:
    arr = ARRAYS[i]
    data = _npy(arr, version)
    shape, fortran, dtype, offset = header_of(data)
    expected = np.load(io.BytesIO(data))
    assert (shape, dtype) == (expected.shape, expected.dtype)
    assert fortran == (arr.ndim > 1 and arr.flags.f_contiguous and not arr.flags.c_contiguous)
    assert offset == len(data) - arr.nbytes and offset % 64 == 0
    f = io.BytesIO(data)
    assert read_header(f) == (shape, fortran, dtype) and f.tell() == offset  # from a file: left at the data
    np.testing.assert_array_equal(decode_field("npy", data, DecodeOptions()), expected)


@pytest.mark.parametrize(
    "data, match",
    [(b"\x93NUMPZ\x01\x00" + b"\0" * 20, "not a .npy"), (b"\x93NUMPY\x04\x00" + b"\0" * 20, "version 4.0"),
     (b"\x93NUMPY\x01\x00\xff\x00{'descr'", "only 8 follow")],
)
def test_header_of_refuses_what_is_no_npy_header(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        header_of(data)


def test_one_fast_path_turns_off_alone_and_a_wrong_name_fails_loudly() -> None:
    assert fastpath.enabled() and fastpath.enabled("npy")
    try:
        fastpath.set_enabled(False, "npy")
        assert fastpath.enabled() and not fastpath.enabled("npy") and fastpath.enabled("jpeg")
        with pytest.raises(ValueError, match="no fast path named 'nyp'"):
            fastpath.set_enabled(False, "nyp")
    finally:
        fastpath.set_enabled(True)
    assert fastpath.enabled("npy")
