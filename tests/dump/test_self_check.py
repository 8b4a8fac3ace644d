"""The online self-check: each captured API call replayed in float64 while the step runs, its own error in
``self_check.json`` beside the dump.json; msprobe's files as they are without it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_msprobe import PrecisionDebugger, seed_all
from pytest_msprobe.errors import ConfigError
from pytest_msprobe.replay import pristine
from pytest_msprobe.replay.offline import replay_dump
from tests.dump.self_check_sidecars import sidecar_calls

ROOT = Path(__file__).resolve().parents[2]


class Net(torch.nn.Module):
    """A small CNN: conv, batch_norm, relu (functional), dropout (not replayable), linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv(x)))
        y = F.dropout(y, p=0.2, training=True)
        return self.fc(y.flatten(1))


def _train(root: Path, steps: tuple[int, ...] = (0, 1), total: int = 2, **settings: Any) -> Path:
    seed_all(3, mode=True)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    settings = {"task": "statistics", "level": "L1", **settings}
    debugger = PrecisionDebugger(dump_path=str(root), step=list(steps), **settings)
    g = torch.Generator().manual_seed(0)
    for _ in range(total):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
        debugger.start()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        debugger.stop()
        debugger.step()
    debugger.close()
    return root


def _out_of_line(root: Path) -> set[tuple[int | None, str]]:
    return {key for key, call in sidecar_calls(root).items() if call.out_of_line}


