"""Multi-rank dumps: pairs compared in worker processes, the order across ranks, and the first divergence
across ranks (collectives whose inputs come from every rank of their group).

The synthetic run: on each rank, a few linears, a relu, an all_reduce of the relu's output over every rank,
and a loss of the all_reduce's output. A fault in the relu of rank 1 reaches rank 0 through the all_reduce,
whose inputs on rank 0 are clean and whose output differs there: it must not be named.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compare_helpers import tensor, write_dump

from pytest_msprobe import compare
from pytest_msprobe.cli import build_parser, main
from pytest_msprobe.compare.alignment import CallPlace, collective_op, collective_peers, execution_order
from pytest_msprobe.compare.run import default_jobs
from pytest_msprobe.errors import ConfigError, DumpFormatError
from pytest_msprobe.report import console_summary, summary_dict, write_reports
from pytest_msprobe.report.html import error_plot_png, plot_title
from pytest_msprobe.report.table import api_sheet
from pytest_msprobe.report.text import failure_message

ALL_REDUCE = "Distributed.all_reduce.0.forward"
RELU = "Functional.relu.0.forward"


def _t(value: float, scale: float = 1.0) -> dict[str, Any]:
    """A [4, 8] float32 record whose statistics follow ``value`` (times ``scale``: a fault)."""
    v = value * scale
    return tensor([4, 8], -v, 2 * v, 0.5 * v, 6 * v)


def _rank_data(
    rank: int, ranks: int, step: int, linears: int, relu_fault: dict[int, float], reduce_fault: float
) -> dict[str, Any]:
    data: dict[str, Any] = {}
    x = 1.0 + rank + 0.1 * step
    for k in range(linears):
        data[f"Functional.linear.{k}.forward"] = {
            "input_args": [_t(x)],
            "input_kwargs": {},
            "output": [_t(x + 0.5)],
        }
        x += 0.5
    relu_out = {r: (1.0 + r + 0.1 * step + 0.5 * linears) * relu_fault.get(r, 1.0) for r in range(ranks)}
    data[RELU] = {"input_args": [_t(x)], "input_kwargs": {}, "output": [_t(relu_out[rank])]}
    total = sum(relu_out.values()) * reduce_fault
    data[ALL_REDUCE] = {
        "input_args": [_t(relu_out[rank])],
        "input_kwargs": {"op": {"type": "str", "value": "SUM"}},
        "output": [_t(total)],
    }
    data["Functional.mse_loss.0.forward"] = {
        "input_args": [_t(total)],
        "input_kwargs": {},
        "output": [{"type": "torch.Tensor", "dtype": "torch.float32", "shape": [], "Max": total,
                    "Min": total, "Mean": total, "Norm": total, "requires_grad": False}],
    }  # fmt: skip
    return data


def make_run(
    root: Path,
    ranks: int = 2,
    steps: int = 1,
    linears: dict[int, int] | None = None,
    relu_fault: dict[int, float] | None = None,
    reduce_fault: float = 1.0,
) -> Path:
    """``root/step{S}/rank{R}/dump.json`` of the synthetic run; rank R makes ``linears[R]`` linears (default
    1) before its relu; ``relu_fault[R]`` scales rank R's relu output, ``reduce_fault`` the all_reduce's."""
    for step in range(steps):
        for rank in range(ranks):
            data = _rank_data(rank, ranks, step, (linears or {}).get(rank, 1), relu_fault or {}, reduce_fault)
            write_dump(root / f"step{step}" / f"rank{rank}", data)
    return root


def by_name(result: Any, api: str, rank: int, step: int = 0) -> Any:
    (found,) = [a for a in result.apis if a.api == api and a.rank == rank and a.step == step]
    return found


# ------------------------------------------------------------------------------------------ first divergence
def test_clean_ranks_pass(tmp_path: Path) -> None:
    baseline = make_run(tmp_path / "b", ranks=2, steps=2)
    target = make_run(tmp_path / "t", ranks=2, steps=2)
    result = compare(target, baseline, jobs=2)
    assert result.passed and result.first_divergence is None
    assert [(p.step, p.rank) for p in result.pairs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert summary_dict(result)["ranks"] == [
        {"rank": 0, "passed": True, "apis": 8, "apis_error": 0, "first_error": None},
        {"rank": 1, "passed": True, "apis": 8, "apis_error": 0, "first_error": None},
    ]


def test_fault_on_rank_1_is_named_on_rank_1(tmp_path: Path) -> None:
    # rank 1 makes more calls before its relu: by index alone, rank 0's all_reduce (call 2) would come
    # before rank 1's relu (call 3)
    shape = {"linears": {0: 1, 1: 3}}
    baseline = make_run(tmp_path / "b", **shape)
    target = make_run(tmp_path / "t", relu_fault={1: 1.01}, **shape)
    result = compare(target, baseline, jobs=1)
    assert not result.passed
    fd = result.first_divergence
    assert fd is not None
    assert (fd.api, fd.rank, fd.rule) == (RELU, 1, "enters")
    # rank 0's all_reduce breaches with clean local inputs: it only carries rank 1's error
    reduce0 = by_name(result, ALL_REDUCE, 0)
    assert reduce0.status == "error" and reduce0.output_breach and not reduce0.input_breach
    # the collective orders the ranks: everything before it on any rank comes before it on every rank
    assert (
        by_name(result, RELU, 1).order
        < reduce0.order
        < by_name(result, "Functional.mse_loss.0.forward", 1).order
    )
    summary = summary_dict(result)
    assert (summary["first_divergence"]["api"], summary["first_divergence"]["rank"]) == (RELU, 1)
    assert [(r["rank"], r["passed"], r["first_error"]) for r in summary["ranks"]] == [
        (0, False, ALL_REDUCE),
        (1, False, RELU),
    ]


def test_the_collective_peers_decide_even_against_the_order(tmp_path: Path) -> None:
    """Rank 1's error comes in where no call records it (its relu's output is not dumped): rank 0's
    all_reduce, first in order with clean local inputs and a differing output, is still not where it enters:
    rank 1's, whose input no recorded call made, is."""
    baseline = make_run(tmp_path / "b")
    target = make_run(tmp_path / "t", relu_fault={1: 1.01})
    for root in (baseline, target):
        path = root / "step0" / "rank1" / "dump.json"
        doc = json.loads(path.read_text())
        del doc["data"][RELU]
        path.write_text(json.dumps(doc))
    result = compare(target, baseline, jobs=1)
    fd = result.first_divergence
    assert fd is not None
    assert (fd.api, fd.rank, fd.rule) == (ALL_REDUCE, 1, "source")
    assert fd.row == f"{ALL_REDUCE}.input.0"


