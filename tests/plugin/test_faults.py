"""The plugin under faults: unusable baselines are errors, refused regenerations are errors that keep the old
baseline, dumps have a size limit, and the dumps of passing tests are removed."""

from __future__ import annotations

import csv
import errno
import json
import os
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from plugin_sources import BASE

TENSOR = '@pytest.mark.msprobe(task="tensor", level="L1", steps=[0, 1])'


def _folder(pytester: pytest.Pytester, root: str = "bl") -> Path:
    return pytester.path / root / "test_train" / "test_train"


def _output(pytester: pytest.Pytester) -> Path:
    return pytester.path / "msprobe-output" / "test_train" / "test_train"


def _regen(pytester: pytest.Pytester, *args: str) -> None:
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline", *args)
    result.assert_outcomes(passed=1)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), folder): Path(d, f).read_bytes()
        for d, _, files in os.walk(folder)
        for f in files
    }


def _one_error(result: pytest.RunResult, message: str) -> None:
    """Exactly one ERROR, no failure and no pass, reported as the one line ``message`` without a traceback."""
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert "Traceback" not in out and "During handling" not in out
    lines = [line for line in out.splitlines() if line.startswith("msprobe: ")]
    assert len(lines) == 1, lines  # once in the ERRORS section (the -ra short summary repeats its start)
    result.stdout.fnmatch_lines(
        [message, "ERROR*test_train.py::test_train*", "ERROR test_train.py::test_train - *"]
    )


BREAKAGES: list[tuple[str, Callable[[Path], Path], str]] = [
    (
        "truncated dump.json",
        lambda f: _truncate(f / "step1" / "rank" / "dump.json"),
        "msprobe: unusable baseline: {file}: invalid JSON: truncated*",
    ),
    (
        "not UTF-8",
        lambda f: _write(
            f / "step0" / "rank" / "dump.json", b'{"task": "statistics", "data": {"\xff\xfe": 1}}'
        ),
        "msprobe: unusable baseline: {file}: not UTF-8 text (byte 0xff at offset *)",
    ),
    (
        "data not an object",
        lambda f: _write(f / "step0" / "rank" / "dump.json", b'{"task": "statistics", "data": [1, 2]}'),
        "msprobe: unusable baseline: {file}: 'data' is an array, expected an object of API calls",
    ),
    (
        "no dump.json at all",
        lambda f: _remove_ranks(f),
        "msprobe: unusable baseline: {file}/step0: step folder holds no rank folder with a dump.json *",
    ),
    (
        "broken manifest",
        lambda f: _write(f / "msprobe_manifest.json", b'{"test": '),
        "msprobe: unusable baseline: {file}: unreadable baseline manifest (*)",
    ),
]


