"""Real msprobe dumps of several fault cases (both layouts) and inserted calls: exit code and first divergence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pytest_msprobe.cli import main
from pytest_msprobe.compare import compare

FAULTS = Path(__file__).resolve().parents[1] / "data" / "msprobe" / "faults"
VERSIONS = ["msprobe-8.3.3", "msprobe-26.2.0"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("case", "entry"),
    [
        ("relu", "Functional.relu.0.forward"),
        ("conv", "Functional.conv2d.0.forward"),
        ("bf16", "Functional.conv2d.3.forward"),
    ],
)
def test_fault_cases_name_where_the_error_enters(version: str, case: str, entry: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(
        ["compare", str(FAULTS / version / case), str(FAULTS / version / "none"), "-o", str(out), "-q"]
    )
    assert code == 1
    summary = json.loads((out / "summary.json").read_text())
    fd = summary["first_divergence"]
    assert (fd["api"], fd["step"], fd["rank"]) == (entry, 0, 0)
    assert fd["row"] == f"{entry}.output.0"


@pytest.mark.parametrize("target", VERSIONS)
@pytest.mark.parametrize("baseline", VERSIONS)
def test_an_inserted_call_is_not_a_failure(target: str, baseline: str) -> None:
    for t, b in (("extrarelu", "none"), ("none", "extrarelu")):
        result = compare(FAULTS / target / t, FAULTS / baseline / b)
        assert result.passed, [a.reason for a in result.failures]
        extra = [a for a in result.apis if a.status == "unmatched"]
        assert {a.api for a in extra} >= {"Functional.relu.1.forward", "Functional.relu.1.backward"}
        warned = [a for a in result.apis if a.status == "warning" and "a call only the" in a.reason]
        assert [a.api for a in warned] == ["Functional.max_pool2d.0.backward"] * 2  # steps 0 and 1


@pytest.mark.parametrize("version", VERSIONS)
def test_clean_reruns_and_versions_pass(version: str, tmp_path: Path) -> None:
    rerun = shutil.copytree(FAULTS / version / "none", tmp_path / "rerun")  # (the same dump is refused)
    for other in VERSIONS:
        assert compare(rerun, FAULTS / other / "none").passed


def test_an_inserted_call_that_changes_the_numbers_is_named(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from pytest_msprobe import PrecisionDebugger, seed_all

    def run(path: Path, scale: float | None) -> None:
        seed_all(1234, mode=True)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten()
        )
        head = torch.nn.Linear(4 * 8 * 8, 3)
        opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
        with PrecisionDebugger(dump_path=str(path), task="statistics", level="L1", step=[0]) as debugger:
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
            debugger.start()
            features = model(x)
            if scale is not None:
                features = features * scale  # the extra operation of the target
            loss = head(features).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            debugger.stop()
            debugger.step()

    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        run(tmp_path / "clean", None)
        run(tmp_path / "scaled", 1.01)
        run(tmp_path / "noop", 1.0)  # the same extra call, numerically a no-op: structure only
    finally:
        torch.use_deterministic_algorithms(deterministic)  # seed_all's process-wide switch
    result = compare(tmp_path / "scaled", tmp_path / "clean")
    assert not result.passed
    assert result.first_divergence is not None
    assert (result.first_divergence.api, result.first_divergence.rule) == (
        "Tensor.__mul__.0.forward",
        "structural",
    )

    assert compare(tmp_path / "noop", tmp_path / "clean").passed
