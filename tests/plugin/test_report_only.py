"""Report-only mode: every msprobe test runs, compares and reports; a precision verdict (a breach, a missing
baseline) is recorded in junitxml, the session summary, the HTML report and the terminal, and does not fail the
test. What leaves a test without a verdict (an unusable baseline, a dump that never happened) still fails."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from plugin_sources import BASE


def _properties(junit: Path) -> dict[str, dict[str, str]]:
    """Each test case's properties, by test name."""
    return {
        case.get("name", ""): {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        for case in ET.parse(junit).getroot().iter("testcase")
    }


def _summary(pytester: pytest.Pytester) -> dict[str, dict]:
    doc = json.loads((pytester.path / "msprobe-output" / "summary.json").read_text())
    return {t["nodeid"]: t for t in doc["tests"]} | {"": doc}


def test_a_breach_is_reported_and_the_test_passes(
    pytester: pytest.Pytester, train_test, fault_plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_test()
    pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline").assert_outcomes(passed=1)
    monkeypatch.setenv("FAULT_SCALE", "0.01")
    junit = pytester.path / "junit.xml"
    args = [*BASE, "-p", fault_plugin, "--msprobe-baseline=bl", f"--junitxml={junit}", "--html=report.html"]
    result = pytester.runpytest(*args, "--msprobe-report-only", "-rP")
    result.assert_outcomes(passed=1)
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "*Captured msprobe (report-only: not failing the test) call*",
            "msprobe: * of * API calls breach the thresholds*",
            "first divergence: Functional.relu.1.forward (step 0, rank 0)*",
            "*= msprobe =*",
            "FAILED (report-only: not failing the test) test_train.py::test_train  (first divergence "
            "Functional.relu.1.forward on rank 0)",
            "report-only mode (--msprobe-report-only, ini msprobe_report_only or the marker's report_only=): "
            "precision verdicts are recorded, not enforced; 1 test(s) passed with a failing verdict",
        ]
    )
    props = _properties(junit)["test_train"]
    assert (props["msprobe_verdict"], props["msprobe_report_only"]) == ("failed", "true")
    assert props["msprobe_first_divergence"] == "Functional.relu.1.forward"
    summary = _summary(pytester)
    test = summary["test_train.py::test_train"]
    assert (test["verdict"], test["outcome"], test["report_only"]) == ("failed", "passed", True)
    assert (
        test["message"].startswith("msprobe: ")
        and test["first_divergence"]["api"] == "Functional.relu.1.forward"
    )
    assert (
        summary[""]["report_only"] is True and summary[""]["passed"] is False
    )  # the verdicts, not the outcomes
    index = (pytester.path / "msprobe-output" / "index.html").read_text()
    assert 'FAILED<br><span class="report-only">report-only: not failing the test</span>' in index
    assert (
        "msprobe statistics compare FAILED (report-only: not failing the test)"
        in (pytester.path / "report.html").read_text()
    )

    # the same run without the mode fails, as it always did
    pytester.runpytest(*args).assert_outcomes(failed=1)


def test_a_missing_baseline_is_reported_and_passes(pytester: pytest.Pytester, train_test) -> None:
    train_test()
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-report-only")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["MISSING (report-only: not failing the test) test_train.py::test_train  (no baseline *"]
    )
    test = _summary(pytester)["test_train.py::test_train"]
    assert (test["verdict"], test["outcome"]) == ("missing", "passed")


@pytest.mark.slow
def test_the_marker_and_the_ini_choose_per_test(
    pytester: pytest.Pytester, train_test, fault_plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    lenient = '@pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1], report_only=True)'
    strict = '@pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1], report_only=False)'
    train_test(lenient, name="test_lenient")
    train_test(strict, name="test_strict")
    train_test(name="test_plain")
    pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline").assert_outcomes(passed=3)
    monkeypatch.setenv("FAULT_SCALE", "0.01")
    args = [*BASE, "-p", fault_plugin, "--msprobe-baseline=bl"]
    # the marker alone: only its test passes
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=1, failed=2)
    outcome = {t: v["outcome"] for t, v in _summary(pytester).items() if t}
    assert outcome == {
        "test_lenient.py::test_train": "passed",
        "test_plain.py::test_train": "failed",
        "test_strict.py::test_train": "failed",
    }
    assert _summary(pytester)[""]["report_only"] is False
    # the ini for every test without a marker that says otherwise
    pytester.makeini("[pytest]\nmsprobe_report_only = true\n")
    pytester.runpytest(*args).assert_outcomes(passed=2, failed=1)
    assert _summary(pytester)["test_strict.py::test_train"]["outcome"] == "failed"
    assert _summary(pytester)[""]["report_only"] is True
    # a bad value is a usage error quoting it
    pytester.makeini("[pytest]\nmsprobe_report_only = sometimes\n")
    bad = pytester.runpytest(*args)
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*ini msprobe_report_only: expected true or false, got 'sometimes'*"])


def test_what_leaves_a_test_without_a_verdict_still_fails(pytester: pytest.Pytester, train_test) -> None:
    train_test()
    pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline").assert_outcomes(passed=1)
    dump = pytester.path / "bl" / "test_train" / "test_train" / "step1" / "rank" / "dump.json"
    dump.write_text(dump.read_text()[:100])  # a broken baseline: no verdict can be reached
    broken = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-report-only")
    broken.assert_outcomes(errors=1)
    broken.stdout.fnmatch_lines(["ERROR*test_train.py::test_train*unusable baseline*"])
    assert _summary(pytester)["test_train.py::test_train"]["verdict"] == "error"

    # a test that never dumped a step (the loop is not wrapped in msprobe.step) compared nothing: a failure
    pytester.makepyfile(
        test_nostep="""
        import pytest

        @pytest.mark.msprobe(steps=[0])
        def test_nostep(msprobe):
            pass
        """
    )
    unwrapped = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-report-only", "test_nostep.py")
    unwrapped.assert_outcomes(failed=1)
    unwrapped.stdout.fnmatch_lines(["*no step was dumped*"])
    test = _summary(pytester)["test_nostep.py::test_nostep"]
    assert (test["verdict"], test["outcome"]) == ("failed", "failed")
