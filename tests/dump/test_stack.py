"""stack.json's stacks: each call's own files and lines, also when another file holds the same code."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from pytest_msprobe.dump.stack import StackTable, capture_stack

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
