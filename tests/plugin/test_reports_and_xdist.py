"""The pytest-html report of a failing precision test, opened in a real browser, and runs under pytest-xdist."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from chromium import CHROMIUM, CHROMIUM_FLAGS, png_size_and_ink, probe
from plugin_sources import BASE


def _failing_html_report(
    pytester: pytest.Pytester, train_test, fault_plugin: str, monkeypatch: pytest.MonkeyPatch
) -> Path:
    train_test()
    pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline").assert_outcomes(passed=1)
    monkeypatch.setenv("FAULT_SCALE", "0.01")
    html = pytester.path / "report.html"
    result = pytester.runpytest(*BASE, "-p", fault_plugin, "--msprobe-baseline=bl", f"--html={html}")
    result.assert_outcomes(failed=1, errors=0)
    return html


def test_html_report_carries_advisor_table_plot_and_links(
    pytester: pytest.Pytester, train_test, fault_plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    html = _failing_html_report(pytester, train_test, fault_plugin, monkeypatch)
    text = html.read_text()
    # pytest-html 4 stores each test's extras in a JSON blob the page renders: check what it will show
    assert "Functional.relu.1.forward" in text
    assert "msprobe-first-divergence" in text and "msprobe-advisor" in text
    assert "Suspect Nodes: Functional.relu.1.forward.output.0" in text
    assert "data:image/png;base64," in text
    assert "compare_result_" in text and ".xlsx" in text
    assert "compare result (csv)" in text


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian package chromium)")
def test_html_report_renders_in_chromium(
    pytester: pytest.Pytester, train_test, fault_plugin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    html = _failing_html_report(pytester, train_test, fault_plugin, monkeypatch)
    profile = tmp_path / "profile"
    common = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1280,2000"]
    # the rendered DOM: pytest-html builds its table with JavaScript; expand every row so extras are in it
    dom = subprocess.run(
        [*common, "--virtual-time-budget=5000", "--dump-dom", html.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert 'class="msprobe-first-divergence">Functional.relu.1.forward<' in dom
    assert "msprobe-plot" in dom and "Suspect Nodes: Functional.relu.1.forward.output.0" in dom
    shot = tmp_path / "report.png"
    subprocess.run(
        [*common, "--virtual-time-budget=5000", f"--screenshot={shot}", html.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    width, height, ink = png_size_and_ink(shot.read_bytes())
    assert (width, height) == (1280, 2000)
    assert ink > 0.01, f"the screenshot is blank ({ink:.4f} of pixels drawn)"
    # as it reads: the advisor is prose under a heading, and the failure's log is shown whole, not cut at
    # pytest-html's 230px behind "expand"
    seen = probe(html, READ, profile)
    assert seen is not None, "no failed msprobe block in the rendered report"
    assert seen["heading"].startswith("Advisor")
    assert seen["headingSize"] > seen["size"] >= 13
    assert not any(mono in seen["font"].lower() for mono in ("mono", "courier")), seen["font"]
    assert max(int(v) for v in seen["colour"][4:-1].split(",")) < 100, seen["colour"]  # dark, not grey
    assert seen["line"].startswith("Line ") and "of the comparison table" in seen["line"]
    assert seen["maxHeight"] == "none" and seen["expander"] == "none"
    assert seen["shown"] >= seen["needed"] and seen["logTop"] >= seen["wrapperTop"]
    assert "first divergence: Functional.relu.1.forward" in seen["log"]


# what the browser makes of the failed test's row: the advisor's computed style, the log's box against its text
READ = """
const block = document.querySelector(".msprobe-failed");
if (!block) return null;
const advisor = block.querySelector(".msprobe-advisor"), cell = block.closest("td");
const prose = getComputedStyle(advisor.querySelector("p:not(.msprobe-line)"));
const wrapper = cell.querySelector(".logwrapper"), log = cell.querySelector(".log");
return {
  heading: advisor.querySelector("h4").textContent,
  headingSize: parseFloat(getComputedStyle(advisor.querySelector("h4")).fontSize),
  size: parseFloat(prose.fontSize), font: prose.fontFamily, colour: prose.color,
  line: advisor.querySelector(".msprobe-line").textContent,
  maxHeight: getComputedStyle(wrapper).maxHeight, expander: getComputedStyle(cell.querySelector(".logexpander")).display,
  shown: wrapper.clientHeight, needed: log.scrollHeight, log: log.textContent,
  logTop: log.getBoundingClientRect().top, wrapperTop: wrapper.getBoundingClientRect().top,
};
"""


@pytest.mark.slow
def test_four_workers_regen_and_compare_eight_tests_without_clashes(
    pytester: pytest.Pytester, train_source: str
) -> None:
    import json

    import openpyxl

    rates = [f"{0.01 * (i + 1):.2f}" for i in range(8)]  # two a worker
    body = train_source.replace(
        "MARKER",
        f"@pytest.mark.parametrize('lr', {rates!r})\n@pytest.mark.msprobe(steps=[0, 1])",
    ).replace(
        "def test_train(msprobe):\n    train(msprobe)", "def test_train(msprobe, lr):\n    train(msprobe)"
    )
    pytester.makepyfile(test_many=body)
    ids = [f"test_train[{rate}]" for rate in rates]
    regen = pytester.runpytest_subprocess(
        *BASE, "-n", "4", "--msprobe-baseline=bl", "--msprobe-regen-baseline"
    )
    regen.assert_outcomes(passed=8)
    regen.stdout.fnmatch_lines(["*8 baseline(s) written to*"])
    assert sorted(p.name for p in (pytester.path / "bl" / "test_many").iterdir()) == sorted(ids)
    left = [str(p.relative_to(pytester.path)) for p in (pytester.path / "msprobe-output").rglob("*.json")]
    assert left == ["msprobe-output/summary.json"], (
        "the baselines are the copies: the session's summary stays"
    )
    for name in ids:
        manifest = json.loads(
            (pytester.path / "bl" / "test_many" / name / "msprobe_manifest.json").read_text()
        )
        assert manifest["test"] == f"test_many.py::{name}"

    compared = pytester.runpytest_subprocess(*BASE, "-n", "4", "--msprobe-baseline=bl")
    compared.assert_outcomes(passed=8)
    summary = [line for line in compared.stdout.lines if line.startswith("PASSED       test_many.py::")]
    assert sorted(line.split("::")[1].split()[0] for line in summary) == sorted(ids)
    output = pytester.path / "msprobe-output" / "test_many"
    assert sorted(p.name for p in output.iterdir()) == sorted(ids)
    for name in ids:
        reports = output / name / "compare"
        assert sorted(p.name for p in (output / name).iterdir()) == ["compare"], "dumps of passes removed"
        assert json.loads((reports / "summary.json").read_text())["passed"] is True
        (xlsx,) = reports.glob("compare_result_*.xlsx")
        sheet = openpyxl.load_workbook(xlsx).worksheets[0]
        assert sheet.max_row > 100
