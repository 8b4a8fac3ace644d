"""Two dumps of genuinely different models: every reason says something true, none prints a meaningless ratio.

Inputs and outputs of other shapes (or NaN/Inf on one side) differ beyond measure: their scaled error is inf,
and inf / inf is no growth. The first divergence then says the dumps may not come from the same model.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from compare_helpers import tensor, write_dump
from test_compare_verdict import build, call
from torch_dumps import dump_training

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.diagnosis import first_divergence
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.report import console_summary, summary_json
from pytest_msprobe.report.advisor import advisor_text
from pytest_msprobe.report.html import html_fragment
from pytest_msprobe.report.text import failure_message

# what a meaningless number looks like in text: "nan", "nanx", "infx", "is inf of", "by inf of"
NONSENSE = re.compile(r"\bnan\b|nanx|infx|\bby inf of\b|\binf is\b|\bis inf\b")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "cnn": dump_training(root / "cnn"),
        "wider": dump_training(root / "wider", width=8),  # the same layers, other widths
        "mlp": dump_training(root / "mlp", model="mlp"),  # another architecture
    }


def _all_text(result: CompareResult, baseline: Path) -> str:
    parts = [
        console_summary(result),
        advisor_text(result),
        failure_message(result, {}, baseline, "pytest x --msprobe-regen-baseline"),
        summary_json(result),
        html_fragment(result, {}, advisor_text(result)),
    ]
    parts.extend(r.reason for r in result.rows)
    parts.extend(a.reason for a in result.apis)
    return "\n".join(parts)


@pytest.mark.parametrize(
    ("target", "baseline"), [("wider", "cnn"), ("cnn", "wider"), ("mlp", "cnn"), ("cnn", "mlp")]
)
def test_different_models_get_a_true_first_divergence(
    models: dict[str, Path], target: str, baseline: str
) -> None:
    result = compare(models[target], models[baseline])
    assert not result.passed
    fd = result.first_divergence
    assert fd is not None and fd.rule == "inherited", fd
    assert fd.reason.startswith("its inputs have other shapes (")
    assert "the two dumps may not come from the same model or data" in fd.reason
    assert "grows" not in fd.reason
    text = _all_text(result, models[baseline])
    assert not NONSENSE.search(text), NONSENSE.search(text)
    # the checklists say it first: the models' structures differ (the calls' verdict above follows from it)
    first = result.checklist_first
    assert first is not None and first.kind == "structure"
    advice = advisor_text(result).splitlines()[2]
    assert "the two runs do not train the same model" in advice
    assert "nondeterministic" not in advice  # no seed makes other shapes agree


def test_other_widths_pair_every_call_and_fail_on_shapes(models: dict[str, Path]) -> None:
    result = compare(models["wider"], models["cnn"])
    assert result.coverage.passed  # the same calls: only the shapes say the models differ
    fd = result.first_divergence
    assert fd is not None and (fd.api, fd.row) == (
        "Functional.conv2d.0.forward",
        "Functional.conv2d.0.forward.input.1",
    )
    assert "shape differs: [8, 3, 3, 3] vs [6, 3, 3, 3]" in fd.reason


def test_another_architecture_also_pairs_too_little(models: dict[str, Path]) -> None:
    result = compare(models["mlp"], models["cnn"])
    assert not result.coverage.passed and result.coverage.headline is not None


def test_infinite_input_errors_never_make_a_growth() -> None:
    inf = math.inf
    apis, rows = build(call(0, inf, inf), call(1, inf, inf), call(2, inf, inf))
    fd = first_divergence(apis, rows, {}, 10.0)
    assert fd is not None and (fd.api, fd.rule) == ("A.op0.0.forward", "inherited")
    assert "beyond measure" in fd.reason and not NONSENSE.search(fd.reason)


def test_a_finite_input_error_turned_infinite_is_where_it_grows() -> None:
    apis, rows = build(call(0, 2e-4, 3e-4), call(1, 3e-4, math.inf), call(2, math.inf, math.inf))
    fd = first_divergence(apis, rows, {}, 10.0)
    assert fd is not None and (fd.api, fd.rule) == ("A.op1.0.forward", "grows")
    assert fd.reason == (
        "errors already flow into every call; here the output differs beyond measure (NaN/Inf on one side only, "
        "or another shape) while the input error is 0.0003: the error grows here"
    )


def test_a_finite_growth_still_names_its_ratio() -> None:
    apis, rows = build(call(0, 2e-4, 3e-4), call(1, 3e-4, 6e-3))
    fd = first_divergence(apis, rows, {}, 10.0)
    assert fd is not None and fd.rule == "grows" and "is 20x the input error 0.0003" in fd.reason


def test_a_statistic_without_a_finite_scale_is_not_inf_of_it(tmp_path: Path) -> None:
    """A masked tensor (Max +inf... Min -inf) whose Mean differs: no range to scale the difference by."""
    for name, mean in (("t", 1.0), ("b", 2.0)):
        item = tensor([4], -math.inf, math.inf, mean, math.inf)
        write_dump(
            tmp_path / name / "step0" / "rank",
            {"Functional.add.0.forward": {"input_args": [], "output": [item]}},
        )
    result = compare(tmp_path / "t", tmp_path / "b")
    (row,) = result.rows
    assert row.status == "error"
    assert row.reason.startswith(
        "Mean differs (2 -> 1; allowed 0.0001 of a scale, and the tensor's Max and Min"
    )
    assert not NONSENSE.search(_all_text(result, tmp_path / "b"))
