"""The plugin as a newcomer meets it: the typed fixture, a mistyped baseline folder stopped before any test
trains, a marker misused on one test erring that test alone, and a misspelt marker keyword with a suggestion."""

from __future__ import annotations

from pathlib import Path

import pytest
from plugin_sources import BASE

import pytest_msprobe

FACE_TEST = """
import pytest
import torch
from pytest_msprobe import MsprobeFixture


@pytest.mark.msprobe(steps=[0], seed=7)
def test_face(msprobe: MsprobeFixture):
    assert type(msprobe) is MsprobeFixture
    assert (msprobe.rank, msprobe.world_size, msprobe.steps, msprobe.seed) == (0, 1, (0,), 7)
    assert msprobe.device.type == "cpu"
    for internal in ("finish", "settings", "manifest", "compare_dump", "close"):
        assert not hasattr(msprobe, internal), internal
    with msprobe.step():
        msprobe.loss(torch.ones(3, device=msprobe.device).mul(2.0).sum())
    assert callable(msprobe.debugger.start) and callable(msprobe.debugger.stop)
    assert msprobe.dump_dir.name == "dump"
"""


def test_the_fixture_is_the_public_msprobe_fixture(pytester: pytest.Pytester) -> None:
    assert "MsprobeFixture" in pytest_msprobe.__all__
    assert (Path(pytest_msprobe.__file__).parent / "py.typed").is_file()
    pytester.makepyfile(test_face=FACE_TEST)
    pytester.runpytest(*BASE, "--msprobe-device=cpu").assert_outcomes(passed=1)
    pytester.runpytest(*BASE, "--msprobe-device=cpu", "--msprobe-self-check").assert_outcomes(passed=1)


# -- the baseline folder, checked before any test trains ---------------------------------------------------------
SLOW_TEST = """
import pytest


@pytest.mark.msprobe(steps=[0])
def test_train(msprobe):
    raise AssertionError("a test trained before the baseline folder was checked")
"""


