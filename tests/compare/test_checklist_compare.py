"""The checklist compare on checklists of real runs and on edited copies: how values are held, what counts
as context, what is expected between two device types, and unusable files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from compare_helpers import seeded

from pytest_msprobe import PrecisionDebugger
from pytest_msprobe.compare import compare
from pytest_msprobe.compare.checklist import compare_checklists
from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.checklistfile import CHECKLIST_JSON, read_checklist
from pytest_msprobe.report.summary import first_divergence_dict
from pytest_msprobe.thresholds import Thresholds


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.c1(x))).mean((2, 3)))


def _dump(path: Path, steps: int = 3, model_to_start: bool = True, change: Any = None) -> Path:
    with seeded(7):
        model = _Net()
        if change is not None:
            with torch.no_grad():
                change(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        debugger = PrecisionDebugger(
            dump_path=str(path), task="statistics", level="L1", step=list(range(steps))
        )
        g = torch.Generator().manual_seed(0)
        for _ in range(steps):
            x = torch.randn(2, 3, 6, 6, generator=g)
            debugger.start(model if model_to_start else None)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            debugger.stop()
            debugger.step()
        debugger.close()
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _dump(tmp_path_factory.mktemp("checklist") / "dump")


def _pairs(target: Path, baseline: Path, steps: tuple[int, ...] = (0, 1, 2)) -> list:
    return [(target / f"step{s}" / "rank", baseline / f"step{s}" / "rank", s, 0) for s in steps]


def _edit(run: Path, tmp_path: Path, step: int, change) -> Path:
    """A copy of the run's checklists (only those) with one step's changed."""
    copy_root = tmp_path / "edited"
    for s in range(3):
        folder = copy_root / f"step{s}" / "rank"
        folder.mkdir(parents=True)
        doc = json.loads((run / f"step{s}" / "rank" / CHECKLIST_JSON).read_text())
        if s == step:
            change(doc)
        (folder / CHECKLIST_JSON).write_text(json.dumps(doc))
        shutil.copy(run / f"step{s}" / "rank" / "dump.json", folder / "dump.json")
    return copy_root


def test_a_run_against_itself_has_no_difference(run: Path) -> None:
    result = compare_checklists(_pairs(run, run), Thresholds())
    assert result.checked == 3 and result.differences == () and result.passed


def test_what_a_step_records(run: Path) -> None:
    doc = read_checklist(run / "step1" / "rank")
    assert doc is not None
    assert doc["seed"] == 7 and doc["device"] == "cpu" and doc["step"] == 1
    assert doc["switches"]["deterministic_algorithms"] is True
    assert doc["versions"]["torch"] == torch.__version__
    assert "NVIDIA_TF32_OVERRIDE" in doc["environment"] and "HCCL_DETERMINISTIC" in doc["environment"]
    assert set(doc["parameters"]) == {"c1.weight", "c1.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"}
    assert set(doc["buffers"]) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    assert doc["buffers"]["bn.num_batches_tracked"]["max"] == 1  # at the start of step 1: one forward done
    assert doc["structure"]["parameters"]["c1.weight"] == [[4, 3, 3, 3], "float32"]
    (adam,) = doc["optimizers"]
    assert adam["class"] == "AdamW" and adam["groups"][0]["lr"] == 1e-2
    assert adam["groups"][0]["betas"] == [0.9, 0.999] and adam["groups"][0]["params"] == 6
    assert doc["data"]["source"] == "the model's forward"
    assert doc["data"]["tensors"]["args.0"]["shape"] == [2, 3, 6, 6]


def test_without_a_model_the_callers_model_is_found(tmp_path: Path) -> None:
    doc = read_checklist(_dump(tmp_path / "d", steps=1, model_to_start=False) / "step0" / "rank")
    assert doc is not None and "c1.weight" in doc["parameters"]  # the loop's local `model`
    assert doc["data"]["source"] == "the model's forward"


def test_with_no_model_in_sight_the_optimizers_model_is_found_and_the_batch_is_the_first_calls(
    tmp_path: Path,
) -> None:
    net = _Net()
    forward, params = net.forward, list(net.parameters())
    del net

    def loop(forward, params) -> None:  # no Module among its locals, nor its caller's
        debugger = PrecisionDebugger(dump_path=str(tmp_path / "d"), task="statistics", level="L1", step=[0])
        x = torch.ones(2, 3, 6, 6)
        debugger.start()
        forward(x).sum().backward()
        torch.optim.SGD(params, lr=0.1).step()
        debugger.stop()
        debugger.close()

    loop(forward, params)
    doc = read_checklist(tmp_path / "d" / "step0" / "rank")
    # the module whose weights the optimizer steps (alive through the bound forward), taken at that step
    assert doc is not None and doc["taken"] == "the first optimizer step" and "fc.weight" in doc["parameters"]
    assert doc["data"]["source"] == "the first recorded call, Functional.conv2d.0.forward"
    assert list(doc["data"]["tensors"]) == ["args.0"] and doc["data"]["tensors"]["args.0"]["shape"] == [
        2,
        3,
        6,
        6,
    ]
    assert doc["optimizers"][0]["class"] == "SGD"


def test_weights_are_exact_at_step_0_and_held_to_their_tolerance_later(run: Path, tmp_path: Path) -> None:
    def nudge(doc: dict) -> None:  # rounding-sized: another CRC32, statistics within float32's tolerance
        fp = doc["parameters"]["fc.weight"]
        fp["crc32"], fp["mean"] = "00000000", fp["mean"] * (1 + 1e-7)

    at0 = compare_checklists(_pairs(_edit(run, tmp_path / "a", 0, nudge), run), Thresholds())
    assert [(d.kind, d.name, d.where) for d in at0.failures] == [("parameter", "fc.weight", "before step 0")]
    assert "CRC32 00000000 vs" in at0.failures[0].detail
    # at step 2 after an uncompared step 1, the same nudge is rounding; a real change is not
    only_2 = lambda t, b: [(t / "step2" / "rank", b / "step2" / "rank", 2, 0)]  # noqa: E731
    assert compare_checklists(only_2(_edit(run, tmp_path / "b", 2, nudge), run), Thresholds()).passed

    def change(doc: dict) -> None:
        fp = doc["parameters"]["fc.weight"]
        fp["crc32"], fp["max"] = "00000000", fp["max"] + 0.01

    later = compare_checklists(only_2(_edit(run, tmp_path / "c", 2, change), run), Thresholds())
    # a drift: reported, but it fails nothing and is never the first divergence
    assert later.passed and later.failures == []
    assert [(d.kind, d.name, d.step, d.drift) for d in later.drifts] == [("parameter", "fc.weight", 2, True)]
    assert later.first is None and "its Max differs by" in later.drifts[0].detail
    # when step 1 was compared call by call, its recorded updates are what moved the weights: unless no recorded
    # call of it gives out the weight's new values (a change outside the dumped calls)
    followed = compare_checklists(_pairs(_edit(run, tmp_path / "d", 2, change), run), Thresholds())
    assert [(d.kind, d.name, d.step) for d in followed.failures] == [("parameter", "fc.weight", 2)]
    assert "a change made outside the dumped calls" in followed.failures[0].detail

    def drift(doc: dict) -> None:  # far off, but the value a recorded call of step 1 gives out
        fp = doc["parameters"]["fc.weight"]
        fp["crc32"], fp["min"], fp["max"] = "00000000", -2.0, 3.0

    edited = _edit(run, tmp_path / "f", 2, drift)
    step1 = edited / "step1" / "rank" / "dump.json"
    dump = json.loads(step1.read_text())
    last = next(name for name in reversed(dump["data"]) if name.startswith("Tensor.addcdiv_"))
    dump["data"][last]["output"][0].update(Min=-2.0, Max=3.0)
    step1.write_text(json.dumps(dump))
    assert compare_checklists(_pairs(edited, run), Thresholds()).passed

    def buffer(doc: dict) -> None:  # buffers are held at every step (later: to their tolerance, as drifts)
        fp = doc["buffers"]["bn.running_var"]
        fp["crc32"], fp["max"] = "00000000", fp["max"] * 2

    changed = compare_checklists(_pairs(_edit(run, tmp_path / "e", 2, buffer), run), Thresholds())
    assert [(d.kind, d.name, d.step) for d in changed.drifts] == [("buffer", "bn.running_var", 2)]
    # after a step whose calls breach, the buffers are what those calls did (a batch norm's running
    # statistics): already reported through them, no drift
    after = compare_checklists(
        _pairs(_edit(run, tmp_path / "g", 2, buffer), run), Thresholds(), breached={(1, 0)}
    )
    assert after.passed and not after.drifts
    before = compare_checklists(
        _pairs(_edit(run, tmp_path / "h", 2, buffer), run), Thresholds(), breached={(2, 0)}
    )
    assert [(d.kind, d.name, d.step) for d in before.drifts] == [("buffer", "bn.running_var", 2)]


def test_the_batch_is_exact_at_every_step(run: Path, tmp_path: Path) -> None:
    def change(doc: dict) -> None:
        doc["data"]["tensors"]["args.0"]["crc32"] = "00000000"

    result = compare_checklists(_pairs(_edit(run, tmp_path, 2, change), run), Thresholds())
    (d,) = result.failures
    assert (d.kind, d.step, d.where) == ("data", 2, "step 2")
    assert d.headline() == f"data (step 2): {d.detail}"


def test_hyperparameters_are_named_at_the_first_step_they_differ(run: Path, tmp_path: Path) -> None:
    def lr_and_flag(doc: dict) -> None:
        doc["optimizers"][0]["groups"][0]["lr"] = 0.5
        doc["optimizers"][0]["groups"][0]["foreach"] = True  # an implementation choice: context

    def lr(doc: dict) -> None:
        doc["optimizers"][0]["groups"][0]["lr"] = 0.5

    edited = _edit(run, tmp_path, 1, lr_and_flag)
    for s in (2,):
        path = edited / f"step{s}" / "rank" / CHECKLIST_JSON
        doc = json.loads(path.read_text())
        lr(doc)
        path.write_text(json.dumps(doc))
    result = compare_checklists(_pairs(edited, run), Thresholds())
    assert [d.headline() for d in result.failures] == ["hyperparameter lr (param group 0): 0.5 vs 0.01"]
    assert result.failures[0].step == 1
    assert [(d.kind, d.name) for d in result.context] == [("switch", "foreach (param group 0)")]


def test_device_specific_context_is_marked_expected_between_device_types(run: Path, tmp_path: Path) -> None:
    def npu(doc: dict) -> None:
        doc["device"] = "npu"
        doc["versions"].update(torch_npu="2.1.0.post3", cann="8.0.RC2", cuda=None)
        doc["environment"]["HCCL_DETERMINISTIC"] = "True"
        doc["environment"]["OMP_NUM_THREADS"] = "4"
        doc["switches"]["npu.matmul.allow_hf32"] = False

    result = compare_checklists(_pairs(_edit(run, tmp_path, 0, npu), run, (0,)), Thresholds())
    assert result.passed
    marks = {d.name: d.expected for d in result.context}
    assert (
        marks["HCCL_DETERMINISTIC"]
        and marks["torch_npu"]
        and marks["cann"]
        and marks["npu.matmul.allow_hf32"]
    )
    assert marks["OMP_NUM_THREADS"] is False  # not a device's own
    line = result.context_line(limit=10)
    assert line is not None and "version torch_npu: 2.1.0.post3 vs unset (expected)" in line


def test_compare_fails_on_a_checklist_difference_that_comes_first(run: Path, tmp_path: Path) -> None:
    other = _dump(tmp_path / "other")
    path = other / "step0" / "rank" / CHECKLIST_JSON
    doc = json.loads(path.read_text())
    doc["optimizers"][0]["groups"][0]["weight_decay"] = 0.5
    path.write_text(json.dumps(doc))
    result = compare(other, run)
    assert not result.passed and not result.failures  # the calls agree: the settings alone fail it
    assert result.checklist_first is not None
    assert result.first_divergence_text() == "hyperparameter weight_decay (param group 0)"


def test_a_plain_msprobe_baseline_is_compared_without_a_checklist(run: Path) -> None:
    real = Path(__file__).parents[1] / "data" / "msprobe"
    dump = next(real.rglob("dump.json")).parent
    result = compare_checklists([(run / "step0" / "rank", dump, 0, 0)], Thresholds())
    assert result.checked == 0 and result.passed
    assert result.unchecked == ("step 0, rank 0: the baseline has no checklist.json (a plain msprobe dump?)",)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{", "invalid JSON"),
        ('{"format": "other"}', "not a checklist"),
        ('{"format": "pytest-msprobe checklist", "version": 99}', "checklist version 99"),
        ('{"format": "pytest-msprobe checklist", "version": 1, "parameters": []}', "'parameters' must be"),
    ],
)
def test_a_broken_checklist_is_an_error_naming_the_file(
    run: Path, tmp_path: Path, text: str, problem: str
) -> None:
    folder = tmp_path / "step0" / "rank"
    folder.mkdir(parents=True)
    (folder / CHECKLIST_JSON).write_text(text)
    with pytest.raises(DumpFormatError) as info:
        compare_checklists([(folder, run / "step0" / "rank", 0, 0)], Thresholds())
    assert str(folder / CHECKLIST_JSON) in str(info.value) and problem in str(info.value)


@pytest.mark.parametrize(
    ("change", "kind", "row"),
    [
        (lambda m: m.c1.weight.mul_(1.5), "parameter", "Functional.conv2d.0.forward.input.1"),
        (lambda m: m.bn.running_var.mul_(3.0), "buffer", "Functional.batch_norm.0.forward.input.2"),
    ],
)
def test_without_checklists_an_outside_input_is_read_off_the_records(
    run: Path, tmp_path: Path, change: Any, kind: str, row: str
) -> None:
    target = _dump(tmp_path / "t", change=change)
    baseline = tmp_path / "b"
    shutil.copytree(run, baseline)
    for path in [*target.rglob(CHECKLIST_JSON), *baseline.rglob(CHECKLIST_JSON)]:
        path.unlink()  # as plain msprobe dumps are
    result = compare(target, baseline)
    assert result.checklist is not None and result.checklist.checked == 0
    first = result.checklist_first
    assert first is not None and (first.kind, first.name, first.step) == (kind, row, 0)
    assert "no recorded call made it" in first.detail and "the dumps carry no checklist" in first.detail
    fd = result.first_divergence
    assert fd is not None and (fd.rule, fd.source, fd.row) == ("source", kind, row)
    summary = first_divergence_dict(result)
    assert summary is not None and (summary["api"], summary["row"]) == (fd.api, row)  # a call and its slot


def test_without_checklists_a_call_wrong_by_itself_is_not_taken_for_an_outside_input(
    run: Path, tmp_path: Path
) -> None:
    baseline = tmp_path / "b"
    shutil.copytree(run, baseline)
    target = tmp_path / "t"
    shutil.copytree(run, target)
    for path in [*target.rglob(CHECKLIST_JSON), *baseline.rglob(CHECKLIST_JSON)]:
        path.unlink()
    dump = target / "step0" / "rank" / "dump.json"
    doc = json.loads(dump.read_text())
    out = doc["data"]["Torch.relu.0.forward"]["output"][0]
    out["Max"] *= 1.01  # the relu's output off while its input matches: it enters there
    dump.write_text(json.dumps(doc))
    result = compare(target, baseline)
    assert result.checklist_first is None
    assert result.first_divergence is not None and result.first_divergence.api == "Torch.relu.0.forward"
