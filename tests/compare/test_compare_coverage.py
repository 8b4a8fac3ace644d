"""Too little compared fails: ``max_unmatched`` bounds the share of the baseline's rows without a partner."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from compare_helpers import DATA, tensor, write_dump
from torch_dumps import dump_training

from pytest_msprobe.cli import main
from pytest_msprobe.compare import Thresholds, compare
from pytest_msprobe.errors import ConfigError
from pytest_msprobe.options import parse_threshold_value, thresholds_from_options
from pytest_msprobe.report import console_summary, summary_dict, write_reports
from pytest_msprobe.report.advisor import advisor_text
from pytest_msprobe.report.text import failure_message
from pytest_msprobe.thresholds import format_share, load_thresholds_file, parse_share

FAULTS = DATA / "faults"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One training step of a small CNN, dumped: in full, twice; without backward() and optimizer.step();
    at level L0."""
    root = tmp_path_factory.mktemp("runs")
    return {
        "full": dump_training(root / "full", steps=1),
        "again": dump_training(root / "again", steps=1),
        "forward_only": dump_training(root / "forward_only", steps=1, backward=False),
        "l0": dump_training(root / "l0", steps=1, level="L0"),
    }


def test_a_run_without_backward_and_optimizer_step_fails(runs: dict[str, Path]) -> None:
    result = compare(runs["forward_only"], runs["full"])
    cov = result.coverage
    assert not result.passed and not cov.passed
    assert not result.failures and result.first_divergence is None  # what it compared agrees
    only_baseline = [a for a in result.apis if a.status == "unmatched"]
    assert only_baseline and all(a.bench_api is not None for a in only_baseline)  # the target adds nothing
    assert (cov.unmatched_calls, cov.baseline_calls) == (len(only_baseline), len(result.apis))
    assert cov.unmatched_rows == sum(1 for r in result.rows if r.target is None)
    assert cov.baseline_rows == len(result.rows) and cov.share > 0.5
    assert cov.headline == (
        f"too little compared: {cov.unmatched_calls} of {cov.baseline_calls} baseline calls "
        f"({cov.unmatched_rows} of {cov.baseline_rows} rows, {format_share(cov.share)}) found no partner in "
        "the target; the limit is 5%"
    )
    # the first calls without a partner, in execution order: the backward pass begins where the target stopped
    assert [result.apis[i].api for i in cov.first_unmatched] == [
        "Torch.ones_like.0.forward",
        "Functional.cross_entropy.0.backward",
        "Functional.linear.0.backward",
        "Torch.flatten.0.backward",
        "Functional.adaptive_avg_pool2d.0.backward",
    ]


def test_an_l1_dump_against_an_l0_baseline_fails(runs: dict[str, Path]) -> None:
    result = compare(runs["full"], runs["l0"])
    assert not result.passed
    cov = result.coverage
    # every module record is left without a partner; only the optimizer's updates pair (optimizer.json holds
    # them at any level)
    updates = sum(1 for r in result.rows if r.row.startswith("Optimizer.") and r.baseline is not None)
    assert updates > 0 and cov.unmatched_rows == cov.baseline_rows - updates > 0
    assert cov.headline is not None and f"({cov.unmatched_rows} of {cov.baseline_rows} rows, " in cov.headline


def test_the_same_training_twice_pairs_everything(runs: dict[str, Path]) -> None:
    result = compare(runs["again"], runs["full"])
    assert result.passed and result.coverage.passed
    assert (result.coverage.unmatched_rows, result.coverage.share, result.coverage.headline) == (0, 0.0, None)


