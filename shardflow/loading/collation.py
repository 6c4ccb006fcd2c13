"""Collating samples into batches: :func:`collate`, the loader's default ``collate_fn``.

A batch of dict samples is a dict with the same keys: numbers and equal-shape
arrays or tensors are stacked into tensors (numpy arrays become tensors via
``torch.from_numpy``), PyTorch Geometric graphs become one ``Batch`` (the rules
of ``Batch.from_data_list``, with its ``follow_batch`` and ``exclude_keys``
options), strings (``__key__`` and ``__url__`` among them), bytes, PIL images and
anything else become lists. Tuples and lists of equal length are collated
position by position. A list of graphs (samples that a ``transform`` turned into
graphs) becomes one ``Batch``.

Decoded images of different sizes under one image field (``jpg``, ``png``, the
alias ``image``, ...) are an error that names two samples and their shapes and
says how to resize (a per-field transform such as
``transform={"image": v2.Resize((224, 224))}``), since a list in place of the
``uint8 (B, 3, H, W)`` tensor would break the model much later. Other arrays of
different shapes (token sequences, say) become lists.

For a loader with PyG's options, pass a :class:`Collate` (picklable, so it reaches
DataLoader workers under any start method)::

    shardflow.loader(ds, batch_size=64, collate_fn=Collate(follow_batch=["x"]))
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import fastpath
from ..codecs import is_image_field
from ..errors import SampleError
from ..graph.records import GraphRecord
from .transfer import BY_VALUE_MAX_BYTES, shared_out
from ..world import World

__all__ = ["Collate", "collate", "is_builtin", "takes_graph_records"]


def collate(
    samples: Sequence[Any],
    *,
    follow_batch: Iterable[str] | None = None,
    exclude_keys: Iterable[str] | None = None,
) -> Any:
    """Collate a list of samples into one batch.

    Args:
        samples: dicts with the same keys (or tuples, tensors, graphs, ...).
        follow_batch: graph attributes that also get ``<attr>_batch`` (int64, the
            graph index of every element along the concatenation dimension) and
            ``<attr>_ptr`` (int64, ``num_graphs + 1`` offsets), as in
            ``Batch.from_data_list``.
        exclude_keys: graph attributes left out of the batch.

    Returns:
        For dicts, ``{key: collated values}``; see the module docstring for
        the rule per value type.

    Raises:
        SampleError: the dict samples do not all have the same keys (names the
            key and the sample lacking or adding it), or graphs of one batch
            differ in attributes, node or edge types, or cannot be concatenated
            (names the field, the sample keys and shards at fault and the
            attribute or type).
        ValueError: an empty list.
        TypeError: ``follow_batch`` or ``exclude_keys`` is a str.
    """
    return Collate(follow_batch or (), exclude_keys or ())(samples)


@dataclass(frozen=True)
class Collate:
    """:func:`collate` with its options bound: a picklable ``collate_fn`` for
    :func:`shardflow.loader`.

    Attributes:
        follow_batch: graph attributes that also get ``<attr>_batch`` and
            ``<attr>_ptr`` (see :func:`collate`).
        exclude_keys: graph attributes left out of the batch.

    Raises (when called): as :func:`collate`.
    """

    follow_batch: tuple[str, ...] = ()
    exclude_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("follow_batch", "exclude_keys"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"{name} must be a sequence of attribute names, e.g. ['x'], not a str")
            object.__setattr__(self, name, tuple(value or ()))

    def __call__(self, samples: Sequence[Any]) -> Any:
        if not samples:
            raise ValueError("cannot collate an empty list of samples")
        samples = samples if isinstance(samples, list) else list(samples)
        first = samples[0]
        if _is_graph(first):
            return self._graphs("graphs", samples, samples)
        if isinstance(first, Mapping):
            return self._dicts(samples, samples)
        return self._values("sample", samples, samples)

    def _dicts(self, samples: list[Any], values: list[Any]) -> dict[str, Any]:
        """``values`` are dicts (``samples`` or the values of one of their fields)."""
        first = values[0]
        keys = list(first.keys())
        keyset = set(keys)
        for s in values[1:]:
            if not isinstance(s, Mapping) or s.keys() != keyset:
                found = set(s.keys()) if isinstance(s, Mapping) else set()
                extra = sorted(found - keyset)
                missing = sorted(keyset - found)
                key = s.get("__key__", "?") if isinstance(s, Mapping) else "?"
                raise SampleError(
                    f"cannot collate sample {key!r} with {first.get('__key__', '?')!r}: "
                    f"fields missing {missing}, extra {extra}; select fields with `fields=` so samples agree"
                )
        return {k: self._values(f"field {k!r}", samples, [v[k] for v in values], field=k) for k in keys}

    def _values(self, what: str, samples: list[Any], values: list[Any], field: str | None = None) -> Any:
        """Collate ``values``, one per sample of ``samples`` (named in errors as ``what``;
        ``field``: the field they come from, if any)."""
        first = values[0]
        if type(first) is GraphRecord:
            return self._graphs(what, samples, values)
        if isinstance(first, torch.Tensor):
            if all(isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype for v in values):
                if first.layout == torch.strided and first.device.type == "cpu":
                    return torch.stack(values, out=_batch_out(len(values), first.shape, first.dtype))
                return torch.stack(values)
            _refuse_image_sizes(field, samples, values)
            return values
        if isinstance(first, np.ndarray) and first.dtype != object:
            if all(isinstance(v, np.ndarray) and v.shape == first.shape and v.dtype == first.dtype for v in values):
                out = _batch_out(len(values), first.shape, _torch_dtype(first.dtype))
                if out is None:
                    return torch.from_numpy(np.stack(values))
                np.stack(values, out=out.numpy())
                return out
            _refuse_image_sizes(field, samples, values)
            return values
        if isinstance(first, (bool, np.bool_)) and all(isinstance(v, (bool, np.bool_)) for v in values):
            return torch.tensor(values, dtype=torch.bool)
        if isinstance(first, numbers.Integral) and all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values
        ):
            return torch.tensor(values, dtype=torch.int64)
        if isinstance(first, numbers.Real) and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
            return torch.tensor(values, dtype=torch.float64)
        if isinstance(first, Mapping):
            return self._dicts(samples, values)
        if isinstance(first, tuple) and all(isinstance(v, tuple) and len(v) == len(first) for v in values):
            return tuple(self._values(f"{what}[{i}]", samples, list(col)) for i, col in enumerate(zip(*values)))
        if _is_graph(first):
            return self._graphs(what, samples, values)
        return list(values)

    def _graphs(self, what: str, samples: list[Any], graphs: list[Any]) -> Any:
        from ..graph.collate import collate_graphs
        from ..graph.records import collate_records
        from ..graph.structure import describe_mismatch

        if any(type(g) is GraphRecord for g in graphs):
            if all(type(g) is GraphRecord for g in graphs):
                batch = collate_records(graphs, follow_batch=frozenset(self.follow_batch),
                                        exclude_keys=frozenset(self.exclude_keys))
                if batch is not None:
                    return batch
            # records that do not line up, or beside graphs: the graphs' own collate
            graphs = [g.build() if type(g) is GraphRecord else g for g in graphs]
        try:
            return collate_graphs(graphs, follow_batch=self.follow_batch, exclude_keys=self.exclude_keys)
        except SampleError as e:
            where = describe_mismatch(samples, graphs, frozenset(self.exclude_keys))
            raise SampleError(f"cannot batch the graphs of {what}: {where}: {e}", reason=e.reason) from e


def _batch_out(count: int, shape: Sequence[int], dtype: torch.dtype | None) -> torch.Tensor | None:
    """In a DataLoader worker, an empty tensor of shape ``(count, *shape)`` in shared
    memory to stack a batch into (as ``torch.utils.data.default_collate`` does): the
    DataLoader then hands its storage to the main process as it is, where a batch in
    private memory is first copied into shared memory (for 64 photo-sized images, 27 MB,
    on the way of every batch, the first one included). None in the main process, and for
    a batch of at most :data:`~shardflow.loading.transfer.BY_VALUE_MAX_BYTES`, which travels by value.
    The memory is a reused buffer of the worker's pool (see :mod:`shardflow.loading.transfer`)."""
    if dtype is None or not World.in_worker():
        return None
    numel = count * int(np.prod(shape, dtype=np.int64))
    if numel * dtype.itemsize <= BY_VALUE_MAX_BYTES:
        return None  # small: sent by value (see shardflow.loading.transfer)
    return shared_out(count, tuple(shape), dtype)


