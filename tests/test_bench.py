"""The dump-overhead bench and the device check still run: what they report, not how fast anything is."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
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
    # dump.json, stack.json, construct.json, the checklist and optimizer.json of the width-8 TinyResNet's step
    assert stats["files"] == 5 and stats["tensor_files"] == 0 and stats["records"] > 50
    tensor = rows["tensor_L1"]["ours"]
    assert tensor["tensor_files"] == tensor["tensors"] > 100
    assert tensor["files"] == tensor["tensor_files"] + 5
    assert 0 < tensor["tensor_bytes"] <= tensor["bytes"]
    assert tensor["write_one_file_ms"] > 0 and tensor["torch_save_files_ms"] > 0
    assert tensor["tensor_limit_ms"] == pytest.approx(
        tensor["plain_ms"] + 1.5 * tensor["torch_save_files_ms"]
    )
    assert "files" not in rows["trend"]["ours"]  # nothing dumped: the trend recorder alone
    assert "| TinyResNet w8 8x3x16x16 | tensor_L1 |" in run.stdout
    assert "| model | tool | plain ms | dumped ms |" in run.stdout  # the tensor table


def test_breakdown_accounts_for_the_dumped_step(tmp_path: Path) -> None:
    out = tmp_path / "breakdown.json"
    argv = ["--quick", "--threads", "1", "--breakdown", "statistics_L1", "tiny", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dump_overhead.py"), *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(out.read_text())["breakdown"]
    parts = found["parts"]
    assert found["dumped_ms"] > found["plain_ms"] > 0
    # start(), the body and stop() are the dumped step, whole
    body = parts["the step's body (forward, backward, optimizer)"]["ms"]
    assert parts["start()"]["ms"] + body + parts["stop()"]["ms"] == pytest.approx(found["dumped_ms"])
    assert 0 < parts["the checklist's fingerprints"]["ms"] <= parts["start()"]["ms"]
    # every tensor whose statistics were computed is in one size bucket; the width-8 model's are small
    sizes = found["statistics"]
    assert sizes["<= 4K (copied, reduced at flush)"]["tensors"] > 100 and sizes["> 1M"]["tensors"] == 0
    total = sum(v["ms"] for v in sizes.values())
    assert parts["statistics' reductions"]["ms"] == pytest.approx(total)
    # 326 items of the recorded calls, and 4 of each of its 20 parameters' updates (the weight and its gradient
    # before, the weight and its momentum buffer after)
    assert parts["recorded calls"]["note"] == "91 a step" and parts["tensor items"]["note"] == "406 a step"
    # each dumped step's files were written once, inline or on the writer thread, and took CPU time
    jobs = found["writer_jobs"]
    assert sorted(job["step"] for job in jobs) == [2, 3] and all(job["cpu_ms"] > 0 for job in jobs)
    assert "| the step's body (forward, backward, optimizer) |" in run.stdout


def test_breakdown_refuses_a_configuration_that_dumps_nothing() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dump_overhead.py"), "--breakdown", "trend", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "--breakdown trend tiny" in run.stderr


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


def _stage(
    out: Path, name: str, outcome: str, summary: dict[str, object] | None, fired: object = None
) -> None:
    """What a compare stage of the device check leaves: its junit file, its compare's summary.json, its firings."""
    body = {"failure": '<failure message="precision breach"/>', "passed": ""}[outcome]
    (out / f"{name}.xml").write_text(
        f'<testsuites><testsuite><testcase classname="t" name="test_x">{body}</testcase></testsuite></testsuites>'
    )
    if summary is not None:
        compare = out / f"{name}-output" / "examples" / "m" / "t" / "test_x" / "compare"
        compare.mkdir(parents=True)
        (compare / "summary.json").write_text(json.dumps(summary))
        (out / f"{name}-output" / "summary.json").write_text("{}")  # the session's: not the compare's
    if fired is not None:
        (out / f"{name}-fired.json").write_text(json.dumps(fired))


