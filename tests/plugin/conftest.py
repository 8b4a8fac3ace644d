"""Fixtures for whole-workflow tests of the pytest plugin, driven with pytester."""

from __future__ import annotations

import textwrap

import pytest

# In-process pytester runs restore sys.modules afterwards: anything first imported inside a run is dropped and
# imported again by the next one. torch cannot be imported twice in one process, so it is imported here, once.
import torch  # noqa: F401
import torchvision  # noqa: F401

# A small CNN trained for two steps: relu (functional and in-place module), batch_norm, conv, linear, SGD.
TRAIN_TEST = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(6)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
            self.fc = nn.Linear(6, 4)

        def forward(self, x):
            x = self.relu(self.bn(self.conv(x)))
            x = F.relu(self.conv2(x))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


    def train(msprobe, steps=2):
        model = Net().to(msprobe.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(0)
        for _ in range(steps):
            x = torch.randn(4, 3, 8, 8, generator=g).to(msprobe.device)
            y = torch.randint(0, 4, (4,), generator=g).to(msprobe.device)
            with msprobe.step(model):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return model


    MARKER

    def test_train(msprobe):
        train(msprobe)
    """
)

# Another plugin, loaded before ours with -p, that makes one F.relu call per forward wrong by a relative
# FAULT_SCALE: a faulty kernel with its own autograd node, as a broken device kernel would be.
FAULT_PLUGIN = textwrap.dedent(
    """
    import os
    import torch
    import torch.nn.functional as F

    _orig = F.relu
    _calls = {"n": 0}


    class _FaultyRelu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            out = torch.clamp_min(x, 0) * (1.0 + scale)
            ctx.save_for_backward(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            (out,) = ctx.saved_tensors
            return grad * (out > 0), None


    def _relu(input, inplace=False):
        _calls["n"] += 1
        if _calls["n"] % 2 == 0 and not inplace:  # the functional relu after conv2
            return _FaultyRelu.apply(input, float(os.environ.get("FAULT_SCALE", "0.01")))
        return _orig(input, inplace=inplace)


    def pytest_configure(config):
        F.relu = _relu


    def pytest_unconfigure(config):
        F.relu = _orig
    """
)


@pytest.fixture
def train_test(pytester: pytest.Pytester):
    """Write the training test with a given marker line; returns a function making more variants."""

    def make(
        marker: str = '@pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1])',
        name: str = "test_train",
    ):
        return pytester.makepyfile(**{name: TRAIN_TEST.replace("MARKER", marker)})

    return make


@pytest.fixture
def train_source() -> str:
    """The training test module's source, with MARKER where the marker line goes."""
    return TRAIN_TEST


@pytest.fixture
def fault_plugin(pytester: pytest.Pytester):
    pytester.makepyfile(faultplugin=FAULT_PLUGIN)
    pytester.syspathinsert()
    return "faultplugin"