def test_every_report_shows_it(runs: dict[str, Path], tmp_path: Path) -> None:
    result = compare(runs["forward_only"], runs["full"])
    paths = write_reports(result, tmp_path)
    headline = result.coverage.headline
    assert headline is not None

    summary = json.loads(Path(paths["summary"]).read_text())
    assert summary == summary_dict(result)
    assert summary["passed"] is False and summary["first_divergence"] is None
    cov = summary["coverage"]
    assert (cov["passed"], cov["reason"], cov["max_unmatched"]) == (False, headline, 0.05)
    c = result.coverage
    assert (cov["unmatched_calls"], cov["baseline_calls"], cov["unmatched_rows"], cov["baseline_rows"]) == (
        c.unmatched_calls,
        c.baseline_calls,
        c.unmatched_rows,
        c.baseline_rows,
    )
    assert [(p["step"], p["rank"], p["unmatched_rows"]) for p in cov["over"]] == [(0, 0, c.unmatched_rows)]
    assert cov["first_unmatched"][0] == {"api": "Torch.ones_like.0.forward", "step": 0, "rank": 0}

    console = console_summary(result, paths)
    assert console.splitlines()[0].startswith("pytest-msprobe compare: FAILED (")
    assert console.splitlines()[1] == headline
    assert "first baseline calls without a partner (execution order): Torch.ones_like.0.forward, " in console
    assert "a skipped backward() or optimizer.step()" in console and "--max-unmatched=SHARE" in console
    assert "first divergence" not in console and "None" not in console

    advisor = Path(paths["advisor"]).read_text()
    assert advisor == advisor_text(result)
    lines = advisor.splitlines()
    first = result.apis[result.coverage.first_unmatched[0]]
    assert lines[:2] == [
        f"Line: {first.row_start}",
        "Suspect Nodes: Torch.ones_like.0.forward",
    ]  # 0: first row
    assert lines[2].startswith(f"Expert Advice: T{headline[1:]}: the compare cannot vouch for a run")
    assert "None" not in advisor

    message = failure_message(result, paths, runs["full"], "pytest t.py --msprobe-regen-baseline")
    lines = message.splitlines()
    assert lines[0] == f"msprobe: {headline}"
    assert lines[1].startswith("  first baseline calls without a partner (execution order): ")
    assert lines[2].startswith("  usual causes: an optimizer step made on one side only")
    assert "another dump level (L0, L1, mix)" in lines[2] and "msprobe versions" in lines[2]
    assert "--msprobe-max-unmatched=SHARE or the marker's max_unmatched=" in lines[3]
    assert lines[4].startswith("of what was compared, no API call breaches the thresholds (0 error rows")
    assert "first divergence" not in message and "None" not in message and "worst rows" not in message