def _noisy_relu(monkeypatch: pytest.MonkeyPatch) -> None:
    """relu, 1e-3 noisy: the noise goes in under no_grad, so the output's node stays relu's."""
    original = F.relu

    def relu(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        out = original(input, inplace=inplace)
        out.data.mul_(1 + 1e-3 * torch.randn_like(out))
        return out

    monkeypatch.setattr(F, "relu", relu)


class _OffGradient(torch.autograd.Function):
    """relu whose gradient is 1% off (its forward is exact)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * (x > 0) * 1.01


def test_a_statistics_dump_gets_sidecars_and_keeps_its_files_as_they_are(tmp_path: Path) -> None:
    plain = _train(tmp_path / "plain")
    checked = _train(tmp_path / "checked", self_check=True)
    for step in (0, 1):
        for name in ("dump.json", "construct.json"):
            a = (plain / f"step{step}" / "rank" / name).read_bytes()
            b = (checked / f"step{step}" / "rank" / name).read_bytes()
            assert a == b, (step, name)  # byte for byte: the replay records nothing, draws nothing
        stacks = [json.loads((root / f"step{step}/rank/stack.json").read_text()) for root in (plain, checked)]
        assert stacks[0].keys() == stacks[1].keys()  # (their last frames, _train's callers, differ)
        assert not (plain / f"step{step}" / "rank" / "self_check.json").exists()
    calls = sidecar_calls(checked)
    data = json.loads((checked / "step0" / "rank" / "dump.json").read_text())["data"]
    assert [name for (step, name) in calls if step == 0] == list(data)  # every record, in the dump's order
    doc = json.loads((checked / "step0" / "rank" / "self_check.json").read_text())
    assert doc["device"] == "cpu" and doc["source"] == "online"
    for name in (
        "Functional.conv2d.0.forward",
        "Functional.batch_norm.0.forward",
        "Functional.relu.0.forward",
        "Functional.linear.0.forward",
        "Functional.conv2d.0.backward",
        "Functional.relu.0.backward",
        "Functional.linear.0.backward",
    ):
        call = calls[(0, name)]
        assert not call.skipped and any(o is not None for o in call.outputs), (name, call)
    assert "random op" in calls[(0, "Functional.dropout.0.forward")].skipped
    assert "random op" in calls[(0, "Functional.dropout.0.backward")].skipped
    assert not _out_of_line(checked)  # CPU float32 against float64: no false alarm


def test_the_online_check_gives_the_offline_replays_verdicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = _train(tmp_path / "clean", task="tensor", self_check=True)
    offline = replay_dump(clean)
    online = sidecar_calls(clean)
    assert {(c.step, c.name) for c in offline.calls} == set(online)
    for call in offline.calls:  # the same calls replayed, the same skipped for the same reason
        mine = online[(call.step, call.name)]
        assert bool(mine.skipped) == bool(call.skipped) and mine.skipped == call.skipped, call.name
        assert len(mine.outputs) == len(call.outputs), call.name
    assert not offline.out_of_line and not _out_of_line(clean)

    _noisy_relu(monkeypatch)
    noisy = _train(tmp_path / "noisy", task="tensor", self_check=True)
    monkeypatch.setattr(F, "relu", _OffGradient.apply)
    off = _train(tmp_path / "off", task="tensor", self_check=True)
    monkeypatch.undo()
    for dump, name in ((noisy, "Functional.relu.0.forward"), (off, "Functional.relu.0.backward")):
        # (the convolution's bias gradient, before a batch norm, is rounding alone: it sums to nothing)
        found = _out_of_line(dump)
        assert found == {(0, name), (1, name)}
        assert found == {(c.step, c.name) for c in replay_dump(dump).out_of_line}


def test_the_replay_runs_torchs_relu_not_the_faulty_one_in_its_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _noisy_relu(monkeypatch)
    dump = _train(tmp_path / "dump", steps=(1,), self_check=True)
    assert _out_of_line(dump) == {(1, "Functional.relu.0.forward")}
    own = sidecar_calls(dump)[(1, "Functional.relu.0.forward")].outputs[0]
    assert own is not None and own.rel_share > 0.1 and "more than 0.001 off" in own.reason


def test_a_gradient_that_is_off_is_named_by_its_backward_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(F, "relu", _OffGradient.apply)
    dump = _train(tmp_path / "dump", steps=(2, 3), total=4, self_check=True)  # from the middle of the run
    assert _out_of_line(dump) == {(2, "Functional.relu.0.backward"), (3, "Functional.relu.0.backward")}
    forward = sidecar_calls(dump)[(2, "Functional.relu.0.forward")]
    assert not forward.out_of_line and forward.outputs  # the forward is exact


def test_the_replay_leaves_the_training_s_random_draws_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def drawing_relu(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        torch.rand(16)  # a function that draws, as the replay runs it
        return torch.relu(input)

    pristine.capture()
    monkeypatch.setitem(pristine._CAPTURED["Functional"], "relu", drawing_relu)
    checked = _train(tmp_path / "checked", self_check=True)
    monkeypatch.undo()
    plain = _train(tmp_path / "plain")
    for step in (0, 1):
        assert (plain / f"step{step}/rank/dump.json").read_text() == (
            checked / f"step{step}/rank/dump.json"
        ).read_text()


def test_a_call_whose_replay_raises_is_skipped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("no kernel for this\nsecond line")

    pristine.capture()
    monkeypatch.setitem(pristine._CAPTURED["Functional"], "linear", broken)
    calls = sidecar_calls(_train(tmp_path / "dump", steps=(0,), self_check=True))
    for direction in ("forward", "backward"):
        call = calls[(0, f"Functional.linear.0.{direction}")]
        assert call.skipped == "the replay raised RuntimeError: no kernel for this" and not call.outputs


def test_only_the_records_of_the_dump_are_judged(tmp_path: Path) -> None:
    dump = _train(tmp_path / "dump", steps=(0,), self_check=True, data_mode=["forward"], list=["relu"])
    data = json.loads((dump / "step0/rank/dump.json").read_text())["data"]
    assert list(data) == ["Functional.relu.0.forward"]
    assert list(sidecar_calls(dump)) == [(0, "Functional.relu.0.forward")]


def test_mix_level_judges_the_api_calls_and_leaves_the_modules_out(tmp_path: Path) -> None:
    seed_all(3, mode=True)
    model = Net()
    debugger = PrecisionDebugger(dump_path=str(tmp_path / "d"), level="mix", step=[0], self_check=True)
    debugger.start(model=model)
    F.cross_entropy(model(torch.randn(2, 3, 8, 8)), torch.tensor([0, 1])).backward()
    debugger.stop()
    debugger.close()
    calls = sidecar_calls(tmp_path / "d")
    assert calls and not any(name.startswith("Module.") for _, name in calls)
    assert not calls[(0, "Functional.conv2d.0.backward")].skipped


def test_the_config_file_key_and_the_argument(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"task": "statistics", "level": "L1", "self_check": True, "dump_path": "x"}))
    assert PrecisionDebugger(config_path=config).config.self_check
    assert not PrecisionDebugger(config_path=config, self_check=False).config.self_check
    with pytest.warns(UserWarning, match="ignoring unknown key 'self_chek'"):
        PrecisionDebugger(config_path=_write(config, {"self_chek": True, "dump_path": "x"}))
    with pytest.raises(ConfigError, match=r"self_check='yes' in .*config.json: expected true or false"):
        PrecisionDebugger(config_path=_write(config, {"self_check": "yes", "dump_path": "x"}))
    with pytest.raises(ConfigError, match="self_check replays API calls: it needs level L1 or mix, not L0"):
        PrecisionDebugger(dump_path=str(tmp_path), level="L0", self_check=True)


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_the_snapshot_is_taken_when_torch_is_imported_before_any_patch() -> None:
    code = (
        "import sys\n"
        "from pytest_msprobe.replay import pristine\n"
        "pristine.capture_when_torch_loads()\n"
        "assert 'torch' not in sys.modules and not pristine._CAPTURED\n"
        "import torch, torch.nn.functional as F\n"
        "relu = F.relu\n"
        "assert pristine._CAPTURED and not any(isinstance(f, pristine._AfterTorch) for f in sys.meta_path)\n"
        "F.relu = lambda x, inplace=False: x\n"
        "from pytest_msprobe.replay.apis import resolve\n"
        "assert resolve('Functional.relu.0.forward').fn is relu\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_snapshot_taken_while_the_wrappers_stand_holds_what_they_wrap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    relu: Callable[..., Any] = F.relu
    debugger = PrecisionDebugger(dump_path="unused", step=[0])
    debugger.start()  # the wrappers stand in torch's namespaces
    try:
        assert F.relu is not relu
        monkeypatch.setattr(pristine, "_CAPTURED", {})
        pristine.capture()
    finally:
        debugger.abort()
    assert pristine.lookup("Functional", "relu") is relu
    assert pristine.lookup("Tensor", "add") is torch.Tensor.add
