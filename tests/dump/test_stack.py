"""stack.json's stacks: each call's own files and lines, also when another file holds the same code."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from pytest_msprobe import PrecisionDebugger
from pytest_msprobe.dump.stack import StackAnchor, StackTable, capture_stack

_SOURCE = """\
from pytest_msprobe.dump.stack import capture_stack


def forward():
    return capture_stack(0)
"""


def _load(path: Path) -> ModuleType:
    path.write_text(_SOURCE)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_same_code_in_two_files_keeps_each_file_s_name(tmp_path: Path) -> None:
    # code objects of two files compare equal when their code is the same: the formatted stacks are not shared
    first = _load(tmp_path / "first_model.py")
    second = _load(tmp_path / "second_model.py")
    assert first.forward.__code__ == second.forward.__code__  # the trap: equal, though of different files
    for _ in range(2):  # the second time from what was formatted before
        table = StackTable()
        table.add("Functional.relu.0.forward", first.forward())
        table.add("Functional.relu.1.forward", second.forward())
        rendered = table.render()
        by_name = {names[0]: lines for names, lines in rendered.values()}
        assert "first_model.py" in by_name["Functional.relu.0.forward"][0]
        assert "second_model.py" in by_name["Functional.relu.1.forward"][0]
        assert "return capture_stack(0)" in by_name["Functional.relu.0.forward"][0]


def test_calls_from_one_place_share_one_stack() -> None:
    def call() -> object:
        return capture_stack(0)

    table = StackTable()
    for i in range(3):
        table.add(f"Tensor.add.{i}.forward", call())
    rendered = table.render()
    assert len(rendered) == 1
    ((names, lines),) = rendered.values()
    assert names == [f"Tensor.add.{i}.forward" for i in range(3)]
    assert lines and "test_stack.py" in lines[0]


def _both(depth: int, anchor: StackAnchor) -> tuple[object, object]:
    """The stack of the caller of the innermost of ``depth`` nested calls, walked up to ``anchor`` and whole."""
    if depth:
        return _both(depth - 1, anchor)
    return capture_stack(1, anchor), capture_stack(1)


def test_an_anchored_stack_is_the_whole_stack() -> None:
    anchor = StackAnchor(skip=0)  # this test's frame and those above it: pytest's
    for depth in (0, 4, 1, 9):
        with_anchor, walked = _both(depth, anchor)
        assert with_anchor == walked
    assert anchor.frame is sys._getframe(0)  # settled on this frame: later walks stop here
    assert len(anchor.key) > 10  # pytest's frames, kept instead of walked


def test_a_stack_from_another_caller_of_a_resumed_generator_is_its_own() -> None:
    def steps() -> Iterator[tuple[object, object]]:
        anchor = StackAnchor(skip=0)  # the generator's frame: its caller changes at every resume
        while True:
            yield _both(2, anchor)

    def first(gen: Iterator[tuple[object, object]]) -> tuple[object, object]:
        return next(gen)

    def second(gen: Iterator[tuple[object, object]]) -> tuple[object, object]:
        return next(gen)

    gen = steps()
    for resume in (first, second, first):
        with_anchor, walked = resume(gen)
        assert with_anchor == walked


def test_an_anchor_whose_frames_have_returned_walks_the_whole_stack() -> None:
    def take() -> StackAnchor:
        return StackAnchor(skip=0)  # only this frame, gone when it returns, and the test's above it

    anchor = take()
    for depth in (3, 0):
        with_anchor, walked = _both(depth, anchor)
        assert with_anchor == walked


def test_a_captured_step_keeps_no_frames_after_it_stops(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(dump_path=tmp_path, task="statistics", level="L1", step=[0])
    debugger.start()
    torch.ones(2).relu()
    recorder = debugger._recorder
    assert recorder is not None and recorder.stacks.anchor is not None
    debugger.stop()
    assert recorder.stacks.anchor is None
    debugger.close()
    stacks = json.loads((tmp_path / "step0" / "rank" / "stack.json").read_text())
    assert any("torch.ones(2).relu()" in line for _, lines in stacks.values() for line in lines)
