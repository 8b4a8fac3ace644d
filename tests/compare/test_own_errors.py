"""Own errors in the compare: each call judged against the float64 replay of its own inputs, on both sides."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openpyxl
import pytest
from compare_helpers import dump_dir

from pytest_msprobe import compare
from pytest_msprobe.compare.judging.self_check import check_dump, own_error_verdict
from pytest_msprobe.errors import ConfigError, DumpFormatError
from pytest_msprobe.format.own_errors import (
    SELF_CHECK_JSON,
    CallOwn,
    OwnError,
    read_own_errors,
    write_own_errors,
)
from pytest_msprobe.report import write_reports
from pytest_msprobe.report.text import self_check_message
from pytest_msprobe.thresholds import ApiRule, Thresholds, thresholds_from_dict

RELU = "Functional.relu.2.forward"


def own(share: float, rmse: float = 1e-3, max_rel: float = 0.03, dtype: str = "float32") -> OwnError:
    """An own error with ``share`` of its elements more than 1e-3 (and 1e-2 for half types) off."""
    return OwnError(
        dtype, 4096, rmse, max_rel, max_rel / 10, rmse, share, 0, 1.0, 0, share > 1e-3, "",
        (share / 100, share, share),
    )  # fmt: skip


def test_a_call_beyond_its_standard_with_no_baseline_own_error_is_out_of_line() -> None:
    v = own_error_verdict(CallOwn((own(0.4),)), None, RELU, Thresholds())
    assert v is not None and v.out_of_line and "40.000% of its elements more than 0.001 off" in v.reason
    clean = own_error_verdict(CallOwn((own(0.0, 1e-8, 1e-7),)), None, RELU, Thresholds())
    assert clean is not None and not clean.out_of_line


def test_a_baseline_as_far_off_excuses_the_target() -> None:
    """Both devices compute a matmul in TF32-like precision: the target is no worse than the reference."""
    b = own(0.3, rmse=1.5e-3, max_rel=0.01)
    close = own(0.3, rmse=1.65e-3, max_rel=0.01)  # 1.1x the baseline's RMSE
    v = own_error_verdict(CallOwn((close,)), CallOwn((b,)), "Torch.matmul.0.forward", Thresholds())
    assert v is not None and not v.out_of_line and "as the baseline's own error is too" in v.reason
    # 1.33x the baseline's RMSE: within L0's 2x (cos), beyond L2's 1.2x (matmul's level)
    t = own(0.3, rmse=2e-3, max_rel=0.01)
    assert (
        own_error_verdict(CallOwn((t,)), CallOwn((b,)), "Torch.cos.0.forward", Thresholds()).out_of_line
        is False
    )  # type: ignore[union-attr]
    far = own_error_verdict(CallOwn((t,)), CallOwn((b,)), "Torch.matmul.0.forward", Thresholds())
    assert (
        far is not None
        and far.out_of_line
        and "its RMSE 0.002 is 1.33x the baseline's own 0.0015" in far.reason
    )


def test_the_baselines_dtype_sets_the_standard() -> None:
    """A bfloat16 output where the reference gives float32 is held to float32's 1e-3, not bfloat16's 1e-2."""
    bf16 = own(0.5, dtype="bfloat16")  # half its elements 1e-3 off, a quarter 1e-2 off
    assert not own_error_verdict(CallOwn((bf16,)), None, RELU, Thresholds()).out_of_line  # type: ignore[union-attr]
    v = own_error_verdict(CallOwn((bf16,)), CallOwn((own(0.0, 1e-8, 1e-7),)), RELU, Thresholds())
    assert v is not None and v.out_of_line


def test_per_api_standards_from_the_thresholds_file() -> None:
    t = thresholds_from_dict({"apis": [{"pattern": "Functional.relu.*", "own_share": 0.5}]})
    assert not own_error_verdict(CallOwn((own(0.4),)), None, RELU, t).out_of_line  # type: ignore[union-attr]
    assert own_error_verdict(CallOwn((own(0.4),)), None, "Functional.gelu.0.forward", t).out_of_line  # type: ignore[union-attr]
    strict = Thresholds(apis=(ApiRule("Torch.cos.*", own_level="L2"),))
    t2, b = own(0.3, rmse=1.5e-3), own(0.3, rmse=1e-3)
    assert own_error_verdict(CallOwn((t2,)), CallOwn((b,)), "Torch.cos.0.forward", strict).out_of_line  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"apis\[0\].own_level must be one of L0, L1, L2, got 'L9'"):
        thresholds_from_dict({"apis": [{"pattern": "*", "own_level": "L9"}]})


def test_a_call_not_replayed_says_why_and_is_never_out_of_line() -> None:
    v = own_error_verdict(CallOwn(skipped="a random op"), None, "Functional.dropout.0.forward", Thresholds())
    assert v is not None and not v.out_of_line and v.skipped == "a random op"


def test_the_sidecar_round_trips_and_a_broken_one_is_named(tmp_path: Path) -> None:
    dump_json = tmp_path / "dump.json"
    calls = {RELU: CallOwn((own(0.4), None)), "Functional.dropout.0.forward": CallOwn(skipped="random")}
    path = write_own_errors(dump_json, calls, device="cpu")
    assert path == tmp_path / SELF_CHECK_JSON
    assert read_own_errors(dump_json) == calls
    doc = json.loads(path.read_text())
    doc["calls"][RELU]["outputs"][0]["rel_share"] = "a lot"
    path.write_text(json.dumps(doc))
    with pytest.raises(DumpFormatError, match=r"self_check.json.*rel_share: 'a lot' is not a valid value"):
        read_own_errors(dump_json)
    path.write_text('{"calls": {}}')
    with pytest.raises(DumpFormatError, match="not a pytest-msprobe self-check file"):
        read_own_errors(dump_json)


def test_a_tensor_compare_replays_both_sides_and_reports_the_own_errors(tmp_path: Path) -> None:
    result = compare(dump_dir("26.2.0", "npu", "tensor_L1", 0), dump_dir("26.2.0", "bench", "tensor_L1", 0))
    assert [a.api for a in result.out_of_line] == [RELU]
    fd = result.first_divergence
    assert fd is not None and (fd.api, fd.rule) == (RELU, "out of line")
    assert "the baseline's own error: 0.000% of 4096 elements off" in fd.reason
    assert not result.self_check and not result.passed  # failed by the thresholds, as before
    paths = write_reports(result, tmp_path)
    with open(paths["own_errors"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    flagged = [r["API"] for r in rows if r["Out of Line"] == "Yes"]
    assert flagged == [RELU] and len(rows) == len(result.own)
    relu = next(r for r in rows if r["API"] == RELU)
    assert float(relu["NPU Own Err Ratio"]) > 0.1 and float(relu["Bench Own Err Ratio"]) == 0.0
    sheet = openpyxl.load_workbook(paths["xlsx"])["own_errors"]
    header = [c.value for c in sheet[1]]
    values = {row[header.index("API")]: row for row in sheet.iter_rows(min_row=2, values_only=True)}
    assert values[RELU][header.index("Out of Line")] == "Yes"
    summary = json.loads(Path(paths["summary"]).read_text())
    assert summary["first_divergence"]["rule"] == "out of line"
    assert [c["api"] for c in summary["self_check"]["out_of_line"]] == [RELU]
    assert summary["self_check"]["gate"] is False and summary["self_check"]["calls_not_replayed"] >= 1


def test_without_replay_the_old_rules_stand() -> None:
    npu, bench = dump_dir("26.2.0", "npu", "tensor_L1", 0), dump_dir("26.2.0", "bench", "tensor_L1", 0)
    result = compare(npu, bench, replay=False)
    assert result.own == {} and result.first_divergence.rule == "enters"  # type: ignore[union-attr]


def test_the_replay_runs_for_the_calls_that_can_change_the_verdict_unless_all_are_asked_for() -> None:
    """By default a same-device compare replays the calls beyond a threshold and the calls they read; the
    verdict is the one a replay of every call gives. ``replay="all"`` replays every call, ``"none"`` none."""
    npu, bench = dump_dir("26.2.0", "npu", "tensor_L1", 0), dump_dir("26.2.0", "bench", "tensor_L1", 0)
    auto, everything = compare(npu, bench), compare(npu, bench, replay="all")
    flagged = {i for i, api in enumerate(auto.apis) if api.status in ("error", "warning")}
    assert flagged and flagged <= set(auto.own) < set(everything.own)
    assert all(auto.own[i] == everything.own[i] for i in auto.own)
    assert auto.first_divergence == everything.first_divergence and auto.passed == everything.passed
    assert compare(npu, bench, replay="none").own == {}
    with pytest.raises(ConfigError, match="replay must be one of auto, all, none"):
        compare(npu, bench, replay="some")


def test_a_tensor_compare_with_nothing_beyond_a_threshold_never_imports_torch(tmp_path: Path) -> None:
    """The replay (and torch's import, most of a large compare's time and memory) is for the calls that breach."""
    bench = dump_dir("26.2.0", "bench", "tensor_L1", 0)
    shutil.copytree(bench, tmp_path / "again")
    script = (
        "import sys; from pytest_msprobe import compare; "
        f"r = compare({str(tmp_path / 'again')!r}, {str(bench)!r}); "
        "print(r.passed, r.mode, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "tensor", "False"], done.stdout + done.stderr


def _with_sidecars(src: Path, dest: Path, tensors: Path) -> Path:
    """A copy of the statistics dump ``src`` with the own errors of the same run's tensor dump beside it."""
    shutil.copytree(src, dest)
    from pytest_msprobe.replay.offline import replay_dump

    calls = {c.name: CallOwn(c.outputs, c.skipped) for c in replay_dump(tensors).calls}
    (dump_json,) = dest.rglob("dump.json")
    write_own_errors(dump_json, calls)
    return dest


