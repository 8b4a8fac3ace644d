"""A recorded call's arguments rebuilt from its dump.json entry: tensors read from their files in float64."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pytest_msprobe.format.tensorfile import open_tensor

_DTYPES = {
    "torch.float64": torch.float64, "torch.float32": torch.float32, "torch.float16": torch.float16,
    "torch.bfloat16": torch.bfloat16, "torch.int64": torch.int64, "torch.int32": torch.int32,
    "torch.int16": torch.int16, "torch.int8": torch.int8, "torch.uint8": torch.uint8, "torch.bool": torch.bool,
    "torch.complex64": torch.complex64, "torch.complex128": torch.complex128,
}  # fmt: skip
_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


class Unreplayable(Exception):
    """A value of a call that cannot be rebuilt: the message says which and why."""


def torch_dtype(name: str) -> torch.dtype:
    """``torch_dtype("torch.float32") is torch.float32``; Unreplayable for a dtype this module does not know."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise Unreplayable(f"dtype {name} is not replayed")
    return dtype


def load_tensor(node: dict[str, Any], tensor_dir: Path) -> torch.Tensor:
    """The tensor a dump.json node names, read from its file; floating ones widened to float64 (complex128)."""
    data_name = node.get("data_name")
    if not isinstance(data_name, str) or data_name in ("", "-1"):
        raise Unreplayable("a tensor without its file (a statistics dump holds no tensors)")
    dtype = torch_dtype(str(node.get("dtype")))
    array = open_tensor(tensor_dir / data_name).read()  # compared values: float64 for floating dtypes
    tensor = torch.from_numpy(np.array(array, copy=True))  # (ascontiguousarray makes a 0-d array 1-d)
    if dtype.is_complex:  # read as (..., 2) pairs of float64
        return torch.view_as_complex(tensor.to(torch.float64))
    return tensor.to(torch.float64 if dtype.is_floating_point else dtype)


def as_leaf(node: dict[str, Any], tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a leaf of a replay with gradients: it takes one where its record says it took one (as
    recorded: batch_norm's running statistics take none, and may not be asked for one)."""
    if (tensor.is_floating_point() or tensor.is_complex()) and node.get("requires_grad", True) is not False:
        tensor.requires_grad_(True)
    return tensor


def rebuild(node: Any, tensor: Callable[[dict[str, Any]], torch.Tensor]) -> Any:
    """A Python value from a dump.json node: tensors through ``tensor``, scalars, None, nested lists."""
    if node is None:
        return None
    if isinstance(node, list):
        return [rebuild(item, tensor) for item in node]
    if not isinstance(node, dict):
        raise Unreplayable(f"an argument recorded as {type(node).__name__}")
    kind = node.get("type")
    if kind == "torch.Tensor":
        return tensor(node)
    if kind in _SCALARS and "value" in node:
        return None if node["value"] is None else _SCALARS[kind](node["value"])
    if kind == "slice":
        start, stop, step = (node.get("value") or [None, None, None])[:3]
        return slice(start, stop, step)
    if kind == "torch.dtype":
        return torch_dtype(str(node.get("value")))
    if kind == "torch.memory_format" and isinstance(
        getattr(torch, str(node.get("format")), None), torch.memory_format
    ):
        return getattr(torch, str(node.get("format")))
    if kind == "torch.Size":
        return torch.Size(node.get("value") or ())
    if kind is None and all(isinstance(v, (dict, list)) or v is None for v in node.values()):
        return {k: rebuild(v, tensor) for k, v in node.items()}
    raise Unreplayable(f"an argument of type {kind}")


def flat(value: Any) -> list[Any]:
    """The leaves of nested lists and tuples, in order (a dump's output lists, a call's outputs)."""
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in flat(item)]
    return [value]


def is_tensor_node(node: Any) -> bool:
    """Whether a dump.json node records a tensor."""
    return isinstance(node, dict) and node.get("type") == "torch.Tensor"


def raised(what: str, exc: BaseException) -> str:
    """Why a replay stopped: ``"the replay raised TypeError: <first line of its message>"``."""
    text = str(exc).splitlines()[0][:160] if str(exc) else ""
    return f"{what} raised {type(exc).__name__}: {text}" if text else f"{what} raised {type(exc).__name__}"


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the process ran out of memory (numpy's MemoryError, torch's allocator refusing): a
    state of the machine at that moment, not of the call, so a replay raises it instead of skipping the call."""
    if isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return "DefaultCPUAllocator" in text or "out of memory" in text.lower()


def rebuild_inputs(
    entry: dict[str, Any], tensor: Callable[[dict[str, Any]], torch.Tensor]
) -> tuple[Any, Any]:
    """The positional and keyword arguments of a forward record, tensors through ``tensor``. An ``inplace=``
    switch is turned off: the inputs are the replay's own, so nothing is gained by changing them."""
    args = rebuild(entry.get("input_args", []), tensor)
    kwargs = rebuild(entry.get("input_kwargs", {}), tensor)
    if isinstance(kwargs, dict) and "inplace" in kwargs:
        kwargs["inplace"] = False
    return args, kwargs
