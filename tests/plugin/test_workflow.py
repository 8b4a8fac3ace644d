"""The plugin as users meet it: no baseline -> regenerate -> pass -> drift -> fail, with real pytest runs."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from plugin_sources import BASE


def _baseline_folder(pytester: pytest.Pytester, name: str = "test_train") -> Path:
    return pytester.path / "baselines" / name / "test_train"


def test_without_a_baseline_the_plugin_stays_out_of_the_way(pytester: pytest.Pytester, train_test) -> None:
    train_test()
    result = pytester.runpytest(*BASE)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*no --msprobe-baseline: msprobe tests ran their training steps without comparing*"]
    )
    assert not (pytester.path / "msprobe-output").exists()


def test_missing_baseline_fails_and_names_the_path_and_the_flag(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test()
    result = pytester.runpytest(*BASE, "--msprobe-baseline=baselines")
    result.assert_outcomes(failed=1, errors=0)
    folder = _baseline_folder(pytester)
    result.stdout.fnmatch_lines([f"*no baseline for this test at {folder}*", "*--msprobe-regen-baseline*"])


def test_regenerate_pass_drift_fail(
    pytester: pytest.Pytester, train_test, fault_plugin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_test()
    regen = pytester.runpytest(*BASE, "--msprobe-baseline=baselines", "--msprobe-regen-baseline")
    regen.assert_outcomes(passed=1)
    regen.stdout.fnmatch_lines(["*REGENERATED*test_train.py::test_train*", "*1 baseline(s) written to*"])
    folder = _baseline_folder(pytester)
    assert sorted(p.name for p in folder.iterdir()) == ["msprobe_manifest.json", "step0", "step1"]
    manifest = json.loads((folder / "msprobe_manifest.json").read_text())
    assert manifest["seed"] == 1234 and manifest["task"] == "statistics" and manifest["steps"] == [0, 1]
    assert manifest["device"].startswith("cpu")
    assert (folder / "step0" / "rank" / "dump.json").is_file()

    same = pytester.runpytest(*BASE, "--msprobe-baseline=baselines")
    same.assert_outcomes(passed=1)
    same.stdout.fnmatch_lines(["*PASSED*test_train.py::test_train*"])

    # drift at float32 rounding level: still a pass
    monkeypatch.setenv("FAULT_SCALE", "1e-7")
    drift = pytester.runpytest(*BASE, "-p", fault_plugin, "--msprobe-baseline=baselines")
    drift.assert_outcomes(passed=1)

    # one relu 1% wrong: a FAILED test from the call phase that names the relu
    monkeypatch.setenv("FAULT_SCALE", "0.01")
    junit = pytester.path / "junit.xml"
    fail = pytester.runpytest(
        *BASE, "-p", fault_plugin, "--msprobe-baseline=baselines", f"--junitxml={junit}"
    )
    fail.assert_outcomes(failed=1, errors=0)
    assert fail.ret == 1
    fail.stdout.fnmatch_lines(
        [
            "*msprobe: * of * API calls breach the thresholds*",
            "*first divergence: Functional.relu.1.forward (step 0, rank 0), row Functional.relu.1.forward.output.0*",
            "*worst rows:*",
            "*row*metric*value*allowed*",
            "*reports: *compare_result_*.xlsx*advisor_*.txt*summary.json*",
            "*regenerate the baseline: pytest 'test_train.py::test_train' --msprobe-baseline=*--msprobe-regen-baseline*",
        ]
    )
    assert "Traceback" not in fail.stdout.str()
    props = {p.get("name"): p.get("value") for p in ET.parse(junit).getroot().iter("property")}
    assert props["msprobe_verdict"] == "failed"
    assert props["msprobe_first_divergence"] == "Functional.relu.1.forward"
    reports = pytester.path / "msprobe-output" / "test_train" / "test_train" / "compare"
    summary = json.loads((reports / "summary.json").read_text())
    assert summary["passed"] is False and summary["first_divergence"]["api"] == "Functional.relu.1.forward"
    # the baseline is untouched by a failing compare
    assert json.loads((folder / "msprobe_manifest.json").read_text()) == manifest


def test_precedence_cli_over_marker_over_ini(
    pytester: pytest.Pytester, train_test, fault_plugin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_test()
    pytester.runpytest(*BASE, "--msprobe-baseline=baselines", "--msprobe-regen-baseline").assert_outcomes(
        passed=1
    )
    monkeypatch.setenv("FAULT_SCALE", "0.001")
    args = [*BASE, "-p", fault_plugin, "--msprobe-baseline=baselines"]
    # default thresholds catch a 1e-3 fault
    pytester.runpytest(*args).assert_outcomes(failed=1)
    # ini loosens it
    pytester.makeini("[pytest]\nmsprobe_rtol = 0.5\n")
    pytester.runpytest(*args).assert_outcomes(passed=1)
    # the marker beats the ini
    train_test('@pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1], rtol=1e-4)')
    pytester.runpytest(*args).assert_outcomes(failed=1)
    # the command line beats the marker
    pytester.runpytest(*args, "--msprobe-rtol=0.5").assert_outcomes(passed=1)
    # an API rule on the command line: skip what the fault touches, by glob
    pytester.makeini("[pytest]\n")
    pytester.runpytest(*args, "--msprobe-rtol=1e-4", "--msprobe-skip-api=*").assert_outcomes(passed=1)


def test_ini_turns_the_gate_on_and_resolves_paths_from_the_ini(pytester: pytest.Pytester, train_test) -> None:
    train_test()
    pytester.makeini("[pytest]\nmsprobe_baseline = bl\nmsprobe_output = out\nmsprobe_keep_dumps = true\n")
    sub = pytester.mkdir("sub")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(sub)
        pytester.runpytest(*BASE, str(pytester.path), "--msprobe-regen-baseline").assert_outcomes(passed=1)
    assert (pytester.path / "bl" / "test_train" / "test_train" / "step0").is_dir()
    assert (pytester.path / "out" / "test_train" / "test_train" / "dump").is_dir()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--msprobe-regen-baseline"], "*--msprobe-regen-baseline needs --msprobe-baseline*"),
        (["--msprobe-baseline=b", "--msprobe-device=tpu"], "*unknown device 'tpu'*"),
        (["--msprobe-baseline=b", "--msprobe-rtol=abc"], "*expected a number, got 'abc'*"),
    ],
)
def test_bad_options_are_usage_errors(
    pytester: pytest.Pytester, train_test, args: list[str], message: str
) -> None:
    train_test()
    result = pytester.runpytest(*BASE, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        (
            '@pytest.mark.msprobe(task="tensors")',
            "task must be one of statistics, tensor, md5, overflow_check, got 'tensors'",
        ),
        ("@pytest.mark.msprobe(steps=[-1])", "steps must be non-negative integers, got ?-1?"),
        ('@pytest.mark.msprobe(levle="L0")', "unknown keyword(s) levle *"),
        ('@pytest.mark.msprobe(rtol="loose")', "rtol: expected a number, got 'loose'"),
    ],
)
def test_bad_marker_values_name_the_test_and_the_value(
    pytester: pytest.Pytester, train_test, marker: str, message: str
) -> None:
    train_test(marker)
    result = pytester.runpytest(*BASE, "--msprobe-baseline=b")
    result.assert_outcomes(errors=1)  # a setup problem of the test, not a precision failure
    result.stdout.fnmatch_lines([f"msprobe: @pytest.mark.msprobe on test_train.py::test_train: {message}"])
    assert "During handling" not in result.stdout.str()


def test_module_levels_need_the_model(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_l0="""
        import pytest
        @pytest.mark.msprobe(level="L0", steps=[0])
        def test_l0(msprobe):
            with msprobe.step():
                pass
        """
    )
    result = pytester.runpytest(*BASE, "--msprobe-baseline=b")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*level L0 dumps modules: pass the model, msprobe.step(model)*"])


def test_a_failing_test_body_is_reported_as_is_and_leaves_no_hooks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_boom="""
        import pytest, torch

        def test_before():
            torch.use_deterministic_algorithms(False)

        @pytest.mark.msprobe(steps=[0])
        def test_boom(msprobe):
            with msprobe.step():
                torch.ones(2) + 1
                raise RuntimeError("boom")

        def test_after():
            import torch
            assert not torch.are_deterministic_algorithms_enabled(), "seed_all's switch must be put back"
            assert "wrapper" not in getattr(torch.Tensor.__add__, "__qualname__", "")
            assert torch.nn.functional.relu.__module__ == "torch.nn.functional"
        """
    )
    result = pytester.runpytest(*BASE, "--msprobe-baseline=b")
    result.assert_outcomes(failed=1, passed=2)
    result.stdout.fnmatch_lines(["*RuntimeError: boom*"])


def test_nothing_dumped_is_a_clear_failure(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_idle="""
        import pytest
        @pytest.mark.msprobe(steps=[0])
        def test_idle(msprobe):
            pass
        """
    )
    result = pytester.runpytest(*BASE, "--msprobe-baseline=b", "--msprobe-regen-baseline")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*no step was dumped*with msprobe.step(model)*"])
