"""A dump compared with itself proves nothing, and reports written into a dump change it: both are refused."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from compare_helpers import dump_dir

from pytest_msprobe.cli import main
from pytest_msprobe.compare import compare
from pytest_msprobe.errors import ConfigError

SAME = "are the same dump (both read "
PROVES = "comparing a dump with itself proves nothing"


@pytest.fixture
def dump(tmp_path: Path) -> Path:
    """A two-step msprobe dump root, copied (links and reports may be made next to it)."""
    return Path(shutil.copytree(dump_dir("8.3.3", "bench", "stat_L1"), tmp_path / "dump"))


def _forms(dump: Path) -> list[tuple[Path, Path]]:
    link = dump.parent / "link"
    if not link.exists():
        link.symlink_to(dump, target_is_directory=True)
    rank = dump / "step0" / "rank"
    return [
        (dump, dump),  # the same folder
        (dump, link),  # a symlink to it
        (link, dump),
        (dump, rank),  # the dump and a rank folder inside it
        (rank / "dump.json", dump / "step0"),  # a dump.json and its step folder
        (dump.parent / "dump" / "step1" / ".." / "step0", dump / "step0"),  # another spelling of the path
    ]


def test_compare_refuses_a_dump_against_itself(dump: Path) -> None:
    for target, baseline in _forms(dump):
        with pytest.raises(ConfigError) as info:
            compare(target, baseline)
        text = str(info.value)
        assert text.startswith(f"TARGET {target} and BASELINE {baseline} {SAME}"), text
        assert PROVES in text and "\n" not in text


def test_a_hard_link_is_the_same_file(dump: Path, tmp_path: Path) -> None:
    other = tmp_path / "other" / "step0" / "rank"
    other.mkdir(parents=True)
    os.link(dump / "step0" / "rank" / "dump.json", other / "dump.json")
    with pytest.raises(ConfigError, match=SAME.replace("(", r"\(")):
        compare(other.parent.parent, dump / "step0")


def test_the_cli_exits_2_with_one_line_and_writes_no_report(
    dump: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for n, (target, baseline) in enumerate(_forms(dump)):
        out = tmp_path / f"out{n}"
        assert main(["compare", str(target), str(baseline), "-o", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        (line,) = captured.err.strip().splitlines()
        assert line.startswith(f"pytest-msprobe: error: TARGET {target} and BASELINE {baseline} {SAME}")
        assert PROVES in line
        assert not out.exists()


def test_a_copy_is_another_dump(dump: Path, tmp_path: Path) -> None:
    again = shutil.copytree(dump, tmp_path / "again")
    assert compare(again, dump).passed


@pytest.mark.parametrize(
    ("where", "relation"),
    [
        ("{t}", "is TARGET {t}"),
        ("{t}/reports", "is inside TARGET {t}"),
        ("{b}/step0/rank/reports", "is inside BASELINE {b}"),
        ("{link}/x", "is inside BASELINE {link}"),
        ("{t}/step0/rank", "is the folder of TARGET {t}/step0/rank/dump.json"),
        ("{t}/step0/rank/x", "is inside the folder of TARGET {t}/step0/rank/dump.json"),
    ],
)
def test_a_report_folder_inside_a_dump_is_refused(
    dump: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, relation: str
) -> None:
    target = Path(shutil.copytree(dump, tmp_path / "target"))
    link = tmp_path / "link"
    link.symlink_to(dump, target_is_directory=True)
    names = {"t": str(target), "b": str(dump), "link": str(link)}
    out = where.format(**names)
    given_target = str(target / "step0" / "rank" / "dump.json") if "dump.json" in relation else str(target)
    given_baseline = str(link) if "link" in where else str(dump)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["compare", given_target, given_baseline, "-o", out]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"pytest-msprobe: error: -o {out} {relation.format(**names)}: reports written into a dump change it; "
        "write them elsewhere"
    )
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_a_report_folder_beside_the_dumps_is_fine(dump: Path, tmp_path: Path) -> None:
    target = shutil.copytree(dump, tmp_path / "target")
    assert main(["compare", str(target), str(dump), "-o", str(tmp_path / "reports"), "-q"]) == 0
    assert main(["compare", str(target), str(dump), "-o", str(tmp_path), "-q"]) == 0  # a folder above them
    assert (tmp_path / "summary.json").is_file()
