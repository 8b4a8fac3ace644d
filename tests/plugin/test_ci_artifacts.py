"""What a CI job keeps: the session's summary.json and index.html, the pytest-html report whose links still work
once it and the output folder are downloaded together (relative links; embedded files in a self-contained
report), under pytest-xdist too, and the example pipeline's artifact paths checked against where the plugin
writes."""

from __future__ import annotations

import base64
import glob
import html
import json
import re
import shlex
import shutil
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from plugin_sources import BASE

from pytest_msprobe.report import links

PIPELINE = Path(__file__).resolve().parents[2] / "examples" / "resnet50" / "ci" / "precision-gate.yml"
LOOSE = '@pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1], rtol=0.5)'  # passes the 1% fault


def _hrefs(page: str) -> list[str]:
    return [html.unescape(h) for h in re.findall(r'href="([^"]*)"', page)]


def _html_extras(report: Path) -> dict[str, str]:
    """The msprobe fragment of each test in a pytest-html 4 report (its extras live in a JSON blob)."""
    (blob,) = re.findall(r'data-jsonblob="([^"]*)"', report.read_text())
    tests = json.loads(html.unescape(blob))["tests"]
    fragments = {
        nodeid: "".join(e["content"] for r in runs for e in r.get("extras", []) if e["format_type"] == "html")
        for nodeid, runs in tests.items()
    }
    return {nodeid: fragment for nodeid, fragment in fragments.items() if fragment}


def _resolve(base: Path, href: str) -> Path:
    assert not href.startswith(("file:", "/")) and "://" not in href, f"not a relative link: {href}"
    return (base / urllib.parse.unquote(href)).resolve()


def _session(
    pytester: pytest.Pytester, train_test, fault_plugin: str, monkeypatch: pytest.MonkeyPatch, *extra: str
) -> pytest.RunResult:
    """Three tests (one breaches, one passes, one has no baseline) and what an earlier run left behind."""
    train_test(name="test_breach")
    train_test(LOOSE, name="test_loose")
    pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline").assert_outcomes(passed=2)
    train_test(name="test_new")  # no baseline yet
    old = pytester.path / "msprobe-output" / "test_gone" / "test_train" / "compare"
    old.mkdir(parents=True)
    (old / "summary.json").write_text('{"passed": false}')  # a test of an earlier session, not run now
    monkeypatch.setenv("FAULT_SCALE", "0.01")
    return pytester.runpytest(*BASE, "-p", fault_plugin, "--msprobe-baseline=bl", *extra)


