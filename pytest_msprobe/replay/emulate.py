"""A device's declared precision, emulated by the replay: a call is judged against what its device computes when
it computes as its settings declare.

A device computes float32 convolutions and matrix products in a reduced format where a switch allows it
(:mod:`pytest_msprobe.format.numerics`: CUDA's TF32, the NPU's HF32, bfloat16 matmuls), and under autocast
torch casts the inputs of those calls to the autocast dtype. A float64 replay of the float32 inputs holds such
a call to float32's precision, which it does not have by design. So the replay of a call with float32 inputs
(:func:`emulation_for`) runs where its kernels are reached (a :class:`~torch.utils._python_dispatch.
TorchDispatchMode` over the aten operators, below autograd) as the device's kernels run:

- **reduced format** (TF32, HF32, bfloat16): the operands of each convolution and matrix product are rounded to
  the format's mantissa (:func:`round_mantissa`, to nearest, ties to even), then multiplied in float64; what is
  added after the product is not rounded (a convolution's bias, addmm's and baddbmm's added input), as the
  kernels add it in float32. The backward kernels run under the same switch: the incoming gradient and the
  saved operands are rounded where a backward matrix product or convolution reads them (``mm`` in addmm's
  backward, ``convolution_backward``), never where the node only reshapes or sums them (a bias's gradient is the
  sum of the incoming gradient as it came, a view's node passes it on);
- **autocast** (bfloat16, float16): every floating input of those operators, the added ones included, is cast
  to the autocast dtype, as torch casts them (not those of an in-place product, which autocast leaves alone).

Matrix products reached through other calls (einsum, a 3-D matmul, an attention's projections) are rounded
where they reach ``mm``/``bmm``/``addmm``, as on the device; the CPU's fused attention (what a float64 replay of
``scaled_dot_product_attention`` runs) reads its query, key and value rounded. Matrix-vector products (``mv``, ``dot``) are not:
no reduced-format kernel computes them. The standard the output is then judged by stays its dtype's: a call
consistent with its declared precision is within float32's bounds against this replay, and a faulty one is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_msprobe.format.numerics import (
    BFLOAT16,
    CONV,
    FLOAT16,
    FLOAT32,
    MANTISSA_BITS,
    MATMUL,
    Policy,
)

_HALF = {"torch.bfloat16": BFLOAT16, "torch.float16": FLOAT16}
_CASTS = {BFLOAT16: torch.bfloat16, FLOAT16: torch.float16}
F32 = "torch.float32"


def round_mantissa(tensor: torch.Tensor, fmt: str) -> torch.Tensor:
    """``tensor`` rounded to the mantissa of ``fmt`` (to nearest, ties to even), in its own dtype: float32
    through its bits, float64 (a replay's values) by Veltkamp's splitting, which gives the same values for
    values a float32 holds. A tensor of another dtype, or a format of full float32 precision, is returned as it
    is; infinities and NaN stay."""
    bits = MANTISSA_BITS.get(fmt, 23)
    if fmt == FLOAT32 or bits >= 23:
        return tensor
    if tensor.dtype == torch.float64:
        # c - (c - x) with c = x (2^s + 1) keeps 53 - s significant bits of x, rounded to nearest even: three
        # passes over the tensor where the bits take ten; an infinite x gives NaN there, put back below
        scaled = tensor * float(2 ** (52 - bits) + 1)
        out = scaled - (scaled - tensor)
        return torch.where(torch.isnan(out), tensor, out)
    if tensor.dtype != torch.float32:
        return tensor
    drop = 23 - bits
    raw = tensor.detach().contiguous().view(torch.int32)
    # round half to even on the bits kept: add 0x7ff..f plus the lowest kept bit, then clear the dropped bits
    lowest_kept = (raw >> drop) & 1
    rounded = (raw + ((1 << (drop - 1)) - 1) + lowest_kept) & ~((1 << drop) - 1)
    out = rounded.view(torch.float32)
    finite = torch.isfinite(tensor)
    return torch.where(finite, out, tensor)


@dataclass(frozen=True)
class Emulation:
    """How a call's kernels compute: the format of convolutions' and matrix products' operands, and the autocast
    dtype every input of those operators is cast to (``cast``, which decides where autocast applies: every
    operator but the in-place ones)."""

    conv: str = FLOAT32
    matmul: str = FLOAT32
    cast: str | None = None


def _dtypes(node: Any, found: set[str]) -> None:
    if isinstance(node, list):
        for item in node:
            _dtypes(item, found)
    elif isinstance(node, dict):
        if node.get("type") == "torch.Tensor":
            found.add(str(node.get("dtype")))
        elif "type" not in node:  # a dict argument: its values
            for item in node.values():
                _dtypes(item, found)


def input_dtypes(entry: Mapping[str, Any]) -> set[str]:
    """The dtypes (``"torch.float32"``) of the tensors among a forward record's inputs."""
    found: set[str] = set()
    _dtypes(entry.get("input_args"), found)
    _dtypes(entry.get("input_kwargs"), found)
    return found


def autocast_of(entry: Mapping[str, Any]) -> str | None:
    """The autocast dtype a recorded call ran under, as its dtypes tell it: float32 inputs, a half-type output
    (the cast torch makes under autocast). For a dump read back, where the autocast state is not recorded."""
    if F32 not in input_dtypes(entry):
        return None
    out: set[str] = set()
    _dtypes(entry.get("output"), out)
    halves = [_HALF[d] for d in sorted(out) if d in _HALF]
    return halves[0] if halves else None


def emulation_for(policy: Policy | None, autocast: str | None, entry: Mapping[str, Any]) -> Emulation | None:
    """How the replay of a recorded call (``entry``: its forward record) emulates its device: under autocast
    (``autocast``: its dtype at the call) the autocast cast, else the policy's reduced formats; None when its
    kernels compute in float32 as the replay assumes (no float32 input, or neither applies)."""
    if F32 not in input_dtypes(entry):
        return None  # the formats and autocast's cast apply to float32 math only
    conv, matmul = (policy.conv, policy.matmul) if policy is not None else (FLOAT32, FLOAT32)
    if (
        autocast in _CASTS
    ):  # (an in-place product, which autocast leaves alone, computes in the policy's format)
        return Emulation(conv, matmul, autocast)
    if conv != FLOAT32 or matmul != FLOAT32:
        return Emulation(conv, matmul)
    return None


def _kernels() -> dict[Any, tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """aten operator -> (kind, positions of its operands, positions of what it adds after the product); the
    in-place ones (which autocast does not cast) are also put in :data:`_INPLACE`."""
    aten = torch.ops.aten
    table: dict[Any, tuple[str, tuple[int, ...], tuple[int, ...]]] = {}
    for op, overload, kind, operands, added in (
        ("convolution", "default", CONV, (0, 1), (2,)),
        ("convolution_backward", "default", CONV, (0, 1, 2), ()),  # grad_output, input, weight
        ("mm", "default", MATMUL, (0, 1), ()),
        ("bmm", "default", MATMUL, (0, 1), ()),
        ("addmm", "default", MATMUL, (1, 2), (0,)),
        ("addmm_", "default", MATMUL, (1, 2), (0,)),
        ("baddbmm", "default", MATMUL, (1, 2), (0,)),
        ("baddbmm_", "default", MATMUL, (1, 2), (0,)),
        ("addbmm", "default", MATMUL, (1, 2), (0,)),
        ("addbmm_", "default", MATMUL, (1, 2), (0,)),
        # the CPU's fused attention (query, key, value), and its backward (grad_out, query, key, value)
        ("_scaled_dot_product_flash_attention_for_cpu", "default", MATMUL, (0, 1, 2), ()),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", "default", MATMUL, (0, 1, 2, 3), ()),
    ):
        packet = getattr(aten, op, None)
        found = getattr(packet, overload, None) if packet is not None else None
        if found is not None:  # (an older torch without the fused attention)
            table[found] = (kind, operands, added)
            if op.endswith("_"):
                _INPLACE.add(found)
    return table


_KERNELS: dict[Any, tuple[str, tuple[int, ...], tuple[int, ...]]] = {}
_INPLACE: set[Any] = set()
_CONV_BACKWARD_MASK = 10  # convolution_backward's output_mask: (grad_input, grad_weight, grad_bias)


class Emulator(TorchDispatchMode):
    """One call's emulation (:class:`Emulation`): its replay, and the backward of the replay's node, run inside
    it (``with emulator:``, as many times as needed); :attr:`label` names the formats it applied."""

    def __init__(self, emulation: Emulation) -> None:
        super().__init__()
        self.emulation = emulation
        self.applied: set[str] = set()
        if not _KERNELS:
            _KERNELS.update(_kernels())

    @property
    def label(self) -> str:
        """The formats applied (``"tf32"``; ``"bfloat16"`` under autocast), ``""`` where no kernel was reached."""
        return "+".join(sorted(self.applied))

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        spec = _KERNELS.get(func)
        if spec is None:
            return func(*args, **kwargs)
        kind, operands, added = spec
        emulation = self.emulation
        cast = emulation.cast if func not in _INPLACE else None
        fmt = cast or (emulation.conv if kind == CONV else emulation.matmul)
        if fmt == FLOAT32:
            return func(*args, **kwargs)
        self.applied.add(fmt)
        rounded = list(args)
        for i in (*operands, *added) if cast else operands:
            if i < len(rounded) and isinstance(rounded[i], torch.Tensor):
                rounded[i] = _rounded(rounded[i], fmt, cast is not None)
        if cast or func is not _conv_backward() or not args[_CONV_BACKWARD_MASK][2]:
            return func(*rounded, **kwargs)
        # a convolution's bias gradient is the sum of the incoming gradient as it came: no product reads it
        mask = list(args[_CONV_BACKWARD_MASK])
        rounded[_CONV_BACKWARD_MASK] = [mask[0], mask[1], False]
        grad_input, grad_weight, _ = func(*rounded, **kwargs)
        plain = list(args)
        plain[_CONV_BACKWARD_MASK] = [False, False, True]
        grad_bias = func(*plain, **kwargs)[2]
        return grad_input, grad_weight, grad_bias


def _conv_backward() -> Any:
    return torch.ops.aten.convolution_backward.default


def _rounded(t: torch.Tensor, fmt: str, cast: bool) -> torch.Tensor:
    """A replay's operand (float64) as the device's kernel reads it: cast to the autocast dtype, or rounded to
    the format's mantissa."""
    if not t.is_floating_point():
        return t
    if cast:
        return t.to(_CASTS[fmt]).to(t.dtype)
    return round_mantissa(t, fmt)


def emulator(emulation: Emulation | None) -> Emulator | None:
    """A fresh :class:`Emulator` of ``emulation``; None for none (the replay runs as it is)."""
    return Emulator(emulation) if emulation is not None else None
