"""Levels L0 and mix: module records, parameters, parameter gradients, construct.json."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pytest_msprobe import PrecisionDebugger
from pytest_msprobe.errors import ConfigError

pytestmark = pytest.mark.usefixtures("no_leftover_debugger")

MSPROBE_MIX = (
    Path(__file__).resolve().parents[1]
    / "data"
    / "msprobe"
    / "msprobe-8.3.3"
    / "dumps"
    / "bench"
    / "stat_mix"
)


def _read(root: Path, name: str = "dump.json", step: int = 0) -> Any:
    return json.loads((root / f"step{step}" / "rank" / name).read_text())


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b)) + 1e-7


def _same_stats(item: dict[str, Any], t: torch.Tensor) -> bool:
    return (
        item["shape"] == list(t.shape)
        and _close(item["Max"], t.max().item())
        and _close(item["Min"], t.min().item())
        and _close(item["Norm"], torch.linalg.vector_norm(t).item())
    )


def _run(
    tmp_path: Path, model: nn.Module, x: torch.Tensor, level: str = "L0", **kwargs: Any
) -> dict[str, Any]:
    with PrecisionDebugger(dump_path=tmp_path, level=level, **kwargs) as debugger:
        debugger.start(model=model)
        model(x).sum().backward()
        debugger.stop()
    return _read(tmp_path)["data"]


def test_l0_records_modules_only_and_matches_msprobe(tmp_path: Path, train: Any) -> None:
    train(PrecisionDebugger(dump_path=tmp_path, level="L0", step=[0, 1]), steps=2)
    for step in (0, 1):
        ours = _read(tmp_path, step=step)["data"]
        assert all(name.startswith("Module.") for name in ours)
        theirs = _read(MSPROBE_MIX, step=step)["data"]
        modules = {name: entry for name, entry in theirs.items() if name.startswith("Module.")}
        assert len(modules) == 49
        for name, entry in modules.items():
            mine = ours[name]
            assert list(mine) == [k for k in entry if k != "is_recompute"], name
            for part in ("input", "output", "input_args", "parameters"):
                if part not in entry:
                    continue
                items = entry[part].items() if isinstance(entry[part], dict) else enumerate(entry[part])
                for key, item in items:
                    if name == "Module.relu.ReLU.forward.0" and part == "input_args":
                        continue  # msprobe records this in-place module's input after the op (Min 0)
                    other = mine[part][key]
                    assert (item is None) == (other is None), f"{name}.{part}.{key}"
                    if item is not None:
                        assert other["shape"] == item["shape"], f"{name}.{part}.{key}"
                        assert _close(other["Max"], item["Max"]) and _close(other["Norm"], item["Norm"]), (
                            f"{name}.{part}.{key}"
                        )
        construct = _read(tmp_path, "construct.json", step)
        assert set(construct) == {n for n in ours if ".forward." in n or ".backward." in n}
        assert (
            construct["Module.layer2.downsample.0.Conv2d.forward.0"]
            == "Module.layer2.downsample.Sequential.forward.0"
        )
        assert (
            construct["Module.layer2.downsample.0.Conv2d.backward.0"]
            == "Module.layer2.downsample.Sequential.backward.0"
        )
        assert construct["Module.conv1.Conv2d.backward.0"] is None  # the root module is not a record


def test_in_place_relu_module_keeps_its_backward_record(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(inplace=True), nn.Linear(6, 2))
    reference = copy.deepcopy(model)
    reference[2] = nn.ReLU()
    x = torch.randn(5, 4)
    data = _run(tmp_path, model, x)

    # the same gradients, taken by hand on a copy without the in-place op
    h = reference[1](reference[0](x))
    h.retain_grad()
    r = reference[2](h)
    r.retain_grad()
    reference[3](r).sum().backward()

    relu = data["Module.2.ReLU.backward.0"]
    assert _same_stats(relu["input"][0], r.grad)  # gradient w.r.t. the ReLU's output
    assert _same_stats(relu["output"][0], h.grad)  # w.r.t. its input, before the in-place op
    bn = data["Module.1.BatchNorm1d.backward.0"]
    assert _same_stats(bn["input"][0], h.grad)
    relu_in = data["Module.2.ReLU.forward.0"]["input_args"][0]
    assert _same_stats(relu_in, h.detach())  # the input as it was before the in-place op


def test_shared_input_gets_each_module_its_own_gradient(tmp_path: Path) -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = nn.Linear(3, 4)
            self.a = nn.Linear(4, 1)
            self.b = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.trunk(x)
            return self.a(h) + 10 * self.b(h)

    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.randn(2, 3)
    data = _run(tmp_path, model, x)
    ones = torch.ones(2, 1)
    # each head reports the gradient flowing from itself into h, not h's total gradient
    assert _same_stats(data["Module.a.Linear.backward.0"]["output"][0], ones @ model.a.weight)
    assert _same_stats(data["Module.b.Linear.backward.0"]["output"][0], 10 * ones @ model.b.weight)
    total = ones @ model.a.weight + 10 * ones @ model.b.weight
    assert _same_stats(data["Module.trunk.Linear.backward.0"]["input"][0], total)
    assert data["Module.trunk.Linear.backward.0"]["output"] == []  # x needs no gradient


def test_parameters_and_parameter_gradients(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    x = torch.randn(5, 3)
    data = _run(tmp_path, model, x)
    names = list(data)
    # each parameters_grad key sits right after its module's first forward record
    assert names.index("Module.0.Linear.parameters_grad") == names.index("Module.0.Linear.forward.0") + 1
    assert names.index("Module.1.Linear.parameters_grad") == names.index("Module.1.Linear.forward.0") + 1
    forward = data["Module.0.Linear.forward.0"]
    assert list(forward) == ["input_args", "input_kwargs", "output", "parameters"]
    assert list(forward["parameters"]) == ["weight", "bias"]
    assert _same_stats(forward["parameters"]["weight"], model[0].weight.detach())
    grads = data["Module.0.Linear.parameters_grad"]
    assert list(grads) == ["weight", "bias"]
    assert _same_stats(grads["weight"][0], model[0].weight.grad)
    assert _same_stats(grads["bias"][0], model[0].bias.grad)
    assert list(data["Module.1.Linear.parameters_grad"]) == ["weight"]  # frozen bias: no gradient entry


def test_module_called_twice_and_keyword_inputs(tmp_path: Path) -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)
            self.scale = Scale()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale(self.layer(self.layer(x)), factor=3.0)

    class Scale(nn.Module):
        def forward(self, x: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
            return x * factor

    data = _run(tmp_path, Twice(), torch.randn(1, 2, requires_grad=True))
    assert {"Module.layer.Linear.forward.0", "Module.layer.Linear.forward.1"} <= set(data)
    assert {"Module.layer.Linear.backward.0", "Module.layer.Linear.backward.1"} <= set(data)
    assert data["Module.scale.Scale.forward.0"]["input_kwargs"] == {"factor": {"type": "float", "value": 3.0}}
    # the gradients accumulated over both calls: one parameters_grad entry
    assert [n for n in data if "parameters_grad" in n] == ["Module.layer.Linear.parameters_grad"]


def test_mix_construct_has_api_parents_and_the_optimizer(tmp_path: Path, train: Any) -> None:
    train(PrecisionDebugger(dump_path=tmp_path, level="mix", step=[1]), steps=2)
    construct = _read(tmp_path, "construct.json", 1)
    assert construct["Functional.conv2d.1.forward"] == "Module.layer1.conv1.Conv2d.forward.0"
    assert construct["Functional.conv2d.1.backward"] == "Module.layer1.conv1.Conv2d.backward.0"
    assert construct["Functional.relu.1.forward"] == "Module.layer1.BasicBlock.forward.0"
    assert construct["Torch.flatten.0.forward"] is None
    assert construct["optimizer"] is None
    assert construct["Tensor.mul_.0.forward"] == "optimizer"  # SGD momentum, from step 1 on
    assert construct == _read(MSPROBE_MIX, "construct.json", 1) | {
        "Functional.batch_norm.0.backward": "Module.bn1.BatchNorm2d.backward.0",
        "Module.conv1.Conv2d.backward.0": None,
        "Functional.conv2d.0.backward": "Module.conv1.Conv2d.backward.0",
        "Module.bn1.BatchNorm2d.backward.0": None,
    }


def test_module_levels_need_the_model(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(dump_path=tmp_path, level="L0")
    with pytest.raises(ConfigError, match="level='L0' needs the model"):
        debugger.start()
    with pytest.raises(ConfigError, match=r"expected a torch\.nn\.Module"):
        debugger.start(model="resnet")  # type: ignore[arg-type]