def test_the_session_summary_lists_this_sessions_tests_with_verdicts_and_reports(
    pytester: pytest.Pytester, train_test, fault_plugin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _session(pytester, train_test, fault_plugin, monkeypatch, "--html=reports/report.html")
    result.assert_outcomes(passed=1, failed=2)
    out = pytester.path / "msprobe-output"
    result.stdout.fnmatch_lines([f"session summary: {out / 'summary.json'} (index: {out / 'index.html'})"])
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["schema"], summary["mode"], summary["report_only"]) == (1, "compare", False)
    assert summary["baseline"] == str(pytester.path / "bl") and summary["passed"] is False
    assert summary["counts"] == {"tests": 3, "failed": 1, "missing": 1, "passed": 1}
    tests = {t["nodeid"]: t for t in summary["tests"]}
    assert list(tests) == [
        "test_breach.py::test_train",
        "test_loose.py::test_train",
        "test_new.py::test_train",
    ]

    breach = tests["test_breach.py::test_train"]
    assert (breach["verdict"], breach["outcome"], breach["report_only"]) == ("failed", "failed", False)
    first = breach["first_divergence"]
    assert (first["api"], first["step"], first["rank"], first["kind"]) == (
        "Functional.relu.1.forward",
        0,
        0,
        "api",
    )
    assert first["row"] == "Functional.relu.1.forward.output.0" and "error enters here" in first["reason"]
    # the user's line that made the call: the model's forward in the test module
    assert first["source"].startswith(f"File {pytester.path / 'test_breach.py'}, line ")
    assert first["source"].endswith("in forward, x = F.relu(self.conv2(x))")
    counts = breach["counts"]
    assert set(counts) == {"calls", "breaching_calls", "error_rows", "warnings", "unmatched"}
    assert (
        0 < counts["breaching_calls"] < counts["calls"] and counts["error_rows"] >= counts["breaching_calls"]
    )
    assert breach["message"].startswith("msprobe: ") and "worst rows:" in breach["message"]
    assert {"xlsx", "advisor", "summary"} <= set(breach["reports"])
    for path in breach["reports"].values():  # relative to the summary's folder
        assert not Path(path).is_absolute() and path.startswith("test_breach/test_train/compare/")
        assert (out / path).is_file()
    own = json.loads((out / breach["reports"]["summary"]).read_text())
    assert own["first_divergence"]["api"] == first["api"]  # the same compare

    loose = tests["test_loose.py::test_train"]
    assert (loose["verdict"], loose["outcome"], loose["first_divergence"]) == ("passed", "passed", None)
    assert loose["counts"]["breaching_calls"] == 0 and all(
        (out / p).is_file() for p in loose["reports"].values()
    )
    new = tests["test_new.py::test_train"]
    assert (new["verdict"], new["reports"], new["counts"]) == ("missing", {}, None)
    assert new["reason"] == f"no baseline for this test at {pytester.path / 'bl' / 'test_new' / 'test_train'}"
    assert "test_gone" not in json.dumps(summary)

    index = (out / "index.html").read_text()
    assert index.startswith("<!DOCTYPE html>") and "test_gone" not in index
    for nodeid, verdict in (("test_breach", "failed"), ("test_loose", "passed"), ("test_new", "missing")):
        assert (
            f'<tr class="{verdict}"><td class="verdict">{verdict.upper()}</td><td><code>{nodeid}.py::'
            in index
        )
    assert "<b>Functional.relu.1.forward</b> (step 0, rank 0)<br><code>File " in index
    hrefs = _hrefs(index)
    # summary.json, and every report of each compared test
    assert len(hrefs) == 1 + len(breach["reports"]) + len(loose["reports"])
    for href in hrefs:
        assert _resolve(out, href).is_file(), href


