"""Constants of the ``pyg`` field format (see :mod:`shardflow.graph.codec`): the
metadata key, the schema version, and the dtype tables shared by encoder and decoder."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["INLINE_DTYPES", "NP_DTYPES", "SCALARS", "SCHEMA_KEY", "SCHEMA_VERSION", "ST_DTYPES"]

SCHEMA_KEY = "shardflow.graph"
SCHEMA_VERSION = 1


# safetensors dtype names (the format's own spelling) <-> torch dtypes.
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


# Little-endian numpy dtypes for the torch dtypes numpy has (bfloat16 and float8 lack one).
NP_DTYPES: dict[torch.dtype, np.dtype] = {
    dt: np.dtype(torch.empty(0, dtype=dt).numpy().dtype).newbyteorder("<")
    for dt in ST_DTYPES.values()
    if dt not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
}


# torch dtype name <-> dtype, for increments written inline in the JSON document.
INLINE_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in ST_DTYPES.values()
    if not dt.is_complex
}
SCALARS = (str, int, float, bool, type(None))
