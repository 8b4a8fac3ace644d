"""Non-tensor values in msprobe's JSON shapes (tensors go through :mod:`.stats`).

``{"type": "int" | "float" | "bool" | "str", "value": v}``, ``None`` -> null, ``torch.dtype`` / ``torch.device``
as their names, ``torch.memory_format`` as ``{"format": ...}``, slices as ``[start, stop, step]``, ``...`` as
``"..."``, numpy scalars with their type name and value, numpy arrays with their statistics, dataclasses as
dicts; anything else is null. Containers and named tuples are walked by the recorder.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from pytest_msprobe.dump.stats import dtype_name

_MEMORY_FORMATS = {
    torch.contiguous_format: "contiguous_format",
    torch.channels_last: "channels_last",
    torch.channels_last_3d: "channels_last_3d",
    torch.preserve_format: "preserve_format",
}


def analyze_other(value: Any) -> Any:
    """Non-tensor, non-container values, in msprobe's shapes; anything unknown is null."""
    if isinstance(value, bool):
        return {"type": "bool", "value": value}
    if isinstance(value, (int, float, str)):  # subclasses (IntEnum, ...) as their base type
        base = int if isinstance(value, int) else float if isinstance(value, float) else str
        return {"type": base.__name__, "value": base(value)}
    if isinstance(value, torch.dtype):
        return {"type": "torch.dtype", "value": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"type": "torch.device", "value": str(value)}
    if isinstance(value, torch.memory_format):
        return {"type": "torch.memory_format", "format": _MEMORY_FORMATS.get(value, str(value))}
    if isinstance(value, slice):
        return {"type": "slice", "value": [_slice_part(v) for v in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"type": "ellipsis", "value": "..."}
    if isinstance(value, np.generic):
        return {"type": type(value).__name__, "value": value.item()}
    if isinstance(value, np.ndarray):
        return _analyze_ndarray(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _analyze_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return None


def _analyze_plain(value: Any) -> Any:
    """Fields of a dataclass: tensors are not expected there; containers and scalars are kept."""
    if isinstance(value, (list, tuple)):
        return [_analyze_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _analyze_plain(v) for k, v in value.items()}
    if value is None or isinstance(value, torch.Tensor):
        return None
    return analyze_other(value)


def _slice_part(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _analyze_ndarray(array: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "numpy.ndarray",
        "dtype": str(array.dtype),
        "shape": list(array.shape),
        "Max": None,
        "Min": None,
        "Mean": None,
        "Norm": None,
    }
    if array.size and array.dtype.kind in "biuf":
        out["Max"] = np.max(array).item()
        out["Min"] = np.min(array).item()
        out["Mean"] = np.mean(array).item()
        out["Norm"] = np.linalg.norm(array.astype(np.float64, copy=False)).item()
    return out
