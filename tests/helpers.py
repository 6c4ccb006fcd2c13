"""Shared test helpers: tiny shard folders and the one resumption check.

``make_shards`` writes a dataset with :class:`shardflow.ShardWriter` from
per-shard sample counts. ``assert_resumes`` is the resume contract every
stateful piece (``ShardDataset`` iterated directly, ``ShardLoader``, ...) must
meet: run to step k, save, rebuild, load, finish, compare with the
uninterrupted run, and check the epoch after that.
"""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardflow.format.manifest import MANIFEST_NAME, Manifest
from shardflow.writing.writer import ShardWriter, write_manifest

__all__ = [
    "make_shards",
    "sample_key",
    "keys_of",
    "batch_keys",
    "canonical",
    "assert_resumes",
    "shard_urls",
    "worker_collate",
]


def sample_key(i: int) -> str:
    """Key of global sample ``i`` in :func:`make_shards` datasets."""
    return f"{i:06d}"


def make_shards(
    tmp_path: str | os.PathLike,
    sizes: Sequence[int],
    fields: Callable[[int], dict[str, Any]] | None = None,
    *,
    name: str = "data",
    manifest: bool = True,
    index: bool = True,
) -> Path:
    """Write shards of the given sample counts into ``tmp_path/name``.

    Sample ``i`` (global, in shard order) has key ``f"{i:06d}"`` and the field
    ``cls = i``, plus whatever ``fields(i)`` returns. Shard ``s`` is
    ``train-%06d.tar`` numbered from 0; each is written by its own
    :class:`ShardWriter` (``max_count`` = its size) and one ``shardflow.json``
    lists them all in order.

    Args:
        tmp_path: parent folder.
        sizes: samples per shard, each >= 1.
        fields: extra fields per global index (``{"txt": "..."}``).
        name: sub-folder name.
        manifest: write ``shardflow.json`` (False: bare tars, an unsized stream).
        index: write the per-shard offset index.

    Returns:
        The folder holding the shards.
    """
    folder = Path(tmp_path) / name
    folder.mkdir(parents=True, exist_ok=False)
    pattern = str(folder / "train-%06d.tar")
    combined = Manifest(shards=[])
    i = 0
    for s, size in enumerate(sizes):
        if size < 1:
            raise ValueError(f"make_shards: shard {s} must hold >= 1 sample, got {size}")
        writer = ShardWriter(pattern, max_count=size, start_shard=s, manifest=False, index=index)
        with writer:
            for _ in range(size):
                sample = {"__key__": sample_key(i), "cls": i}
                if fields is not None:
                    sample.update(fields(i))
                writer.write(sample)
                i += 1
        combined.shards.extend(writer.manifest.shards)
        combined.fields.update(writer.manifest.fields)
    if len(combined.shards) != len(sizes):
        raise AssertionError(f"make_shards wrote {len(combined.shards)} shards, expected {len(sizes)}")
    if manifest:
        write_manifest(str(folder / MANIFEST_NAME), combined)
    return folder


def shard_urls(folder: str | os.PathLike) -> list[str]:
    """The ``.tar`` files of a :func:`make_shards` folder, in order."""
    return sorted(str(p) for p in Path(folder).glob("*.tar"))


def keys_of(batch: Any) -> list[str]:
    """Keys of a collated batch (``{"__key__": [...]}``) or of one sample dict."""
    keys = batch["__key__"]
    return [keys] if isinstance(keys, str) else list(keys)


def batch_keys(items: Iterable[Any]) -> list[list[str]]:
    """Keys of each batch (or sample) of an iteration."""
    return [keys_of(b) for b in items]


def canonical(item: Any) -> Any:
    """A plain, comparable form of a batch or sample (tensors and arrays to lists)."""
    if isinstance(item, dict):
        return {k: canonical(v) for k, v in sorted(item.items())}
    if isinstance(item, (list, tuple)):
        return [canonical(v) for v in item]
    if isinstance(item, torch.Tensor):
        return ("tensor", str(item.dtype), tuple(item.shape), item.tolist())
    if isinstance(item, np.ndarray):
        return ("ndarray", str(item.dtype), item.shape, item.tolist())
    if isinstance(item, np.generic):
        return item.item()
    return item


def _take(it: Iterator[Any], k: int) -> list[Any]:
    out = []
    for _ in range(k):
        out.append(canonical(next(it)))
    return out


