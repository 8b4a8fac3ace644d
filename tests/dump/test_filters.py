"""Filters: list, scope, data_mode, steps and ranks decide which records are written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_msprobe import PrecisionDebugger

pytestmark = pytest.mark.usefixtures("no_leftover_debugger")


def _names(root: Path, step: int = 0) -> list[str]:
    path = root / f"step{step}" / "rank" / "dump.json"
    return list(json.loads(path.read_text())["data"])


def test_list_by_api_kind_and_by_full_name(tmp_path: Path, train: Any) -> None:
    train(PrecisionDebugger(dump_path=tmp_path / "kind", level="L1", step=[0], list=["relu"]), steps=1)
    names = _names(tmp_path / "kind")
    assert names and all(".relu." in n for n in names)
    assert {n for n in names if n.endswith("forward")} == {f"Functional.relu.{i}.forward" for i in range(5)}
    assert "Functional.relu.0.backward" in names

    exact = ["Functional.conv2d.1.forward", "Tensor.__add__.0"]
    train(PrecisionDebugger(dump_path=tmp_path / "full", level="L1", step=[0], list=exact), steps=1)
    assert _names(tmp_path / "full") == [
        "Functional.conv2d.1.forward",
        "Tensor.__add__.0.forward",
        "Tensor.__add__.0.backward",
    ]


def test_filtered_runs_keep_the_unfiltered_numbering(tmp_path: Path, train: Any) -> None:
    train(
        PrecisionDebugger(dump_path=tmp_path, level="L1", step=[0], list=["Functional.batch_norm.3"]), steps=1
    )
    assert _names(tmp_path) == ["Functional.batch_norm.3.forward", "Functional.batch_norm.3.backward"]


def test_scope_is_a_range_of_calls(tmp_path: Path, train: Any) -> None:
    scope = ["Functional.relu.1.forward", "Functional.batch_norm.2"]
    train(PrecisionDebugger(dump_path=tmp_path, level="L1", step=[0], scope=scope), steps=1)
    names = _names(tmp_path)
    assert [n for n in names if n.endswith("forward")] == [
        "Functional.relu.1.forward",
        "Functional.conv2d.2.forward",
        "Tensor.add_.2.forward",
        "Functional.batch_norm.2.forward",
    ]
    # the backward records of the calls in range, and only those
    assert {n for n in names if n.endswith("backward")} == {
        "Functional.relu.1.backward",
        "Functional.conv2d.2.backward",
        "Functional.batch_norm.2.backward",
    }


def test_scope_of_modules_at_level_mix(tmp_path: Path, train: Any) -> None:
    scope = ["Module.layer1.BasicBlock.forward.0"]  # one bound: that module's call, and everything in it
    train(PrecisionDebugger(dump_path=tmp_path, level="mix", step=[0], scope=scope), steps=1)
    forward = [n for n in _names(tmp_path) if ".forward" in n]
    assert forward[0] == "Functional.conv2d.1.forward"
    assert forward[-1] == "Module.layer1.BasicBlock.forward.0"
    assert "Functional.conv2d.3.forward" not in forward and "Module.bn1.BatchNorm2d.forward.0" not in forward


def test_steps_as_ranges(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(dump_path=tmp_path, level="L1", step=["1-2", 4])
    for _ in range(6):
        debugger.start()
        F.relu(torch.ones(1))
        debugger.stop()
        debugger.step()
    debugger.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1", "step2", "step4"]


def test_ranks_not_selected_dump_nothing(tmp_path: Path) -> None:
    # outside torch.distributed the process is rank 0
    debugger = PrecisionDebugger(dump_path=tmp_path, level="L1", rank=[1])
    debugger.start()
    F.relu(torch.ones(1))
    debugger.close()
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    kept = PrecisionDebugger(dump_path=tmp_path / "r0", level="L1", rank=[0])
    kept.start()
    F.relu(torch.ones(1))
    kept.close()
    assert _names(tmp_path / "r0") == ["Torch.ones.0.forward", "Functional.relu.0.forward"]
