"""Fixtures of the dump engine's tests: the TinyResNet training loop that produced the msprobe dumps.

The model, batches and optimizer are those of ``tests/data/msprobe/make_dumps.py`` (imported from there), so our
dumps can be checked entry by entry against msprobe 8.3.3's.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

DATA = Path(__file__).resolve().parents[1] / "data" / "msprobe"


def _load_make_dumps() -> ModuleType:
    spec = importlib.util.spec_from_file_location("msprobe_make_dumps", DATA / "make_dumps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def make_dumps() -> ModuleType:
    """``tests/data/msprobe/make_dumps.py`` as a module: ``TinyResNet``, ``make_batch``."""
    return _load_make_dumps()


@dataclass(frozen=True)
class TrainResult:
    """What a training run produced: per step losses, model outputs and parameter gradients; final parameters."""

    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


TrainFn = Callable[..., TrainResult]


@pytest.fixture(scope="session")
def train(make_dumps: ModuleType) -> TrainFn:
    """Run TinyResNet training steps as make_dumps.py does, optionally around a debugger.

    ``train(debugger=None, steps=2, width=8, batch=8, size=16, pass_model=True)``; the debugger is closed at
    the end, so its files are complete when ``train`` returns.
    """

    def run(
        debugger: Any = None,
        steps: int = 2,
        width: int = 8,
        batch: int = 8,
        size: int = 16,
        pass_model: bool = True,
        model: torch.nn.Module | None = None,
    ) -> TrainResult:
        from pytest_msprobe import seed_all

        seed_all(seed=1234, mode=True)
        torch.manual_seed(1234)
        net = model if model is not None else make_dumps.TinyResNet(width=width)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        result = TrainResult()
        for step in range(steps):
            x, y = make_dumps.make_batch(step, batch, size)
            if debugger is not None:
                if pass_model:
                    debugger.start(model=net)
                else:
                    debugger.start()
            out = net(x)
            loss = loss_fn(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if debugger is not None:
                debugger.stop()
                debugger.step()
            result.losses.append(loss.detach().clone())
            result.outputs.append(out.detach().clone())
            result.grads.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})
        result.params.update({n: p.detach().clone() for n, p in net.named_parameters()})
        if debugger is not None:
            debugger.close()
        return result

    return run


def read_dump(root: Path, step: int, name: str = "dump.json") -> Any:
    """A dump file of ``root/step{N}/rank/``."""
    with open(root / f"step{step}" / "rank" / name, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture
def dump_reader() -> Callable[..., Any]:
    return read_dump


@pytest.fixture
def no_leftover_debugger() -> Iterator[None]:
    """Fails a test that leaves API wrappers installed or a debugger started."""
    yield
    from pytest_msprobe.dump import debugger, intercept, threads

    assert debugger._STARTED == {}
    assert threads.slot.active is None
    assert not intercept._HOLDERS and not intercept.wrappers_installed()
    assert "__add__" not in vars(torch.Tensor)


@pytest.fixture(autouse=True)
def _restore_global_torch_state() -> Iterator[None]:
    """seed_all changes process-wide switches: put them back so other tests run as they would alone."""
    import os

    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    env = {k: os.environ.get(k) for k in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC")}
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
