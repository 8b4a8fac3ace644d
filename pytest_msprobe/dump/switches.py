"""torch's numeric switches as this process has them, and the numerics policy they give (see
:mod:`pytest_msprobe.format.numerics`; the rounding that emulates a reduced format is the replay's,
:func:`pytest_msprobe.replay.emulate.round_mantissa`).

- :func:`switches`: every switch that changes the numbers of a float32 run (what the checklist records);
- :func:`training_device`: the device type a step trains on (the policy's device);
- :func:`current_policy`: the policy of a device now, with the autocast dtype in force where it is called;
- :func:`strict_float32`: TF32 and HF32 off (float32 math in float32 on every device), returning what puts the
  switches back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from pytest_msprobe.dump import determinism
from pytest_msprobe.format.numerics import Policy, device_type, policy_from_switches

__all__ = [
    "autocast_dtype",
    "current_policy",
    "strict_float32",
    "switches",
    "training_device",
]

# torch >= 2.9 also names the format of each backend's float32 math (``ieee``, ``tf32``, ``bf16``, ``none``)
_FP32_PRECISION = (
    ("fp32_precision", ("backends",)),
    ("cuda.matmul.fp32_precision", ("backends", "cuda", "matmul")),
    ("cudnn.conv.fp32_precision", ("backends", "cudnn", "conv")),
    ("cudnn.rnn.fp32_precision", ("backends", "cudnn", "rnn")),
    ("mkldnn.matmul.fp32_precision", ("backends", "mkldnn", "matmul")),
    ("mkldnn.conv.fp32_precision", ("backends", "mkldnn", "conv")),
)


def _attribute(path: tuple[str, ...], name: str = "fp32_precision") -> Any:
    holder: Any = torch
    for part in path:
        holder = getattr(holder, part, None)
        if holder is None:
            return None
    try:
        return getattr(holder, name, None)
    except Exception:  # a backend that cannot say (not built in): nothing to record
        return None


def _legacy(read: Callable[[], Any]) -> Any:
    """A legacy switch's value, None where torch refuses to say: once a ``fp32_precision`` name was set, torch
    (2.9 and later) raises on reading ``allow_tf32`` and ``get_float32_matmul_precision``, and the
    ``fp32_precision`` names recorded beside them hold the state."""
    try:
        return read()
    except RuntimeError:
        return None


def _flag(read: Callable[[], Any]) -> bool | None:
    value = _legacy(read)
    return None if value is None else bool(value)


def switches() -> dict[str, Any]:
    """torch's (and torch_npu's) switches that change a run's numbers, by the names the checklist uses; a legacy
    TF32 switch that torch refuses to read (set through a ``fp32_precision`` name) is None."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    found: dict[str, Any] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn.deterministic": bool(cudnn.deterministic),
        "cudnn.benchmark": bool(cudnn.benchmark),
        "cudnn.allow_tf32": _flag(lambda: cudnn.allow_tf32),
        "cuda.matmul.allow_tf32": _flag(lambda: matmul.allow_tf32),
        "cuda.matmul.allow_fp16_reduced_precision_reduction": bool(
            matmul.allow_fp16_reduced_precision_reduction
        ),
        "cuda.matmul.allow_bf16_reduced_precision_reduction": bool(
            matmul.allow_bf16_reduced_precision_reduction
        ),
        "float32_matmul_precision": _legacy(torch.get_float32_matmul_precision),
        "dropout_removed": determinism.dropout_removed(),
    }
    for key, path in _FP32_PRECISION:
        value = _attribute(path)
        if isinstance(value, str):
            found[key] = value
    for part, holder in _npu_holders():
        found[f"npu.{part}.allow_hf32"] = bool(holder.allow_hf32)
    return found


def _npu_holders() -> list[tuple[str, Any]]:
    """torch_npu's matmul and conv switch holders that have ``allow_hf32`` (none without torch_npu)."""
    npu = getattr(torch, "npu", None) if "torch_npu" in sys.modules else None
    found = []
    for part in ("matmul", "conv") if npu is not None else ():
        holder = getattr(npu, part, None)
        if holder is not None and getattr(holder, "allow_hf32", None) is not None:
            found.append((part, holder))
    return found