def test_device_check_summary_tells_whether_each_fault_is_named_where_it_was_made(tmp_path: Path) -> None:
    counts = {"apis_error": 12, "apis": 996, "error": 31, "rows": 3356}
    at_op = {
        "kind": "api",
        "api": "Functional.linear.8.forward",
        "step": 0,
        "reason": "the error enters here",
    }
    elsewhere = {
        "kind": "api",
        "api": "Functional.linear.5.forward",
        "step": 1,
        "reason": "the error enters here",
    }
    weight = {"kind": "parameter", "name": "fc.weight", "where": "before step 1", "api": None, "step": 1}
    (tmp_path / "stages.tsv").write_text("tr-clean\tok\t9\ntr-op\texit 1\t8\n")
    (tmp_path / "faults.tsv").write_text(
        "tr-clean\ttransformer\t\ntr-op\ttransformer\top:Functional.linear.8\n"
        "tr-backward\ttransformer\tbackward:Functional.gelu.1\ntr-optimizer\ttransformer\toptimizer:fc.weight\n"
        "tr-missed\ttransformer\top:Functional.linear.99\n"
        "tr-update\ttransformer\toptimizer:fc.weight\n"
    )
    _stage(tmp_path, "tr-clean", "passed", {"counts": {**counts, "apis_error": 0}, "first_divergence": None})
    fired_op = [
        {"step": 0, "at": "Functional.linear.8.forward"},
        {"step": 1, "at": "Functional.linear.8.forward"},
    ]
    _stage(tmp_path, "tr-op", "failure", {"counts": counts, "first_divergence": at_op}, fired_op)
    _stage(
        tmp_path,
        "tr-backward",
        "failure",
        {"counts": counts, "first_divergence": elsewhere},
        [{"step": 0, "at": "Functional.gelu.1.backward"}],
    )
    fired_w = [{"step": 0, "at": "fc.weight (after optimizer.step())"}]
    _stage(tmp_path, "tr-optimizer", "failure", {"counts": counts, "first_divergence": weight}, fired_w)
    _stage(tmp_path, "tr-missed", "passed", {"counts": counts, "first_divergence": None}, [])
    update = {
        "kind": "api",
        "api": "Optimizer.fc.weight.0.forward",
        "step": 0,
        "reason": "the error enters here",
    }
    _stage(tmp_path, "tr-update", "failure", {"counts": counts, "first_divergence": update}, fired_w)
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "device_check_summary.py"), str(tmp_path), "cuda", "300"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    rows = {
        line.split(" | ")[1]: line for line in run.stdout.splitlines() if line.startswith("| transformer |")
    }
    assert rows["tr-clean"].endswith(
        "| none (clean) |  | passed | 0 / 996 calls (31 / 3356 rows) | none |  |"
    )
    assert rows["tr-op"].startswith(
        "| transformer | tr-op | op:Functional.linear.8 | Functional.linear.8.forward, steps 0, 1 | failure | "
        "12 / 996 calls (31 / 3356 rows) | Functional.linear.8.forward (step 0): the error enters here | yes |"
    )
    assert "| Functional.linear.5.forward (step 1): the error enters here | no |" in rows["tr-backward"]
    assert "| parameter fc.weight (before step 1): " in rows["tr-optimizer"]
    assert rows["tr-optimizer"].endswith("| yes |")
    assert "| never fired | passed |" in rows["tr-missed"] and rows["tr-missed"].endswith("| no result |")
    # a weight's update named at the step the fault fired is where it was made too
    assert "| Optimizer.fc.weight.0.forward (step 0): " in rows["tr-update"] and rows["tr-update"].endswith(
        "| yes |"
    )
    assert "| tr-op | exit 1 | 8 |" in run.stdout  # the stage table
    assert "no result (see cuda-tests.log)" in run.stdout  # a stage that left nothing


def test_launch_count_reports_the_dumps_operators_per_recorded_tensor(tmp_path: Path) -> None:
    out = tmp_path / "launches.json"
    script = str(ROOT / "bench" / "launch_count.py")
    run = subprocess.run(
        [sys.executable, script, "--models", "tiny", "--tasks", "statistics", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(out.read_text())
    # TinyResNet's step records 326 tensors; the dump's own operators: a copy of each small tensor, the flush's
    # reductions (counted on whichever thread runs them), no item()
    assert row["tensors"] > 300 and row["syncs"] == 0
    assert row["top"]["clone"] > 200 and "amax" in row["top"] and "stack" in row["top"]
    assert row["per_tensor"] == round(row["launches"] / row["tensors"], 2) and "| TinyResNet w8" in run.stdout
