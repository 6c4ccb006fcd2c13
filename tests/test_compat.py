"""The private names of torch, numpy and gcsfs that shardflow uses (shardflow.compat): each
one exists in the installed version, and each wrapper does what the private name did. A
failure here after an upgrade names what moved."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from shardflow.compat import gcsfs as gcsfs_compat
from shardflow.compat import numpy as numpy_compat
from shardflow.compat import torch as torch_compat


@pytest.mark.parametrize("compat", [torch_compat, numpy_compat], ids=["torch", "numpy"])
def test_every_private_name_used_is_there(compat):
    assert compat.missing() == [], f"moved by an upgrade (see {compat.__name__}): {compat.missing()}"


def test_gcsfs_private_names_are_there():
    pytest.importorskip("gcsfs")
    assert gcsfs_compat.missing() == [], f"moved by a gcsfs upgrade (see shardflow.compat.gcsfs): {gcsfs_compat.missing()}"


def test_storage_uses_counts_the_tensors_on_a_storage():
    t = torch.zeros(8)
    alone = torch_compat.storage_uses(t)
    view = t[2:]
    assert torch_compat.storage_uses(t) == alone + 1
    del view
    assert torch_compat.storage_uses(t) == alone


def test_new_shared_is_in_shared_memory_with_the_shape_and_dtype():
    t = torch_compat.new_shared((3, 5), torch.int16)
    assert t.is_shared() and t.shape == (3, 5) and t.dtype == torch.int16
    t.fill_(7)
    assert int(t.sum()) == 7 * 15


def test_pin_memory_pins_as_the_dataloader_does():
    from torch.utils.data._utils.pin_memory import pin_memory as reference

    batch = {"x": torch.ones(2), "k": ["a", "b"]}
    try:
        expected = reference(batch)
    except RuntimeError as e:  # no accelerator to pin for: the same error
        with pytest.raises(type(e)):
            torch_compat.pin_memory(batch)
        return
    ours = torch_compat.pin_memory(batch)
    assert ours["k"] == expected["k"] and ours["x"].is_pinned() == expected["x"].is_pinned()
    assert torch.equal(ours["x"], batch["x"])


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_headers_of_every_version_read_as_numpy_writes_them(version):
    arr = np.zeros((4, 3), dtype=np.dtype([("a", "<i4"), ("b", "<f8")]), order="F")
    buf = io.BytesIO()
    fmt = np.lib.format
    fmt.write_array(buf, arr, version=version)
    buf.seek(0)
    shape, fortran, dtype = numpy_compat.read_array_header(buf, fmt.read_magic(buf))
    buf.seek(0)
    loaded = np.load(buf)  # the reference
    assert (shape, dtype) == (loaded.shape, loaded.dtype)
    assert fortran == (loaded.flags.f_contiguous and not loaded.flags.c_contiguous)


def test_shutdown_workers_is_a_noop_for_a_single_process_iterator():
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    it = iter(loader)
    torch_compat.shutdown_workers(it)
    assert [b.tolist() for b in it] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("name", ["pyg", "fsspec", "aio"])
def test_every_private_name_of_pyg_fsspec_aiohttp_is_there(name):
    import importlib

    compat = importlib.import_module(f"shardflow.compat.{name}")
    assert compat.missing() == [], f"moved by an upgrade (see {compat.__name__}): {compat.missing()}"


def test_pyg_storages_are_the_graph_attributes_and_batch_slices_what_from_data_list_records():
    from torch_geometric.data import Batch, Data, HeteroData

    from shardflow.compat import pyg

    data = Data()
    pyg.data_attributes(data)["x"] = torch.arange(3.0)  # written into the graph itself
    assert torch.equal(data.x, torch.arange(3.0)) and pyg.data_store(data) is data.stores[0]
    hetero = HeteroData()
    hetero["paper"].x = torch.zeros(2)
    hetero["paper", "cites", "paper"].edge_index = torch.zeros(2, 1, dtype=torch.long)
    assert [pyg.store_key(s) for s in hetero.node_stores + hetero.edge_stores] == ["paper", ("paper", "cites", "paper")]
    pyg.store_attributes(pyg.global_store(hetero))["y"] = 1
    assert hetero.y == 1

    graphs = [Data(x=torch.ones(2, 1), edge_index=torch.tensor([[0], [1]])) for _ in range(2)]
    reference = Batch.from_data_list(graphs)
    ours = Batch.from_data_list(graphs)
    pyg.set_batch_slices(ours, 2, {"x": torch.tensor([0, 2, 4])}, {"x": torch.tensor([0, 0])})
    assert ours.num_graphs == 2 and torch.equal(ours.get_example(1).x, reference.get_example(1).x)


def test_fsspec_strip_protocol_and_s3_call_are_the_filesystems_own():
    import inspect

    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from shardflow.compat import fsspec as fsspec_compat

    assert fsspec_compat.strip_protocol(LocalFileSystem, "file:///a/b") == "/a/b"
    assert fsspec_compat.strip_protocol(fsspec.filesystem("memory"), "memory://x/y.tar") == "/x/y.tar"
    s3fs = pytest.importorskip("s3fs")
    assert inspect.iscoroutinefunction(fsspec_compat.call_s3(s3fs.S3FileSystem(anon=True)))


def test_aiohttp_takes_auto_decompress_per_request_and_aiobotocore_credentials_are_dropped():
    from aiobotocore.session import AioSession

    from shardflow.compat import aio

    assert {"method", "auto_decompress"} <= aio.request_parameters()
    session = AioSession()
    session._credentials = object()
    aio.drop_credentials(session)
    assert session._credentials is None
