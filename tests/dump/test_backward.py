"""L1 backward records: gradients in and out of each API's autograd node, as msprobe records them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_msprobe import PrecisionDebugger

pytestmark = pytest.mark.usefixtures("no_leftover_debugger")


def _dump(tmp_path: Path, body: Callable[[], Any], **kwargs: Any) -> dict[str, Any]:
    debugger = PrecisionDebugger(dump_path=tmp_path, task="statistics", level="L1", **kwargs)
    debugger.start()
    try:
        body()
    finally:
        debugger.close()
    return json.loads((tmp_path / "step0" / "rank" / "dump.json").read_text())["data"]


def _shapes(items: list[Any]) -> list[Any]:
    return [None if item is None else item["shape"] for item in items]


def test_linear_backward_lists_the_addmm_gradients(tmp_path: Path) -> None:
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    data = _dump(tmp_path, lambda: F.linear(x, layer.weight, layer.bias).sum().backward())
    record = data["Functional.linear.0.backward"]
    assert list(record) == ["input", "output"]
    assert _shapes(record["input"]) == [[5, 3]]
    # AddmmBackward0: (bias, input, weight.t()), as in msprobe's dump of TinyResNet's fc
    assert _shapes(record["output"]) == [[3], [5, 4], [4, 3]]
    assert record["input"][0]["Max"] == 1.0 and record["input"][0]["requires_grad"] is False
    assert record["output"][1]["Max"] == pytest.approx(layer.weight.sum(0).max().item())


def test_undefined_gradients_are_null(tmp_path: Path) -> None:
    weight = torch.randn(2, 1, 3, 3, requires_grad=True)
    image = torch.randn(1, 1, 5, 5)  # needs no gradient; no bias
    data = _dump(tmp_path, lambda: F.conv2d(image, weight).sum().backward())
    assert _shapes(data["Functional.conv2d.0.backward"]["output"]) == [None, [2, 1, 3, 3], None]


def test_gradient_values_flowing_in_and_out(tmp_path: Path) -> None:
    x = torch.full((3,), 2.0, requires_grad=True)

    def body() -> None:
        y = x * 3  # Tensor.__mul__
        (y * y).sum().backward()

    data = _dump(tmp_path, body)
    first = data["Tensor.__mul__.0.backward"]
    assert first["input"][0]["Max"] == 12.0  # d(y*y)/dy = 2y = 12
    assert first["output"][0]["Max"] == 36.0  # times 3
    square = data["Tensor.__mul__.1.backward"]
    assert _shapes(square["output"]) == [[3], [3]]


def test_backward_records_come_in_backward_order(tmp_path: Path) -> None:
    x = torch.randn(4, requires_grad=True)
    data = _dump(tmp_path, lambda: F.relu(torch.sigmoid(x)).sum().backward())
    backward = [n for n in data if n.endswith(".backward")]
    assert backward == ["Tensor.sum.0.backward", "Functional.relu.0.backward", "Torch.sigmoid.0.backward"]


def test_identity_like_calls_get_no_backward_record(tmp_path: Path) -> None:
    x = torch.randn(4, requires_grad=True)

    def body() -> None:
        y = x * 1
        z = y.float().contiguous()  # both return y itself
        (z * 2).sum().backward()

    data = _dump(tmp_path, body)
    assert "Tensor.float.0.forward" in data and "Tensor.contiguous.0.forward" in data
    assert "Tensor.float.0.backward" not in data and "Tensor.contiguous.0.backward" not in data
    assert "Tensor.__mul__.0.backward" in data


def test_in_place_relu_keeps_its_backward_record(tmp_path: Path) -> None:
    x = torch.randn(6, requires_grad=True)

    def body() -> None:
        y = x * 1
        F.relu(y, inplace=True)
        (y * 2).sum().backward()

    data = _dump(tmp_path, body)
    record = data["Functional.relu.0.backward"]
    assert record["input"][0]["Max"] == 2.0
    expected = torch.where(x > 0, 2.0, 0.0)
    assert record["output"][0]["Max"] == expected.max().item()
    assert record["output"][0]["Min"] == expected.min().item()


def test_backward_after_stop_is_not_recorded_and_leaves_no_hook(tmp_path: Path) -> None:
    x = torch.randn(3, requires_grad=True)
    debugger = PrecisionDebugger(dump_path=tmp_path, task="statistics", level="L1")
    debugger.start()
    y = F.relu(x * 2)
    debugger.stop()
    y.sum().backward()  # the graph outlives the capture: its hooks are gone
    debugger.close()
    data = json.loads((tmp_path / "step0" / "rank" / "dump.json").read_text())["data"]
    assert not [n for n in data if n.endswith(".backward")]
    assert torch.equal(x.grad, torch.where(x > 0, 2.0, 0.0))


def test_data_mode_filters_directions(tmp_path: Path) -> None:
    x = torch.randn(3, requires_grad=True)
    body = lambda: F.relu(x).sum().backward()  # noqa: E731
    only_backward = _dump(tmp_path / "b", body, data_mode=["backward"])
    assert only_backward and all(n.endswith(".backward") for n in only_backward)
    only_inputs = _dump(tmp_path / "i", body, data_mode=["input"])
    fwd, bwd = only_inputs["Functional.relu.0.forward"], only_inputs["Functional.relu.0.backward"]
    assert list(fwd) == ["input_args", "input_kwargs"] and list(bwd) == ["input"]
    backward_outputs = _dump(tmp_path / "bo", body, data_mode=["backward", "output"])
    assert list(backward_outputs["Functional.relu.0.backward"]) == ["output"]
