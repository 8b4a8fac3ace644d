"""The transformer example end to end, as a user runs it: its shipped CPU baseline passes, and each fault of
``bench/faults_plugin.py`` fails the test with the first divergence at the call (or weight) it broke."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from processes import NO_HYPOTHESIS

pytestmark = pytest.mark.slow  # whole pytest runs of the example, one per fault

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "examples" / "transformer" / "baselines" / "cpu"
NODE = "examples/transformer/test_transformer.py::test_transformer_training_steps"
FOLDER = Path("examples/transformer/test_transformer/test_transformer_training_steps")


def _pytest(tmp_path: Path, *args: str, fault: str = "") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if fault:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "bench"), env.get("PYTHONPATH", "")) if p)
        env["INJECT_FAULT"], env["INJECT_FAULT_LOG"] = fault, str(tmp_path / "fired.json")
        args = ("-p", "faults_plugin", *args)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "examples/transformer",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        *NO_HYPOTHESIS,
    ]
    cmd += [*args, f"--msprobe-baseline={SHIPPED}", f"--msprobe-output={tmp_path / 'out'}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_shipped_cpu_baseline_passes(tmp_path: Path) -> None:
    manifest = json.loads((SHIPPED / FOLDER / "msprobe_manifest.json").read_text())
    assert manifest["device"].startswith("cpu") and manifest["task"] == "statistics"
    dumped = sorted(p.parent.parent.name for p in (SHIPPED / FOLDER).glob("step*/rank/dump.json"))
    assert dumped == ["step0", "step1"]
    run = _pytest(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"PASSED       {NODE}" in run.stdout


@pytest.mark.parametrize(
    ("fault", "fired", "first"),
    [
        # block 1's v projection: its output x (1 + 1e-3)
        (
            "op:Functional.linear.8",
            "Functional.linear.8.forward",
            "Functional.linear.8.forward (step 0, rank 0)",
        ),
        # block 1's first layer_norm: its backward 1% off
        (
            "backward:Functional.layer_norm.2",
            "Functional.layer_norm.2.backward",
            "Functional.layer_norm.2.backward (step 0, rank 0)",
        ),
        # one weight off after step 0's update: named at that parameter's update (optimizer.json on both sides)
        (
            "optimizer:blocks.0.fc1.weight",
            "blocks.0.fc1.weight (after optimizer.step())",
            "Optimizer.blocks.0.fc1.weight.0.forward (step 0, rank 0)",
        ),
    ],
)
def test_an_injected_fault_fails_the_test_named_where_it_was_made(
    tmp_path: Path, fault: str, fired: str, first: str
) -> None:
    run = _pytest(tmp_path, fault=fault)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"FAILED       {NODE}" in run.stdout
    assert f"first divergence: {first}" in run.stdout, run.stdout
    log = json.loads((tmp_path / "fired.json").read_text())
    assert log == [{"step": 0, "at": fired}, {"step": 1, "at": fired}]
    assert f"injected fault {fault}: fired 2 time(s), steps [0, 1], at {fired}" in run.stdout
