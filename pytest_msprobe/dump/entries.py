"""msprobe's JSON entries of call arguments and outputs: how each value is written (tensors through
:mod:`.stats`).

``{"type": "int" | "float" | "bool" | "str", "value": v}``, ``None`` -> null, ``torch.Size`` as its list,
``torch.dtype`` / ``torch.device`` as their names, ``torch.memory_format`` as ``{"format": ...}``, slices as
``[start, stop, step]``, ``...`` as ``"..."``, numpy scalars with their type name and value, numpy arrays with
their statistics, dataclasses as dicts; anything else is null. Lists and tuples become lists, named tuples and
dicts dicts, item by item, each tensor named after its place (``<record>.input.0.1``) when tensors are saved.

torch.distributed's arguments, as msprobe writes them: a process group as ``{"type": "torch.ProcessGroup",
"group_ranks": [0, 1], "group_id": "<CRC32 of the text of the rank list, 8 hex digits>"}`` (ranks in the default
group, so the same group has the same id on every rank), a reduce operation as ``{"type":
"torch.distributed.ReduceOp", "value": "RedOpType.SUM"}``, a ``P2POp`` as its tensor and its other fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pytest_msprobe.dump.config import DumpConfig
from pytest_msprobe.dump.stats import StatEngine, dtype_name
from pytest_msprobe.format.crc import crc32_hex
from pytest_msprobe.format.layout import TENSOR_SUFFIX

try:
    import torch.distributed as _dist

    _AVAILABLE = _dist.is_available()
except ImportError:  # pragma: no cover - torch built without distributed support
    _dist = None  # type: ignore[assignment]
    _AVAILABLE = False
_ProcessGroup: Any = _dist.ProcessGroup if _AVAILABLE else None
_ReduceOp: Any = _dist.ReduceOp if _AVAILABLE else None
_P2POp: Any = _dist.P2POp if _AVAILABLE else None
_Tensor = torch.Tensor
_set_grad_enabled = torch._C._set_grad_enabled

_MEMORY_FORMATS = {
    torch.contiguous_format: "contiguous_format",
    torch.channels_last: "channels_last",
    torch.channels_last_3d: "channels_last_3d",
    torch.preserve_format: "preserve_format",
}


class Values:
    """msprobe's JSON form of the values a record holds, tensors' statistics through the step's StatEngine.

    A part of the recorder; ``names``: build each tensor's ``data_name`` (only when tensors are saved).
    """

    def __init__(self, config: DumpConfig, engine: StatEngine) -> None:
        self.engine = engine
        self.names = config.save_tensors

    def analyze(self, value: Any, name: str | None, remember: bool) -> Any:
        """msprobe's JSON form of one argument / output value (tensors through the StatEngine)."""
        if isinstance(value, _Tensor):
            return self.engine.item(value, name + TENSOR_SUFFIX if name is not None else None, remember)
        if value is None:
            return None
        tp = type(value)
        if tp is bool:
            return {"type": "bool", "value": value}
        if tp is int or tp is float or tp is str:
            return {"type": tp.__name__, "value": value}
        if tp is torch.Size:
            return {"type": "torch.Size", "value": [int(v) for v in value]}
        if isinstance(value, (tuple, list)):
            fields = getattr(value, "_fields", None)
            if fields is not None and isinstance(value, tuple):
                return {
                    f: self.analyze(getattr(value, f), None if name is None else f"{name}.{f}", remember)
                    for f in fields
                }
            if name is None:
                return [self.analyze(v, None, remember) for v in value]
            return [self.analyze(v, f"{name}.{i}", remember) for i, v in enumerate(value)]
        if isinstance(value, dict):
            return {
                k: self.analyze(v, None if name is None else f"{name}.{k}", remember)
                for k, v in value.items()
            }
        if _P2POp is not None and isinstance(value, _P2POp):
            return {
                "class_type": "torch.distributed.P2POp",
                "tensor": self.analyze(value.tensor, name, remember),
                **p2p_fields(value),
            }
        return analyze_other(value)

    def analyze_inputs(
        self, fwd: str, args: tuple[Any, ...], kwargs: dict[str, Any], grad: bool
    ) -> tuple[list[Any], dict[str, Any]]:
        """``input_args`` and ``input_kwargs`` of record ``fwd``; ``grad``: autograd is on, and is switched off
        meanwhile (the statistics must not join the graph)."""
        try:
            if grad:
                _set_grad_enabled(False)
            if not self.names:
                return (
                    [self.analyze(a, None, False) for a in args],
                    {k: self.analyze(v, None, False) for k, v in kwargs.items()},
                )
            prefix = f"{fwd}.input"
            return (
                [self.analyze(a, f"{prefix}.{i}", False) for i, a in enumerate(args)],
                {k: self.analyze(v, f"{prefix}.{k}", False) for k, v in kwargs.items()},
            )
        finally:
            if grad:
                _set_grad_enabled(True)

    def analyze_output(self, fwd: str, output: Any, grad: bool) -> list[Any]:
        """``output`` of record ``fwd`` (``grad`` as for :meth:`analyze_inputs`)."""
        try:
            if grad:
                _set_grad_enabled(False)
            prefix = f"{fwd}.output" if self.names else None
            # as msprobe: a tuple output is listed item by item, anything else is one item
            if isinstance(output, tuple) and getattr(output, "_fields", None) is None:
                if prefix is None:
                    return [self.analyze(v, None, True) for v in output]
                return [self.analyze(v, f"{prefix}.{i}", True) for i, v in enumerate(output)]
            return [self.analyze(output, None if prefix is None else f"{prefix}.0", True)]
        finally:
            if grad:
                _set_grad_enabled(True)


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``: itself, or within its lists, tuples, dicts and ``P2POp`` objects."""
    if isinstance(value, _Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)
    elif _P2POp is not None and isinstance(value, _P2POp):
        yield from iter_tensors(value.tensor)


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
    return crc32_hex(str(ranks).encode("utf-8"))


def analyze_process_group(group: Any) -> dict[str, Any]:
    """``{"type": "torch.ProcessGroup", "group_ranks": [...], "group_id": "..."}`` (the type alone when the ranks
    cannot be known)."""
    item: dict[str, Any] = {"type": "torch.ProcessGroup"}
    ranks = group_ranks(group)
    if ranks is not None:
        item["group_ranks"] = ranks
        item["group_id"] = group_id(ranks)
    return item


def p2p_fields(op: Any) -> dict[str, Any]:
    """The fields of a ``P2POp`` other than its tensor, as msprobe writes them."""
    fields: dict[str, Any] = {
        "op": getattr(op.op, "__name__", str(op.op)),
        "peer": op.peer,
        "tag": op.tag,
    }
    ranks = group_ranks(op.group)
    if ranks is not None:
        fields["group_id"] = group_id(ranks)
    return fields


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
