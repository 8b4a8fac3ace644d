"""The ResNet50 example end to end, as a user runs it: shipped baseline, regenerate, pass, a faulty relu fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from processes import NO_HYPOTHESIS

pytestmark = pytest.mark.slow  # ResNet50 training steps in subprocesses

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "resnet50"
SHIPPED = EXAMPLE / "baselines" / "cpu"
NODE = "examples/resnet50/test_resnet50.py::test_resnet50_training_steps"
FOLDER = Path("examples/resnet50/test_resnet50/test_resnet50_training_steps")

# another plugin, loaded before ours, that makes the fifth relu of every forward 1% wrong
RELU_FAULT = textwrap.dedent(
    """
    import torch.nn.functional as F

    _orig = F.relu
    _calls = {"n": 0}


    def _relu(input, inplace=False):
        out = _orig(input, inplace=inplace)
        _calls["n"] += 1
        if _calls["n"] % 49 == 5:  # ResNet50 calls relu 49 times per forward
            out = out * 1.01
        return out


    def pytest_configure(config):
        F.relu = _relu
    """
)


def _pytest(tmp_path: Path, *args: str, fault: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if fault:
        (tmp_path / "relu_fault.py").write_text(RELU_FAULT)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH", "")) if p)
        args = ("-p", "relu_fault", *args)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "examples/resnet50",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        *NO_HYPOTHESIS,
        *args,
    ]
    cmd += [f"--msprobe-output={tmp_path / 'out'}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_shipped_cpu_baseline_passes(tmp_path: Path) -> None:
    manifest = json.loads((SHIPPED / FOLDER / "msprobe_manifest.json").read_text())
    assert manifest["device"].startswith("cpu") and manifest["task"] == "statistics"
    run = _pytest(tmp_path, f"--msprobe-baseline={SHIPPED}")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"PASSED       {NODE}" in run.stdout


def test_regenerate_then_a_faulty_relu_fails_with_the_relu_named(tmp_path: Path) -> None:
    # (a first run without a baseline, MISSING with the command that writes it, is the workflow tests' part)
    baselines = tmp_path / "baselines"
    regen = _pytest(tmp_path, f"--msprobe-baseline={baselines}", "--msprobe-regen-baseline")
    assert regen.returncode == 0, regen.stdout + regen.stderr
    assert "1 baseline(s) written to" in regen.stdout
    assert (baselines / FOLDER / "step1" / "rank" / "dump.json").is_file()

    # the fresh baseline is read and compared: the fault alone is named (a pass is the shipped baseline's test)
    html = tmp_path / "report.html"
    fail = _pytest(tmp_path, f"--msprobe-baseline={baselines}", f"--html={html}", fault=True)
    assert fail.returncode == 1, fail.stdout + fail.stderr
    last = fail.stdout.strip().splitlines()[-1]
    assert "1 failed" in last and "error" not in last
    assert "first divergence: Functional.relu.4.forward (step 0, rank 0)" in fail.stdout
    report = html.read_text()
    assert "Functional.relu.4.forward" in report and "msprobe-first-divergence" in report


def test_main_script_writes_an_msprobe_dump(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE / "main.py"),
            "-a",
            "resnet18",
            "-b",
            "2",
            "--dummy",
            "--image-size",
            "32",
            "--steps",
            "1",
            "--dump-step",
            "0",
            "--device",
            "cpu",
            "--dump-path",
            str(tmp_path / "dump"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    dump = json.loads((tmp_path / "dump" / "step0" / "rank" / "dump.json").read_text())
    assert dump["task"] == "statistics" and dump["level"] == "L1"
    assert "Functional.conv2d.0.forward" in dump["data"] and "Functional.relu.0.backward" in dump["data"]
