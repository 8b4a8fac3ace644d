"""Small float16 models (on the CPU) that overflow in chosen places, dumped with our PrecisionDebugger."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pytest_msprobe import PrecisionDebugger, seed_all


class Mlp(torch.nn.Module):
    """linear -> relu -> (x factor) -> [exp] -> linear, in float16."""

    def __init__(self, factor: float = 1.0, exp: bool = False, mask: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.factor, self.exp, self.mask = factor, exp, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        h = h * self.factor
        if self.exp:
            h = torch.exp(h)
        out = self.fc2(h)
        if self.mask:  # attention-like: a -inf fill that the softmax turns into zeros
            out = F.softmax(out.masked_fill(torch.arange(4) == 3, float("-inf")), dim=-1)
        return out


def dump(
    path: Path,
    *,
    task: str = "statistics",
    steps: int = 2,
    level: str = "L1",
    before_step: Callable[[int, Mlp], None] | None = None,
    batch: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    **model_and_debugger: Any,
) -> Path:
    """Train ``Mlp`` in float16 for ``steps`` steps with every step dumped; ``before_step(i, model)`` may
    break something between steps, ``batch(i, x)`` change the data."""
    model_keys = {"factor", "exp", "mask"}
    model_args = {k: v for k, v in model_and_debugger.items() if k in model_keys}
    debugger_args = {k: v for k, v in model_and_debugger.items() if k not in model_keys}
    seed_all(1234, mode=True)
    model = Mlp(**model_args).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    debugger = PrecisionDebugger(
        dump_path=path, task=task, level=level, step=list(range(steps)), **debugger_args
    )
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        x = torch.randn(4, 8, generator=g).half()
        if batch is not None:
            x = batch(i, x)
        if before_step is not None:
            before_step(i, model)
        debugger.start(model=model)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        debugger.stop()
        debugger.step()
    debugger.close()
    return path
