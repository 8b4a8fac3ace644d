"""The dump-overhead bench and the device check still run: what they report, not how fast anything is."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_dump_overhead_quick_run_reports_each_loop(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "dump_overhead.py"),
            "--quick",
            "--models",
            "tiny",
            "--configs",
            "statistics_L1",
            "tensor_L1",
            "trend",
            "--no-msprobe",
            "--threads",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["shape"] == {"steps": 6, "first": 2, "last": 3, "warmup": 1}
    rows = {row["config"]: row for row in doc["rows"]}
    assert set(rows) == {"statistics_L1", "tensor_L1", "trend"}
    assert all("msprobe" not in row for row in rows.values())
    stats = rows["statistics_L1"]["ours"]
    assert len(stats["step_ms"]) == 6 and stats["ratio"] > 0
    # dump.json, stack.json, construct.json and the checklist of the width-8 TinyResNet's step
    assert stats["files"] == 4 and stats["tensor_files"] == 0 and stats["records"] > 50
    tensor = rows["tensor_L1"]["ours"]
    assert tensor["tensor_files"] == tensor["tensors"] > 100
    assert tensor["files"] == tensor["tensor_files"] + 4
    assert 0 < tensor["tensor_bytes"] <= tensor["bytes"]
    assert tensor["write_one_file_ms"] > 0 and tensor["torch_save_files_ms"] > 0
    assert tensor["tensor_limit_ms"] == pytest.approx(
        tensor["plain_ms"] + 1.5 * tensor["torch_save_files_ms"]
    )
    assert "files" not in rows["trend"]["ours"]  # nothing dumped: the trend recorder alone
    assert "| TinyResNet w8 8x3x16x16 | tensor_L1 |" in run.stdout
    assert "| model | tool | plain ms | dumped ms |" in run.stdout  # the tensor table


def test_dump_overhead_refuses_a_window_outside_the_loop() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dump_overhead.py"), "--steps", "5", "--dump", "3-6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "--dump 3-6" in run.stderr and "window" in run.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_device_check_script_parses() -> None:
    run = subprocess.run(
        ["bash", "-n", str(ROOT / "bench" / "device_check.sh")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