def test_html_report_links_are_relative_and_survive_the_download(
    pytester: pytest.Pytester, train_test, fault_plugin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = pytester.path / "reports" / "html" / "report.html"
    _session(pytester, train_test, fault_plugin, monkeypatch, f"--html={report.relative_to(pytester.path)}")
    # a CI artifact: the report's folder and the output folder, downloaded elsewhere side by side
    artifact = tmp_path / "artifact"
    shutil.copytree(pytester.path / "reports", artifact / "reports")
    shutil.copytree(
        pytester.path / "msprobe-output", artifact / "msprobe-output", ignore=shutil.ignore_patterns("dump")
    )
    shutil.rmtree(pytester.path / "msprobe-output")  # nothing may still point at the runner's files
    fragments = _html_extras(artifact / "reports" / "html" / "report.html")
    assert set(fragments) == {"test_breach.py::test_train", "test_loose.py::test_train"}
    summary = json.loads((artifact / "msprobe-output" / "summary.json").read_text())
    reports = {t["nodeid"]: t["reports"] for t in summary["tests"]}
    for nodeid, fragment in fragments.items():
        hrefs = _hrefs(fragment)
        assert len(hrefs) == len(reports[nodeid]) >= 3, (nodeid, hrefs)
        assert all(h.startswith("../../msprobe-output/") for h in hrefs)
        for href in hrefs:
            assert _resolve(artifact / "reports" / "html", href).is_file(), href
    assert (
        'class="msprobe-plot" alt="error per API call" src="data:image/png;base64,'
        in fragments["test_breach.py::test_train"]
    )
    index = artifact / "msprobe-output" / "index.html"
    assert all(_resolve(index.parent, h).is_file() for h in _hrefs(index.read_text()))


def test_a_self_contained_report_embeds_the_files(
    pytester: pytest.Pytester,
    train_test,
    fault_plugin: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = _session(
        pytester, train_test, fault_plugin, monkeypatch, "--html=report.html", "--self-contained-html"
    )
    result.assert_outcomes(passed=1, failed=2)
    fragment = _html_extras(pytester.path / "report.html")["test_breach.py::test_train"]
    summary = json.loads((pytester.path / "msprobe-output" / "summary.json").read_text())
    reports = {k: pytester.path / "msprobe-output" / v for k, v in summary["tests"][0]["reports"].items()}
    anchors = re.findall(
        r'<a class="msprobe-embedded" download="([^"]+)" href="data:([^;]+);base64,([^"]+)">', fragment
    )
    assert sorted(name for name, _, _ in anchors) == sorted(p.name for p in reports.values())
    types = {"xlsx": links.XLSX_MIME, "txt": "text/plain", "json": "application/json"}
    for name, mime, data in anchors:  # each embedded file is the file itself, with its type
        assert base64.b64decode(data) == next(p for p in reports.values() if p.name == name).read_bytes()
        assert mime == types.get(name.rsplit(".", 1)[1], mime)
    assert {name.rsplit(".", 1)[1] for name, _, _ in anchors} >= set(types)
    advisor = reports["advisor"].read_text()
    assert html.escape(advisor.splitlines()[1]) in fragment  # the advisor's text inline as well
    assert "data:image/png;base64," in fragment

    # a file over the limit is not embedded: a relative link, marked as such
    assert reports["advisor"].stat().st_size < reports["xlsx"].stat().st_size // 2
    monkeypatch.setattr(links, "EMBED_LIMIT", reports["xlsx"].stat().st_size // 2)
    pytester.runpytest(
        *BASE, "-p", fault_plugin, "--msprobe-baseline=bl", "--html=report.html", "--self-contained-html"
    )
    fragment = _html_extras(pytester.path / "report.html")["test_breach.py::test_train"]
    (xlsx,) = re.findall(
        r'<a href="([^"]+\.xlsx)">compare result \(xlsx\)</a> <i>\(not embedded \(', fragment
    )
    assert _resolve(pytester.path, xlsx).is_file()
    summary = json.loads((pytester.path / "msprobe-output" / "summary.json").read_text())
    advisor_name = Path(summary["tests"][0]["reports"]["advisor"]).name
    assert f'download="{advisor_name}"' in fragment  # the smaller ones still are


@pytest.mark.slow
def test_under_xdist_the_controller_writes_the_summary_of_every_worker(
    pytester: pytest.Pytester, train_source: str
) -> None:
    body = train_source.replace(
        "MARKER", '@pytest.mark.parametrize("lr", [1, 2, 3])\n@pytest.mark.msprobe(steps=[0, 1])'
    ).replace(
        "def test_train(msprobe):\n    train(msprobe)", "def test_train(msprobe, lr):\n    train(msprobe)"
    )
    pytester.makepyfile(test_many=body)
    # every process that writes the session summary says so (the workers must not)
    pytester.makeconftest(
        """
        import os
        import pytest_msprobe.pytest.session_hooks as session

        _write = session.write_session_reports
        _role = []

        def pytest_configure(config):
            _role.append("worker" if hasattr(config, "workerinput") else "controller")

        def _spy(summary, out):
            with open(os.path.join(os.path.dirname(__file__), "writers.log"), "a") as log:
                log.write(f"{_role[0]} {len(summary['tests'])}\\n")
            return _write(summary, out)

        session.write_session_reports = _spy
        """
    )
    regen = pytester.runpytest_subprocess(
        *BASE, "-n", "2", "--msprobe-baseline=bl", "--msprobe-regen-baseline"
    )
    regen.assert_outcomes(passed=3)
    summary = json.loads((pytester.path / "msprobe-output" / "summary.json").read_text())
    assert summary["mode"] == "regenerate" and summary["counts"] == {"tests": 3, "regenerated": 3}
    assert [t["baseline"] for t in summary["tests"]] == [
        str(pytester.path / "bl" / "test_many" / f"test_train[{lr}]") for lr in (1, 2, 3)
    ]
    compared = pytester.runpytest_subprocess(*BASE, "-n", "2", "--msprobe-baseline=bl")
    compared.assert_outcomes(passed=3)
    assert (pytester.path / "writers.log").read_text().splitlines() == ["controller 3", "controller 3"]
    summary = json.loads((pytester.path / "msprobe-output" / "summary.json").read_text())
    assert summary["counts"] == {"tests": 3, "passed": 3}
    for lr, test in zip((1, 2, 3), summary["tests"]):
        assert test["nodeid"] == f"test_many.py::test_train[{lr}]" and test["verdict"] == "passed"
        # a parametrized id in a link: quoted, and it still leads to the file
        assert test["reports"]["summary"] == f"test_many/test_train%5B{lr}%5D/compare/summary.json"
        assert _resolve(pytester.path / "msprobe-output", test["reports"]["summary"]).is_file()


def test_a_self_check_session_has_a_summary_and_a_plain_one_leaves_the_folder_alone(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test()
    pytester.runpytest(*BASE).assert_outcomes(passed=1)
    assert not (pytester.path / "msprobe-output").exists()  # no baseline, no self-check: nothing written
    pytester.runpytest(*BASE, "--msprobe-self-check").assert_outcomes(passed=1)
    summary = json.loads((pytester.path / "msprobe-output" / "summary.json").read_text())
    assert (summary["mode"], summary["baseline"], summary["counts"]) == (
        "self-check",
        None,
        {"tests": 1, "passed": 1},
    )
    assert (
        summary["tests"][0]["counts"]["breaching_calls"] == 0 and summary["tests"][0]["counts"]["calls"] > 10
    )
    # a compare that checks no test still writes its (empty) summary: the earlier one is not taken for it
    pytester.runpytest(*BASE, "--msprobe-baseline=bl", "-k", "nothing").assert_outcomes(deselected=1)
    summary = json.loads((pytester.path / "msprobe-output" / "summary.json").read_text())
    assert (summary["counts"], summary["tests"], summary["passed"]) == ({"tests": 0}, [], True)
    assert (
        "no msprobe test was checked in this session"
        in (pytester.path / "msprobe-output" / "index.html").read_text()
    )


# ------------------------------------------------------------------------------------------ the example's CI
def _yaml(text: str) -> Any:
    """The YAML of a CI workflow, read in the subset such files use: block mappings and sequences (a sequence's
    item may be a mapping), ``|`` and ``>`` block scalars, ``[a, b]`` flow sequences, quoted and plain scalars,
    comment lines. Anything else is not expected in the example and fails the test."""
    raw = text.splitlines()
    pos = 0

    def indent(i: int) -> int:
        return len(raw[i]) - len(raw[i].lstrip(" "))

    def skip() -> None:
        nonlocal pos
        while pos < len(raw) and (not raw[pos].strip() or raw[pos].lstrip().startswith("#")):
            pos += 1

    def scalar(s: str) -> Any:
        s = s.strip()
        if s.startswith("[") and s.endswith("]"):
            return [scalar(x) for x in s[1:-1].split(",") if x.strip()]
        if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
            return s[1:-1]
        assert not s.startswith(("{", "&", "*", "!")), f"YAML beyond the subset: {s}"
        return {"true": True, "false": False}.get(s, s)

    def block_scalar(style: str, parent: int) -> str:
        nonlocal pos
        lines = []
        while pos < len(raw) and (not raw[pos].strip() or indent(pos) > parent):
            lines.append(raw[pos])
            pos += 1
        cut = min(len(x) - len(x.lstrip(" ")) for x in lines if x.strip())
        body = [x[cut:] for x in lines]
        if style == "|":
            return "\n".join(body).strip("\n") + "\n"
        return " ".join(x.strip() for x in body if x.strip())

    def value(text: str, at: int) -> Any:
        if text in ("|", ">"):
            return block_scalar(text, at)
        if text:
            return scalar(text)
        skip()
        if pos < len(raw) and indent(pos) > at:
            return node(indent(pos))
        return None

    def node(at: int) -> Any:
        skip()
        return sequence(at) if raw[pos].lstrip().startswith("- ") else mapping(at)

    def mapping(at: int) -> dict[str, Any]:
        nonlocal pos
        out: dict[str, Any] = {}
        while True:
            skip()
            if pos >= len(raw) or indent(pos) != at or raw[pos].lstrip().startswith("- "):
                return out
            key, colon, rest = raw[pos].strip().partition(":")
            assert colon and (not rest or rest.startswith(" ")), f"YAML beyond the subset: {raw[pos]}"
            pos += 1
            out[key] = value(rest.strip(), at)

    def sequence(at: int) -> list[Any]:
        nonlocal pos
        out: list[Any] = []
        while True:
            skip()
            if pos >= len(raw) or indent(pos) != at or not raw[pos].lstrip().startswith("- "):
                return out
            item = raw[pos].strip()[2:]
            if re.match(r"[\w-]+:( |$)", item):  # a mapping: its first key stands where the item starts
                raw[pos] = " " * (at + 2) + item
                out.append(mapping(at + 2))
            else:
                pos += 1
                out.append(scalar(item))

    return node(0)


def _uploaded(root: Path, patterns: list[str]) -> set[str]:
    """The files an ``actions/upload-artifact`` path list takes from ``root``: globs, a folder whole."""
    files: set[str] = set()
    for pattern in patterns:
        for match in glob.glob(pattern, root_dir=root, recursive=True):
            path = root / match
            found = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
            files.update(p.relative_to(root).as_posix() for p in found)
    return files


def test_the_example_pipelines_artifacts_hold_what_the_plugin_writes(
    pytester: pytest.Pytester, train_test, fault_plugin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = _yaml(PIPELINE.read_text())["jobs"]
    # the GPU job uploads the folder it regenerates into
    regen = next(s for s in jobs["gpu-baseline"]["steps"] if "--msprobe-regen-baseline" in s.get("run", ""))
    baseline = next(
        a.split("=", 1)[1] for a in shlex.split(regen["run"]) if a.startswith("--msprobe-baseline=")
    )
    upload = next(
        s for s in jobs["gpu-baseline"]["steps"] if s.get("uses", "").startswith("actions/upload-artifact")
    )
    assert upload["with"]["path"] == baseline
    download = next(s for s in jobs["npu-gate"]["steps"] if "download-artifact" in s.get("uses", ""))
    assert (download["with"]["name"], download["with"]["path"]) == (upload["with"]["name"], baseline)

    # the gate: its reporting options, run here on the training test, then its artifact's path list applied
    gate = next(s for s in jobs["npu-gate"]["steps"] if "--msprobe-baseline=" in s.get("run", ""))
    args = shlex.split(gate["run"])
    assert args[0] == "pytest" and f"--msprobe-baseline={baseline}" in args
    reporting = [
        a for a in args if a.startswith(("--msprobe-output=", "--html=", "--junitxml=", "--self-contained"))
    ]
    option = dict(a.split("=", 1) for a in reporting if "=" in a)
    assert set(option) == {"--msprobe-output", "--html", "--junitxml"}
    train_test()
    pytester.runpytest(*BASE, f"--msprobe-baseline={baseline}", "--msprobe-regen-baseline").assert_outcomes(
        passed=1
    )
    monkeypatch.setenv("FAULT_SCALE", "0.01")
    gated = pytester.runpytest(*BASE, "-p", fault_plugin, f"--msprobe-baseline={baseline}", *reporting)
    gated.assert_outcomes(failed=1)

    (kept,) = [
        s for s in jobs["npu-gate"]["steps"] if s.get("uses", "").startswith("actions/upload-artifact")
    ]
    assert kept["if"] == "always()"  # a failing gate is when the reports matter
    files = _uploaded(pytester.path, kept["with"]["path"].split())
    output = option["--msprobe-output"]
    for expected in (
        option["--html"],
        option["--junitxml"],
        f"{output}/summary.json",
        f"{output}/index.html",
    ):
        assert expected in files, f"{expected} is written but not uploaded"
    summary = json.loads((pytester.path / output / "summary.json").read_text())
    (test,) = summary["tests"]
    assert test["verdict"] == "failed" and test["reports"]
    for path in test["reports"].values():
        assert f"{output}/{urllib.parse.unquote(path)}" in files
    assert not any("/dump/" in f for f in files), "the dumps stay behind"
    # every link of the uploaded index leads into the artifact; the self-contained report embeds its files
    index = pytester.path / output / "index.html"
    for href in _hrefs(index.read_text()):
        assert _resolve(index.parent, href).relative_to(pytester.path).as_posix() in files
    fragment = _html_extras(pytester.path / option["--html"])[test["nodeid"]]
    if "--self-contained-html" in args:
        assert fragment.count('class="msprobe-embedded"') == len(test["reports"])
    for href in _hrefs(fragment):
        if not href.startswith("data:"):
            resolved = _resolve((pytester.path / option["--html"]).parent, href)
            assert resolved.relative_to(pytester.path).as_posix() in files