def test_a_fault_in_the_collective_itself_enters_there(tmp_path: Path) -> None:
    baseline = make_run(tmp_path / "b", ranks=3)
    target = make_run(tmp_path / "t", ranks=3, reduce_fault=1.01)
    result = compare(target, baseline, jobs=1)
    fd = result.first_divergence
    assert fd is not None
    assert (fd.api, fd.rank, fd.rule) == (ALL_REDUCE, 0, "enters")
    assert "its inputs on ranks 0, 1, 2 match the baseline" in fd.reason


def test_a_later_step_is_ordered_after_every_rank_of_the_earlier_one(tmp_path: Path) -> None:
    baseline = make_run(tmp_path / "b", steps=2)
    target = make_run(tmp_path / "t", steps=2, relu_fault={1: 1.01})
    result = compare(target, baseline, jobs=2)
    fd = result.first_divergence
    assert fd is not None and (fd.step, fd.rank, fd.api) == (0, 1, RELU)
    last_of_step0 = max(a.order for a in result.apis if a.step == 0)
    assert all(a.order > last_of_step0 for a in result.apis if a.step == 1)


# ------------------------------------------------------------------------------------------ one-sided ranks
def test_a_rank_the_target_lacks_fails_and_one_only_the_target_has_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = make_run(tmp_path / "b", ranks=2)
    target = make_run(tmp_path / "t", ranks=2)
    shutil.rmtree(target / "step0" / "rank1")
    result = compare(target, baseline, jobs=2)
    assert not result.passed and result.first_divergence is None
    assert len(result.missing) == 1 and "rank 1" in result.missing[0]
    assert main(["compare", str(target), str(baseline), "-o", str(tmp_path / "out"), "-j", "2"]) == 1
    assert "missing: baseline step 0, rank 1" in capsys.readouterr().out

    extra = make_run(tmp_path / "t3", ranks=3)
    baseline = make_run(tmp_path / "b3", ranks=3)
    shutil.rmtree(baseline / "step0" / "rank2")
    result = compare(extra, baseline, jobs=2)
    assert result.passed and not result.missing
    assert [p.rank for p in result.pairs] == [0, 1] and "rank 2" in result.unpaired[0]


