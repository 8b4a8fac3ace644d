"""A numerics setting the two runs compute under differently is a cause with a name: the first divergence, at
the first call it changes, compared by what the setting does on each side's device. Real dumps made by the
plugin, their checklists edited to record another device's settings (this machine has no GPU), and a real CUDA
baseline (``tests/data/resnet50-cuda-h200``, step 0 of the ResNet50 example on an H200)."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_msprobe import cli
from pytest_msprobe.compare import compare
from pytest_msprobe.compare.checklist import compare_checklists
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.format.checklistfile import CHECKLIST_JSON, read_checklist
from pytest_msprobe.format.numerics import policy_from_switches
from pytest_msprobe.report.advisor import advisor_text
from pytest_msprobe.report.html import html_fragment
from pytest_msprobe.report.model import model_data
from pytest_msprobe.report.summary import summary_dict
from pytest_msprobe.report.text import failure_message
from pytest_msprobe.thresholds import Thresholds

DATA = Path(__file__).resolve().parents[1] / "data"
CUDA_BASELINE = DATA / "resnet50-cuda-h200"
CPU_BASELINE = (
    Path(__file__).resolve().parents[2]
    / "examples/resnet50/baselines/cpu/examples/resnet50/test_resnet50/test_resnet50_training_steps"
)


def _on(device: str, **switches: Any) -> Callable[[dict], None]:
    """An edit of a checklist: its run on ``device`` with these switches (``cudnn__allow_tf32`` for
    ``cudnn.allow_tf32``), its recorded policy what they give there."""

    def edit(doc: dict) -> None:
        doc["device"] = device
        doc["switches"].update({k.replace("__", "."): v for k, v in switches.items()})
        autocast = (doc.get("precision") or {}).get("autocast")
        doc["precision"] = policy_from_switches(device, doc["switches"], autocast).to_dict()

    return edit


def _edited(run: Path, to: Path, *edits: Callable[[dict], None]) -> Path:
    """A copy of a dump whose every checklist went through ``edits``."""
    shutil.copytree(run, to)
    for path in to.rglob(CHECKLIST_JSON):
        doc = json.loads(path.read_text())
        for edit in edits:
            edit(doc)
        path.write_text(json.dumps(doc))
    return to


def _edit_dump(root: Path, step: int, api: str, change: Callable[[dict], None]) -> None:
    path = root / f"step{step}" / "rank" / "dump.json"
    doc = json.loads(path.read_text())
    change(doc["data"][api])
    path.write_text(json.dumps(doc))


def _setting(result: CompareResult) -> tuple[str, str, int | None] | None:
    first = result.checklist_first
    if first is None or first.kind != "setting":
        return None
    return first.name, first.call, first.step


@pytest.fixture(scope="module")
def cnn(dumps: Callable[..., Path]) -> Path:
    return dumps("cnn", model="cnn", task="statistics", steps=2, width=8)


@pytest.fixture(scope="module")
def transformer(dumps: Callable[..., Path]) -> Path:
    return dumps("transformer", task="statistics", steps=2, width=16, layers=1)


CUDA_TF32_CONV = _on("cuda", cudnn__allow_tf32=True, cuda__matmul__allow_tf32=False)


def test_the_checklist_records_the_runs_policy(cnn: Path) -> None:
    doc = read_checklist(cnn / "step0" / "rank")
    assert doc is not None
    assert doc["precision"] == {
        "device": "cpu",
        "conv": "float32",
        "matmul": "float32",
        "autocast": None,
        "conv_setting": None,
        "matmul_setting": None,
    }


def test_tf32_convolutions_against_a_cpu_baseline_are_named_at_the_first_conv(
    cnn: Path, tmp_path: Path
) -> None:
    target = _edited(cnn, tmp_path / "cuda", CUDA_TF32_CONV)
    result = compare(target, cnn)
    assert not result.passed and not result.failures  # the calls agree: the setting alone fails it
    first = result.checklist_first
    assert first is not None and _setting(result) == (
        "torch.backends.cudnn.allow_tf32",
        "Functional.conv2d.0.forward",
        0,
    )
    assert first.headline() == (
        "setting torch.backends.cudnn.allow_tf32 (target True; the baseline's cpu has none): "
        "Functional.conv2d.0.forward (step 0) is the first call it changes"
    )
    assert result.first_divergence_text() == "setting torch.backends.cudnn.allow_tf32"
    assert "about 1e-3 relative error" in first.meaning
    assert result.checklist is not None
    assert result.checklist.cross_device() == (
        "the baseline ran on cpu, the target on cuda; the target computes float32 convolutions in tf32 "
        "(torch.backends.cudnn.allow_tf32 True), the baseline in float32"
    )
    # the flag said once, as the setting: not again as a raw switch of the context
    assert not [d for d in result.checklist.context if d.name == "cudnn.allow_tf32"]


def test_tf32_matmuls_are_named_at_the_first_linear(transformer: Path, tmp_path: Path) -> None:
    cuda = _on("cuda", cudnn__allow_tf32=False, cuda__matmul__allow_tf32=False)
    baseline = _edited(transformer, tmp_path / "b", cuda)
    target = _edited(transformer, tmp_path / "t", cuda, _on("cuda", cuda__matmul__allow_tf32=True))
    result = compare(target, baseline)
    assert _setting(result) == ("torch.backends.cuda.matmul.allow_tf32", "Functional.linear.0.forward", 0)
    assert result.checklist_first is not None
    assert result.checklist_first.where == "target True; baseline False"


def test_tf32_matmuls_against_the_same_devices_baseline_name_the_linear_after_the_convs(
    cnn: Path, tmp_path: Path
) -> None:
    # the ResNet50 example on an H200 with TF32 matmuls against its own baseline named a batch_norm's backward
    baseline = _edited(cnn, tmp_path / "b", CUDA_TF32_CONV)
    target = _edited(cnn, tmp_path / "t", CUDA_TF32_CONV, _on("cuda", float32_matmul_precision="high"))
    result = compare(target, baseline)
    assert _setting(result) == ("torch.set_float32_matmul_precision", "Functional.linear.0.forward", 0)
    assert (
        result.checklist_first is not None and result.checklist_first.where == "target high; baseline highest"
    )


def test_the_same_flag_on_a_cpu_names_nothing(cnn: Path, tmp_path: Path) -> None:
    on, off = _on("cpu", cudnn__allow_tf32=True), _on("cpu", cudnn__allow_tf32=False)
    result = compare(_edited(cnn, tmp_path / "t", on), _edited(cnn, tmp_path / "b", off))
    assert result.passed and result.checklist_first is None
    assert result.checklist is not None and result.checklist.cross_device() is None


def test_reduced_formats_of_their_own_devices_are_expected(cnn: Path, tmp_path: Path) -> None:
    npu_hf32 = _on("npu", npu__conv__allow_hf32=True, npu__matmul__allow_hf32=False)
    target = _edited(cnn, tmp_path / "cuda", CUDA_TF32_CONV)
    result = compare(target, _edited(cnn, tmp_path / "npu", npu_hf32))
    assert result.passed and result.checklist is not None
    (expected,) = [d for d in result.checklist.context if d.name == "torch.backends.cudnn.allow_tf32"]
    assert expected.context_text() == (
        "switch torch.backends.cudnn.allow_tf32: True vs torch_npu.npu.conv.allow_hf32 True (expected)"
    )
    # an NPU computing its convolutions in float32 against CUDA's TF32 ones: not alike
    npu_float32 = _on("npu", npu__conv__allow_hf32=False)
    strict = compare(target, _edited(cnn, tmp_path / "npu32", npu_float32))
    assert _setting(strict) == ("torch.backends.cudnn.allow_tf32", "Functional.conv2d.0.forward", 0)
    assert strict.checklist_first is not None
    assert strict.checklist_first.where == "target True; baseline torch_npu.npu.conv.allow_hf32 False"


def test_a_setting_whose_calls_do_not_occur_changes_nothing(transformer: Path, tmp_path: Path) -> None:
    # TF32 convolutions in a model without a convolution
    result = compare(_edited(transformer, tmp_path / "t", CUDA_TF32_CONV), transformer)
    assert result.passed and result.checklist_first is None
    assert result.checklist is not None
    (unused,) = [d for d in result.checklist.context if d.name == "torch.backends.cudnn.allow_tf32"]
    assert unused.context_text().endswith("True vs none (cpu) (changes no recorded call)")
    assert "(changes no recorded call)" in (result.checklist.context_line(limit=20) or "")


def test_reduced_reductions_of_half_matmuls_are_held_between_two_cuda_runs(
    dumps: Callable[..., Path], tmp_path: Path
) -> None:
    run = dumps("cnn-autocast", model="cnn", task="statistics", steps=2, width=8, variant=_bf16_autocast)
    reduced = _on("cuda", cudnn__allow_tf32=False, cuda__matmul__allow_bf16_reduced_precision_reduction=True)
    full = _on("cuda", cudnn__allow_tf32=False, cuda__matmul__allow_bf16_reduced_precision_reduction=False)
    result = compare(_edited(run, tmp_path / "t", reduced), _edited(run, tmp_path / "b", full))
    name = "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"
    assert _setting(result) == (name, "Functional.linear.0.forward", 0)  # the first matmul in bfloat16
    # against a CPU, whose matmul kernels are its own: nothing to hold
    against_cpu = compare(_edited(run, tmp_path / "t2", reduced), run)
    assert against_cpu.passed and against_cpu.checklist is not None
    assert not [d for d in against_cpu.checklist.differences if d.name == name]


def test_algorithm_switches_are_held_between_runs_of_one_device_type(cnn: Path, tmp_path: Path) -> None:
    def deterministic(device: str, on: bool) -> Callable[[dict], None]:
        return _on(device, cudnn__allow_tf32=False, deterministic_algorithms=on)

    baseline = _edited(cnn, tmp_path / "b", deterministic("cuda", True))
    result = compare(_edited(cnn, tmp_path / "t", deterministic("cuda", False)), baseline)
    assert _setting(result) == ("torch.use_deterministic_algorithms", "Functional.conv2d.0.forward", 0)
    # another device type's kernels are its own: expected; a CPU's kernels have no such switch
    no_hf32 = _on("npu", npu__conv__allow_hf32=False)  # (torch_npu's default: HF32 convolutions)
    npu = compare(_edited(cnn, tmp_path / "npu", deterministic("npu", False), no_hf32), baseline)
    assert npu.checklist is not None and npu.checklist_first is None
    assert "switch torch.use_deterministic_algorithms: False vs True (expected)" in [
        d.context_text() for d in npu.checklist.context
    ]
    cpu = compare(_edited(cnn, tmp_path / "cpu", deterministic("cpu", False)), cnn)
    assert cpu.passed and cpu.checklist_first is None


def _scale_output(key: str, factor: float) -> Callable[[dict], None]:
    def change(entry: dict) -> None:
        entry["output"][0][key] *= factor

    return change


def test_a_call_where_the_error_enters_before_the_setting_changes_anything_comes_first(
    transformer: Path, tmp_path: Path
) -> None:
    target = _edited(transformer, tmp_path / "t", _on("cuda", cuda__matmul__allow_tf32=True))
    # the layer norm before the first linear: its output off while its inputs match
    _edit_dump(target, 0, "Functional.layer_norm.0.forward", _scale_output("Max", 1.01))
    result = compare(target, transformer)
    assert result.first_divergence is not None and result.first_divergence.rule == "enters"
    assert result.checklist_first is None
    assert result.first_divergence_text() == "Functional.layer_norm.0.forward"


def test_an_error_that_enters_after_the_first_changed_call_is_the_settings(
    transformer: Path, tmp_path: Path
) -> None:
    target = _edited(transformer, tmp_path / "t", _on("cuda", cuda__matmul__allow_tf32=True))
    _edit_dump(target, 0, "Functional.gelu.0.forward", _scale_output("Max", 1.01))
    result = compare(target, transformer)
    assert result.first_divergence is not None and result.first_divergence.api == "Functional.gelu.0.forward"
    assert _setting(result) == ("torch.backends.cuda.matmul.allow_tf32", "Functional.linear.0.forward", 0)


def test_a_call_with_evidence_of_its_own_comes_first_wherever_it_is(
    transformer: Path, tmp_path: Path
) -> None:
    target = _edited(transformer, tmp_path / "t", _on("cuda", cuda__matmul__allow_tf32=True))

    def overflow(entry: dict) -> None:
        entry["output"][0]["Max"] = "inf"

    _edit_dump(target, 0, "Functional.gelu.0.forward", overflow)
    result = compare(target, transformer)
    assert result.first_divergence is not None and result.first_divergence.rule == "overflow"
    assert result.checklist_first is None  # an op's fault under TF32 noise is named at its call


def test_a_data_difference_of_the_same_step_stays_before_the_setting(cnn: Path, tmp_path: Path) -> None:
    def other_batch(doc: dict) -> None:
        if doc["step"] == 0:
            doc["data"]["tensors"]["args.0"]["crc32"] = "00000000"

    result = compare(_edited(cnn, tmp_path / "t", CUDA_TF32_CONV, other_batch), cnn)
    assert result.checklist is not None
    assert [d.kind for d in result.checklist.failures] == ["data", "setting"]
    assert result.checklist_first is not None and result.checklist_first.kind == "data"


@contextlib.contextmanager
def _bf16_autocast() -> Iterator[None]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yield None


def test_autocast_is_recorded_where_the_forward_starts_and_named_at_its_first_call(
    cnn: Path, dumps: Callable[..., Path]
) -> None:
    target = dumps("cnn-autocast", model="cnn", task="statistics", steps=2, width=8, variant=_bf16_autocast)
    doc = read_checklist(target / "step0" / "rank")
    assert doc is not None and doc["precision"]["autocast"] == "bfloat16"
    result = compare(target, cnn)
    assert _setting(result) == ("torch.autocast", "Functional.conv2d.0.forward", 0)
    assert (
        result.checklist_first is not None and result.checklist_first.where == "target bfloat16; baseline off"
    )


def test_config_check_places_a_setting_at_the_first_call_both_dumps_record(
    cnn: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _edited(cnn, tmp_path / "t", CUDA_TF32_CONV)
    assert cli.main(["config-check", str(target), str(cnn)]) == 1
    out = capsys.readouterr().out
    assert (
        "  setting torch.backends.cudnn.allow_tf32 (target True; the baseline's cpu has none): "
        "Functional.conv2d.0.forward (step 0) is the first call it changes"
    ) in out
    # how cuBLAS sums half-type products: no setting of the CPU, whose kernels are its own
    assert "reduced_precision_reduction" not in out
    # the checklists alone, without the calls: the setting fails, saying it was not placed
    pairs = [(target / "step0" / "rank", cnn / "step0" / "rank", 0, 0)]
    alone = compare_checklists(pairs, Thresholds())
    assert ("setting", "torch.backends.cudnn.allow_tf32", 0) in [
        (d.kind, d.name, d.step) for d in alone.failures
    ]
    assert all("not looked at" in d.detail for d in alone.failures)


def test_cross_device_is_unknown_without_both_checklists(cnn: Path, tmp_path: Path) -> None:
    target = _edited(cnn, tmp_path / "t", CUDA_TF32_CONV)
    for path in target.rglob(CHECKLIST_JSON):
        path.unlink()
    result = compare(target, cnn)
    assert result.checklist is not None and result.checklist.cross_device() is None
    assert result.checklist_first is None


def test_a_real_cuda_baseline_against_the_cpu_one_names_tf32_convolutions() -> None:
    # measured on an H200: the verdict named Functional.conv2d.24.forward, where "the error grows"; across devices
    # that TF32 drift fails no call, and the setting is what the verdict names
    result = compare(CUDA_BASELINE, CPU_BASELINE, steps=[0])
    assert not result.passed and result.first_divergence is None
    assert result.across is not None and result.across.drift_calls > 100
    first = result.checklist_first
    assert first is not None and first.headline() == (
        "setting torch.backends.cudnn.allow_tf32 (target True; the baseline's cpu has none): "
        "Functional.conv2d.0.forward (step 0) is the first call it changes"
    )
    assert result.checklist is not None
    assert (result.checklist.cross_device() or "").startswith("the baseline ran on cpu, the target on cuda")


def test_every_report_says_the_setting(cnn: Path, tmp_path: Path) -> None:
    result = compare(_edited(cnn, tmp_path / "cuda", CUDA_TF32_CONV), cnn, stack=False)
    headline = (
        "setting torch.backends.cudnn.allow_tf32 (target True; the baseline's cpu has none): "
        "Functional.conv2d.0.forward (step 0) is the first call it changes"
    )
    message = failure_message(result, {}, cnn, "pytest ... --msprobe-regen-baseline")
    assert f"first divergence: {headline}" in message
    assert "  called from: File " in message  # the first changed call's stack, attached without stack=True
    advisor = advisor_text(result)
    assert "Suspect Nodes: setting torch.backends.cudnn.allow_tf32" in advisor
    assert "Run both sides with the same setting" in advisor and "about 1e-3 relative error" in advisor
    assert "setting torch.backends.cudnn.allow_tf32</b> (target True; the baseline&#x27;s cpu has none)" in (
        html_fragment(result, {}, advisor)
    )
    first = summary_dict(result)["first_divergence"]
    assert (first["kind"], first["name"], first["call"], first["step"]) == (
        "setting",
        "torch.backends.cudnn.allow_tf32",
        "Functional.conv2d.0.forward",
        0,
    )
    assert model_data(result)["checklist"] == headline
