"""The verdict design targets, on msprobe's real dumps (8.3.3 and 26.2.0) and on copies of them.

``npu`` = ``bench`` + 1e-3 * N(0, 1) on the output of ``Functional.relu.2.forward``. msprobe's tensor verdict
let that pass (cosine 1.0) and its advisor blamed the relu's backward; ours must name the forward relu.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from compare_helpers import VERSIONS, copy_dump, dump_dir, insert_call, perturb_statistics, rank_dir

from pytest_msprobe.compare import Thresholds, compare
from pytest_msprobe.compare.judging import ERROR, PASS, SKIPPED, UNMATCHED, WARNING
from pytest_msprobe.compare.result import CompareResult

RELU = "Functional.relu.2.forward"
RELU_ROW = "Functional.relu.2.forward.output.0"


def check_relu_found(result: CompareResult, step: int = 0) -> None:
    assert not result.passed
    fd = result.first_divergence
    assert fd is not None
    if result.own:  # tensor dumps, replayed: the relu's own error names it
        assert (fd.api, fd.row, fd.step, fd.rank, fd.rule) == (RELU, RELU_ROW, step, 0, "out of line")
        assert "its own error is out of line" in fd.reason and "the baseline's own error: 0.000%" in fd.reason
        return
    assert (fd.api, fd.row, fd.step, fd.rank, fd.rule) == (RELU, RELU_ROW, step, 0, "enters")
    assert "while its inputs match" in fd.reason


def check_clean(result: CompareResult) -> None:
    assert result.passed, [(a.api, a.reason) for a in result.failures[:3]]
    assert result.first_divergence is None
    assert {row.status for row in result.rows} <= {PASS, SKIPPED, UNMATCHED, WARNING}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", ["stat_L1", "stat_mix", "tensor_L1", "md5_L1"])
def test_the_injected_relu_is_the_first_divergence(version: str, kind: str) -> None:
    result = compare(dump_dir(version, "npu", kind, 0), dump_dir(version, "bench", kind, 0))
    expected_mode = {
        "stat_L1": "statistics",
        "stat_mix": "statistics",
        "tensor_L1": "tensor",
        "md5_L1": "md5",
    }
    assert result.mode == expected_mode[kind]
    check_relu_found(result)
    relu = result.apis[result.first_divergence.api_index]  # type: ignore[union-attr]
    assert relu.input_breach is False and relu.output_breach is True


@pytest.mark.parametrize("version", VERSIONS)
def test_tensor_mode_sees_what_msprobes_tensor_verdict_missed(version: str) -> None:
    result = compare(dump_dir(version, "npu", "tensor_L1", 0), dump_dir(version, "bench", "tensor_L1", 0))
    row = next(r for r in result.rows if r.row == RELU_ROW)
    assert row.tensor is not None and row.tensor.cosine == pytest.approx(1.0, abs=1e-6)
    assert row.msprobe_accuracy == "Yes"  # msprobe 8.3.3's rule passes it...
    assert row.status == ERROR  # ...our scaled error does not
    assert row.error == pytest.approx(6.4e-4, rel=0.05)


@pytest.mark.parametrize("version", VERSIONS)
def test_md5_tells_real_differences_from_msprobes_racing_crcs(version: str) -> None:
    result = compare(dump_dir(version, "npu", "md5_L1", 0), dump_dir(version, "bench", "md5_L1", 0))
    check_relu_found(result)
    # batch_norm's running statistics: CRC computed while the op updated them in place (statistics equal)
    racing = next(r for r in result.rows if r.row == "Functional.batch_norm.0.forward.input.1")
    assert racing.target is not None and racing.baseline is not None
    assert racing.target.md5 != racing.baseline.md5
    assert racing.status == WARNING and "statistics are identical" in racing.reason


@pytest.mark.parametrize("version", VERSIONS)
def test_a_whole_dump_root_finds_the_divergence_in_its_first_step(version: str) -> None:
    result = compare(dump_dir(version, "npu", "stat_L1"), dump_dir(version, "bench", "stat_L1"))
    assert [(p.step, p.rank) for p in result.pairs] == [(0, 0), (1, 0)]
    check_relu_found(result, step=0)


@pytest.mark.parametrize("version", VERSIONS)
def test_step_1_alone_errors_flow_in_everywhere(version: str) -> None:
    """After step 0's fault moved the weights, every call's inputs differ at step 1, and no call's output
    error is 10x its input error (the largest ratio is 8x, at Functional.conv2d.3.backward). The faulty relu is
    still named: its statistics break a relation they keep whatever its inputs (rule "inconsistent")."""
    npu, bench = dump_dir(version, "npu", "stat_L1", 1), dump_dir(version, "bench", "stat_L1", 1)
    result = compare(npu, bench)
    fd = result.first_divergence
    assert fd is not None and not result.passed
    assert (fd.api, fd.rule, fd.step) == ("Functional.relu.2.forward", "inconsistent", 1)
    assert result.apis[fd.api_index].input_breach  # (errors flow into it)
    assert "(Max = relu(input's Max))" in fd.reason or "(Min = relu(input's Min))" in fd.reason
    # the relation comes before the amplification rule, whatever its ratio
    relaxed = compare(npu, bench, thresholds=Thresholds(amplification=5))
    assert relaxed.first_divergence is not None
    assert (relaxed.first_divergence.api, relaxed.first_divergence.rule) == (
        "Functional.relu.2.forward",
        "inconsistent",
    )


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", ["stat_L1", "stat_mix", "tensor_L1", "md5_L1"])
def test_a_copy_of_a_dump_compared_with_it_passes(tmp_path: Path, version: str, kind: str) -> None:
    result = compare(
        copy_dump(dump_dir(version, "bench", kind), tmp_path / "again"), dump_dir(version, "bench", kind)
    )
    check_clean(result)
    assert {row.status for row in result.rows} <= {PASS, SKIPPED}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", ["stat_L1", "stat_mix", "md5_L1"])
def test_cross_device_float32_noise_passes(tmp_path: Path, version: str, kind: str) -> None:
    """Every float statistic moved by ~1e-6 relative, near-zero means moved and sign-flipped."""
    noisy = copy_dump(dump_dir(version, "bench", kind), tmp_path / "noisy")
    moved = sum(
        perturb_statistics(p, rel=1e-6, seed=i) for i, p in enumerate(sorted(noisy.rglob("dump.json")))
    )
    assert moved > 10  # the batch_norm outputs' means are ~1e-9 of their range
    result = compare(noisy, dump_dir(version, "bench", kind))
    check_clean(result)
    assert result.counts()["warning"] == 0


@pytest.mark.parametrize("kind", ["stat_L1", "stat_mix", "md5_L1", "tensor_L1"])
def test_msprobe_8_3_3_and_26_2_0_dumps_compare_with_each_other(kind: str) -> None:
    old, new = dump_dir("8.3.3", "bench", kind), dump_dir("26.2.0", "bench", kind)
    for target, baseline in ((old, new), (new, old)):
        result = compare(target, baseline)
        check_clean(result)
        unmatched = {a.api for a in result.apis if a.status == UNMATCHED}
        # 26.x leaves out low-risk APIs by default: reported, not compared
        assert unmatched == {
            "Torch.flatten.0.forward",
            "Torch.flatten.0.backward",
            "Torch.ones_like.0.forward",
        }
    check_relu_found(compare(dump_dir("8.3.3", "npu", kind, 0), dump_dir("26.2.0", "bench", kind, 0)))


def test_mix_level_in_place_relu_recorded_differently_by_the_two_versions() -> None:
    """8.3.3 records nn.ReLU(inplace=True)'s input after the update, 26.2.0 before it."""
    result = compare(dump_dir("8.3.3", "bench", "stat_mix", 0), dump_dir("26.2.0", "bench", "stat_mix", 0))
    row = next(r for r in result.rows if r.row == "Module.relu.ReLU.forward.0.input.0")
    assert row.status == PASS and "after the in-place update" in row.reason


