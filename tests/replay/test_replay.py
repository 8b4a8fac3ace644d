"""Offline replay: each forward call of a real tensor dump rebuilt from its inputs and run in float64."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pytest_msprobe import PrecisionDebugger, seed_all
from pytest_msprobe.cli import main
from pytest_msprobe.replay.offline import replay_dump


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.fc = torch.nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.relu(self.conv(x))
        y = torch.nn.functional.dropout(y, p=0.2, training=True)
        return self.fc(y.flatten(1))


def _dump(root: Path, task: str = "tensor") -> Path:
    seed_all(3)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = PrecisionDebugger(task=task, dump_path=str(root), level="L1", step=[0])
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    debugger.start()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    debugger.stop()
    debugger.step()
    debugger.close()  # the step's files are written in the background: wait for them
    return root


def _noisy(fn: Callable[..., torch.Tensor], scale: float) -> Callable[..., torch.Tensor]:
    def noisy(*args: object, **kwargs: object) -> torch.Tensor:
        out = fn(*args, **kwargs)
        return out * (1 + scale * torch.randn_like(out))

    return noisy


def test_a_clean_dump_has_no_call_out_of_line(tmp_path: Path) -> None:
    result = replay_dump(_dump(tmp_path / "dump"))
    by_name = {c.name: c for c in result.calls}
    for name in ("Functional.conv2d.0.forward", "Functional.relu.0.forward", "Functional.linear.0.forward"):
        call = by_name[name]
        assert not call.skipped and call.outputs and all(o is not None for o in call.outputs), call
        assert not call.out_of_line, call
        own = call.outputs[0]
        assert own is not None and own.max_rel < 1e-4  # float32 against float64: rounding only
    assert result.out_of_line == []
    assert "random op" in by_name["Functional.dropout.0.forward"].skipped  # a draw is never replayed


def test_a_noisy_api_is_out_of_line_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(torch.nn.functional, "relu", _noisy(torch.nn.functional.relu, 1e-3))
    dump = _dump(tmp_path / "dump")
    result = replay_dump(dump)
    assert [c.name for c in result.out_of_line] == ["Functional.relu.0.forward"]
    code = main(["replay", str(dump), "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 1 and "Functional.relu.0.forward" in out and "1 out of line" in out
    doc = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert doc["out_of_line"] == ["Functional.relu.0.forward"] and doc["replayed"] >= 4


def test_the_cli_passes_a_clean_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = _dump(tmp_path / "dump")
    assert main(["replay", str(dump), "-o", str(tmp_path / "out"), "-q"]) == 0
    assert capsys.readouterr().out == ""
    assert (tmp_path / "out" / "replay.json").is_file()


def test_a_statistics_dump_cannot_be_replayed_and_says_so(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    dump = _dump(tmp_path / "dump", task="statistics")
    assert main(["replay", str(dump), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no forward call could be replayed" in err and "without its file" in err
    assert not (tmp_path / "out").exists()  # nothing judged, nothing written
