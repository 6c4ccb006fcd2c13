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
