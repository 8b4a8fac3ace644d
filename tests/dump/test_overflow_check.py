"""Task overflow_check: msprobe's format with only the calls whose outputs hold inf/nan, whole (inputs too)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pytest_msprobe import PrecisionDebugger
from pytest_msprobe.compare.dumps import validate
from pytest_msprobe.errors import ConfigError
from tests.compare.overflow_models import dump

pytestmark = pytest.mark.usefixtures("no_leftover_debugger")


def _nonfinite(node: Any) -> bool:
    if isinstance(node, dict):
        stats = [node.get(k) for k in ("Max", "Min")]
        if any(isinstance(v, float) and not math.isfinite(v) for v in stats):
            return True
        return any(_nonfinite(v) for v in node.values())
    return isinstance(node, list) and any(_nonfinite(v) for v in node)


def _read(root: Path, step: int, name: str = "dump.json") -> dict[str, Any]:
    return json.loads((root / f"step{step}" / "rank" / name).read_text())


def test_only_the_overflowing_calls_are_written_whole_in_msprobes_format(tmp_path: Path) -> None:
    full = dump(tmp_path / "full", factor=1e5)
    checked = dump(tmp_path / "ovf", task="overflow_check", factor=1e5, overflow_nums=-1)
    for step in (0, 1):
        doc = _read(checked, step)
        # msprobe's header, in its order, with its task name
        assert list(doc) == ["task", "level", "framework", "dump_data_dir", "data"]
        assert (doc["task"], doc["level"], doc["framework"], doc["dump_data_dir"]) == (
            "overflow_check",
            "L1",
            "pytorch",
            None,
        )
        every = _read(full, step)["data"]
        kept = doc["data"]
        assert kept and len(kept) < len(every)
        # the records are those of the statistics dump of the same run, every one that overflows, in order
        assert kept == {name: every[name] for name in kept}
        overflowing = [name for name, entry in every.items() if _nonfinite(entry.get("output", entry))]
        assert list(kept) == overflowing
        stacks = _read(checked, step, "stack.json")
        assert {n for names, _ in stacks.values() for n in names} <= set(kept)
    first = _read(checked, 0)["data"]
    assert next(iter(first)) == "Tensor.__mul__.0.forward"
    assert set(first["Tensor.__mul__.0.forward"]) == {"input_args", "input_kwargs", "output"}
    assert validate(checked).calls == sum(len(_read(checked, s)["data"]) for s in (0, 1))


def test_a_clean_run_writes_every_step_with_no_call(tmp_path: Path) -> None:
    checked = dump(tmp_path / "ovf", task="overflow_check")
    for step in (0, 1):
        assert _read(checked, step)["data"] == {} and _read(checked, step, "stack.json") == {}
    assert validate(checked).calls == 0


def test_overflow_nums_counts_over_the_whole_dump(tmp_path: Path) -> None:
    one = dump(tmp_path / "one", task="overflow_check", factor=1e5)  # msprobe's default: 1
    assert list(_read(one, 0)["data"]) == ["Tensor.__mul__.0.forward"] and _read(one, 1)["data"] == {}
    three = dump(tmp_path / "three", task="overflow_check", factor=1e5, overflow_nums=3)
    assert len(_read(three, 0)["data"]) == 3 and _read(three, 1)["data"] == {}


def test_config_json_section_and_bad_values(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "task": "overflow_check",
                "dump_path": str(tmp_path / "d"),
                "overflow_check": {"overflow_nums": -1},
            }
        )
    )
    debugger = PrecisionDebugger(config_path=config)
    assert debugger.config.task == "overflow_check" and debugger.config.overflow_nums == -1
    config.write_text(
        json.dumps({"task": "overflow_check", "dump_path": "d", "overflow_check": {"overflow_nums": "all"}})
    )
    with pytest.raises(ConfigError, match=r"overflow_nums='all' in .*config.json: expected the number"):
        PrecisionDebugger(config_path=config)
    with pytest.raises(ConfigError, match="only valid with task 'statistics'"):
        PrecisionDebugger(dump_path=tmp_path, task="overflow_check", summary_mode="md5")
