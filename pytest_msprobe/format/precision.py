"""The numerics policy of a run: in which format a device computes float32 convolutions and matmuls, and the
autocast dtype, derived from the switches a checklist records (no torch here: the compare reads it from JSON).

Devices compute float32 math in a reduced format where a switch allows it, each its own:

- CUDA: TF32 (10 mantissa bits) for cuDNN convolutions when ``torch.backends.cudnn.allow_tf32`` (torch's default:
  on) and for matmuls when ``torch.backends.cuda.matmul.allow_tf32`` or ``torch.set_float32_matmul_precision``
  is ``high`` (default: off, ``highest``); ``medium`` allows bfloat16 for matmuls;
- Ascend NPU: HF32 (taken here as 11 mantissa bits) for convolutions when ``torch_npu.npu.conv.allow_hf32``
  (torch_npu's default: on) and for matmuls when ``torch_npu.npu.matmul.allow_hf32`` (default: off);
- CPU: float32, unless oneDNN is allowed a reduced format (``torch.backends.mkldnn.matmul.fp32_precision`` or
  ``...conv.fp32_precision`` set to ``bf16`` or ``tf32``).

A :class:`Policy` says, per kind of call (:data:`CONV`, :data:`MATMUL`), the format and the switch that chose it;
the checklist records it (``"precision"``) and the self-check replays each call under it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FLOAT32, TF32, HF32, BFLOAT16, FLOAT16 = "float32", "tf32", "hf32", "bfloat16", "float16"
# explicit mantissa bits of each compute format (float32's 23 is full precision: nothing is rounded)
MANTISSA_BITS: dict[str, int] = {FLOAT32: 23, TF32: 10, HF32: 11, BFLOAT16: 7, FLOAT16: 10}
CONV, MATMUL = "conv", "matmul"
KINDS = (CONV, MATMUL)

# the switch that sets each kind's format, by device type, as users name it
CUDNN_TF32 = "torch.backends.cudnn.allow_tf32"
CUDA_MATMUL_TF32 = "torch.backends.cuda.matmul.allow_tf32"
MATMUL_PRECISION = "torch.set_float32_matmul_precision"
CUDNN_CONV_PRECISION = "torch.backends.cudnn.conv.fp32_precision"  # torch >= 2.9's name of the same choice
CUDA_MATMUL_PRECISION = "torch.backends.cuda.matmul.fp32_precision"
NPU_CONV_HF32 = "torch_npu.npu.conv.allow_hf32"
NPU_MATMUL_HF32 = "torch_npu.npu.matmul.allow_hf32"
MKLDNN_CONV = "torch.backends.mkldnn.conv.fp32_precision"
MKLDNN_MATMUL = "torch.backends.mkldnn.matmul.fp32_precision"

_REDUCED_NAMES = {"tf32": TF32, "bf16": BFLOAT16, "bfloat16": BFLOAT16}


@dataclass(frozen=True)
class Policy:
    """How one run computes float32 convolutions and matmuls, and under which autocast dtype (None: off).

    ``settings[kind]`` is the switch (and its value) that chose a reduced format, ``""`` where the format is
    float32: ``("torch.backends.cudnn.allow_tf32", "True")``."""

    device: str  # the device type: "cpu", "cuda", "npu", ...
    conv: str = FLOAT32
    matmul: str = FLOAT32
    autocast: str | None = None
    conv_setting: tuple[str, str] | None = None
    matmul_setting: tuple[str, str] | None = None

    def format_of(self, kind: str) -> str:
        return self.conv if kind == CONV else self.matmul

    def setting_of(self, kind: str) -> tuple[str, str] | None:
        return self.conv_setting if kind == CONV else self.matmul_setting

    @property
    def reduced(self) -> bool:
        """Whether any float32 math of this run is computed in a reduced format (or under autocast)."""
        return self.conv != FLOAT32 or self.matmul != FLOAT32 or self.autocast is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "conv": self.conv,
            "matmul": self.matmul,
            "autocast": self.autocast,
            "conv_setting": list(self.conv_setting) if self.conv_setting else None,
            "matmul_setting": list(self.matmul_setting) if self.matmul_setting else None,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Policy | None:
        """The policy a checklist recorded, None where it holds none or one this version cannot read."""
        try:
            device, conv, matmul = str(doc["device"]), str(doc["conv"]), str(doc["matmul"])
        except (KeyError, TypeError):
            return None
        if conv not in MANTISSA_BITS or matmul not in MANTISSA_BITS:
            return None
        autocast = doc.get("autocast")
        return cls(
            device,
            conv,
            matmul,
            str(autocast) if autocast else None,
            _setting(doc.get("conv_setting")),
            _setting(doc.get("matmul_setting")),
        )


def _setting(value: Any) -> tuple[str, str] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return (str(value[0]), str(value[1]))
    return None


def device_type(device: Any) -> str:
    """``cuda:0 (NVIDIA H200)`` -> ``cuda``; ``None`` -> ``cpu``."""
    text = str(device or "cpu").strip().lower()
    return text.split(":", 1)[0].split(" ", 1)[0] or "cpu"


def policy_from_switches(device: Any, switches: Mapping[str, Any], autocast: str | None = None) -> Policy:
    """The policy a run's recorded switches give on its device (see the module docstring)."""
    kind = device_type(device)
    get = switches.get
    conv, matmul = FLOAT32, FLOAT32
    conv_setting: tuple[str, str] | None = None
    matmul_setting: tuple[str, str] | None = None
    if kind == "cuda":
        # a legacy switch is None where torch refused to read it (set through its fp32_precision name)
        if get("cudnn.allow_tf32") is None and get("cudnn.conv.fp32_precision") is not None:
            if str(get("cudnn.conv.fp32_precision")).lower() == "tf32":
                conv, conv_setting = TF32, (CUDNN_CONV_PRECISION, "tf32")
        elif get("cudnn.allow_tf32"):
            conv, conv_setting = TF32, (CUDNN_TF32, "True")
        legacy = get("float32_matmul_precision") is not None or get("cuda.matmul.allow_tf32") is not None
        precision = str(get("float32_matmul_precision") or "highest")
        if not legacy and str(get("cuda.matmul.fp32_precision") or "").lower() == "tf32":
            matmul, matmul_setting = TF32, (CUDA_MATMUL_PRECISION, "tf32")
        if get("cuda.matmul.allow_tf32"):
            matmul, matmul_setting = TF32, (CUDA_MATMUL_TF32, "True")
        if precision == "medium":
            matmul, matmul_setting = BFLOAT16, (MATMUL_PRECISION, precision)
        elif precision == "high" and matmul == FLOAT32:
            matmul, matmul_setting = TF32, (MATMUL_PRECISION, precision)
    elif kind == "npu":
        # torch_npu's defaults where a switch was not read: convolutions in HF32, matmuls in float32
        if get("npu.conv.allow_hf32", True):
            conv, conv_setting = HF32, (NPU_CONV_HF32, "True")
        if get("npu.matmul.allow_hf32", False):
            matmul, matmul_setting = HF32, (NPU_MATMUL_HF32, "True")
    elif kind == "cpu":
        for part, name in ((CONV, MKLDNN_CONV), (MATMUL, MKLDNN_MATMUL)):
            value = str(get(f"mkldnn.{part}.fp32_precision") or "none").lower()
            reduced = _REDUCED_NAMES.get(value)
            if reduced is None:
                continue
            if part == CONV:
                conv, conv_setting = reduced, (name, value)
            else:
                matmul, matmul_setting = reduced, (name, value)
    return Policy(kind, conv, matmul, autocast or None, conv_setting, matmul_setting)