# ------------------------------------------------------------------------------------------ jobs
def test_jobs_give_identical_results_and_reports(tmp_path: Path) -> None:
    baseline = make_run(tmp_path / "b", ranks=4, steps=2, linears={2: 3})
    target = make_run(tmp_path / "t", ranks=4, steps=2, linears={2: 3}, relu_fault={2: 1.001, 3: 1.05})
    one = compare(target, baseline, jobs=1)
    two = compare(target, baseline, jobs=2)
    # both faulty relus run before the all_reduce; rank 3 reaches its relu two calls before rank 2
    assert one.first_divergence is not None and one.first_divergence.rank == 3
    assert one.rows == two.rows and one.apis == two.apis and one.first_divergence == two.first_divergence
    texts = []
    for name, result in (("one", one), ("two", two)):
        paths = write_reports(result, tmp_path / name)
        texts.append(Path(paths["summary"]).read_text())
    assert texts[0] == texts[1]


def test_the_first_unusable_pair_is_reported_whatever_the_jobs(tmp_path: Path) -> None:
    baseline = make_run(tmp_path / "b", ranks=2, steps=2)
    target = make_run(tmp_path / "t", ranks=2, steps=2)
    for step, rank in ((0, 1), (1, 0)):
        (target / f"step{step}" / f"rank{rank}" / "dump.json").write_text('{"data": ')
    for jobs in (1, 2):
        with pytest.raises(DumpFormatError) as info:
            compare(target, baseline, jobs=jobs)
        assert info.value.path == str(target / "step0" / "rank1" / "dump.json")
        assert "invalid JSON" in info.value.problem


# ------------------------------------------------------------------------------------------ the order itself
def test_collectives_are_recognised_by_name() -> None:
    assert collective_op(ALL_REDUCE) == "all_reduce"
    assert collective_op("Distributed.reduce_scatter_tensor.2.backward") == "reduce_scatter_tensor"
    assert collective_op("Distributed.isend.0.forward") is None  # point to point: no group
    assert collective_op("Functional.relu.0.forward") is None


def test_order_waits_at_collectives_and_interleaves_between_them() -> None:
    calls = [
        CallPlace("Functional.a.0.forward", 0, 0, 0),
        CallPlace(ALL_REDUCE, 0, 0, 1),
        CallPlace("Functional.b.0.forward", 0, 0, 2),
        CallPlace("Functional.a.0.forward", 0, 1, 0),
        CallPlace("Functional.a.1.forward", 0, 1, 1),
        CallPlace("Functional.a.2.forward", 0, 1, 2),
        CallPlace(ALL_REDUCE, 0, 1, 3),
        CallPlace("Functional.b.0.forward", 0, 1, 4),
    ]
    assert execution_order(calls) == [0, 3, 4, 5, 1, 6, 2, 7]
    assert collective_peers(calls) == {1: [6], 6: [1]}


def test_order_ends_when_ranks_disagree_on_their_collectives() -> None:
    broadcast = "Distributed.broadcast.0.forward"
    calls = [
        CallPlace(ALL_REDUCE, 0, 0, 0),
        CallPlace(broadcast, 0, 0, 1),
        CallPlace(broadcast, 0, 1, 0),
        CallPlace(ALL_REDUCE, 0, 1, 1),
    ]
    assert sorted(execution_order(calls)) == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------ reports
def test_reports_name_the_rank_where_the_error_enters(tmp_path: Path) -> None:
    baseline = make_run(tmp_path / "b", linears={0: 1, 1: 3})
    target = make_run(tmp_path / "t", linears={0: 1, 1: 3}, relu_fault={1: 1.01})
    result = compare(target, baseline, jobs=1)
    paths = write_reports(result, tmp_path / "out")
    text = console_summary(result, paths)
    assert f"first divergence: {RELU} (step 0, rank 1)" in text
    assert (
        f"by rank: rank 0: 2 of 4 calls breach, first {ALL_REDUCE}; rank 1: 3 of 6 calls breach, first {RELU}"
        in text
    )
    advisor = Path(paths["advisor"]).read_text()
    assert "Step 0, rank 1;" in advisor
    assert (
        f"The error enters on rank 1; rank(s) 0 breach later (first: rank 0: {ALL_REDUCE}), carried there by the collectives"
        in advisor
    )
    # the xlsx's API sheet: step and rank of every call, in execution order
    sheet = api_sheet(result)
    assert sheet.header[:3] == ("Order", "Step", "Rank")
    listed = [(row[2], row[3]) for row in sheet.rows]
    assert listed.index((1, RELU)) < listed.index((0, ALL_REDUCE))
    assert plot_title(result) == "statistics compare: FAILED, ranks 0, 1; first divergence on rank 1"
    message = failure_message(result, paths, tmp_path / "b", "pytest ... --msprobe-regen-baseline")
    assert message.splitlines()[0].endswith("statistics mode, steps 0, ranks 0, 1)")
    assert message.splitlines()[1] == f"first divergence: {RELU} (step 0, rank 1), row {RELU}.output.0"
    assert message.splitlines()[3].startswith("by rank: rank 0: 2 of 4 calls breach")
    assert error_plot_png(result) is not None


