"""Device selection shared by the pytest plugin, the examples and the CLI: ``auto``, ``cpu``, ``cuda``, ``npu``.

``auto`` picks an Ascend NPU when torch_npu is importable and reports a usable device, then CUDA, then the CPU.
Choosing ``npu`` imports ``torch_npu`` and ``torch_npu.contrib.transfer_to_npu``, which maps ``cuda`` calls in a
training script to the NPU: the same script then runs unchanged on the GPU runner and on the NPU runner.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
from typing import TYPE_CHECKING

from pytest_msprobe.errors import ConfigError
from pytest_msprobe.settings import DEVICE_CHOICES

if TYPE_CHECKING:  # pragma: no cover
    import torch


def npu_usable() -> bool:
    """True when torch_npu imports and reports at least one NPU."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
        import torch

        npu = getattr(torch, "npu", None)
        return bool(npu is not None and npu.is_available() and npu.device_count() > 0)
    except Exception:  # a broken CANN install must not break device selection
        return False


def _enable_npu() -> None:
    try:
        importlib.import_module("torch_npu")
    except ImportError as exc:
        raise ConfigError(
            f"device 'npu' needs torch_npu, which cannot be imported ({exc}); install the torch_npu build that "
            "matches your torch and CANN (pip install 'pytest-msprobe[npu]')"
        ) from exc
    # maps torch.cuda.* and device="cuda" to the NPU, so one script serves both runners
    importlib.import_module("torch_npu.contrib.transfer_to_npu")
    import torch

    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        raise ConfigError("device 'npu' was requested but torch_npu reports no available NPU")


def select_device(requested: str = "auto") -> torch.device:
    """Resolve a device name (``auto``/``cpu``/``cuda``/``npu``, optionally ``cuda:1``) to a ``torch.device``."""
    import torch

    name = (requested or "auto").strip().lower()
    kind, _, index = name.partition(":")
    if kind not in DEVICE_CHOICES or (index and not index.isdigit()) or (kind == "auto" and index):
        raise ConfigError(
            f"unknown device {requested!r}: expected one of {', '.join(DEVICE_CHOICES)} (optionally with ':N')"
        )
    if kind == "auto":
        if npu_usable():
            _enable_npu()
            return torch.device("npu", 0)
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("cpu")
    if kind == "npu":
        _enable_npu()
    elif kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was requested but torch.cuda.is_available() is False")
    return torch.device(kind, int(index)) if index else torch.device(kind if kind == "cpu" else f"{kind}:0")


def describe_device(device: torch.device) -> str:
    """A one-line human description of a device, recorded in baseline manifests and reports."""
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "npu":
        npu = getattr(torch, "npu", None)
        name = npu.get_device_name(device) if npu is not None else "Ascend NPU"
        return f"{device} ({name})"
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()  # the kernels' vector ISA
    isa = f", {capability}" if capability else ""
    return f"cpu ({platform.machine() or 'unknown'}{isa}, {torch.get_num_threads()} threads)"
