"""Non-tensor values in msprobe's JSON shapes (tensors go through :mod:`.stats`).

``{"type": "int" | "float" | "bool" | "str", "value": v}``, ``None`` -> null, ``torch.dtype`` / ``torch.device``
as their names, ``torch.memory_format`` as ``{"format": ...}``, slices as ``[start, stop, step]``, ``...`` as
``"..."``, numpy scalars with their type name and value, numpy arrays with their statistics, dataclasses as
dicts; anything else is null. Containers and named tuples are walked by the recorder.

torch.distributed's arguments, as msprobe writes them: a process group as ``{"type": "torch.ProcessGroup",
"group_ranks": [0, 1], "group_id": "<CRC32 of the text of the rank list, 8 hex digits>"}`` (ranks in the default
group, so the same group has the same id on every rank), a reduce operation as ``{"type":
"torch.distributed.ReduceOp", "value": "RedOpType.SUM"}``. A ``P2POp`` holds a tensor and is described by the
recorder.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np
import torch

from pytest_msprobe.dump.stats import dtype_name

try:
    import torch.distributed as _dist

    _ProcessGroup: Any = _dist.ProcessGroup if _dist.is_available() else None
    _ReduceOp: Any = _dist.ReduceOp if _dist.is_available() else None
except ImportError:  # pragma: no cover - torch built without distributed support
    _dist = None  # type: ignore[assignment]
    _ProcessGroup = _ReduceOp = None

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
    if _ReduceOp is not None:
        if isinstance(value, _ReduceOp):
            return analyze_reduce_op(value)
        if isinstance(value, _ProcessGroup):
            return analyze_process_group(value)
    return None


def analyze_reduce_op(op: Any) -> dict[str, Any]:
    """``{"type": "torch.distributed.ReduceOp", "value": "RedOpType.SUM"}``.

    A ``ReduceOp`` object (``ReduceOp(ReduceOp.MAX)``, a pre-multiplied sum) is named by the operation it holds:
    its own text is an object address, which would differ between any two runs.
    """
    return {"type": "torch.distributed.ReduceOp", "value": str(getattr(op, "op", op))}


def group_ranks(group: Any) -> list[int] | None:
    """The global ranks of a process group (None: the default group; None when they cannot be known)."""
    if _dist is None:
        return None
    try:
        if group is None:
            group = _dist.group.WORLD
        return [int(r) for r in _dist.get_process_group_ranks(group)]
    except (RuntimeError, ValueError, AttributeError):  # not initialized, or not a group of this process
        return None


def group_id(ranks: list[int]) -> str:
    """msprobe's id of a process group: the CRC32 of its rank list written as Python does, ``"[0, 1]"``."""
    return f"{zlib.crc32(str(ranks).encode('utf-8')):08x}"


def analyze_process_group(group: Any) -> dict[str, Any]:
    """``{"type": "torch.ProcessGroup", "group_ranks": [...], "group_id": "..."}`` (the type alone when the ranks
    cannot be known)."""
    item: dict[str, Any] = {"type": "torch.ProcessGroup"}
    ranks = group_ranks(group)
    if ranks is not None:
        item["group_ranks"] = ranks
        item["group_id"] = group_id(ranks)
    return item


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