@pytest.mark.parametrize("version", VERSIONS)
def test_parameter_gradients_do_not_hide_the_forward_fault(version: str) -> None:
    """In mix dumps the parameters_grad entries sit early in dump.json (8.3.3) but are computed in backward."""
    result = compare(dump_dir(version, "npu", "stat_mix", 0), dump_dir(version, "bench", "stat_mix", 0))
    check_relu_found(result)
    grads = [a for a in result.apis if ".parameters_grad" in a.api]
    relu = result.apis[result.first_divergence.api_index]  # type: ignore[union-attr]
    assert grads and all(g.order > relu.order for g in grads)


@pytest.mark.parametrize("version", VERSIONS)
def test_an_inserted_call_is_reported_not_compared(tmp_path: Path, version: str) -> None:
    """One extra F.relu after the first renumbers every later relu; they must still pair by position."""
    bench = dump_dir(version, "bench", "stat_L1", 0)
    target = copy_dump(bench, tmp_path / "extra")
    new_fwd, new_bwd = insert_call(next(target.rglob("dump.json")), "Functional.relu", after=0)
    result = compare(target, bench)
    check_clean(result)
    assert {a.api for a in result.apis if a.status == UNMATCHED} == {new_fwd, new_bwd}
    renumbered = [(a.api, a.bench_api) for a in result.apis if a.api.startswith("Functional.relu.")]
    assert ("Functional.relu.3.forward", "Functional.relu.2.forward") in renumbered
    assert ("Functional.relu.5.backward", "Functional.relu.4.backward") in renumbered
    assert result.pairs[0].alignment == "ordered"


