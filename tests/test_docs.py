"""The documentation stays whole: every page is in the site's navigation and every navigation entry is a page,
the options page lists every option where it may be given, the READMEs link to files that exist, and the
README's first test runs as it is written.

Cheap checks that need no mkdocs (CI builds the site itself with ``mkdocs build --strict``)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from processes import NO_HYPOTHESIS

from pytest_msprobe.options import OPTIONS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav names (``Title: page.md`` lines of the nav block), read without a YAML parser."""
    lines = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").splitlines()
    start = lines.index("nav:")
    pages = []
    for line in lines[start + 1 :]:
        if line and not line.startswith(" "):  # the next top-level key ends the nav
            break
        match = re.search(r":\s*([\w./-]+\.md)\s*$", line)
        if match:
            pages.append(match.group(1))
    return pages


def test_every_nav_entry_is_a_page_and_every_page_is_in_the_nav() -> None:
    nav = _nav_pages()
    assert nav, "mkdocs.yml has no nav entries"
    assert len(nav) == len(set(nav)), f"pages listed twice: {sorted(p for p in nav if nav.count(p) > 1)}"
    missing = [page for page in nav if not (DOCS / page).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    unlisted = [page for page in pages if page not in nav]
    assert not unlisted, f"pages missing from mkdocs.yml's nav: {unlisted}"


def _group(match: re.Match[str] | None) -> str | None:
    return match.group(1) if match else None


def _option_rows() -> list[tuple[str | None, str | None, str | None]]:
    """(flag, ini key, marker keyword) of each row of the options page's full table."""
    text = (DOCS / "options.md").read_text(encoding="utf-8")
    section = text.split("## Every option", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| command line") or line.startswith("|---"):
            continue
        cells = [cell.strip() for cell in line.strip()[1:-1].split("|")]
        flag = re.match(r"`(--[a-z0-9-]+)", cells[0])
        ini = re.match(r"`(msprobe_\w+)`", cells[1])
        marker = re.match(r"`(\w+)=", cells[2])
        rows.append((_group(flag), _group(ini), _group(marker)))
    return rows


def test_the_options_page_lists_every_option_where_it_may_be_given() -> None:
    rows = _option_rows()
    documented = [opt for opt in OPTIONS if opt.help != argparse.SUPPRESS]
    expected = {(opt.flag, opt.ini, opt.marker) for opt in documented}
    missing = sorted(str(row) for row in expected - set(rows))
    assert not missing, f"docs/options.md lacks (flag, ini, marker) rows: {missing}"
    stale = sorted(str(row) for row in set(rows) - expected)
    assert not stale, f"docs/options.md has rows that match no option: {stale}"
    assert len(rows) == len(documented)


def test_readme_links_point_to_files_that_exist() -> None:
    for readme in (ROOT / "README.md", ROOT / "bench" / "README.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (readme.parent / target).exists(), (
                f"{readme.relative_to(ROOT)} links to {target}, not found"
            )


def test_the_readme_stays_short() -> None:
    """The README is the front page; the guide is in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 330, f"README.md has {lines} lines: move detail into docs/"


def test_getting_started_shows_the_readme_set_up_commands() -> None:
    """Both front doors give the same two commands (CI runs the second), and the CPU-only torch line."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    guide = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv")]
    assert len(commands) == 3, commands  # the example, the tests, torch's CPU build
    assert any("download.pytorch.org/whl/cpu" in line for line in commands)
    for command in commands:
        assert command in guide, f"docs/getting-started.md lacks the README's command: {command}"


@pytest.mark.slow
def test_the_readmes_first_test_runs_as_it_is(pytester: pytest.Pytester) -> None:
    """The README's first test, copied as a newcomer would, writes its baseline and then compares green."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"```python\n(# (test_\w+)\.py[^\n]*\n.*?)```", text, re.S)
    assert match, "the README has no first test starting '# test_<name>.py'"
    source, name = match.group(1), match.group(2)
    pytester.makepyfile(**{name: source})
    args = [
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        *NO_HYPOTHESIS,
        f"{name}.py",
        "--msprobe-baseline=baselines",
    ]
    pytester.runpytest_subprocess(*args, "--msprobe-regen-baseline").assert_outcomes(passed=1)
    assert (pytester.path / "baselines" / name).is_dir()
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=1)