def test_statistics_dumps_with_sidecars_get_the_out_of_line_rule_and_the_gate(tmp_path: Path) -> None:
    npu = tmp_path / "npu"
    _with_sidecars(
        dump_dir("26.2.0", "npu", "stat_L1", 0), npu / "step0", dump_dir("26.2.0", "npu", "tensor_L1", 0)
    )
    bench = dump_dir("26.2.0", "bench", "stat_L1")
    result = compare(npu, bench, self_check=True)
    assert result.mode == "statistics" and result.self_check
    assert result.first_divergence is not None and result.first_divergence.rule == "out of line"
    # the gate without a baseline: the same call, with where it is called from
    alone = check_dump(npu)
    assert [c.name for c in alone.out_of_line] == [RELU] and not alone.passed
    message = self_check_message(alone)
    assert message.startswith("msprobe self-check: 1 of ")
    assert f"first out of line: {RELU} (step 0, rank 0)" in message and "called from: File" in message
    # a statistics dump without own errors cannot be gated on them: said, never passed
    with pytest.raises(DumpFormatError, match=r"no self_check\.json beside it: the dump was made without"):
        compare(bench, npu, self_check=True)
    with pytest.raises(DumpFormatError, match=r"no self_check\.json beside it"):
        check_dump(bench)


