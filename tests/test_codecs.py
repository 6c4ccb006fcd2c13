"""Field codecs: encode/decode round trips, the fast .npy path against np.load, no pickle."""

import gzip
import io
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shardflow.codecs import DecodeOptions, decode_field, encode_field, known_extensions
from shardflow.errors import DecodeError, SampleError

OPTS = DecodeOptions()


@settings(max_examples=80, deadline=None)
@given(
    hnp.arrays(
        dtype=st.one_of(hnp.scalar_dtypes(), hnp.byte_string_dtypes(), hnp.unicode_string_dtypes()),
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    ),
    st.booleans(),
)
def test_npy_fast_path_equals_np_load(arr, fortran):
    if fortran:
        arr = np.asfortranarray(arr)
    data = encode_field("k", "x.npy", arr)
    ours = decode_field("x.npy", data, OPTS)
    ref = np.load(io.BytesIO(data), allow_pickle=False)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)
    assert ours.flags.writeable and ours.flags.f_contiguous == ref.flags.f_contiguous


def test_npy_refuses_object_arrays_both_ways():
    with pytest.raises(SampleError, match="pickle"):
        encode_field("k", "x.npy", np.array([{"a": 1}], dtype=object))
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DecodeError, match="field 'x.npy'"):
        decode_field("x.npy", buf.getvalue(), OPTS)


def test_scalar_codecs_round_trip():
    cases = [("cls", 7, 7), ("txt", "héllo wörld", "héllo wörld"), ("json", {"a": [1, 2.5, None]}, {"a": [1, 2.5, None]})]
    for field, value, expected in cases:
        assert decode_field(field, encode_field("k", field, value), OPTS) == expected
    assert encode_field("k", "cls", np.int64(3)) == b"3"
    assert decode_field("cls", b" 12\n", OPTS) == 12


def test_gz_wraps_the_inner_codec():
    arr = np.arange(10, dtype=np.int32)
    data = encode_field("k", "x.npy.gz", arr)
    assert gzip.decompress(data)[:6] == b"\x93NUMPY"
    np.testing.assert_array_equal(decode_field("x.npy.gz", data, OPTS), arr)
    assert decode_field("notes.txt.gz", gzip.compress(b"hi"), OPTS) == "hi"


def test_pickle_fields_stay_bytes_unless_opted_in():
    import pickle

    data = pickle.dumps({"a": 1})
    assert decode_field("x.pkl", data, OPTS) == data
    # opted in: a pickle/pkl field is pickle.dumps bytes (torch.load refused them: "Invalid magic number"),
    # a pt/pth field what torch.save wrote
    opted = DecodeOptions(allow_pickle=True)
    assert decode_field("x.pkl", data, opted) == decode_field("pickle", data, opted) == {"a": 1}
    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.arange(3)}, buf)
    assert decode_field("x.pt", buf.getvalue(), opted)["w"].tolist() == [0, 1, 2]


def test_unknown_extension_keeps_bytes_and_encoding_lists_known():
    assert decode_field("x.weird", b"abc", OPTS) == b"abc"
    with pytest.raises(SampleError, match="use one of the extensions .*npy"):
        encode_field("k", "x.weird", object())
    assert {"npy", "json", "cls", "jpg", "pyg"} <= set(known_extensions())


def test_a_graph_dataset_imports_its_codec_in_the_parent(tmp_path):
    """Built over a manifest with a pyg field, a ShardDataset imports torch_geometric at once, so
    that DataLoader workers forked later do not each import it before their first batch; with
    decode=None, or fields that leave the graphs out, it does not."""
    import subprocess
    import sys

    pytest.importorskip("torch_geometric")
    torch = pytest.importorskip("torch")
    from torch_geometric.data import Data

    import shardflow

    with shardflow.ShardWriter(str(tmp_path / "g-%06d.tar"), max_count=10) as w:
        for i in range(3):
            w.write({"__key__": f"{i}", "graph.pyg": Data(x=torch.ones(2, 1), edge_index=torch.zeros(2, 1, dtype=torch.long)),
                     "cls": i})
    code = ("import sys, shardflow\n"
            f"shardflow.ShardDataset({str(tmp_path)!r}, **eval(sys.argv[1]))\n"
            "print('torch_geometric' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def imported(kwargs: str) -> str:
        return subprocess.run([sys.executable, "-c", code, kwargs], capture_output=True, text=True, env=env,
                              check=True, timeout=300).stdout.strip()

    assert imported("{}") == "True"
    assert imported("{'decode': None}") == "False"
    assert imported("{'fields': ['cls']}") == "False"