def _truncate(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _remove_ranks(folder: Path) -> Path:
    for step in folder.glob("step*"):
        shutil.rmtree(step / "rank")
    return folder


def test_an_unusable_baseline_is_an_error_before_the_test_body_runs(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test()
    _regen(pytester)
    folder = _folder(pytester)
    pristine = pytester.path / "pristine"
    shutil.copytree(folder, pristine)
    for what, breakage, message in BREAKAGES:
        shutil.rmtree(folder)
        shutil.copytree(pristine, folder)
        shutil.rmtree(_output(pytester), ignore_errors=True)
        file = breakage(folder)
        result = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
        try:
            _one_error(result, message.format(file=file))
            result.stdout.fnmatch_lines(["*ERROR at setup of test_train*"])
            assert not _output(pytester).exists(), "the training must not have run"
        except AssertionError as exc:
            raise AssertionError(f"{what}: {exc}") from exc
    # a missing baseline is still a failure, with the command that makes it
    shutil.rmtree(folder)
    missing = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    missing.assert_outcomes(failed=1, errors=0)
    missing.stdout.fnmatch_lines([f"*no baseline for this test at {folder}*", "*--msprobe-regen-baseline*"])


def test_a_truncated_baseline_tensor_is_an_error_before_the_test_body_runs(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test(TENSOR)
    _regen(pytester)
    victim = _victim(pytester)
    _truncate(victim)  # the JSON files are fine: only opening the tensor file shows it
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    _one_error(result, f"msprobe: unusable baseline: {victim}: corrupt torch archive (*)")
    result.stdout.fnmatch_lines(["*ERROR at setup of test_train*"])
    assert not _output(pytester).exists(), "the training must not have run"


def _victim(pytester: pytest.Pytester) -> Path:
    tensors = _folder(pytester) / "step0" / "rank" / "dump_tensor_data"
    return sorted(tensors.iterdir())[len(list(tensors.iterdir())) // 2]


def test_a_baseline_found_unusable_only_by_the_compare_is_an_error_too(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test(TENSOR)
    _regen(pytester)
    victim = _victim(pytester)
    # the baseline is intact at set-up and breaks while the test body trains: only the compare can see it
    pytester.makeconftest(
        f"""
        import pytest

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_call(item):
            victim = {str(victim)!r}
            data = open(victim, "rb").read()
            open(victim, "wb").write(data[: len(data) // 2])
            return (yield)
        """
    )
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl", f"--junitxml={junit}")
    _one_error(result, f"msprobe: unusable baseline: {victim}: *")
    result.stdout.fnmatch_lines(["*ERROR at call of test_train*"])
    props = {p.get("name"): p.get("value") for p in ET.parse(junit).getroot().iter("property")}
    assert props["msprobe_verdict"] == "error"
    assert (_output(pytester) / "dump" / "step0").is_dir(), "the dump of a test without a verdict stays"


def _read_only(monkeypatch: pytest.MonkeyPatch, under: Path, err: int) -> None:
    """Refuse to make folders under ``under``, as a read-only (EROFS) or forbidden (EACCES) folder does."""
    real_mkdir = os.mkdir

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        target = Path(os.fspath(path)).absolute()
        if target.is_relative_to(under) and not target.exists():  # an existing name is EEXIST, as on Linux
            raise OSError(err, os.strerror(err), os.fspath(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)


def _disk_full(monkeypatch: pytest.MonkeyPatch, under: Path, err: int) -> None:
    real_copyfile = shutil.copyfile

    def copyfile(src: Any, dst: Any, **kwargs: Any) -> Any:
        if Path(os.fspath(dst)).absolute().is_relative_to(under) and "dump.json" in os.fspath(dst):
            raise OSError(err, os.strerror(err), os.fspath(dst))
        return real_copyfile(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", copyfile)


@pytest.mark.parametrize(
    ("err", "refuse"),
    [(errno.EROFS, _read_only), (errno.EACCES, _read_only), (errno.ENOSPC, _disk_full)],
    ids=["read-only", "forbidden", "disk-full"],
)
def test_a_refused_regeneration_is_one_clear_error_and_keeps_the_old_baseline(
    pytester: pytest.Pytester, train_test, err: int, refuse: Callable[..., None]
) -> None:
    train_test()
    _regen(pytester)
    folder = _folder(pytester)
    before = _snapshot(folder)
    with pytest.MonkeyPatch.context() as mp:
        refuse(mp, pytester.path / "bl", err)
        result = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline")
    message = f"msprobe: {folder}: cannot write the baseline ({os.strerror(err)} at *); the previous baseline is unchanged"
    _one_error(result, message)
    result.stdout.fnmatch_lines(["*ERROR at call of test_train*"])
    assert "0 baseline(s) written" in result.stdout.str()
    assert _snapshot(folder) == before
    assert [p.name for p in folder.parent.iterdir()] == ["test_train"]
    assert (_output(pytester) / "dump" / "step0").is_dir(), "the dump that could not be stored stays"


def test_the_dumps_of_passing_tests_go_and_those_of_failing_tests_stay(
    pytester: pytest.Pytester, train_test, fault_plugin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_test()
    _regen(pytester)
    assert not _output(pytester).exists(), "a regeneration keeps nothing beside the baseline"
    pytester.runpytest(*BASE, "--msprobe-baseline=bl").assert_outcomes(passed=1)
    assert sorted(p.name for p in _output(pytester).iterdir()) == ["compare"], "the dump of a pass goes"
    reports = _output(pytester) / "compare"
    assert json.loads((reports / "summary.json").read_text())["passed"] is True
    assert len(list(reports.glob("compare_result_*.xlsx"))) == 1
    assert len(list(reports.glob("advisor_*.txt"))) == 1
    (table,) = reports.glob("compare_result_*.csv")  # msprobe 26's CSV, a passing test's rows all pass
    with table.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert (
        rows
        and {r["Result"] for r in rows} <= {"pass", "warning"}
        and {r["Step"] for r in rows} == {"0", "1"}
    )

    pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-keep-dumps").assert_outcomes(passed=1)
    assert (_output(pytester) / "dump" / "step1" / "rank" / "dump.json").is_file()
    _regen(pytester, "--msprobe-keep-dumps")
    assert (_output(pytester) / "dump" / "step1" / "rank" / "dump.json").is_file()

    monkeypatch.setenv("FAULT_SCALE", "0.01")
    failing = pytester.runpytest(*BASE, "-p", fault_plugin, "--msprobe-baseline=bl")
    failing.assert_outcomes(failed=1)
    assert (_output(pytester) / "dump" / "step1" / "rank" / "dump.json").is_file(), "a failure keeps its dump"


@pytest.mark.parametrize(
    ("marker", "args", "ini", "limit"),
    [
        (TENSOR, ["--msprobe-max-dump-size=200kB"], "", "200 kB"),
        (TENSOR.replace("])", '], max_dump_size="64KiB")'), [], "", "64 KiB"),
        (TENSOR, [], "msprobe_max_dump_size = 0.1MB", "100 kB"),
    ],
    ids=["command-line", "marker", "ini"],
)
def test_a_tensor_dump_past_the_size_limit_fails_with_the_row_and_the_option(
    pytester: pytest.Pytester, train_test, marker: str, args: list[str], ini: str, limit: str
) -> None:
    train_test(marker)
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline", *args)
    result.assert_outcomes(failed=1, errors=0)
    out = result.stdout.str()
    assert "Traceback" not in out
    result.stdout.fnmatch_lines(
        [
            f"msprobe: dump of test_train.py::test_train reached the {limit} limit at *ward.*; raise "
            "--msprobe-max-dump-size (or the marker's max_dump_size=) or dump fewer steps / use task statistics"
        ]
    )
    assert not _folder(pytester).exists(), "no baseline from a dump cut short"
    tensors = _output(pytester) / "dump" / "step0" / "rank" / "dump_tensor_data"
    size = sum(p.stat().st_size for p in tensors.iterdir())
    assert 0 < size <= float(limit.split()[0]) * {"kB": 1000, "KiB": 1024}[limit.split()[1]]


def test_the_limit_lets_a_dump_that_fits_through_and_bad_limits_are_refused(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test(TENSOR)
    _regen(pytester, "--msprobe-max-dump-size=1GiB")
    usage = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-max-dump-size=lots")
    assert usage.ret == pytest.ExitCode.USAGE_ERROR
    usage.stderr.fnmatch_lines(["*--msprobe-max-dump-size: expected a size such as 500MB, 2GiB*got 'lots'*"])
    train_test(TENSOR.replace("])", '], max_dump_size="10 parsecs")'))
    marked = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    marked.assert_outcomes(errors=1)
    marked.stdout.fnmatch_lines(
        [
            "msprobe: @pytest.mark.msprobe on test_train.py::test_train: max_dump_size: expected a size*'10 parsecs'"
        ]
    )
