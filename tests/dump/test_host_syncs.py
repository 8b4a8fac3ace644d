"""A dumped step asks the host for no tensor's values one tensor at a time: statistics stay on the tensor's device
until the step's are moved in one transfer per dtype. On a GPU each ``.item()``, ``.tolist()`` or ``.cpu()`` of a
device tensor waits for the device (``bench/dump_overhead.py --count-syncs`` counts them there); here the same
calls are counted on the training thread, whatever the device, for models of 3 and 12 layers: the count must not
grow with the number of recorded tensors."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_msprobe import PrecisionDebugger

# Tensor methods that give the host a tensor's values (and wait for its device)
_ASKS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")
_OURS = str(Path(__import__("pytest_msprobe").__file__).parent)


def _count(monkeypatch: pytest.MonkeyPatch, counted: Counter[str]) -> None:
    main = threading.get_ident()
    for name in _ASKS:
        original = getattr(torch.Tensor, name)

        def counting(
            self: torch.Tensor, *args: Any, _name: str = name, _original: Any = original, **kw: Any
        ) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if threading.get_ident() == main and caller.startswith(_OURS):
                counted[_name] += 1
            return _original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, counting)


def _asks_of_a_dumped_step(
    tmp_path: Path, layers: int, task: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> Counter[str]:
    torch.manual_seed(0)
    blocks = [
        m for _ in range(layers) for m in (torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.ReLU())
    ]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(32, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 32, device=device), torch.randint(0, 4, (8,), device=device)
    debugger = PrecisionDebugger(
        dump_path=tmp_path / f"{task}{layers}{device}", task=task, level="L1", step=[1]
    )
    counted: Counter[str] = Counter()
    for step in range(2):
        if step == 1:
            _count(monkeypatch, counted)
        debugger.start(model=model)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        debugger.stop()
        debugger.step()
    debugger.close()
    monkeypatch.undo()
    assert list((tmp_path / f"{task}{layers}{device}").rglob("dump.json")), "the step was dumped"
    return counted


@pytest.mark.parametrize("task", ["statistics", "md5"])
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_a_dumped_step_asks_for_no_tensors_values_one_tensor_at_a_time(
    tmp_path: Path, task: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = _asks_of_a_dumped_step(tmp_path, 3, task, device, monkeypatch)
    large = _asks_of_a_dumped_step(tmp_path, 12, task, device, monkeypatch)
    # 12 layers record four times the tensors of 3 (about 300 more): the asks are the step's, not the tensors'
    assert large == small and sum(large.values()) <= 8, (small, large)
