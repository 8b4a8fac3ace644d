"""Across devices the gate judges each call by what can tell a fault from rounding, never by drift.

The ResNet50 example is chaotic: run with one CPU thread instead of the two its shipped baseline was made with,
its two steps differ from the baseline in hundreds of calls, by rounding alone. Compared as a run of one device,
that fails. The same dump relabelled as made on another device type (its checklists' ``device``, as a CUDA run
records it) is compared across devices: the drift fails nothing, while a fault is still named at its call, by
its broken relation (a relu's Max is its input's) where errors already flow in, where its error enters where
they do not, and by its own error (the self-check) where statistics cannot tell.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from processes import NO_HYPOTHESIS

from pytest_msprobe.compare.diagnosis import ENTERS, INCONSISTENT, OUT_OF_LINE
from pytest_msprobe.compare.run import compare

pytestmark = pytest.mark.slow  # the example run on two simulated devices, in subprocesses

ROOT = Path(__file__).resolve().parents[1]
BASELINE = (
    ROOT / "examples/resnet50/baselines/cpu/examples/resnet50/test_resnet50/test_resnet50_training_steps"
)
ONE_THREAD = """
import pytest

@pytest.hookimpl(trylast=True)  # after the example's conftest pins two threads
def pytest_configure(config):
    import torch

    torch.set_num_threads(1)
"""

Run = Callable[..., "Example"]


class Example:
    """One run of the example with one thread: its exit status, its dump, the dump relabelled as another
    device's, and its session summary."""

    def __init__(self, out: Path, status: int, summary: dict) -> None:
        self.status, self.summary = status, summary
        found = sorted(out.glob("**/dump"))
        assert found, f"no dump kept under {out}"
        self.dump = found[0]
        self.other_device = out / "as-cuda"
        shutil.copytree(self.dump, self.other_device)
        for path in self.other_device.glob("**/checklist.json"):
            doc = json.loads(path.read_text())
            doc["device"] = "cuda"  # what a CUDA run records; its policy says float32, as the fixture sets
            if isinstance(doc.get("precision"), dict):
                doc["precision"]["device"] = "cuda"
            path.write_text(json.dumps(doc))


@pytest.fixture(scope="module")
def run_example(tmp_path_factory: pytest.TempPathFactory) -> Run:
    plugins = tmp_path_factory.mktemp("plugins")
    (plugins / "one_thread.py").write_text(ONE_THREAD)

    def run(fault: str | None = None, *extra: str) -> Example:
        out = tmp_path_factory.mktemp("run")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(plugins), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]
            ),
        }
        env.pop("INJECT_FAULT", None)
        args = ["-p", "one_thread"]
        if fault is not None:
            env["INJECT_FAULT"] = fault
            args += ["-p", "faults_plugin"]
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "examples/resnet50", "-p", "no:cacheprovider", *NO_HYPOTHESIS, *args,
             f"--msprobe-baseline={ROOT / 'examples/resnet50/baselines/cpu'}", f"--msprobe-output={out}",
             "--msprobe-keep-dumps", *extra],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert (out / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
        return Example(out, proc.returncode, json.loads((out / "summary.json").read_text()))

    return run


@pytest.fixture(scope="module")
def clean(run_example: Run) -> Example:
    return run_example()


def test_rounding_drift_fails_on_one_device_and_passes_across_devices(clean: Example) -> None:
    on_one = compare(clean.dump, BASELINE)
    assert clean.status == 1 and not on_one.passed and on_one.across is None
    breaching = on_one.counts()["apis_error"]
    assert breaching > 100  # one thread instead of two: rounding that training amplifies

    across = compare(clean.other_device, BASELINE)
    assert across.passed, across.first_divergence
    assert across.first_divergence is None and across.checklist is not None and not across.checklist.failures
    assert across.across is not None and not across.across.own_errors
    assert across.across.why == "the baseline ran on cpu, the target on cuda"
    assert across.across.drift_calls == breaching and across.across.evidence_calls == 0
    drifting = [a for a in across.apis if a.reason.startswith("drift across devices")]
    assert len(drifting) == breaching  # reported, each with its rows and why
    line = across.across.line()
    assert "values alone cannot tell rounding" in line and "--msprobe-self-check" in line


def test_a_fault_where_errors_flow_in_is_named_by_its_broken_relation(run_example: Run) -> None:
    # step 1: the one-thread drift already flows into the relu; its Max is no longer its input's
    faulty = run_example("op:Functional.relu.20@1")
    result = compare(faulty.other_device, BASELINE)
    assert not result.passed
    fd = result.first_divergence
    assert fd is not None and (fd.api, fd.step) == ("Functional.relu.20.forward", 1)
    assert fd.rule in (INCONSISTENT, ENTERS)
    assert result.across is not None and result.across.drift_calls > 100


def test_a_fault_where_inputs_match_is_named_where_its_error_enters(run_example: Run) -> None:
    faulty = run_example("op:Functional.conv2d.30@0")
    result = compare(faulty.other_device, BASELINE)
    assert not result.passed
    fd = result.first_divergence
    assert fd is not None and (fd.api, fd.step, fd.rule) == ("Functional.conv2d.30.forward", 0, ENTERS)


def test_a_fault_no_statistic_shows_is_named_by_its_own_error(run_example: Run) -> None:
    # a convolution 1e-3 off at step 1, where its inputs drift: statistics cannot tell it from rounding, its
    # own error (the target's self-check) can; the drift of the other calls is in line and fails nothing
    faulty = run_example("op:Functional.conv2d.40@1", "--msprobe-self-check")
    result = compare(faulty.other_device, BASELINE)
    assert not result.passed
    fd = result.first_divergence
    assert fd is not None and (fd.api, fd.step, fd.rule) == ("Functional.conv2d.40.forward", 1, OUT_OF_LINE)
    assert result.across is not None and result.across.own_errors
    assert [a.api for a in result.failures] == ["Functional.conv2d.40.forward"]