def training_device(model: torch.nn.Module | None) -> str:
    """The device type a step trains on: the model's, else the accelerator in use, else the CPU (what the
    checklist records and the self-check's policy is read for)."""
    if model is not None:
        for p in model.parameters():
            return p.device.type
    npu = getattr(torch, "npu", None)
    if npu is not None and getattr(npu, "is_initialized", lambda: False)():
        return "npu"
    return "cuda" if torch.cuda.is_initialized() else "cpu"


def autocast_dtype(device: Any) -> str | None:
    """The dtype autocast computes in on this device type where it is called now, None when autocast is off."""
    kind = device_type(device)
    try:
        if not torch.is_autocast_enabled(kind):
            return None
        dtype = torch.get_autocast_dtype(kind)
    except (RuntimeError, TypeError, AttributeError):  # an older torch, or a device type autocast lacks
        return None
    return str(dtype).removeprefix("torch.")


def current_policy(device: Any, found: dict[str, Any] | None = None) -> Policy:
    """The policy of ``device`` under the switches now (``found``: already read), autocast included."""
    return policy_from_switches(device, switches() if found is None else found, autocast_dtype(device))


def strict_float32() -> Callable[[], None]:
    """Switch TF32 and HF32 off (CUDA's cuDNN convolutions and matmuls, ``float32_matmul_precision`` highest,
    oneDNN's reduced formats on the CPU, the NPU's convolutions and matmuls), so float32 math is computed in
    float32 on every device; returns the function that puts every switch back as it was.

    The legacy switches are set (torch lets them override a ``fp32_precision`` name, and reads them back
    after); each is put back the way it was held: through the legacy switch where torch could read it,
    else through its ``fp32_precision`` name (setting a name makes torch refuse later reads of the legacy
    switch, so a name is set only where the user had set one)."""
    cudnn = torch.backends.cudnn
    conv_flag = _flag(lambda: cudnn.allow_tf32)
    precision = _legacy(torch.get_float32_matmul_precision)
    names = {key: value for key, path in _FP32_PRECISION if isinstance(value := _attribute(path), str)}
    npu_saved = [(holder, bool(holder.allow_hf32)) for _, holder in _npu_holders()]
    cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")  # (matmul.allow_tf32 follows it: False)
    mkldnn_conv = names.get("mkldnn.conv.fp32_precision")
    if mkldnn_conv is not None and mkldnn_conv.lower() in ("bf16", "tf32"):
        _set_name(("backends", "mkldnn", "conv"), "ieee")
    for holder, _ in npu_saved:
        holder.allow_hf32 = False

    def restore() -> None:
        if conv_flag is not None:
            cudnn.allow_tf32 = conv_flag
        elif "cudnn.conv.fp32_precision" in names:
            _set_name(("backends", "cudnn", "conv"), names["cudnn.conv.fp32_precision"])
        if precision is not None:
            # the one legacy switch of matmuls: allow_tf32 follows it, and setting allow_tf32 after it would
            # turn "medium" into a state torch refuses to read
            torch.set_float32_matmul_precision(precision)
        else:
            for key, path in (
                ("cuda.matmul.fp32_precision", ("backends", "cuda", "matmul")),
                ("mkldnn.matmul.fp32_precision", ("backends", "mkldnn", "matmul")),
            ):
                if key in names:
                    _set_name(path, names[key])
        if mkldnn_conv is not None and _attribute(("backends", "mkldnn", "conv")) != mkldnn_conv:
            _set_name(("backends", "mkldnn", "conv"), mkldnn_conv)
        for holder, value in npu_saved:
            holder.allow_hf32 = value

    return restore


def _set_name(path: tuple[str, ...], value: str) -> None:
    holder: Any = torch
    for part in path:
        holder = getattr(holder, part)
    holder.fp32_precision = value