def test_cli_exit_status_and_the_limit_option(runs: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    target, baseline = str(runs["forward_only"]), str(runs["full"])
    assert main(["compare", target, baseline, "-o", str(tmp_path / "a")]) == 1
    out = capsys.readouterr().out
    assert compare(target, baseline).coverage.headline in out.splitlines()
    assert main(["compare", target, baseline, "-o", str(tmp_path / "b"), "--max-unmatched", "60%", "-q"]) == 0
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["coverage"]["max_unmatched"] == 0.6
    assert main(["compare", target, baseline, "-o", str(tmp_path / "c"), "--max-unmatched=0.55", "-q"]) == 1
    assert main(["compare", target, baseline, "-o", str(tmp_path / "d"), "--max-unmatched", "5"]) == 2
    err = capsys.readouterr().err
    assert "--max-unmatched" in err and "'5'" in err and "5%" in err
    assert not (tmp_path / "d").exists()


def test_a_raised_limit_lets_it_pass(runs: dict[str, Path]) -> None:
    result = compare(runs["forward_only"], runs["full"], thresholds=Thresholds(max_unmatched=0.6))
    assert result.passed and result.coverage.passed and 0.55 < result.coverage.share < 0.6


def test_extra_calls_of_the_target_never_count() -> None:
    for pair in (("8.3.3", "8.3.3"), ("26.2.0", "8.3.3")):
        target, baseline = (FAULTS / f"msprobe-{v}" for v in pair)
        strict = Thresholds(max_unmatched=0.0)
        # the target makes an extra relu: nothing of the baseline is left out
        inserted = compare(target / "extrarelu", baseline / "none", thresholds=strict)
        if pair[0] == pair[1]:
            assert inserted.passed and inserted.coverage.unmatched_rows == 0
        # the baseline makes it: 8 of its rows (1%) have no partner, under the default limit, over a limit of 0
        removed = compare(target / "none", baseline / "extrarelu")
        assert removed.passed and 0 < removed.coverage.share <= 0.05
        if pair[0] == pair[1]:
            assert not compare(target / "none", baseline / "extrarelu", thresholds=strict).passed


@pytest.mark.parametrize("version", ["msprobe-8.3.3", "msprobe-26.2.0"])
@pytest.mark.parametrize("other", ["msprobe-8.3.3", "msprobe-26.2.0"])
def test_real_msprobe_dumps_pair_enough(version: str, other: str, tmp_path: Path) -> None:
    """Clean reruns across msprobe versions (whose API lists differ by a few calls) stay within 5%."""
    for case in ("none", "extrarelu"):
        # (a dump compared with itself is refused: a copy stands for a rerun)
        result = compare(shutil.copytree(FAULTS / version / case, tmp_path / case), FAULTS / other / "none")
        assert result.coverage.passed, result.coverage.headline
        assert result.passed
    for kind in ("stat_L1", "tensor_L1", "md5_L1", "stat_mix"):
        bench = DATA / version / "dumps" / "bench" / kind
        against = DATA / other / "dumps" / "bench" / kind
        if bench.exists() and against.exists() and version != other:
            assert compare(bench, against).passed


def _calls(step: int, names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        t = tensor([4], -1.0 - step, 2.0, 0.25, 3.0)
        out[f"Functional.{name}.0.forward"] = {"input_args": [t], "input_kwargs": {}, "output": [t]}
    return out


def test_each_dump_pair_is_held_to_the_limit(tmp_path: Path) -> None:
    """One step of twenty that lacks 3 of its 10 calls fails, though the whole lacks 1.5%."""
    names = [f"op{i}" for i in range(10)]
    for step in range(20):
        write_dump(tmp_path / "b" / f"step{step}" / "rank", _calls(step, names))
        write_dump(tmp_path / "t" / f"step{step}" / "rank", _calls(step, names if step != 7 else names[:7]))
    result = compare(tmp_path / "t", tmp_path / "b", jobs=1)
    cov = result.coverage
    assert cov.share == pytest.approx(6 / 400) and not cov.passed and not result.passed
    assert [cov.pairs[i].step for i in cov.over] == [7]
    assert cov.headline == (
        "too little compared: in step 7, rank 0 (1 of 20 dump pairs), 3 of 10 baseline calls (6 of 20 rows, "
        "30%) found no partner in the target; the limit is 5% per dump pair"
    )
    assert [result.apis[i].api for i in cov.first_unmatched] == [
        "Functional.op7.0.forward",
        "Functional.op8.0.forward",
        "Functional.op9.0.forward",
    ]


def test_an_optimizer_implementation_that_differs_leaves_nothing_unpaired(tmp_path: Path) -> None:
    """A CPU baseline for a CUDA run: SGD loops over the parameters on one, calls torch._foreach_* on the
    other. The optimizer's calls give way to each parameter's update (compare/dumps/optimizer.py): nothing is left
    without a partner, and the coverage limit does not trip on the implementation."""
    import torch

    sgd = torch.optim.SGD

    def run(path: Path, foreach: bool) -> Path:
        torch.optim.SGD = lambda params, **kw: sgd(params, foreach=foreach, **kw)  # type: ignore[assignment,misc]
        try:
            return dump_training(path, steps=1)
        finally:
            torch.optim.SGD = sgd  # type: ignore[misc]

    loops, foreach = run(tmp_path / "l", False), run(tmp_path / "f", True)
    result = compare(foreach, loops)
    assert result.passed and result.coverage.unmatched_rows == 0 and not result.coverage.first_unmatched
    assert {api.api for api in result.apis if api.api.startswith("Optimizer.")} == {
        "Optimizer.conv.weight.0.forward",
        "Optimizer.bn.weight.0.forward",
        "Optimizer.bn.bias.0.forward",
        "Optimizer.conv2.weight.0.forward",
        "Optimizer.fc.weight.0.forward",
        "Optimizer.fc.bias.0.forward",
    }


# ------------------------------------------------------------------------------------------- the setting
@pytest.mark.parametrize(
    ("text", "share"),
    [("5%", 0.05), ("0.05", 0.05), (" 12.5 % ", 0.125), ("0", 0.0), ("0%", 0.0), ("100%", 1.0), ("1", 1.0)],
)
def test_shares_are_written_with_or_without_percent(text: str, share: float) -> None:
    assert parse_share(text) == pytest.approx(share)


@pytest.mark.parametrize("text", ["5", "150%", "-1%", "-0.1", "1.5", "abc", "nan", "%", ""])
def test_bad_shares_are_refused_quoting_the_value(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_share(text)


def test_a_bare_number_above_one_says_how_to_write_a_percentage() -> None:
    with pytest.raises(ValueError, match=r"a percentage needs its %: 5%"):
        parse_share("5")


@pytest.mark.parametrize(
    ("share", "text"),
    [
        (0.05, "5%"),
        (40 / 52, "77%"),
        (0.024, "2.4%"),
        (0.0035, "0.35%"),
        (0.996, "99.6%"),
        (1, "100%"),
        (0, "0%"),
    ],
)
def test_shares_in_messages(share: float, text: str) -> None:
    assert format_share(share) == text


def test_the_setting_in_every_form(tmp_path: Path) -> None:
    assert Thresholds().max_unmatched == 0.05
    assert thresholds_from_options({"max_unmatched": 0.2}).max_unmatched == 0.2
    assert parse_threshold_value("max_unmatched", "20%", "marker") == pytest.approx(0.2)
    assert parse_threshold_value("max_unmatched", 0.2, "marker") == pytest.approx(0.2)
    with pytest.raises(ConfigError, match=r"^marker: expected a share .*'250%'"):
        parse_threshold_value("max_unmatched", "250%", "marker")
    with pytest.raises(ConfigError, match=r"^marker: expected a number or text, got True"):
        parse_threshold_value("max_unmatched", True, "marker")
    for value, share in (("10%", 0.1), (0.1, 0.1), (0, 0.0)):
        path = tmp_path / "t.json"
        path.write_text(json.dumps({"max_unmatched": value}))
        assert load_thresholds_file(path).max_unmatched == pytest.approx(share)
        # the option overrides the file
        assert thresholds_from_options({"thresholds": str(path), "max_unmatched": 0.3}).max_unmatched == 0.3
        assert thresholds_from_options({"thresholds": str(path)}).to_dict()["max_unmatched"] == pytest.approx(
            share
        )
    for bad in ("5", [5], True, "x%"):
        path.write_text(json.dumps({"max_unmatched": bad}))
        with pytest.raises(ConfigError, match=r"t\.json: max_unmatched"):
            load_thresholds_file(path)


def test_the_cli_declares_it_with_the_other_thresholds(capsys: Any) -> None:
    assert main(["compare", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--max-unmatched SHARE" in text and "default 5%" in text


def test_shipped_examples_and_real_pairs_are_not_affected() -> None:
    # the real msprobe pair with a fault: it still fails for its fault, not for coverage
    target = DATA / "msprobe-8.3.3" / "dumps" / "npu" / "stat_L1"
    baseline = DATA / "msprobe-8.3.3" / "dumps" / "bench" / "stat_L1"
    result = compare(target, baseline)
    assert result.coverage.passed and not result.passed
    assert result.first_divergence is not None and result.first_divergence.api == "Functional.relu.2.forward"
