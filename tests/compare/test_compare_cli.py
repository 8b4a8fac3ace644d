"""``pytest-msprobe compare``: both forms, exit codes, one-line errors."""

from __future__ import annotations

import csv
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from compare_helpers import DATA, copy_dump, dump_dir, rank_dir

import pytest_msprobe
from pytest_msprobe.cli import main

REPO = Path(__file__).resolve().parents[2]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, path: object, problem: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"pytest-msprobe: error: {path}: "), lines[0]
    assert problem in lines[0]
    assert "Traceback" not in err


def test_a_breach_exits_1_and_writes_the_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npu, bench = dump_dir("8.3.3", "npu", "stat_L1"), dump_dir("8.3.3", "bench", "stat_L1")
    code, out, err = run(["compare", str(npu), str(bench), "-o", str(tmp_path / "out")], capsys)
    assert (code, err) == (1, "")
    assert "first divergence: Functional.relu.2.forward (step 0, rank 0)" in out
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    stamp = names[0].removeprefix("advisor_").removesuffix(".txt")
    assert names == [
        f"advisor_{stamp}.txt",
        f"compare_result_{stamp}.csv",
        f"compare_result_{stamp}.xlsx",
        f"model_{stamp}.html",
        "summary.json",
    ]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["passed"] is False


def test_all_within_thresholds_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = dump_dir("8.3.3", "bench", "stat_L1")
    code, out, _ = run(
        ["compare", str(bench), str(dump_dir("26.2.0", "bench", "stat_L1")), "-o", str(tmp_path)], capsys
    )
    assert code == 0 and out.startswith("pytest-msprobe compare: PASSED")
    again = copy_dump(bench, tmp_path / "again")  # the same numbers from another run
    code, out, _ = run(["compare", str(again), str(bench), "-o", str(tmp_path / "out"), "-q"], capsys)
    assert (code, out) == (0, "")


def test_threshold_options_change_the_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npu, bench = str(dump_dir("8.3.3", "npu", "stat_L1", 0)), str(dump_dir("8.3.3", "bench", "stat_L1", 0))
    assert run(["compare", npu, bench, "-o", str(tmp_path), "--rtol", "1"], capsys)[0] == 0
    assert (
        run(["compare", npu, bench, "-o", str(tmp_path), "--rtol", "1", "--dtype-rtol", "fp32=1e-4"], capsys)[
            0
        ]
        == 1
    )
    assert run(["compare", npu, bench, "-o", str(tmp_path), "--skip-api", "*"], capsys)[0] == 0