def test_a_single_rank_report_has_no_rank_lines(tmp_path: Path) -> None:
    baseline = make_run(tmp_path / "b", ranks=1)
    target = make_run(tmp_path / "t", ranks=1, relu_fault={0: 1.01})
    result = compare(target, baseline)
    assert "by rank" not in console_summary(result)
    assert "by rank" not in failure_message(result, {}, tmp_path / "b", "regen")
    assert plot_title(result) == "statistics compare: FAILED"
    assert (
        "The error enters on rank" not in Path(write_reports(result, tmp_path / "o")["advisor"]).read_text()
    )


def _tensor_rank(folder: Path, arrays: dict[str, dict[str, list[np.ndarray]]]) -> None:
    """A tensor dump of ``{api: {"input_args"/"output": [array, ...]}}``, each array saved as .npy."""
    (folder / "dump_tensor_data").mkdir(parents=True)
    data: dict[str, Any] = {}
    for api, parts in arrays.items():
        entry: dict[str, Any] = {"input_args": [], "input_kwargs": {}, "output": []}
        for key, values in parts.items():
            role = "input" if key == "input_args" else "output"
            for n, a in enumerate(values):
                name = f"{api}.{role}.{n}.npy"
                np.save(folder / "dump_tensor_data" / name, a)
                stats = (float(a.max()), float(a.min()), float(a.mean()), float(np.linalg.norm(a)))
                entry[key].append(
                    {**tensor(list(a.shape), stats[1], stats[0], stats[2], stats[3]), "data_name": name}
                )
        data[api] = entry
    write_dump(folder, data, task="tensor")


