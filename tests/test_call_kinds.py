"""Which recorded calls a precision setting governs (format/numerics.py's one table, CALLS), as kind_of says
for a record: forward and backward records of each API, and a module's records by its class."""

from __future__ import annotations

import pytest

from pytest_msprobe.dump.api_lists import FUNCTIONAL, TENSOR, TORCH
from pytest_msprobe.format.numerics import CONV, MATMUL, kind_of

CONVOLUTIONS = [
    "Functional.conv1d.0.forward",
    "Functional.conv2d.3.backward",
    "Functional.conv3d.0.forward",
    "Functional.conv_transpose1d.0.forward",
    "Functional.conv_transpose2d.1.backward",
    "Functional.conv_transpose3d.0.forward",
    "Torch.conv2d.0.forward",
    "Torch.conv_transpose2d.0.forward",
    "Torch.convolution.0.backward",
    "Aten.convolution.default.0.forward",
    "Aten.convolution_backward.default.0.forward",
    "NPU.npu_conv2d.0.forward",
    "VF.lstm.0.forward",  # cuDNN's recurrent layers are under its convolutions' switches
    "Module.conv.Conv2d.forward.0",
    "Module.layer1.0.conv1.Conv2d.backward.0",
]
MATMULS = [
    "Functional.linear.0.forward",
    "Functional.linear.7.backward",
    "Functional.bilinear.0.forward",
    "Functional.scaled_dot_product_attention.0.forward",
    "Functional.multi_head_attention_forward.0.backward",
    "Torch.matmul.0.forward",
    "Torch.mm.0.forward",
    "Torch.bmm.2.backward",
    "Torch.addmm.0.forward",
    "Torch.baddbmm.0.forward",
    "Torch.addbmm.0.forward",
    "Torch.einsum.0.forward",
    "Torch.tensordot.0.forward",
    "Torch.linalg.matmul.0.forward",
    "Tensor.__matmul__.0.forward",
    "Tensor.__rmatmul__.0.forward",
    "Tensor.matmul.1.backward",
    "Tensor.mm.0.forward",
    "Tensor.bmm.0.forward",
    "Tensor.addmm_.0.forward",
    "Tensor.baddbmm.0.forward",
    "Aten.mm.default.0.forward",
    "Aten.addmm.default.0.backward",
    "NPU.npu_linear.0.forward",
    "Torch.mv.0.forward",
    "Module.fc.Linear.backward.0",
]
NEITHER = [
    "Functional.relu.0.forward",
    "Functional.layer_norm.0.backward",
    "Functional.softmax.0.forward",
    "Functional.batch_norm.0.forward",
    "Tensor.dot.0.forward",
    "Tensor.add_.0.forward",
    "Distributed.all_reduce.0.forward",
    "Module.bn.BatchNorm2d.forward.0",
    "Functional.convolution_like.0.forward",
]


@pytest.mark.parametrize("name", CONVOLUTIONS)
def test_convolutions_forward_and_backward(name: str) -> None:
    assert kind_of(name) == CONV


@pytest.mark.parametrize("name", MATMULS)
def test_matrix_products_forward_and_backward(name: str) -> None:
    assert kind_of(name) == MATMUL


@pytest.mark.parametrize("name", NEITHER)
def test_other_calls_are_of_no_kind(name: str) -> None:
    assert kind_of(name) is None


def test_an_api_name_without_counter_and_direction_is_classified_too() -> None:
    assert kind_of("Functional.conv2d") == CONV and kind_of("Torch.matmul") == MATMUL
    assert kind_of("Functional.relu") is None


def test_every_governed_api_named_in_the_table_is_one_the_dump_captures() -> None:
    """A name in the table that no namespace captures would never match a record (a typo, a renamed API)."""
    captured = {f"Functional.{n}" for n in FUNCTIONAL} | {f"Tensor.{n}" for n in TENSOR}
    captured |= {f"Torch.{n}" for n in TORCH}
    for name in CONVOLUTIONS + MATMULS:
        base = name.rsplit(".", 2)[0]
        if base.startswith(("Functional.", "Tensor.", "Torch.")):
            assert base in captured, base
