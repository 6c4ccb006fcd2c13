"""Collating samples into batches.

A batch of dict samples is a dict with the same keys: numbers and equal-shape
arrays or tensors are stacked into tensors (numpy arrays become tensors via
``torch.from_numpy``), PyTorch Geometric graphs become one ``Batch`` (the rules
of ``Batch.from_data_list``), strings (``__key__`` and ``__url__`` among them),
bytes, PIL images and anything else become lists. Tuples and lists of equal
length are collated position by position.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .errors import SampleError

__all__ = ["collate"]


def _collate_values(name: str, values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        if all(isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype for v in values):
            return torch.stack(values)
        return values
    if isinstance(first, np.ndarray) and first.dtype != object:
        if all(isinstance(v, np.ndarray) and v.shape == first.shape and v.dtype == first.dtype for v in values):
            return torch.from_numpy(np.stack(values))
        return values
    if isinstance(first, (bool, np.bool_)) and all(isinstance(v, (bool, np.bool_)) for v in values):
        return torch.tensor(values, dtype=torch.bool)
    if isinstance(first, numbers.Integral) and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
        return torch.tensor(values, dtype=torch.int64)
    if isinstance(first, numbers.Real) and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
        return torch.tensor(values, dtype=torch.float64)
    if isinstance(first, Mapping):
        return collate(values)
    if isinstance(first, tuple) and all(isinstance(v, tuple) and len(v) == len(first) for v in values):
        return tuple(_collate_values(f"{name}[{i}]", list(col)) for i, col in enumerate(zip(*values)))
    if _is_graph(first):
        from .graph import collate_graphs

        return collate_graphs(values)
    return list(values)


def _is_graph(obj: Any) -> bool:
    mod = type(obj).__module__
    if not mod.startswith("torch_geometric") and not hasattr(obj, "__cat_dim__"):
        return False
    from .graph import is_graph

    return is_graph(obj)


def collate(samples: Sequence[Any]) -> Any:
    """Collate a list of samples into one batch.

    Args:
        samples: dicts with the same keys (or tuples, tensors, graphs, ...).

    Returns:
        For dicts, ``{key: collated values}``; see the module docstring for
        the rule per value type.

    Raises:
        SampleError: the dict samples do not all have the same keys (names the
            key and the sample lacking or adding it).
        ValueError: an empty list.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    first = samples[0]
    if isinstance(first, Mapping):
        keys = list(first.keys())
        keyset = set(keys)
        for s in samples[1:]:
            if s.keys() != keyset:
                extra = sorted(set(s.keys()) - keyset)
                missing = sorted(keyset - set(s.keys()))
                raise SampleError(
                    f"cannot collate sample {s.get('__key__', '?')!r} with {first.get('__key__', '?')!r}: "
                    f"fields missing {missing}, extra {extra}; select fields with `fields=` so samples agree"
                )
        return {k: _collate_values(k, [s[k] for s in samples]) for k in keys}
    return _collate_values("sample", list(samples))