def _torch_dtype(dtype: np.dtype) -> torch.dtype | None:
    """The torch dtype of a numpy dtype, None if torch has none (``torch.from_numpy`` then says why)."""
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError:
        return None


def is_builtin(collate_fn: Any) -> bool:
    """Whether ``collate_fn`` is :func:`collate` or a :class:`Collate`: shardflow's own
    code, which draws from no random generator."""
    return collate_fn is collate or type(collate_fn) is Collate


def takes_graph_records(collate_fn: Any) -> bool:
    """Whether ``collate_fn`` batches :class:`~shardflow.graph.records.GraphRecord` values
    (:func:`collate` and :class:`Collate` do), so that a dataset may decode graph fields
    into records for it (see :func:`shardflow.codecs.decode_field`); False with the fast
    paths off (:mod:`shardflow.fastpath`)."""
    return is_builtin(collate_fn) and fastpath.enabled()


def _refuse_image_sizes(field: str | None, samples: list[Any], values: list[Any]) -> None:
    """Raise if ``values`` are images of an image field that differ in shape."""
    if field is None or not is_image_field(field):
        return
    first = values[0]
    i = next((i for i, v in enumerate(values) if getattr(v, "shape", None) != first.shape), None)
    if i is None:  # one shape, different dtypes
        return

    def key(j: int) -> Any:
        s = samples[j]
        return s.get("__key__", f"#{j}") if isinstance(s, Mapping) else f"#{j}"

    raise SampleError(
        f"cannot batch field {field!r}: image {key(0)!r} has shape {tuple(first.shape)}, "
        f"image {key(i)!r} has shape {tuple(getattr(values[i], 'shape', ()))}; the images of a "
        f"batch must have one size. Resize them in a per-field transform, e.g. "
        f"transform={{{field!r}: torchvision.transforms.v2.Resize((224, 224))}} (or "
        f"v2.RandomResizedCrop(224) for training), or pass collate_fn=list to batch them as a list"
    )


def _is_graph(obj: Any) -> bool:
    mod = type(obj).__module__
    if not mod.startswith("torch_geometric") and not hasattr(obj, "__cat_dim__"):
        return False
    from ..graph import is_graph

    return is_graph(obj)