def assert_resumes(
    make: Callable[[], Any],
    consume: Callable[[Any], Iterator[Any]] | None = None,
    k: int = 1,
    *,
    check_next_epoch: bool = True,
) -> tuple[list[Any], list[Any]]:
    """The resume contract of a stateful piece, checked end to end.

    1. ``make()`` a fresh object; record one uninterrupted epoch (``consume``)
       and the epoch after it (a second ``consume`` with no ``set_epoch``).
    2. ``make()`` another; take ``k`` items of an epoch; ``state_dict()``; drop
       the iterator and the object.
    3. ``make()`` a third; ``load_state_dict`` (the state is deep-copied and
       round-tripped through pickle, as a checkpoint would be); finish the
       epoch: it must equal the record from item ``k`` on, item for item.
    4. The next iteration of that third object must equal the recorded next
       epoch.

    Args:
        make: builds a fresh, identically configured object (dataset, loader, ...).
        consume: ``consume(obj) -> iterator`` of one epoch; default ``iter``.
        k: items to take before saving, ``0 <= k <= epoch length``.
        check_next_epoch: also compare the epoch after the resumed one.

    Returns:
        ``(epoch, next_epoch)`` as recorded, in canonical form.
    """
    consume = consume or iter
    step = ["recording the epoch (make(), first consume)"]
    try:
        return _assert_resumes(make, consume, k, check_next_epoch, step)
    except Exception as e:
        # say which step failed, so that a rare failure in CI is diagnosable from its log alone
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(f"assert_resumes(k={k}) failed while {step[0]}" + (f"; saved state: {step[1]}" if len(step) > 1 else ""))
        raise


def _assert_resumes(
    make: Callable[[], Any],
    consume: Callable[[Any], Iterator[Any]],
    k: int,
    check_next_epoch: bool,
    step: list[Any],
) -> tuple[list[Any], list[Any]]:
    first = make()
    record = [canonical(x) for x in consume(first)]
    step[0] = "recording the next epoch (second consume of the first object)"
    record_next = [canonical(x) for x in consume(first)] if check_next_epoch else []
    step[0] = "dropping the first object"
    del first
    if not 0 <= k <= len(record):
        raise ValueError(f"k={k} outside the epoch of {len(record)} items")

    step[0] = f"taking {k} items from a second object"
    second = make()
    it = consume(second)
    head = _take(it, k)
    assert head == record[:k], "a fresh object does not reproduce the recorded epoch"
    step[0] = "saving the second object's state_dict()"
    state = second.state_dict()
    state = pickle.loads(pickle.dumps(copy.deepcopy(state)))
    step[1:] = [{key: state.get(key) for key in ("epoch", "next_worker", "remaining")}]
    step[0] = "dropping the second object and its iterator"
    del it, second

    step[0] = "building the third object and loading the state"
    third = make()
    third.load_state_dict(state)
    step[0] = "finishing the resumed epoch on the third object"
    rest = [canonical(x) for x in consume(third)]
    assert len(rest) == len(record) - k, f"resumed with {len(rest)} items, expected {len(record) - k}"
    for j, (got, want) in enumerate(zip(rest, record[k:])):
        assert got == want, f"item {k + j} differs after resuming at {k}"
    if check_next_epoch:
        step[0] = "iterating the epoch after the resumed one on the third object"
        after = [canonical(x) for x in consume(third)]
        assert after == record_next, "the epoch after the resumed one differs from the recorded next epoch"
    return record, record_next


def worker_collate(samples: list[Any]) -> dict[str, Any]:
    """:func:`shardflow.loading.collation.collate` plus ``__worker__``: the DataLoader worker
    id that built the batch (-1 in the main process), to tell streams apart."""
    from torch.utils.data import get_worker_info

    from shardflow.loading.collation import collate

    batch = collate(samples)
    info = get_worker_info()
    batch["__worker__"] = -1 if info is None else info.id
    return batch


def tiny_image(fmt: str, seed: int, size: tuple[int, int] = (4, 3)) -> bytes:
    """A real image of random pixels (``size`` = (width, height)) encoded by Pillow in ``fmt``
    (``"JPEG"``, ``"PNG"``, ``"WEBP"``, ...): distinct bytes per seed, a header that parses."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def handles_under(path: str | os.PathLike) -> int:
    """How many of this process's file descriptors are open on ``path`` or on files under it.

    Counted from ``/proc/self/fd`` rather than as a change in the total, so descriptors that other
    tests' garbage releases during a test (a garbage collection closes them) cannot move the count."""
    root = os.path.realpath(path)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed by now
            continue
        if target == root or target.startswith(root + os.sep):
            count += 1
    return count