@pytest.mark.parametrize("after", [0, 3])
def test_an_inserted_call_pairs_the_right_neighbour(tmp_path: Path, after: int) -> None:
    """Inserted just before a call of the same API, in a run the edit script cannot tell apart: the call
    whose statistics match the baseline's is the one paired, the other is reported."""
    bench = dump_dir("8.3.3", "bench", "stat_L1", 0)
    target = copy_dump(bench, tmp_path / "extra")
    new_fwd, new_bwd = insert_call(
        next(target.rglob("dump.json")), "Functional.relu", after=after, before=True
    )
    result = compare(target, bench)
    check_clean(result)
    assert {a.api for a in result.apis if a.status == UNMATCHED} == {new_fwd, new_bwd}


@pytest.mark.parametrize("version", VERSIONS)
def test_an_inserted_call_does_not_move_the_divergence(tmp_path: Path, version: str) -> None:
    npu = copy_dump(dump_dir(version, "npu", "stat_L1", 0), tmp_path / "npu")
    insert_call(next(npu.rglob("dump.json")), "Functional.relu", after=0)
    result = compare(npu, dump_dir(version, "bench", "stat_L1", 0))
    fd = result.first_divergence
    assert fd is not None and fd.rule == "enters"
    api = result.apis[fd.api_index]
    assert (api.api, api.bench_api) == ("Functional.relu.3.forward", RELU)


def test_a_removed_call_is_reported_not_compared(tmp_path: Path) -> None:
    bench = dump_dir("8.3.3", "bench", "stat_L1", 0)
    extra = copy_dump(bench, tmp_path / "extra")
    insert_call(next(extra.rglob("dump.json")), "Functional.relu", after=1)
    result = compare(bench, extra)  # now the target lacks a call the baseline has
    check_clean(result)
    only_baseline = [a for a in result.apis if a.status == UNMATCHED]
    assert {a.bench_api for a in only_baseline} == {"Functional.relu.2.forward", "Functional.relu.2.backward"}


@pytest.mark.parametrize("version", VERSIONS)
def test_tensor_noise_of_another_device_passes(tmp_path: Path, version: str) -> None:
    torch = pytest.importorskip("torch")
    bench = dump_dir(version, "bench", "tensor_L1", 0)
    noisy = copy_dump(bench, tmp_path / "noisy")
    g = torch.Generator().manual_seed(0)
    for pt in sorted(noisy.rglob("*.pt")):
        t = torch.load(pt, weights_only=True)
        if t.is_floating_point():
            t = t * (1 + 1e-6 * torch.randn(t.shape, generator=g))
            torch.save(t, pt)
    result = compare(noisy, bench)
    assert result.mode == "tensor"
    check_clean(result)
    worst = max(r.error or 0.0 for r in result.rows)
    assert 0 < worst < 1e-5


def test_rank_folders_pair_by_rank(tmp_path: Path) -> None:
    src = rank_dir("8.3.3", "bench", "stat_L1", 0)
    for side in ("a", "b"):
        for rank in (0, 1):
            copy_dump(src, tmp_path / side / "step0" / f"rank{rank}")
    npu_rank = rank_dir("8.3.3", "npu", "stat_L1", 0)
    (tmp_path / "a" / "step0" / "rank1" / "dump.json").write_bytes((npu_rank / "dump.json").read_bytes())
    result = compare(tmp_path / "a", tmp_path / "b")
    assert [(p.step, p.rank) for p in result.pairs] == [(0, 0), (0, 1)]
    fd = result.first_divergence
    assert fd is not None and (fd.api, fd.rank) == (RELU, 1)


@pytest.mark.parametrize("version", VERSIONS)
def test_one_op_computed_in_bfloat16_is_found(tmp_path: Path, version: str) -> None:
    """A bfloat16 op against a float32 baseline is held to the baseline's precision, not to bfloat16's."""
    torch = pytest.importorskip("torch")
    bench = dump_dir(version, "bench", "tensor_L1", 0)
    target = copy_dump(bench, tmp_path / "bf16")
    (dump_json,) = target.rglob("dump.json")
    doc = json.loads(dump_json.read_text())
    item = doc["data"]["Functional.conv2d.3.forward"]["output"][0]
    item["dtype"] = "torch.bfloat16"
    pt = dump_json.parent / "dump_tensor_data" / item["data_name"]
    torch.save(torch.load(pt, weights_only=True).bfloat16(), pt)
    dump_json.write_text(json.dumps(doc))
    result = compare(target, bench)
    fd = result.first_divergence
    # held to the baseline's float32 standard, the bfloat16 output is out of line against its own inputs too
    assert fd is not None and (fd.api, fd.rule) == ("Functional.conv2d.3.forward", "out of line")
    assert compare(target, bench, replay=False).first_divergence.rule == "enters"  # type: ignore[union-attr]
    row = result.rows[fd.row_index]
    assert row.status == ERROR and "dtype differs: torch.bfloat16 vs torch.float32" in row.reason