@pytest.mark.parametrize("kind", ["stat_L1", "tensor_L1", "md5_L1"])
def test_msprobes_compare_json_form(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The tutorial's form: msprobe -f pytorch compare -i compare.json -o OUT -s, paths relative to the cwd."""
    monkeypatch.chdir(DATA / "msprobe-8.3.3")
    config = f"compare/compare_npu_vs_bench_{kind}_step0.json"
    code, out, err = run(["-f", "pytorch", "compare", "-i", config, "-o", str(tmp_path), "-s"], capsys)
    assert (code, err) == (1, "")
    assert "first divergence: Functional.relu.2.forward" in out
    import openpyxl

    (xlsx,) = tmp_path.glob("compare_result_*.xlsx")
    sheet = openpyxl.load_workbook(xlsx)["compare_result"]
    col = [c.value for c in sheet[1]].index("NPU_Stack_Info") + 1
    assert "make_dumps.py" in sheet.cell(2, col).value


def test_compare_json_paths_relative_to_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = DATA / "msprobe-8.3.3" / "compare" / "compare_npu_vs_bench_md5_L1_step0.json"
    assert run(["compare", "-i", str(config), "-o", str(tmp_path)], capsys)[0] == 1


def test_python_dash_m(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "pytest_msprobe", "compare"]
    npu, bench = str(dump_dir("26.2.0", "npu", "stat_L1", 0)), str(dump_dir("26.2.0", "bench", "stat_L1", 0))
    proc = subprocess.run(
        [*args, npu, bench, "-o", str(tmp_path)], capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == 1 and "Functional.relu.2.forward" in proc.stdout and proc.stderr == ""
    proc = subprocess.run(
        [*args, npu, str(tmp_path / "nope"), "-o", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 2
    one_line_error(proc.stderr, tmp_path / "nope", "no such file or directory")


def test_statistics_compare_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from pytest_msprobe.cli import main; "
        f"rc = main(['compare', {str(dump_dir('8.3.3', 'npu', 'tensor_L1', 0))!r}, "
        f"{str(dump_dir('8.3.3', 'bench', 'tensor_L1', 0))!r}, '-o', {str(tmp_path)!r}, '-q', '--no-replay']); "
        "assert 'torch' not in sys.modules, 'torch imported'; print(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert proc.stdout.strip() == "1", proc.stderr  # tensor mode, without torch (no replay asked for)


def test_jobs_give_the_same_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npu, bench = (
        str(dump_dir("8.3.3", "npu", "tensor_L1", 0)),
        str(dump_dir("8.3.3", "bench", "tensor_L1", 0)),
    )
    assert run(["compare", npu, bench, "-o", str(tmp_path / "one")], capsys)[0] == 1
    assert run(["compare", npu, bench, "-o", str(tmp_path / "two"), "--jobs", "2"], capsys)[0] == 1
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert one == two


def test_the_package_and_its_compare_are_callable() -> None:
    result = pytest_msprobe.compare(
        dump_dir("8.3.3", "npu", "stat_L1", 0), dump_dir("8.3.3", "bench", "stat_L1", 0)
    )
    assert result.first_divergence is not None and result.first_divergence.api == "Functional.relu.2.forward"
    from pytest_msprobe import compare

    assert compare(dump_dir("8.3.3", "bench", "stat_L1", 0), dump_dir("26.2.0", "bench", "stat_L1", 0)).passed


# ----------------------------------------------------------------------------------------------- exit 2
def test_missing_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        ["compare", str(tmp_path / "x"), str(tmp_path), "-o", str(tmp_path.parent / "out")], capsys
    )
    assert code == 2
    one_line_error(err, tmp_path / "x", "no such file or directory")


def test_corrupt_dump_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = copy_dump(dump_dir("8.3.3", "npu", "stat_L1", 0), tmp_path / "bad")
    (dump_json,) = bad.rglob("dump.json")
    dump_json.write_text(dump_json.read_text()[:5000])
    code, _, err = run(
        ["compare", str(bad), str(dump_dir("8.3.3", "bench", "stat_L1", 0)), "-o", str(tmp_path)], capsys
    )
    assert code == 2
    one_line_error(err, dump_json, "invalid JSON")


def test_steps_in_common_are_needed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    only1 = tmp_path / "only1"
    shutil.copytree(dump_dir("8.3.3", "bench", "stat_L1", 1), only1 / "step1")
    bench_root = tmp_path / "root"
    shutil.copytree(dump_dir("8.3.3", "bench", "stat_L1", 0), bench_root / "step0")
    shutil.copytree(dump_dir("8.3.3", "bench", "stat_L1", 0), bench_root / "step2")
    code, _, err = run(["compare", str(only1), str(bench_root), "-o", str(tmp_path)], capsys)
    assert code == 2
    one_line_error(err, bench_root, "no step/rank in common")


def _tensor_copy(tmp_path: Path) -> tuple[Path, Path]:
    target = copy_dump(dump_dir("8.3.3", "npu", "tensor_L1", 0), tmp_path / "t")
    (dump_json,) = target.rglob("dump.json")
    return target, dump_json


def test_hostile_tensor_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, dump_json = _tensor_copy(tmp_path)
    victim = dump_json.parent / "dump_tensor_data" / "Functional.relu.2.forward.output.0.pt"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    with zipfile.ZipFile(victim, "w") as z:
        z.writestr("x/data.pkl", pickle.dumps(Evil(), protocol=2))
    code, _, err = run(
        ["compare", str(target), str(dump_dir("8.3.3", "bench", "tensor_L1", 0)), "-o", str(tmp_path)], capsys
    )
    assert code == 2 and not marker.exists()
    one_line_error(err, victim, "refused")


def test_data_name_leaving_the_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, dump_json = _tensor_copy(tmp_path)
    dump_json.write_text(
        dump_json.read_text().replace('"Functional.relu.2.forward.output.0.pt"', '"../../../../etc/passwd"')
    )
    code, _, err = run(
        ["compare", str(target), str(dump_dir("8.3.3", "bench", "tensor_L1", 0)), "-o", str(tmp_path)], capsys
    )
    assert code == 2
    one_line_error(err, dump_json, "leaves the dump folder")


def test_missing_tensor_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, dump_json = _tensor_copy(tmp_path)
    missing = dump_json.parent / "dump_tensor_data" / "Functional.relu.2.forward.output.0.pt"
    missing.unlink()
    code, _, err = run(
        ["compare", str(target), str(dump_dir("8.3.3", "bench", "tensor_L1", 0)), "-o", str(tmp_path)], capsys
    )
    assert code == 2
    one_line_error(err, missing, "missing")


def test_tensor_mode_needs_tensor_dumps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stat, other = dump_dir("8.3.3", "bench", "stat_L1", 0), dump_dir("26.2.0", "bench", "stat_L1", 0)
    code, _, err = run(["compare", str(stat), str(other), "-o", str(tmp_path), "--mode", "tensor"], capsys)
    assert code == 2
    assert "has no tensor files" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{", "invalid JSON"),
        ('{"bench_path": "x"}', "missing 'npu_path'"),
        ('{"npu_path": 1, "bench_path": "x"}', "npu_path must be a path"),
    ],
)
def test_bad_compare_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, problem: str
) -> None:
    config = tmp_path / "compare.json"
    config.write_text(content)
    code, _, err = run(["compare", "-i", str(config), "-o", str(tmp_path)], capsys)
    assert code == 2
    one_line_error(err, config, problem)


def test_unwritable_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").write_text("a file")
    bench, other = (
        str(dump_dir("8.3.3", "bench", "stat_L1", 0)),
        str(dump_dir("26.2.0", "bench", "stat_L1", 0)),
    )
    code, _, err = run(["compare", bench, other, "-o", str(tmp_path / "out")], capsys)
    assert code == 2
    one_line_error(err, tmp_path / "out", "cannot write report")


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "required"),
        (["compare"], "-o/--output-path"),
        (["compare", "-o", "x"], "compare needs TARGET and BASELINE"),
        (["compare", "a", "b", "-i", "c.json", "-o", "x"], "not as TARGET BASELINE and as -i COMPARE_JSON"),
        (["compare", "a", "b", "-tp", "c", "-gp", "d", "-o", "x"], "not as TARGET BASELINE and as -tp"),
        (["compare", "-tp", "a", "-o", "x"], "-tp TARGET and -gp GOLDEN go together: -gp is missing"),
        (["compare", "-gp", "a", "-o", "x"], "-tp is missing"),
        (["compare", "a", "b", "-o", "x", "--rtol", "lots"], "expected a number, got 'lots'"),
        (["compare", "a", "b", "-o", "x", "--jobs", "0"], "expected a number >= 1"),
        (["compare", "a", "b", "-o", "x", "--mode", "fast"], "invalid choice"),
        (["compare", "a", "b", "-o", "x", "--bogus"], "unrecognized arguments: --bogus"),
        (["compare", "a", "b", "c", "-o", "x"], "unrecognized arguments: c"),
        (["config-check"], "the following arguments are required: TARGET, BASELINE"),
        (["config-check", "a", "b", "--bogus"], "unrecognized arguments: --bogus"),
        (["replay", "d"], "the following arguments are required: -o/--output"),
        (["replay", "d", "-o", "x", "-tp", "y"], "unrecognized arguments: -tp y"),
    ],
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """A usage error prints the usage of the command it is about (the top-level one only without a command)."""
    code, out, err = run(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err and out == ""
    usage = "usage: pytest-msprobe " + (f"{argv[0]} [-h]" if argv else "[-h]")
    assert err.startswith(usage), err
    command = argv[0] if argv else None
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"pytest-msprobe {command}: error: " if command else "pytest-msprobe: error: ")
    )


