"""Gate integrity: a green precision test means it compared, and no run can lose a baseline.

Whole pytest sessions (pytester) in the set-ups CI meets: an output folder that holds the baselines, an unset
variable in ``--msprobe-baseline=$BASELINE``, the same test in several xdist workers or sessions at once, a
baseline folder linked from elsewhere, a baseline made by another kind of run than the test now makes, a loop
shorter than the steps asked for.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from plugin_sources import BASE


def _folder(pytester: pytest.Pytester, root: str = "bl", name: str = "test_train") -> Path:
    return pytester.path / root / name / "test_train"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), folder): Path(d, f).read_bytes()
        for d, _, files in os.walk(folder)
        for f in files
    }


def _regen(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline", *args)
    result.assert_outcomes(passed=1)
    return result


def _usage_error(result: pytest.RunResult, *patterns: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(list(patterns))
    assert "Traceback" not in result.stderr.str()


# -- never lose a baseline ------------------------------------------------------------------------------------


@pytest.mark.parametrize("output", ["bl", "bl/out", ".", "bl/test_train/test_train"])
def test_an_output_folder_that_is_in_or_holds_the_baselines_is_refused_before_anything_is_touched(
    pytester: pytest.Pytester, train_test, output: str
) -> None:
    train_test()
    _regen(pytester)
    before = _snapshot(pytester.path / "bl")
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl", f"--msprobe-output={output}")
    out = (pytester.path / output).resolve()
    _usage_error(result, f"*--msprobe-output {out}* the baseline folder {pytester.path / 'bl'}*")
    assert _snapshot(pytester.path / "bl") == before


def test_an_ini_output_inside_the_baselines_is_refused_too(pytester: pytest.Pytester, train_test) -> None:
    train_test()
    _regen(pytester)
    before = _snapshot(pytester.path / "bl")
    pytester.makeini("[pytest]\nmsprobe_baseline = bl\nmsprobe_output = bl/out\n")
    result = pytester.runpytest(*BASE)
    _usage_error(result, "*ini msprobe_output * lies inside the baseline folder *bl*")
    assert _snapshot(pytester.path / "bl") == before


def test_an_output_folder_inside_a_linked_baseline_folder_is_an_error_of_the_test(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test()
    _regen(pytester)
    elsewhere = pytester.path / "elsewhere"
    shutil.move(_folder(pytester), elsewhere)
    os.symlink(elsewhere, _folder(pytester))
    before = _snapshot(elsewhere)
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl", f"--msprobe-output={elsewhere / 'out'}")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            f"*the output folder {elsewhere / 'out'} lies inside the baseline folder*",
            f"msprobe: the session summary is not written: the output folder {elsewhere / 'out'} lies inside the "
            f"dump folder {elsewhere} (a baseline?)",
        ]
    )
    assert _snapshot(elsewhere) == before


def test_a_test_output_folder_linked_into_the_baselines_is_never_cleared(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test()
    _regen(pytester)
    before = _snapshot(pytester.path / "bl")
    out = pytester.path / "msprobe-output" / "test_train" / "test_train"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    os.symlink(_folder(pytester), out)
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*the test's output folder * the baseline folder *"])
    assert _snapshot(pytester.path / "bl") == before


@pytest.mark.parametrize("option", ["--msprobe-baseline=", "--msprobe-baseline=  ", "--msprobe-output="])
def test_an_empty_option_is_a_usage_error_not_an_off_switch(
    pytester: pytest.Pytester, train_test, option: str
) -> None:
    train_test()
    extra = [] if "baseline" in option else ["--msprobe-baseline=bl"]
    result = pytester.runpytest(*BASE, option, *extra)
    name = option.split("=")[0]
    _usage_error(result, f"*{name} is empty (an unset variable in the CI script?)*")


def test_a_baseline_option_naming_a_file_is_a_usage_error(pytester: pytest.Pytester, train_test) -> None:
    train_test()
    (pytester.path / "bl").write_text("")
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    _usage_error(result, f"*the baseline folder {pytester.path / 'bl'} is a file, not a folder*")


def test_an_empty_ini_baseline_is_a_usage_error(pytester: pytest.Pytester, train_test) -> None:
    train_test()
    pytester.makeini("[pytest]\nmsprobe_baseline =\n")
    _usage_error(pytester.runpytest(*BASE), "*ini msprobe_baseline is empty*")


def _barrier_test(pytester: pytest.Pytester, train_source: str, parties: int) -> None:
    """The training test, each run of which waits (up to 60 s) until ``parties`` runs have reached the body."""
    body = train_source.replace("MARKER", "@pytest.mark.msprobe(steps=[0, 1, 2])")
    body = body.replace(
        "def test_train(msprobe):\n    train(msprobe)",
        textwrap.dedent(
            f"""
            def test_train(msprobe):
                import os, time, uuid
                gate = os.environ["BARRIER_DIR"]
                open(os.path.join(gate, uuid.uuid4().hex), "w").close()
                deadline = time.time() + 60
                while len(os.listdir(gate)) < {parties} and time.time() < deadline:
                    time.sleep(0.02)
                train(msprobe, steps=3)
            """
        ),
    )
    pytester.makepyfile(test_train=body)


def _session(pytester: pytest.Pytester, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", *BASE, *args],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


@pytest.mark.slow
def test_the_same_test_in_four_xdist_workers_regenerates_one_whole_baseline(
    pytester: pytest.Pytester, train_source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _barrier_test(pytester, train_source, parties=4)
    monkeypatch.setenv("BARRIER_DIR", str(tmp_path))
    # --dist each: every worker runs the test, at the same time (the barrier holds each until all are there)
    each = ["-n", "4", "--dist", "each"]
    regen = pytester.runpytest_subprocess(*BASE, *each, "--msprobe-baseline=bl", "--msprobe-regen-baseline")
    regen.assert_outcomes(passed=4)
    folder = _folder(pytester)
    assert sorted(p.name for p in folder.iterdir()) == ["msprobe_manifest.json", "step0", "step1", "step2"]
    assert [p.name for p in folder.parent.iterdir()] == ["test_train"], "no leftovers beside the baseline"
    for tmp in tmp_path.iterdir():
        tmp.unlink()
    _barrier_test(pytester, train_source, parties=2)
    compared = pytester.runpytest_subprocess(*BASE, "-n", "2", "--dist", "each", "--msprobe-baseline=bl")
    compared.assert_outcomes(passed=2)
    assert "lacks" not in compared.stdout.str()
    # --keep-duplicates: one session collects the same test id twice (the barrier is passed by now)
    dupes = pytester.runpytest_subprocess(
        *BASE, "-n", "2", "--keep-duplicates", "--msprobe-baseline=bl", *["test_train.py"] * 2
    )
    dupes.assert_outcomes(passed=2)


@pytest.mark.parametrize("first", ["regen", "compare"])
@pytest.mark.slow
def test_two_sessions_sharing_one_output_folder_never_read_each_others_dumps(
    pytester: pytest.Pytester, train_source: str, tmp_path: Path, first: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _barrier_test(pytester, train_source, parties=1)
    monkeypatch.setenv("BARRIER_DIR", str(tmp_path))
    _regen(pytester)
    before = _snapshot(_folder(pytester))
    _barrier_test(pytester, train_source, parties=2)
    env_gate = tmp_path / "gate"
    env_gate.mkdir()
    monkeypatch.setenv("BARRIER_DIR", str(env_gate))
    regen_args = ["--msprobe-baseline=bl", "--msprobe-regen-baseline"]
    compare_args = ["--msprobe-baseline=bl"]
    runs = [regen_args, compare_args] if first == "regen" else [compare_args, compare_args]
    procs = [_session(pytester, *args) for args in runs]
    results = [_finish(p) for p in procs]
    for code, out in results:
        assert code == 0, out
        assert "lacks" not in out
    folder = _folder(pytester)
    assert sorted(p.name for p in folder.iterdir()) == ["msprobe_manifest.json", "step0", "step1", "step2"]
    if first == "compare":
        assert _snapshot(folder) == before
    pytester.runpytest(*BASE, "--msprobe-baseline=bl").assert_outcomes(passed=1)


def test_a_linked_baseline_folder_is_written_in_place_and_the_link_stays(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test()
    target = pytester.path / "shared" / "train_baseline"
    target.mkdir(parents=True)
    link = _folder(pytester)
    link.parent.mkdir(parents=True)
    os.symlink(target, link)
    result = _regen(pytester)
    result.stdout.fnmatch_lines([f"*REGENERATED*test_train.py::test_train*({target})*"])
    assert os.path.islink(link) and os.readlink(link) == str(target)
    assert sorted(p.name for p in target.iterdir()) == ["msprobe_manifest.json", "step0", "step1"]
    assert sorted(p.name for p in link.parent.iterdir()) == ["test_train"], "no hidden leftovers"
    assert sorted(p.name for p in target.parent.iterdir()) == ["train_baseline"]
    _regen(pytester)  # replacing it keeps the link too
    assert os.path.islink(link) and sorted(p.name for p in target.parent.iterdir()) == ["train_baseline"]
    pytester.runpytest(*BASE, "--msprobe-baseline=bl").assert_outcomes(passed=1)


# -- no false green -------------------------------------------------------------------------------------------


def _error_line(result: pytest.RunResult, pattern: str) -> None:
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line.startswith("msprobe: ")]
    assert len(lines) == 1, lines
    result.stdout.fnmatch_lines([pattern])


@pytest.mark.parametrize(
    ("made", "now", "problem"),
    [
        ("steps=[0, 1]", "steps=[0, 1, 2]", "it holds steps 0, 1, the test dumps steps 0, 1, 2"),
        (
            'level="L0", steps=[0, 1]',
            'level="L1", steps=[0, 1]',
            "it was dumped at level L0, the test runs level L1",
        ),
        (
            'task="statistics"',
            'task="tensor"',
            "it was dumped with task statistics, the test runs task tensor",
        ),
        ('task="md5"', 'task="statistics"', "it was dumped with task md5, the test runs task statistics"),
        ("seed=1", "seed=2", "it was made with seed 1, the test runs seed 2"),
    ],
    ids=["steps", "level", "task", "md5", "seed"],
)
def test_a_baseline_made_by_another_kind_of_run_is_an_error_before_training(
    pytester: pytest.Pytester, train_test, made: str, now: str, problem: str
) -> None:
    train_test(f"@pytest.mark.msprobe({made})")
    _regen(pytester)
    train_test(f"@pytest.mark.msprobe({now})")
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    _error_line(
        result,
        f"msprobe: the baseline {_folder(pytester)} does not fit this test: {problem}; regenerate it: "
        "pytest 'test_train.py::test_train' *--msprobe-regen-baseline",
    )
    result.stdout.fnmatch_lines(["*ERROR at setup of test_train*"])
    result.stdout.fnmatch_lines(
        ["ERROR        test_train.py::test_train  (the baseline * does not fit this test*"]
    )


def test_a_single_rank_baseline_does_not_fit_a_two_rank_test(pytester: pytest.Pytester, train_test) -> None:
    train_test()
    _regen(pytester)
    train_test("@pytest.mark.msprobe(world_size=2, steps=[0, 1])")
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    _error_line(
        result,
        "*does not fit this test: its step 0 holds rank(s) 0, the test runs world_size=2 (ranks 0, 1)*",
    )


def test_a_plain_msprobe_dump_is_checked_from_what_it_holds(pytester: pytest.Pytester, train_test) -> None:
    data = Path(__file__).parents[1] / "data" / "msprobe" / "msprobe-8.3.3" / "dumps" / "bench"
    folder = _folder(pytester)
    folder.parent.mkdir(parents=True)
    shutil.copytree(data / "stat_mix", folder)
    train_test('@pytest.mark.msprobe(level="L1", steps=[0, 1, 2])')
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    _error_line(
        result,
        "*does not fit this test: it holds steps 0, 1, the test dumps steps 0, 1, 2; it was dumped at level mix, "
        "the test runs level L1; regenerate it*",
    )


@pytest.mark.parametrize(
    ("steps", "loop", "missing"),
    [("[0, 1, 2]", 2, "step 2 never ran (the loop ran 2 step(s))"), ("[1, 2]", 2, "step 2 never ran")],
)
@pytest.mark.parametrize("mode", ["regen", "compare"])
def test_a_requested_step_that_never_ran_fails_in_regen_and_in_compare(
    pytester: pytest.Pytester, train_test, steps: str, loop: int, missing: str, mode: str
) -> None:
    train_test(f"@pytest.mark.msprobe(steps={steps})")
    if mode == "compare":
        body = (
            (pytester.path / "test_train.py")
            .read_text()
            .replace("    train(msprobe)", "    train(msprobe, 3)")
        )
        (pytester.path / "test_train.py").write_text(body)
        _regen(pytester)
        body = body.replace("train(msprobe, 3)", f"train(msprobe, {loop})")
        (pytester.path / "test_train.py").write_text(body)
        args = ["--msprobe-baseline=bl"]
    else:
        args = ["--msprobe-baseline=bl", "--msprobe-regen-baseline"]
    result = pytester.runpytest(*BASE, *args)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"msprobe: test_train.py::test_train: {missing}*run every requested step*"])
    result.stdout.fnmatch_lines(
        [f"FAILED       test_train.py::test_train  (test_train.py::test_train: {missing}*"]
    )
    if mode == "regen":
        assert not _folder(pytester).exists(), "no baseline of fewer steps is stored"


def test_a_nested_step_is_refused(pytester: pytest.Pytester, train_source: str) -> None:
    body = train_source.replace("MARKER", "@pytest.mark.msprobe(steps=[0, 1])").replace(
        "def test_train(msprobe):\n    train(msprobe)",
        "def test_train(msprobe):\n    with msprobe.step():\n        train(msprobe)",
    )
    pytester.makepyfile(test_train=body)
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["msprobe: msprobe.step() inside msprobe.step() (step 0): steps do not nest*"]
    )
    assert not _folder(pytester).exists()


def test_the_marker_on_a_test_without_the_fixture_is_an_error_of_that_test(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_forgot="""
        import pytest

        @pytest.mark.msprobe(steps=[0, 1])
        def test_forgot():
            pass

        def test_plain():
            pass
        """
    )
    for args in ([], ["--msprobe-baseline=bl"]):
        result = pytester.runpytest(*BASE, *args)
        result.assert_outcomes(passed=1, errors=1)  # the other tests run
        result.stdout.fnmatch_lines(
            ["*test_forgot.py::test_forgot: @pytest.mark.msprobe needs the msprobe fixture*"]
        )
        assert "Traceback" not in result.stdout.str()


def test_the_marker_on_a_class_or_usefixtures_counts(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_cls="""
        import pytest

        @pytest.mark.msprobe(steps=[0])
        class TestIt:
            def test_without(self):
                pass

        @pytest.mark.usefixtures("msprobe")
        @pytest.mark.msprobe(steps=[0])
        def test_with_usefixtures():
            pass
        """
    )
    result = pytester.runpytest(*BASE)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_cls.py::TestIt::test_without: @pytest.mark.msprobe needs*"])


# -- messages -------------------------------------------------------------------------------------------------


def test_the_summary_of_a_test_that_compared_nothing_says_why(pytester: pytest.Pytester, train_test) -> None:
    train_test()
    result = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [f"MISSING      test_train.py::test_train  (no baseline for this test at {_folder(pytester)})"]
    )
    assert "first divergence" not in result.stdout.str()


@pytest.mark.parametrize(
    "param", ["it's", "two words", "$(touch pwned)", "`touch pwned2`", 'a"b; touch pwned3'], ids=range(5)
)
def test_the_regenerate_command_is_quoted_for_the_shell(
    pytester: pytest.Pytester, train_source: str, param: str
) -> None:
    body = train_source.replace(
        "MARKER",
        f"@pytest.mark.parametrize('p', [{param!r}], ids=[{param!r}])\n@pytest.mark.msprobe(steps=[0, 1])",
    ).replace("def test_train(msprobe):", "def test_train(msprobe, p):")
    pytester.makepyfile(test_train=body)
    result = pytester.runpytest(*BASE, "--msprobe-baseline=my baselines")
    result.assert_outcomes(failed=1)
    # once in the failure, and again in the short summary where pytest prints whole messages (CI=true)
    (line,) = {x for x in result.stdout.lines if x.startswith("create it on the reference device with: ")}
    command = line.split(": ", 1)[1]
    assert command.startswith("pytest ")
    show = pytester.path / "show_args.py"
    show.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    argv = subprocess.run(
        ["bash", "-c", f"{sys.executable} {show} {command.removeprefix('pytest ')}"],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(argv) == [
        f"test_train.py::test_train[{param}]",
        f"--msprobe-baseline={pytester.path / 'my baselines'}",
        "--msprobe-regen-baseline",
    ]
    assert not list(pytester.path.glob("pwned*"))
