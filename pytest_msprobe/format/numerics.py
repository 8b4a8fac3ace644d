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
the checklist records it (``"precision"``) and the self-check replays each call under it. :data:`CALLS` is the
one table of the calls each kind of setting governs (:func:`kind_of`: a record's kind of call).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pytest_msprobe.format.names import is_parameters_grad, params_grad_module, parse_name

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
            **asdict(self),
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


def checklist_policy(doc: Mapping[str, Any]) -> Policy:
    """The policy a checklist recorded (``precision``), or, in a checklist without one, the policy its device and
    switches give (with no autocast known)."""
    recorded = doc.get("precision")
    policy = Policy.from_dict(recorded) if isinstance(recorded, Mapping) else None
    if policy is not None:
        return policy
    switches = doc.get("switches")
    return policy_from_switches(doc.get("device"), switches if isinstance(switches, Mapping) else {})


# ------------------------------------------------------------------------------ the calls a setting changes
AUTOCAST, NONDETERMINISTIC = "autocast", "nondeterministic"
# the calls each kind of setting governs, by the operation of their record (an API's name, a module's class)
_CONVOLUTIONS = frozenset(
    {
        *("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
        *("convolution", "_convolution", "conv_tbc", "cudnn_convolution", "npu_convolution"),
        *("convolution_backward", "cudnn_convolution_transpose", "mkldnn_convolution", "npu_conv2d"),
        *("npu_conv3d", "npu_conv_transpose2d", "npu_convolution_transpose"),
        # cuDNN's recurrent layers are under its TF32 and algorithm switches as its convolutions are
        *("lstm", "gru", "rnn_tanh", "rnn_relu"),
        *("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"),
        *("LSTM", "GRU", "RNN"),
    }
)
_MATMULS = frozenset(
    {
        *("linear", "matmul", "mm", "bmm", "addmm", "addmm_", "addbmm", "addbmm_", "baddbmm", "baddbmm_"),
        *("mv", "addmv", "addmv_", "einsum", "tensordot", "bilinear", "chain_matmul", "multi_dot", "inner"),
        *("__matmul__", "__rmatmul__", "scaled_dot_product_attention", "multi_head_attention_forward"),
        *("npu_linear", "npu_bmmV2", "npu_fusion_attention"),
        *("Linear", "LazyLinear", "Bilinear", "MultiheadAttention"),
    }
)
CALLS: dict[str, frozenset[str]] = {
    CONV: _CONVOLUTIONS,
    MATMUL: _MATMULS,
    # autocast's lower-precision lists (CUDA's float16 one, the CPU's bfloat16 one): the calls it casts down
    AUTOCAST: _CONVOLUTIONS
    | _MATMULS
    | frozenset({"prelu", "addr", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"})
    | frozenset({"PReLU", "LSTMCell", "GRUCell", "RNNCell"}),
    # what use_deterministic_algorithms changes: cuDNN's convolutions and the operations torch documents as
    # nondeterministic on an accelerator (atomic adds in their kernels or their backward)
    NONDETERMINISTIC: _CONVOLUTIONS
    | frozenset(
        {
            *("scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "index_add", "index_add_"),
            *("index_put", "index_put_", "index_copy", "index_copy_", "index_select", "gather", "put_"),
            *("embedding", "embedding_bag", "nll_loss", "cross_entropy", "ctc_loss", "grid_sample"),
            *("avg_pool3d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "max_pool3d"),
            *("adaptive_max_pool2d", "fractional_max_pool2d", "fractional_max_pool3d"),
            *("max_unpool1d", "max_unpool2d", "max_unpool3d", "interpolate", "upsample", "pad"),
            *("histc", "bincount", "kthvalue", "median", "cumsum", "repeat_interleave"),
            *("Embedding", "EmbeddingBag", "NLLLoss", "CrossEntropyLoss", "CTCLoss", "AdaptiveAvgPool2d"),
        }
    ),
}


def operation(name: str) -> str:
    """The operation a record is a call of: ``Functional.conv2d.0.backward`` -> ``conv2d``,
    ``Module.fc.Linear.forward.0`` -> ``Linear``, ``Aten.convolution.default.0.forward`` -> ``convolution``."""
    parts = parse_name(name)
    base = params_grad_module(parts.base) if is_parameters_grad(name) else parts.base
    head, _, last = base.rpartition(".")
    if last == "default" and head:  # an aten overload
        last = head.rpartition(".")[2]
    return last


def kind_of(name: str) -> str | None:
    """The kind of call (:data:`CONV` or :data:`MATMUL`) a record is, by :data:`CALLS` (its forward and backward
    records alike, a module's records by its class); None for every other record.

        >>> kind_of("Functional.conv2d.0.backward"), kind_of("Tensor.__matmul__.3.forward")
        ('conv', 'matmul')
        >>> kind_of("Functional.relu.0.forward") is None
        True
    """
    op = operation(name)
    if op in CALLS[CONV]:
        return CONV
    if op in CALLS[MATMUL]:
        return MATMUL
    return None


# ---------------------------------------------------------------------------------------- the settings
FP16_REDUCTION = "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction"
BF16_REDUCTION = "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"
DETERMINISTIC = "torch.use_deterministic_algorithms"
CUDNN_DETERMINISTIC = "torch.backends.cudnn.deterministic"
CUDNN_BENCHMARK = "torch.backends.cudnn.benchmark"
AUTOCAST_SWITCH = "torch.autocast"


@dataclass(frozen=True)
class Aspect:
    """One thing a numerics setting decides, the calls it changes, and the checklist switches that hold it."""

    key: str
    calls: str  # the kind of call it governs: a key of CALLS
    dtypes: tuple[str, ...]  # the dtypes of the calls it changes (empty: any floating dtype)
    recorded: tuple[str, ...]  # the checklist's switches (keys of its "switches") that hold it
    names: tuple[str, ...]  # the switches that decide it, as users name them (one switch: the first)
    what: str  # what it does to the numbers, for the advice
    # how a device's kernels compute (their algorithm, cuBLAS's sums of half products): another device type's
    # kernels differ anyway, so it is held only between two runs whose devices both have the switch
    algorithm: bool = False
    devices: tuple[str, ...] = ()  # the device types its switch acts on (the formats: by the policy)
    states: tuple[str, str] = ("on", "off")  # the states of its flag, set and not


def _half_reduction(short: str, dtype: str, switch: str) -> Aspect:
    """cuBLAS's sums of the products of ``dtype`` matmuls in ``dtype`` (``short``: fp16, bf16), or in float32."""
    return Aspect(
        f"{short} reduction",
        MATMUL,
        (dtype,),
        (f"cuda.matmul.allow_{short}_reduced_precision_reduction",),
        (switch,),
        f"it lets cuBLAS sum the products of {dtype} matmuls in {dtype} rather than float32",
        algorithm=True,
        devices=("cuda",),
        states=("reduced", "full"),
    )


ASPECTS: tuple[Aspect, ...] = (
    Aspect(
        "conv",
        CONV,
        (FLOAT32,),
        (
            "cudnn.allow_tf32",
            "cudnn.conv.fp32_precision",
            "npu.conv.allow_hf32",
            "mkldnn.conv.fp32_precision",
        ),
        (CUDNN_TF32, CUDNN_CONV_PRECISION, NPU_CONV_HF32, MKLDNN_CONV),
        "it lets the device compute float32 convolutions in a reduced format (TF32: inputs rounded to a 10-bit "
        "mantissa, about 1e-3 relative error, ten times float32's tolerance; HF32 the NPU's like it)",
    ),
    Aspect(
        "matmul",
        MATMUL,
        (FLOAT32,),
        (
            "cuda.matmul.allow_tf32",
            "float32_matmul_precision",
            "cuda.matmul.fp32_precision",
            "fp32_precision",
            "npu.matmul.allow_hf32",
            "mkldnn.matmul.fp32_precision",
        ),
        (CUDA_MATMUL_TF32, MATMUL_PRECISION, CUDA_MATMUL_PRECISION, NPU_MATMUL_HF32, MKLDNN_MATMUL),
        "it lets the device compute float32 matmuls (linear, matmul, bmm, ...) in a reduced format (TF32: inputs "
        "rounded to a 10-bit mantissa, about 1e-3 relative error, ten times float32's tolerance; 'medium' "
        "bfloat16, about 1e-2; HF32 the NPU's)",
    ),
    _half_reduction("fp16", FLOAT16, FP16_REDUCTION),
    _half_reduction("bf16", BFLOAT16, BF16_REDUCTION),
    Aspect(
        "autocast",
        AUTOCAST,
        (FLOAT32,),
        (),
        (AUTOCAST_SWITCH,),
        "autocast computes float32 convolutions and matmuls in a half type (float16 or bfloat16: about 1e-3 or "
        "1e-2 relative error)",
    ),
    Aspect(
        "deterministic",
        NONDETERMINISTIC,
        (),
        ("deterministic_algorithms",),
        (DETERMINISTIC,),
        "it chooses the kernels of convolutions and of operations with atomic adds (scatter_add, index_add, "
        "nll_loss, embedding's backward, ...): without it their sums run in another order on every run",
        algorithm=True,
        devices=("cuda", "npu"),
    ),
    Aspect(
        "cudnn deterministic",
        CONV,
        (),
        ("cudnn.deterministic",),
        (CUDNN_DETERMINISTIC,),
        "it chooses cuDNN's convolution algorithms: each sums in its own order",
        algorithm=True,
        devices=("cuda",),
    ),
    Aspect(
        "cudnn benchmark",
        CONV,
        (),
        ("cudnn.benchmark",),
        (CUDNN_BENCHMARK,),
        "it lets cuDNN time its convolution algorithms and take the fastest: each sums in its own order, and "
        "the choice can change from run to run",
        algorithm=True,
        devices=("cuda",),
    ),
)
ASPECT_OF_SWITCH = {name: aspect for aspect in ASPECTS for name in aspect.names}
# each switch as users name it: the checklist's key that records it, and the device type it acts on (None: any)
SWITCH_KEYS: dict[str, tuple[str, str | None]] = {
    CUDNN_TF32: ("cudnn.allow_tf32", "cuda"),
    CUDNN_CONV_PRECISION: ("cudnn.conv.fp32_precision", "cuda"),
    CUDA_MATMUL_TF32: ("cuda.matmul.allow_tf32", "cuda"),
    MATMUL_PRECISION: ("float32_matmul_precision", "cuda"),
    CUDA_MATMUL_PRECISION: ("cuda.matmul.fp32_precision", "cuda"),
    NPU_CONV_HF32: ("npu.conv.allow_hf32", "npu"),
    NPU_MATMUL_HF32: ("npu.matmul.allow_hf32", "npu"),
    MKLDNN_CONV: ("mkldnn.conv.fp32_precision", "cpu"),
    MKLDNN_MATMUL: ("mkldnn.matmul.fp32_precision", "cpu"),
    FP16_REDUCTION: ("cuda.matmul.allow_fp16_reduced_precision_reduction", "cuda"),
    BF16_REDUCTION: ("cuda.matmul.allow_bf16_reduced_precision_reduction", "cuda"),
    DETERMINISTIC: ("deterministic_algorithms", None),
    CUDNN_DETERMINISTIC: ("cudnn.deterministic", "cuda"),
    CUDNN_BENCHMARK: ("cudnn.benchmark", "cuda"),
}


def switch_value(name: str, device: str, switches: Mapping[str, Any]) -> str | None:
    """A switch's recorded value on a run, as text, where the switch acts on the run's device type (a CPU's
    ``cudnn.allow_tf32`` is no value of its own); None otherwise."""
    key, on = SWITCH_KEYS.get(name, (None, None))
    value = switches.get(key) if key is not None and on in (None, device) else None
    return None if value is None else str(value)


@dataclass(frozen=True)
class SettingState:
    """One aspect of the numerics settings as it stands on one run: what is compared (``state``), and the switch
    (as users name it) that holds it on the run's device with its value, None where the device has none."""

    aspect: Aspect
    state: str  # a format ("tf32", "float32"), "reduced" / "full", "on" / "off", an autocast dtype
    switch: str | None
    value: str | None
    reduced: bool = False  # a reduced computation of the device's own (TF32, HF32, a reduced reduction)


def setting_states(policy: Policy, switches: Mapping[str, Any]) -> dict[str, SettingState]:
    """Each aspect's state on a run of ``policy`` (its device and formats) with these recorded switches."""
    device = policy.device
    get = switches.get
    states: dict[str, SettingState] = {}
    for aspect in ASPECTS:
        switch: str | None = None
        value: str | None = None
        if aspect.key in (CONV, MATMUL):
            state = policy.format_of(aspect.key)
            chosen = policy.setting_of(aspect.key)
            if chosen is not None:
                switch, value = chosen
            else:
                switch, value = _float32_switch(aspect.key, device, switches)
            states[aspect.key] = SettingState(aspect, state, switch, value, state != FLOAT32)
            continue
        if aspect.key == "autocast":
            state = policy.autocast or "off"
            states[aspect.key] = SettingState(aspect, state, aspect.names[0], state)
            continue
        flag = get(aspect.recorded[0])
        if device not in aspect.devices or flag is None:
            states[aspect.key] = SettingState(aspect, "none", None, None)
            continue
        on, off = aspect.states
        state = on if flag else off
        states[aspect.key] = SettingState(aspect, state, aspect.names[0], str(bool(flag)), state == "reduced")
    return states


def _float32_switch(kind: str, device: str, switches: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The switch that keeps a kind of call in float32 on a device, with its value; (None, None) where the
    device has none (the CPU's convolutions and matmuls are float32 unless oneDNN is told otherwise)."""
    get = switches.get
    if device == "cuda":
        legacy, name, legacy_key, name_key = (
            (CUDNN_TF32, CUDNN_CONV_PRECISION, "cudnn.allow_tf32", "cudnn.conv.fp32_precision")
            if kind == CONV
            else (
                CUDA_MATMUL_TF32,
                CUDA_MATMUL_PRECISION,
                "cuda.matmul.allow_tf32",
                "cuda.matmul.fp32_precision",
            )
        )
        if get(legacy_key) is None and get(name_key) is not None:
            return name, str(get(name_key))
        return legacy, "False"
    if device == "npu":
        return (NPU_CONV_HF32 if kind == CONV else NPU_MATMUL_HF32), "False"
    return None, None