def _usage_error(result: pytest.RunResult, line: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {line}"])
    assert "a test trained" not in result.stdout.str()


def test_a_mistyped_baseline_folder_stops_the_session_with_the_close_name(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_train=SLOW_TEST)
    (pytester.path / "baselines").mkdir()
    result = pytester.runpytest(*BASE, "--msprobe-baseline=baselnes")
    _usage_error(
        result,
        f"the baseline folder {pytester.path / 'baselnes'} does not exist; did you mean "
        f"{pytester.path / 'baselines'}? (to write new baselines there, add --msprobe-regen-baseline)",
    )
    # a typo in a folder above it: the corrected path
    (pytester.path / "baselines" / "gpu").mkdir()
    result = pytester.runpytest(*BASE, "--msprobe-baseline=baselnes/gpu")
    _usage_error(result, f"*does not exist; did you mean {pytester.path / 'baselines' / 'gpu'}?*")


def test_a_baseline_folder_under_a_missing_parent_names_the_nearest_folder(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_train=SLOW_TEST)
    result = pytester.runpytest(*BASE, "--msprobe-baseline=ci/gpu/baselines")
    _usage_error(
        result,
        f"the baseline folder {pytester.path / 'ci/gpu/baselines'} does not exist; the nearest folder that "
        f"exists is {pytester.path}*",
    )


def test_a_new_baseline_folder_is_left_to_the_regeneration_and_to_report_only(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test()
    (pytester.path / "baselines").mkdir()
    # regenerating into a new (even a close-named) folder is what it is for
    regen = pytester.runpytest(*BASE, "--msprobe-baseline=baselnes", "--msprobe-regen-baseline")
    regen.assert_outcomes(passed=1)
    # report-only records the missing baseline as the test's verdict
    lenient = pytester.runpytest(*BASE, "--msprobe-baseline=basel", "--msprobe-report-only")
    lenient.assert_outcomes(passed=1)
    lenient.stdout.fnmatch_lines(["MISSING (report-only: not failing the test)*"])


def test_a_new_baseline_folder_beside_others_is_said_before_the_tests_run(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test()
    (pytester.path / "baselines").mkdir()
    result = pytester.runpytest(*BASE, "--msprobe-baseline=gpu_dump")
    result.assert_outcomes(failed=1)
    header = (
        f"msprobe: the baseline folder {pytester.path / 'gpu_dump'} does not exist (beside it: baselines): "
        "every msprobe test will report its baseline missing; to write them there, add --msprobe-regen-baseline"
    )
    lines = result.stdout.lines
    assert header in lines, result.stdout.str()
    assert lines.index(header) < next(i for i, line in enumerate(lines) if line.startswith("test_train.py"))
    result.stdout.fnmatch_lines(["*no baseline for this test at*gpu_dump*"])
    # the folder once written, nothing more is said
    pytester.runpytest(*BASE, "--msprobe-baseline=gpu_dump", "--msprobe-regen-baseline").assert_outcomes(
        passed=1
    )
    again = pytester.runpytest(*BASE, "--msprobe-baseline=gpu_dump")
    again.assert_outcomes(passed=1)
    assert not [line for line in again.stdout.lines if line.startswith("msprobe: the baseline folder")]


def test_one_tests_own_baseline_folder_as_the_root_names_the_root(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test()
    pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline").assert_outcomes(passed=1)
    own = pytester.path / "bl" / "test_train" / "test_train"
    assert (own / "step0").is_dir()
    for extra in ([], ["--msprobe-regen-baseline"]):
        result = pytester.runpytest(*BASE, f"--msprobe-baseline={own}", *extra)
        _usage_error(
            result,
            f"the baseline folder {own} is one test's own baseline (it holds step0, msprobe_manifest.json), so "
            f"every test's folder would be looked for inside it: give the folder that holds all the tests' "
            f"baselines, {pytester.path / 'bl'}?",
        )
    # the right root still compares
    pytester.runpytest(*BASE, "--msprobe-baseline=bl").assert_outcomes(passed=1)


def test_a_root_one_folder_off_names_the_root_that_holds_the_tests_baseline(
    pytester: pytest.Pytester, train_test
) -> None:
    """A root given a folder too deep or too high: the missing baseline's message names the root that holds it."""
    train_test()
    pytester.runpytest(*BASE, "--msprobe-baseline=bl/cpu", "--msprobe-regen-baseline").assert_outcomes(
        passed=1
    )
    right = pytester.path / "bl" / "cpu"
    for off in ("bl", "bl/cpu/test_train"):  # too high; too deep (the test file's folder inside the root)
        result = pytester.runpytest(*BASE, f"--msprobe-baseline={off}")
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(
            [f"*its baseline is under {right}: did you mean --msprobe-baseline={right}?*"]
        )
    # a root near none: no guess
    (pytester.path / "other").mkdir()
    result = pytester.runpytest(*BASE, "--msprobe-baseline=other")
    result.assert_outcomes(failed=1)
    assert "its baseline is under" not in result.stdout.str()
    pytester.runpytest(*BASE, "--msprobe-baseline=bl/cpu").assert_outcomes(passed=1)


# -- the marker ---------------------------------------------------------------------------------------------------
MISUSED = """
import pytest


@pytest.mark.msprobe(steps=[0])
def test_forgot():
    pass


def test_plain():
    pass


@pytest.mark.msprobe(steps=[0])
def test_right(msprobe):
    with msprobe.step():
        pass
"""


def test_a_marker_without_the_fixture_errs_that_test_and_the_others_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_misused=MISUSED)
    result = pytester.runpytest(*BASE)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*msprobe: test_misused.py::test_forgot: @pytest.mark.msprobe needs the msprobe fixture: add it to "
            "the test's arguments (def test_forgot(msprobe): ...) or drop the marker",
        ]
    )


def test_a_misspelt_marker_keyword_gets_a_suggestion(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_misspelt="""
        import pytest

        @pytest.mark.msprobe(step=[0, 1])
        def test_misspelt(msprobe):
            pass

        def test_plain():
            pass
        """
    )
    result = pytester.runpytest(*BASE)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*unknown keyword(s) step (did you mean steps?) (known: *"])