def test_tensor_dumps_of_two_ranks_give_the_same_result_whatever_the_jobs(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = {r: rng.standard_normal((64, 64)).astype(np.float32) for r in range(2)}
    for side, fault in (("b", 0.0), ("t", 1e-2)):
        relu = {r: np.maximum(x[r], 0) for r in range(2)}
        relu[1] = (relu[1] * (1 + fault * rng.standard_normal(relu[1].shape))).astype(np.float32)
        total = relu[0] + relu[1]
        for r in range(2):
            _tensor_rank(
                tmp_path / side / "step0" / f"rank{r}",
                {
                    RELU: {"input_args": [x[r]], "output": [relu[r]]},
                    ALL_REDUCE: {"input_args": [relu[r]], "output": [total]},
                },
            )
    one = compare(tmp_path / "t", tmp_path / "b", jobs=1)
    two = compare(tmp_path / "t", tmp_path / "b", jobs=2)
    assert one.mode == "tensor" and all(r.tensor is not None for r in one.rows)
    assert one.rows == two.rows and one.apis == two.apis
    assert one.first_divergence == two.first_divergence
    assert one.first_divergence is not None
    assert (one.first_divergence.api, one.first_divergence.rank) == (RELU, 1)
    assert by_name(one, ALL_REDUCE, 0).output_breach


def test_jobs_default_to_the_cpus_and_must_be_positive(tmp_path: Path) -> None:
    baseline = make_run(tmp_path / "b")
    assert build_parser().parse_args(["compare", "t", "b", "-o", "out"]).jobs is None  # compare's default
    assert default_jobs() >= 1
    with pytest.raises(ConfigError, match="jobs must be a whole number >= 1, got 0"):
        compare(baseline, baseline, jobs=0)


# ------------------------------------------------------------------------------------- several process groups
def _group(ranks: list[int]) -> dict[str, Any]:
    return {"type": "torch.ProcessGroup", "group_ranks": ranks, "group_id": "g" + "".join(map(str, ranks))}


def _reduce(values: dict[int, float], rank: int, group: list[int], drift: float = 1.0) -> dict[str, Any]:
    """An all_reduce over ``group`` of every member's ``values[r]``; ``drift`` scales this rank's input."""
    total = sum(values[r] for r in group)
    return {
        "input_args": [_t(values[rank] * drift)],
        "input_kwargs": {"group": _group(group)},
        "output": [_t(total)],
    }


def make_two_groups_run(root: Path, dp_input_drift: float = 1.0) -> Path:
    """4 ranks: tensor-parallel pairs {0, 1} (two all_reduces) and {2, 3} (one), then data-parallel pairs
    {0, 2} and {1, 3}. The ranks make different numbers of all_reduces, so the data-parallel one is
    ``all_reduce.2`` on ranks 0 and 1 but ``all_reduce.1`` on ranks 2 and 3. ``dp_input_drift`` scales rank 2's
    input to its data-parallel all_reduce (and so rank 0's output of it), coming from no recorded call."""
    tp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    dp = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    x = {r: 1.0 + r for r in range(4)}
    g = {r: 10.0 + r for r in range(4)}  # each rank's gradient, reduced over its data-parallel pair
    g_seen = dict(g)
    g_seen[2] = g[2] * dp_input_drift
    for rank in range(4):
        data: dict[str, Any] = {
            "Functional.linear.0.forward": {"input_args": [_t(x[rank])], "input_kwargs": {}, "output": [_t(x[rank] + 1)]}
        }  # fmt: skip
        n = 0
        for _ in range(2 if rank < 2 else 1):
            data[f"Distributed.all_reduce.{n}.forward"] = _reduce(
                {r: x[r] + 1 for r in range(4)}, rank, tp[rank]
            )
            n += 1
        reduce = _reduce(g_seen, rank, dp[rank])
        if rank == 2:
            reduce["input_args"] = [_t(g_seen[2])]
        data[f"Distributed.all_reduce.{n}.forward"] = reduce
        write_dump(root / "step0" / f"rank{rank}", data)
    return root


def test_collectives_pair_by_group_and_place_in_it_not_by_name(tmp_path: Path) -> None:
    """Rank 2's gradient differs where no call records it; rank 0's data-parallel all_reduce (``.2``) then
    breaches on clean local inputs. By name it would pair with rank 1's ``all_reduce.2`` (another group, clean)
    and look like where the error enters; by group it pairs with rank 2's ``all_reduce.1``, whose input differs."""
    baseline = make_two_groups_run(tmp_path / "b")
    target = make_two_groups_run(tmp_path / "t", dp_input_drift=1.01)
    result = compare(target, baseline, jobs=1)
    assert not result.passed
    fd = result.first_divergence
    assert fd is not None
    assert (fd.api, fd.rank) == ("Distributed.all_reduce.1.forward", 2), fd
    assert fd.rule != "enters"
    dp0 = by_name(result, "Distributed.all_reduce.2.forward", 0)
    assert dp0.output_breach and not dp0.input_breach
    # the tensor-parallel all_reduces are clean everywhere
    assert by_name(result, "Distributed.all_reduce.0.forward", 2).status == "pass"


def test_collective_keys_follow_the_group() -> None:
    g01, g02 = (0, 1), (0, 2)
    places = [
        CallPlace("Distributed.all_reduce.0.forward", 0, 0, 0, g01),
        CallPlace("Distributed.all_reduce.1.forward", 0, 0, 1, g01),
        CallPlace("Distributed.all_reduce.2.forward", 0, 0, 2, g02),
        CallPlace("Distributed.all_reduce.0.forward", 0, 1, 0, g01),
        CallPlace("Distributed.all_reduce.1.forward", 0, 1, 1, g01),
        CallPlace("Distributed.all_reduce.0.forward", 0, 2, 0, g02),
        CallPlace("Distributed.broadcast.0.forward", 0, 2, 1, None),  # the default group: every rank
    ]
    peers = collective_peers(places)
    assert peers[2] == [5] and peers[5] == [2]  # all_reduce.2 on rank 0 is all_reduce.0 on rank 2
    assert peers[0] == [3] and peers[1] == [4]
    assert 6 not in peers  # no other rank has a broadcast
    order = execution_order(places)
    # rank 0 cannot leave its data-parallel all_reduce before rank 2 enters it, nor rank 2 before rank 0
    assert order.index(5) > order.index(1) and order.index(2) > order.index(1)
