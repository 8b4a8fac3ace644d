"""The DDP example as a multi-rank precision test, as a user runs it: the shipped CPU baseline passes with two
gloo ranks, and a relu 1% wrong on rank 1 only fails the test naming rank 1."""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from processes import NO_HYPOTHESIS

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "examples" / "ddp" / "baselines" / "cpu"
NODE = "examples/ddp/test_ddp.py::test_ddp_training_steps"
FOLDER = Path("examples/ddp/test_ddp/test_ddp_training_steps")

# a plugin loaded before ours, in every rank: rank 1's relus go 1% wrong (the example's own faulty kernel)
RANK1_FAULT = textwrap.dedent(
    f"""
    import importlib.util
    import os
    import sys

    if os.environ.get("RANK") == "1":
        spec = importlib.util.spec_from_file_location("train_ddp", {str(ROOT / "examples" / "ddp" / "train_ddp.py")!r})
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_ddp"] = module
        spec.loader.exec_module(module)

        def pytest_configure(config):
            module.install_relu_fault(0.01)
    """
)

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="multi-rank tests: POSIX"),
    pytest.mark.slow,  # two-rank runs of the example
]


def _pytest(tmp_path: Path, *args: str, fault: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if fault:
        (tmp_path / "rank1_fault.py").write_text(RANK1_FAULT)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH", "")) if p)
        args = ("-p", "rank1_fault", *args)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "examples/ddp",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        *NO_HYPOTHESIS,
        *args,
    ]
    cmd += [f"--msprobe-baseline={SHIPPED}", f"--msprobe-output={tmp_path / 'out'}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_shipped_baseline_passes_with_two_gloo_ranks(tmp_path: Path) -> None:
    manifest = json.loads((SHIPPED / FOLDER / "msprobe_manifest.json").read_text())
    assert manifest["extra"]["world_size"] == 2 and manifest["extra"]["backend"] == "gloo"
    ranks = sorted(p.parent.name for p in (SHIPPED / FOLDER).glob("step0/rank*/dump.json"))
    assert ranks == ["rank0", "rank1"]
    run = _pytest(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"PASSED       {NODE}" in run.stdout


def test_a_relu_fault_on_rank_one_fails_naming_rank_one(tmp_path: Path) -> None:
    report = tmp_path / "report.html"
    run = _pytest(tmp_path, f"--junitxml={tmp_path / 'junit.xml'}", f"--html={report}", fault=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "first divergence: Functional.relu.1.forward (step 0, rank 1)" in run.stdout, run.stdout
    summary = json.loads((tmp_path / "out" / FOLDER / "compare" / "summary.json").read_text())
    by_rank = {r["rank"]: r["passed"] for r in summary["ranks"]}
    assert by_rank == {0: False, 1: False}  # DDP carries rank 1's error into rank 0's gradients
    assert 'name="msprobe_first_divergence_rank" value="1"' in (tmp_path / "junit.xml").read_text()
    # the pytest-html report (its results are an HTML-escaped JSON blob) names the rank, in the headline and in
    # the advisor text
    page = html.unescape(report.read_text())
    assert "Functional.relu.1.forward</b> (step 0, rank 1)" in page
    assert "msprobe-advisor" in page and "The error enters on rank 1" in page