def tiny_tensor_dump(root: Path) -> Path:
    """One training step of a small CNN, dumped with tensors (L1) under ``root``."""
    import torch

    from pytest_msprobe import PrecisionDebugger, seed_all

    seed_all(3)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 5)
    )
    debugger = PrecisionDebugger(task="tensor", dump_path=str(root), level="L1", step=[0])
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    debugger.start()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    debugger.stop()
    debugger.step()
    debugger.close()
    return root


def test_a_breach_no_call_explains_is_named_rounding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear computed in float64 and rounded once (more accurate, not less): no call is out of line, so a
    breach of a tight tolerance is rounding, not a fault."""
    torch = pytest.importorskip("torch")
    baseline = tiny_tensor_dump(tmp_path / "b")
    linear = torch.nn.functional.linear

    def exact(x: object, w: object, b: object = None) -> object:
        out = linear(x.double(), w.double(), None if b is None else b.double())  # type: ignore[attr-defined]
        return out.float()

    monkeypatch.setattr(torch.nn.functional, "linear", exact)
    target = tiny_tensor_dump(tmp_path / "t")
    monkeypatch.undo()
    tight = Thresholds(apis=(ApiRule("*", error=1e-12),))
    result = compare(target, baseline, thresholds=tight)
    fd = result.first_divergence
    assert not result.passed and result.out_of_line == []
    assert fd is not None and fd.rule == "rounding" and fd.api == "Functional.linear.0.forward"
    assert fd.reason.startswith("no API is out of line: the difference builds up from rounding")


def test_the_cli_gates_on_own_errors_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pytest_msprobe.cli import main

    npu, bench = dump_dir("26.2.0", "npu", "stat_L1", 0), dump_dir("26.2.0", "bench", "stat_L1", 0)
    code = main(["compare", str(npu), str(bench), "-o", str(tmp_path / "a"), "--self-check"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "dump.json" in err and "no self_check.json beside it" in err
    # a tensor pair: own errors from the replay; the console names them
    npu, bench = dump_dir("26.2.0", "npu", "tensor_L1", 0), dump_dir("26.2.0", "bench", "tensor_L1", 0)
    code = main(["compare", str(npu), str(bench), "-o", str(tmp_path / "b"), "--self-check"])
    out = capsys.readouterr().out
    assert code == 1 and f"1 out of line (first: {RELU}, step 0, rank 0)" in out
    assert (tmp_path / "b" / "own_errors.csv").is_file()


def test_an_input_too_small_to_measure_does_not_match(make_dump: Callable[..., Path]) -> None:
    """Adam's second moment of a gradient that is rounding noise (1e-12): its difference is within atol, so it
    counts as none, but its square root (1e-6) differs by a tenth of its size, beyond atol. The sqrt is not
    where the error enters."""
    from compare_helpers import tensor

    def data(v: float) -> dict[str, Any]:
        moment = tensor([32], 0.0, v, v / 4, v * 3)
        root = v**0.5
        return {
            "Tensor.sqrt.7.forward": {
                "input_args": [moment],
                "input_kwargs": {},
                "output": [tensor([32], 0.0, root, root / 4, root * 3)],
            }
        }

    result = compare(make_dump("t", data(2e-12)), make_dump("b", data(1.5e-12)))
    assert not result.passed
    fd = result.first_divergence
    assert fd is not None and fd.api == "Tensor.sqrt.7.forward" and fd.rule == "inherited"
    assert result.rows[0].error == 0.0  # (the input's difference is within atol)