@pytest.mark.parametrize(
    "option, message",
    [
        (
            ["-dm", "mapping.yaml"],
            "-dm/--data_mapping: msprobe's option that pairs rows by a name mapping file",
        ),
        (
            ["--data_mapping", "mapping.yaml"],
            "-dm/--data_mapping: msprobe's option that pairs rows by a name mapping file",
        ),
        (["-cm"], "-cm/--cell_mapping: msprobe's option that maps MindSpore cells to PyTorch modules"),
        (["-am", "api.yaml"], "-am/--api_mapping: msprobe's option that maps MindSpore APIs"),
        (["-lm"], "-lm/--layer_mapping"),
        (["--rank", "0"], "--rank: msprobe's option that selects ranks of a MindSpore static-graph compare"),
        (["--step", "1"], "--step: msprobe's option that selects steps"),
        (
            ["--consistent_check"],
            "--consistent_check: msprobe's option that compares training with inference",
        ),
        (["--backend", "fsdp"], "--backend"),
        (
            ["-fr", "rules.json"],
            "-fr/--fusion_rule_file: msprobe's option that belongs to the offline_data mode",
        ),
        (
            ["--input_shape", "x:1,2"],
            "--input_shape: msprobe's option that belongs to the offline_model mode",
        ),
        (["-m", "offline_model"], "-m offline_model: msprobe's offline_model mode runs and compares offline"),
        (["--mode", "torchair"], "-m torchair: msprobe's torchair mode"),
    ],
)
def test_msprobe_options_this_compare_does_not_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: list[str], message: str
) -> None:
    """msprobe 26.x's compare options that make no sense here are usage errors that say what they are, never
    "unrecognized arguments"."""
    npu, bench = str(dump_dir("26.2.0", "npu", "stat_L1", 0)), str(dump_dir("26.2.0", "bench", "stat_L1", 0))
    code, out, err = run(["compare", "-tp", npu, "-gp", bench, "-o", str(tmp_path / "out"), *option], capsys)
    assert (code, out) == (2, "") and err.startswith("usage: pytest-msprobe compare [-h]")
    last = err.strip().splitlines()[-1]
    assert last.startswith("pytest-msprobe compare: error: ") and message in last
    assert "unrecognized" not in err and not (tmp_path / "out").exists()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    for flag in ("--version", "-V"):
        code, out, err = run([flag], capsys)
        assert (code, err) == (0, "") and out == f"pytest-msprobe {version('pytest-msprobe')}\n"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_msprobe", "--version"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert (proc.returncode, proc.stdout.split()) == (0, ["pytest-msprobe", version("pytest-msprobe")])


