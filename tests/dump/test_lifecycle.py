"""Debugger life cycle: numbers unchanged, nothing left behind after stop, several debuggers per process."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_msprobe import PrecisionDebugger
from pytest_msprobe.dump import intercept, threads
from pytest_msprobe.errors import DumpError

pytestmark = pytest.mark.usefixtures("no_leftover_debugger")


def _assert_bitwise_equal(a: Any, b: Any) -> None:
    for step, (la, lb) in enumerate(zip(a.losses, b.losses)):
        assert torch.equal(la, lb), f"loss of step {step}"
    for step, (oa, ob) in enumerate(zip(a.outputs, b.outputs)):
        assert torch.equal(oa, ob), f"output of step {step}"
    for step, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"gradient of {name} at step {step}"
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), f"parameter {name} after training"


@pytest.mark.parametrize(
    ("task", "level"), [("statistics", "L1"), ("statistics", "mix"), ("md5", "L1"), ("tensor", "L0")]
)
def test_dumping_does_not_change_the_numbers(tmp_path: Path, train: Any, task: str, level: str) -> None:
    plain = train(None, steps=3)
    dumped = train(PrecisionDebugger(dump_path=tmp_path, task=task, level=level, step=[0, 1, 2]), steps=3)
    _assert_bitwise_equal(plain, dumped)
    assert (tmp_path / "step2" / "rank" / "dump.json").exists()


def _wrapped_names() -> list[str]:
    """API names whose current function is one of our wrappers."""
    found = []
    for batches in intercept._BATCHES.values():
        for batch in batches:
            for name, wrapper in batch.wrappers.items():
                if getattr(batch.owner, name, None) is wrapper:
                    found.append(batch.apis[name])
    return found


def test_stop_removes_every_wrapper_and_hook(tmp_path: Path, make_dumps: Any) -> None:
    model = make_dumps.TinyResNet(width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    originals = (F.relu, torch.add, torch.Tensor.add_, torch._VF.lstm)
    assert "__add__" not in vars(torch.Tensor)
    debugger = PrecisionDebugger(dump_path=tmp_path, level="mix", task="statistics")
    debugger.start(model=model)
    assert F.relu is not originals[0] and "__add__" in vars(torch.Tensor)
    assert len(_wrapped_names()) > 1000
    assert model.conv1._forward_pre_hooks and model.conv1.weight._post_accumulate_grad_hooks
    x, y = make_dumps.make_batch(0, 2, 8)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    opt.step()
    debugger.stop()

    assert (F.relu, torch.add, torch.Tensor.add_, torch._VF.lstm) == originals
    assert "__add__" not in vars(torch.Tensor) and "lstm" not in vars(torch._VF)
    assert _wrapped_names() == []
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    for param in model.parameters():
        assert not param._post_accumulate_grad_hooks
    from torch.optim import optimizer as optim_module

    assert not optim_module._global_optimizer_pre_hooks and not optim_module._global_optimizer_post_hooks
    debugger.close()


def test_two_debuggers_one_after_another(tmp_path: Path, train: Any, dump_reader: Any) -> None:
    train(PrecisionDebugger(dump_path=tmp_path / "first", task="statistics", level="L1", step=[0]), steps=1)
    train(PrecisionDebugger(dump_path=tmp_path / "second", task="md5", level="L0", step=[1]), steps=2)
    first = dump_reader(tmp_path / "first", 0)
    second = dump_reader(tmp_path / "second", 1)
    assert first["level"] == "L1" and "Functional.conv2d.0.forward" in first["data"]
    assert second["level"] == "L0" and all(n.startswith("Module.") for n in second["data"])
    assert "md5" in second["data"]["Module.conv1.Conv2d.forward.0"]["output"][0]
    assert not (tmp_path / "second" / "step0").exists()


def test_only_one_debugger_started_at_a_time_in_a_thread(tmp_path: Path) -> None:
    first = PrecisionDebugger(dump_path=tmp_path / "a", level="L1")
    second = PrecisionDebugger(dump_path=tmp_path / "b", level="L1")
    first.start()
    try:
        with pytest.raises(DumpError, match="another PrecisionDebugger is started"):
            second.start()
    finally:
        first.close()
    second.start()
    torch.ones(1).neg()
    second.close()
    data = json.loads((tmp_path / "b" / "step0" / "rank" / "dump.json").read_text())["data"]
    assert list(data) == ["Torch.ones.0.forward", "Tensor.neg.0.forward"]


def test_context_manager_closes_and_a_closed_debugger_cannot_start(tmp_path: Path) -> None:
    with PrecisionDebugger(dump_path=tmp_path, level="L1") as debugger:
        debugger.start()
        F.relu(torch.ones(1))
    assert not debugger.started and not hasattr(F.relu, "__wrapped__")
    assert (tmp_path / "step0" / "rank" / "dump.json").exists()
    with pytest.raises(DumpError, match="closed"):
        debugger.start()


def test_files_are_complete_after_wait_and_errors_surface(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(dump_path=tmp_path, level="L1")
    for _ in range(3):
        debugger.start()
        F.relu(torch.ones(2))
        debugger.stop()
        debugger.step()
    debugger.wait()
    for step in range(3):
        data = json.loads((tmp_path / f"step{step}" / "rank" / "dump.json").read_text())["data"]
        assert "Functional.relu.0.forward" in data
    debugger.close()

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the dump folder should be")
    failing = PrecisionDebugger(dump_path=blocked, level="L1")
    failing.start()
    F.relu(torch.ones(1))
    failing.stop()
    with pytest.raises(DumpError, match="blocked"):
        failing.wait()
    failing.close()


def test_the_dumps_own_threads_are_not_recorded(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(dump_path=tmp_path, level="L1")
    debugger.start()
    done = threading.Event()

    def silenced() -> None:
        threads.silence_this_thread()
        torch.ones(3).sum()
        done.set()

    threading.Thread(target=silenced).start()
    done.wait()
    torch.zeros(1)
    debugger.close()
    data = json.loads((tmp_path / "step0" / "rank" / "dump.json").read_text())["data"]
    assert list(data) == ["Torch.zeros.0.forward"]
