"""The replay's emulation of a declared precision: which operands of which kernels are rounded (or cast), forward
and backward, and when a call is emulated at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.numerics import BFLOAT16, FLOAT32, HF32, TF32, Policy
from pytest_msprobe.format.own_errors import CallOwn, read_own_errors, write_own_errors
from pytest_msprobe.replay.emulate import (
    Emulation,
    Emulator,
    autocast_of,
    emulation_for,
    round_mantissa,
)

F64 = torch.float64


def _r(t: torch.Tensor, fmt: str = TF32) -> torch.Tensor:
    """A float64 value of float32 origin as a kernel of ``fmt`` reads it."""
    return round_mantissa(t.float(), fmt).double()


def _tensors(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).float().double() for s in shapes]  # float32 values, held in float64


def test_rounding_to_bfloat16_s_mantissa_is_torch_s_conversion() -> None:
    x = torch.randn(10000) * torch.logspace(-20, 20, 10000)
    x[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4e38])  # ties to even, and the top
    assert torch.equal(round_mantissa(x, BFLOAT16), x.to(torch.bfloat16).float())


def test_tf32_keeps_ten_bits_and_hf32_eleven() -> None:
    x = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-12, 1 + 3 * 2**-12])
    assert round_mantissa(x, TF32).tolist() == [1.0, 1 + 2**-9, 1.0, 1 + 2**-10]
    assert round_mantissa(x, HF32).tolist() == [1 + 2**-11, 1 + 3 * 2**-11, 1.0, 1 + 2**-10]
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    assert round_mantissa(special, TF32).isnan().tolist() == [False, False, True]


@pytest.mark.parametrize("fmt", [TF32, HF32, BFLOAT16])
def test_a_float64_tensor_of_float32_values_rounds_as_the_float32_one(fmt: str) -> None:
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(100000, generator=g) * torch.exp(8 * torch.randn(100000, generator=g))).float()
    drop = 23 - {TF32: 10, HF32: 11, BFLOAT16: 7}[fmt]
    raw = x.view(torch.int32)
    ties = ((raw & ~((1 << drop) - 1)) | (1 << (drop - 1))).view(torch.float32)  # exactly halfway
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    for values in (x, ties, special):
        got = round_mantissa(values.double(), fmt)
        assert got.dtype == F64
        assert torch.equal(got.nan_to_num(), round_mantissa(values, fmt).double().nan_to_num())
        assert torch.equal(got.isnan(), values.isnan())


def test_a_linear_s_product_is_rounded_and_its_bias_added_as_it_is() -> None:
    x, w, b = _tensors(0, (4, 8), (3, 8), (3,))
    with Emulator(Emulation(TF32, TF32)) as emulating:
        got = F.linear(x, w, b)
    assert emulating.label == TF32
    assert torch.equal(got, F.linear(_r(x), _r(w), b))
    assert not torch.equal(got, F.linear(_r(x), _r(w), _r(b)))  # (the bias has bits TF32 drops)
    assert not torch.equal(got, F.linear(x, w, b))


def test_each_kind_follows_its_own_format() -> None:
    x, w, a = _tensors(1, (2, 3, 6, 6), (4, 3, 3, 3), (5, 7))
    with Emulator(Emulation(conv=TF32, matmul=FLOAT32)) as emulating:
        conv, mm = F.conv2d(x, w), torch.mm(a, a.t())
    assert torch.equal(conv, F.conv2d(_r(x), _r(w))) and torch.equal(mm, torch.mm(a, a.t()))
    assert emulating.label == TF32
    with Emulator(Emulation(conv=FLOAT32, matmul=BFLOAT16)) as emulating:
        conv, mm = F.conv2d(x, w), torch.mm(a, a.t())
    assert torch.equal(conv, F.conv2d(x, w)) and torch.equal(
        mm, torch.mm(_r(a, BFLOAT16), _r(a, BFLOAT16).t())
    )
    assert emulating.label == BFLOAT16


def test_matrix_products_inside_other_calls_are_rounded_where_they_reach_the_kernel() -> None:
    q, k = _tensors(2, (2, 3, 5, 4), (2, 3, 5, 4))
    with Emulator(Emulation(TF32, TF32)):
        einsum = torch.einsum("bhqd,bhkd->bhqk", q, k)
        matmul = torch.matmul(q, k.transpose(-2, -1))
    want = torch.matmul(_r(q), _r(k).transpose(-2, -1))
    assert torch.allclose(einsum, want, rtol=1e-13, atol=0) and torch.equal(matmul, want)
    v = _tensors(3, (4,))[0]
    with Emulator(Emulation(TF32, TF32)) as emulating:  # a matrix-vector product: no TF32 kernel
        mv = torch.matmul(q[0, 0], v)
    assert torch.equal(mv, torch.matmul(q[0, 0], v)) and emulating.label == ""


def test_the_backward_kernels_read_the_incoming_gradient_and_operands_rounded_the_bias_gradient_not() -> None:
    x, w, b, g = _tensors(4, (2, 3, 6, 6), (4, 3, 3, 3), (4,), (2, 4, 4, 4))
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    emulating = Emulator(Emulation(TF32, TF32))
    with emulating:
        out = F.conv2d(*leaves)
    with emulating:  # the node called as the replay calls it, inside the same emulation
        gx, gw, gb = out.grad_fn(g)
    rx, rw, rg = (t.clone().requires_grad_() for t in (_r(x), _r(w), _r(g)))
    ex, ew = torch.autograd.grad(F.conv2d(rx, rw), (rx, rw), rg)
    assert torch.equal(gx, ex) and torch.equal(gw, ew)
    assert torch.equal(gb, g.sum((0, 2, 3)))  # summed as it came
    assert not torch.equal(gb, rg.sum((0, 2, 3)))


def test_a_view_s_node_passes_its_gradient_on_as_it_came() -> None:
    x, w, b, g = _tensors(5, (2, 3, 8), (4, 8), (4,), (2, 3, 4))
    emulating = Emulator(Emulation(TF32, TF32))
    with emulating:
        out = F.linear(x.requires_grad_(), w.requires_grad_(), b.requires_grad_())
    node: Any = out.grad_fn  # a 3-D linear's output is a view of addmm's
    with emulating:
        given = node(g)
    assert torch.equal(given, g.reshape(6, 4))


def test_autocast_casts_every_input_of_those_kernels_the_bias_too() -> None:
    x, w, b = _tensors(6, (4, 8), (3, 8), (3,))
    with Emulator(Emulation(cast=BFLOAT16)) as emulating:
        got = F.linear(x, w, b)
    bf = [t.to(torch.bfloat16).double() for t in (x, w, b)]
    assert torch.equal(got, F.linear(*bf)) and emulating.label == BFLOAT16


def test_autocast_leaves_an_in_place_product_to_the_policy_s_format() -> None:
    c, a, b = _tensors(7, (4, 3), (4, 8), (8, 3))
    with Emulator(Emulation(FLOAT32, TF32, BFLOAT16)) as emulating:
        inplace = c.clone().addmm_(a, b)
        product = torch.addmm(c, a, b)
    assert torch.equal(inplace, torch.addmm(c, _r(a), _r(b)))  # TF32, the added input as it is
    bf = [t.to(torch.bfloat16).double() for t in (c, a, b)]
    assert torch.equal(product, torch.addmm(*bf))
    assert emulating.label == "bfloat16+tf32"


def _entry(inputs: list[str], outputs: list[str] | None = None) -> dict[str, Any]:
    node = lambda dtype: {"type": "torch.Tensor", "dtype": dtype}  # noqa: E731
    return {
        "input_args": [node(d) for d in inputs] + [{"type": "int", "value": 1}],
        "input_kwargs": {"bias": node(inputs[0])} if inputs else {},
        "output": [node(d) for d in outputs or []],
    }


def test_which_calls_are_emulated() -> None:
    tf32 = Policy("cuda", TF32, FLOAT32)
    f32 = _entry(["torch.float32", "torch.float32"])
    assert emulation_for(tf32, None, f32) == Emulation(TF32, FLOAT32)
    assert emulation_for(tf32, "bfloat16", f32) == Emulation(TF32, FLOAT32, "bfloat16")  # autocast decides
    assert emulation_for(None, "float16", f32) == Emulation(cast="float16")
    assert emulation_for(Policy("cpu"), None, f32) is None  # float32 as declared
    assert emulation_for(None, None, f32) is None
    for other in ("torch.float64", "torch.bfloat16", "torch.float16"):  # the formats apply to float32 math
        assert emulation_for(tf32, "bfloat16", _entry([other])) is None
    assert emulation_for(tf32, None, _entry([])) is None


def test_autocast_is_read_off_a_dumped_call_s_dtypes() -> None:
    assert autocast_of(_entry(["torch.float32"], ["torch.bfloat16"])) == "bfloat16"
    assert autocast_of(_entry(["torch.float32"], ["torch.float16"])) == "float16"
    assert autocast_of(_entry(["torch.float32"], ["torch.float32"])) is None
    assert autocast_of(_entry(["torch.bfloat16"], ["torch.bfloat16"])) is None  # a bfloat16 model: no cast


def test_the_sidecar_keeps_each_call_s_emulated_format_and_the_policy(tmp_path: Path) -> None:
    dump_json = tmp_path / "dump.json"
    calls = {
        "Functional.conv2d.0.forward": CallOwn((None,), emulated=TF32),
        "Functional.relu.0.forward": CallOwn((None,)),
    }
    policy = Policy("cuda", TF32, TF32)
    path = write_own_errors(dump_json, calls, "cpu", precision=policy.to_dict())
    doc = json.loads(path.read_text())
    assert doc["precision"] == policy.to_dict() and Policy.from_dict(doc["precision"]) == policy
    assert doc["calls"]["Functional.conv2d.0.forward"]["emulated"] == TF32
    assert "emulated" not in doc["calls"]["Functional.relu.0.forward"]
    assert read_own_errors(dump_json) == calls
    doc["calls"]["Functional.conv2d.0.forward"]["emulated"] = 10
    path.write_text(json.dumps(doc))
    with pytest.raises(DumpFormatError, match=r"self_check\.json.*emulated: 10 is not a format name"):
        read_own_errors(dump_json)