@pytest.mark.parametrize("form", ["dump.json", "rank folder", "step folder", "dump root"])
def test_msprobe_26_form(tmp_path: Path, capsys: pytest.CaptureFixture[str], form: str) -> None:
    """msprobe 26.x's spelling: -tp TARGET -gp GOLDEN -o OUT, on the dump.json files or the folders msprobe
    takes, with msprobe 26's accepted switches; NPU_Stack_Info is filled, as msprobe 26 fills it."""

    def where(side: str) -> Path:
        if form == "dump root":
            return dump_dir("26.2.0", side, "stat_L1")
        if form == "step folder":
            return dump_dir("26.2.0", side, "stat_L1", 0)
        folder = rank_dir("26.2.0", side, "stat_L1", 0)
        return folder / "dump.json" if form == "dump.json" else folder

    out = tmp_path / "out"
    argv = ["compare", "-tp", str(where("npu")), "-gp", str(where("bench")), "-o", str(out)]
    code, text, err = run([*argv, "--xlsx", "-da", "-tensor_log", "-m", "auto"], capsys)
    assert (code, err) == (1, "")
    assert "first divergence: Functional.relu.2.forward (step 0, rank 0)" in text
    (table,) = out.glob("compare_result_*.csv")
    with table.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["Step"] for r in rows} == ({"0", "1"} if form == "dump root" else {"0"})
    assert "make_dumps.py" in rows[0]["NPU_Stack_Info"]
    code, text, _ = run(["compare", "--target_path", str(where("npu")), "--golden_path", str(where("bench")),
                         "-o", str(tmp_path / "again"), "-q"], capsys)  # fmt: skip
    assert (code, text) == (1, "")


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["compare", "--help"], capsys)
    assert code == 0 and "--rtol" in out and "exit status" in out
