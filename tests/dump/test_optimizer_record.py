"""optimizer.json: each optimizer step of a dumped step, and each parameter's update, beside msprobe's files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytest_msprobe import PrecisionDebugger
from pytest_msprobe.format.optimizerfile import read_optimizer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: Any) -> Any:
        return self.fc2(F.relu(self.fc1(x)))


def _run(tmp_path: Path, task: str = "statistics", give_model: bool = True, **kw: Any) -> tuple[Net, Path]:
    torch.manual_seed(0)
    net = Net()
    other = nn.Linear(3, 3)  # another model's optimizer, stepped inside the dumped step
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, **kw)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    debugger = PrecisionDebugger(dump_path=tmp_path, task=task, level="L1", step=[0])
    debugger.start(model=net if give_model else None)
    opt.zero_grad()
    F.mse_loss(net(x), torch.zeros(5, 2)).backward()
    opt.step()  # the step's call site
    other(torch.randn(2, 3)).sum().backward()
    other_opt.step()
    debugger.stop()
    debugger.close()
    return net, tmp_path / "step0" / "rank"


@pytest.mark.parametrize(
    ("flags", "implementation"),
    [({"foreach": False}, "single-tensor"), ({"foreach": True}, "foreach"), ({"fused": True}, "fused")],
)
def test_each_parameter_update_is_recorded_by_name(
    tmp_path: Path, flags: dict[str, bool], implementation: str
) -> None:
    net, folder = _run(tmp_path, **flags)
    steps = read_optimizer(folder / "dump.json")
    assert steps is not None and len(steps) == 1  # the other model's optimizer is not this model's
    step = steps[0]
    assert (step.cls, step.implementation) == ("SGD", implementation)
    assert list(step.records) == [f"Optimizer.{n}.0.forward" for n, _ in net.named_parameters()]
    record = step.records["Optimizer.fc1.weight.0.forward"]
    assert set(record["input_kwargs"]) == {"param", "grad"}
    assert set(record["output"]) == {"param", "momentum_buffer"}
    after = record["output"]["param"]
    w = net.fc1.weight.detach().double()
    assert after["shape"] == [8, 4] and after["Max"] == pytest.approx(w.max().item())
    assert after["Norm"] == pytest.approx(w.norm().item())
    # the statistics of the buffer are its own after the step (a fused kernel does not bump its version)
    buffer = record["output"]["momentum_buffer"]
    assert buffer["Norm"] == pytest.approx(record["input_kwargs"]["grad"]["Norm"])
    # the calls it made are dump.json's records from its position on; msprobe's files hold none of ours
    data = json.loads((folder / "dump.json").read_text())["data"]
    names = list(data)
    assert list(step.calls) == names[step.position : step.position + len(step.calls)]
    assert all(not n.startswith("Optimizer.") for n in names)
    if implementation == "fused":
        assert [n.split(".")[1] for n in step.calls if "_fused_" in n] == ["_fused_sgd_"]
    # the step's call site, for "called from"
    assert any("opt.step()  # the step's call site" in frame for frame in step.stack)


def test_without_the_model_names_come_from_the_caller_or_the_groups(tmp_path: Path) -> None:
    _, folder = _run(tmp_path, give_model=False, foreach=True)
    steps = read_optimizer(folder / "dump.json")
    assert steps is not None
    # the checklist finds the training loop's model, so the names are still the model's
    assert next(iter(steps[0].records)) == "Optimizer.fc1.weight.0.forward"


@pytest.mark.parametrize("task", ["tensor", "md5"])
def test_tensor_files_and_crcs_of_the_updates(tmp_path: Path, task: str) -> None:
    net, folder = _run(tmp_path, task=task, foreach=True)
    steps = read_optimizer(folder / "dump.json")
    assert steps is not None
    item = steps[0].records["Optimizer.fc2.bias.0.forward"]["output"]["param"]
    if task == "tensor":
        assert item["data_name"] == "Optimizer.fc2.bias.0.forward.output.param.pt"
        saved = torch.load(folder / "dump_tensor_data" / item["data_name"], weights_only=True)
        assert torch.equal(saved, net.fc2.bias.detach())
    else:
        from pytest_msprobe.format.crc import crc32_hex

        assert item["md5"] == crc32_hex(net.fc2.bias.detach().numpy().tobytes())


def test_an_optimizer_step_outside_the_dumped_step_is_not_recorded(tmp_path: Path) -> None:
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    debugger = PrecisionDebugger(dump_path=tmp_path, task="statistics", level="L1", step=[0])
    debugger.start(model=net)
    net(torch.randn(2, 4)).sum().backward()
    debugger.stop()
    opt.step()  # after stop(): not part of the dumped step
    debugger.close()
    assert read_optimizer(tmp_path / "step0" / "rank" / "dump.json") == ()
