"""The trend recorder: the gradient norms when the gradients are final, grouped by module, the loss, its
refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pytest_msprobe.dump.trend_recorder import ROOT_MODULE, TrendRecorder
from pytest_msprobe.errors import ConfigError


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, bias=False)
        self.fc = torch.nn.Linear(4, 2)
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.conv(x), 1).flatten(1)) * self.scale


def _step(recorder: TrendRecorder, model: Net, opt: torch.optim.Optimizer, zero_after: bool = False) -> float:
    recorder.begin(model)
    loss = F.cross_entropy(model(torch.randn(2, 3, 6, 6)), torch.tensor([0, 1]))
    recorder.loss(loss)
    opt.zero_grad()
    loss.backward()
    expected = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    opt.step()
    if zero_after:  # the gradients are gone by the end of the step: the norms were taken at optimizer.step()
        opt.zero_grad()
    recorder.end()
    return expected


def test_norms_are_taken_at_the_optimizer_step_and_grouped_by_module() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrendRecorder(steps=2)
    expected = [_step(recorder, model, opt, zero_after=True) for _ in range(3)]  # the third is not recorded
    data = recorder.data()
    assert len(data.steps) == 2 and data.dtype == "float32"
    assert data.modules == (ROOT_MODULE, "conv", "fc")  # named_parameters() order: its own first
    first = data.steps[0]
    assert first.grad_norm == pytest.approx(expected[0], rel=1e-6)
    assert math.sqrt(sum(m * m for m in first.modules if m is not None)) == pytest.approx(
        first.grad_norm, rel=1e-6
    )
    assert first.loss is not None and first.loss > 0


def test_without_an_optimizer_step_the_norms_are_taken_at_the_end_of_the_step() -> None:
    model = Net()
    recorder = TrendRecorder(steps=1)
    recorder.begin(model)
    loss = model(torch.randn(1, 3, 6, 6)).sum()
    recorder.loss(float(loss.detach()))
    loss.backward()
    recorder.end()
    expected = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    assert recorder.data().steps[0].grad_norm == pytest.approx(expected, rel=1e-6)


def test_another_optimizers_step_is_not_taken_for_the_models() -> None:
    model = Net()
    other = torch.nn.Parameter(torch.ones(3))
    recorder = TrendRecorder(steps=1)
    recorder.begin(model)
    other.grad = torch.ones(3)
    torch.optim.SGD([other], lr=0.1).step()  # not the model's: its gradients are not final yet
    loss = model(torch.randn(1, 3, 6, 6)).sum()
    recorder.loss(loss)
    loss.backward()
    recorder.end()
    assert recorder.data().steps[0].grad_norm > 0


def test_the_loss_is_required_once_per_step_and_only_inside_a_step() -> None:
    model = Net()
    recorder = TrendRecorder(steps=3)
    with pytest.raises(ConfigError, match=r"msprobe.loss\(\) outside msprobe.step\(\)"):
        recorder.loss(1.0)
    recorder.begin(model)
    with pytest.raises(ConfigError, match="one number; got a tensor of shape \\[2\\]"):
        recorder.loss(torch.ones(2))
    with pytest.raises(ConfigError, match=r"msprobe.loss\(\) was not called in step 0"):
        recorder.end()
    with pytest.raises(ConfigError, match=r"pass the model, msprobe.step\(model\)"):
        recorder.begin(None)


def test_several_losses_in_a_step_the_last_counts_and_nan_is_kept() -> None:
    model = Net()
    recorder = TrendRecorder(steps=2)
    recorder.begin(model)
    recorder.loss(torch.tensor(3.0))
    recorder.loss(torch.tensor(2.0))
    recorder.end()
    recorder.begin(model)
    recorder.loss(torch.tensor(float("nan")))
    recorder.end()
    steps = recorder.data().steps
    assert steps[0].loss == 2.0 and math.isnan(steps[1].loss or 0.0)
    assert steps[0].grad_norm == 0.0  # no backward: no gradient


def test_the_autocast_dtype_is_the_training_dtype() -> None:
    model = Net()
    recorder = TrendRecorder(steps=1)
    recorder.begin(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(1, 3, 6, 6)).sum()
        recorder.loss(loss)
    recorder.end()
    assert recorder.data().dtype == "bfloat16"
