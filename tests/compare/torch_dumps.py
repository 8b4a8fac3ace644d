"""Dumps of small real torch trainings, made with our PrecisionDebugger, for the gate's integrity tests.

``dump_training(path, ...)`` trains a small CNN (or a two-layer MLP) for ``steps`` steps, seeded, and dumps
every step: the full step by default, or the forward only (``backward=False``: no ``backward()``, no
``optimizer.step()``), at level L1, L0 or mix, with another layer width, or another architecture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compare_helpers import seeded


def dump_training(
    path: Path,
    *,
    model: str = "cnn",
    width: int = 6,
    level: str = "L1",
    backward: bool = True,
    steps: int = 2,
    task: str = "statistics",
) -> Path:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from pytest_msprobe import PrecisionDebugger

    class Cnn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, width, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
            self.fc = nn.Linear(width, 4)

        def forward(self, x: Any) -> Any:
            x = F.relu(self.bn(self.conv(x)))
            x = F.relu(self.conv2(x))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = nn.Linear(3 * 8 * 8, 4 * width)
            self.out = nn.Linear(4 * width, 4)

        def forward(self, x: Any) -> Any:
            return self.out(torch.tanh(self.hidden(torch.flatten(x, 1))))

    with seeded(1234):
        net = Cnn() if model == "cnn" else Mlp()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        data = torch.Generator().manual_seed(0)
        steps_ = list(range(steps))
        with PrecisionDebugger(dump_path=str(path), task=task, level=level, step=steps_) as debugger:
            for _ in steps_:
                x = torch.randn(4, 3, 8, 8, generator=data)
                y = torch.randint(0, 4, (4,), generator=data)
                debugger.start(model=net)
                loss = F.cross_entropy(net(x), y)
                if backward:
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                debugger.stop()
                debugger.step()
    return path
