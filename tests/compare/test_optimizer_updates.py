"""Optimizer updates pair by parameter whatever kernels made them (compare/dumps/optimizer.py, dump/optimizer_hooks.py).

Real CPU trainings of a small CNN dumped with each of torch's implementations (single-tensor loops, foreach lists,
one fused kernel: all three run on the CPU) and compared against each other; the same dumps without their
optimizer.json (what plain msprobe writes); the H200's foreach dump of the ResNet50 example against its shipped
CPU baseline.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from compare_helpers import seeded

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.judging import UNMATCHED
from pytest_msprobe.report.advisor import advisor_text
from pytest_msprobe.report.summary import summary_dict
from pytest_msprobe.report.text import console_summary, failure_message

torch = pytest.importorskip("torch")

IMPLEMENTATIONS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
PAIRS = [("single", "foreach"), ("foreach", "fused"), ("fused", "single")]
DATA = Path(__file__).parent.parent / "data"
RESNET_CPU = (
    Path(__file__).parents[2]
    / "examples/resnet50/baselines/cpu/examples/resnet50/test_resnet50/test_resnet50_training_steps"
)


def train(
    path: Path,
    impl: str,
    *,
    optimizer: str = "sgd",
    task: str = "statistics",
    level: str = "L1",
    lr: float | None = None,
    fault: float = 0.0,
    clip: bool = False,
    conv_bias: bool = True,
) -> Path:
    """Two dumped steps of a small CNN (conv with bias, batch norm, linear) with the optimizer ``impl`` runs;
    ``fault`` adds that much to ``fc.weight`` after each step, in a post-step hook (a patched optimizer)."""
    from torch import nn
    from torch.nn import functional as F

    from pytest_msprobe import PrecisionDebugger

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 6, 3, padding=1, bias=conv_bias)
            self.bn = nn.BatchNorm2d(6)
            self.fc = nn.Linear(6, 4)

        def forward(self, x: Any) -> Any:
            x = F.relu(self.bn(self.conv(x)))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    with seeded(1234):
        net = Net()
        kw = IMPLEMENTATIONS[impl]
        if optimizer == "sgd":
            opt = torch.optim.SGD(net.parameters(), lr=lr or 0.05, momentum=0.9, weight_decay=1e-4, **kw)
        else:
            opt = torch.optim.AdamW(net.parameters(), lr=lr or 1e-3, weight_decay=0.1, **kw)
        if fault:

            def patched(optimizer: Any, args: Any, kwargs: Any) -> None:
                with torch.no_grad():
                    net.fc.weight.add_(fault)

            opt.register_step_post_hook(patched)
        data = torch.Generator().manual_seed(0)
        with PrecisionDebugger(dump_path=str(path), task=task, level=level, step=[0, 1]) as debugger:
            for _ in range(2):
                x = torch.randn(8, 3, 8, 8, generator=data)
                y = torch.randint(0, 4, (8,), generator=data)
                debugger.start(model=net)
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5, foreach=impl != "single")
                opt.step()
                debugger.stop()
                debugger.step()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``runs(impl, **options)``: a dump of :func:`train`, made once per module."""
    root = tmp_path_factory.mktemp("optimizer_runs")
    made: dict[str, Path] = {}

    def get(impl: str, **options: Any) -> Path:
        key = "-".join([impl, *(f"{k}={v}" for k, v in sorted(options.items()))])
        if key not in made:
            made[key] = train(root / key, impl, **options)
        return made[key]

    return get


def plain(dump: Path, dest: Path, checklist: bool = True) -> Path:
    """A copy of ``dump`` without our optimizer.json (as plain msprobe writes it; and without checklist.json)."""
    shutil.copytree(dump, dest)
    for path in dest.rglob("optimizer.json"):
        path.unlink()
    if not checklist:
        for path in dest.rglob("checklist.json"):
            path.unlink()
    return dest


def updates(result: Any) -> list[Any]:
    return [api for api in result.apis if api.api.startswith("Optimizer.")]


def assert_paired_whole(result: Any) -> None:
    """Every row has its partner, every optimizer update is compared, and the compare passes."""
    assert [r.row for r in result.rows if r.status == UNMATCHED] == []
    assert result.coverage.passed and result.coverage.unmatched_rows == 0
    assert result.passed, console_summary(result)


# --------------------------------------------------------------------------------------- clean runs pass
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize(("target", "baseline"), PAIRS)
def test_implementations_pair_by_parameter(
    runs: Callable[..., Path], optimizer: str, target: str, baseline: str
) -> None:
    result = compare(runs(target, optimizer=optimizer), runs(baseline, optimizer=optimizer), jobs=1)
    assert_paired_whole(result)
    names = {api.api for api in updates(result)}
    # each parameter by its name, at each of the two steps, with the weight after and the optimizer's state
    assert names == {
        f"Optimizer.{p}.0.forward"
        for p in ("conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias")
    }
    assert len(updates(result)) == 12
    rows = {r.row.split(".forward", 1)[1] for r in result.rows if r.row.startswith("Optimizer.fc.weight.0.")}
    state = {".output.momentum_buffer"} if optimizer == "sgd" else {".output.exp_avg", ".output.exp_avg_sq"}
    assert {".input.param", ".input.grad", ".output.param"} | state <= rows
    assert not result.set_aside


def test_same_implementation_pairs_call_by_call(runs: Callable[..., Path], tmp_path: Path) -> None:
    """Both sides foreach: the decomposed calls pair as they are, and both sidecars' updates follow them, whole."""
    again = train(tmp_path / "again", "foreach")
    result = compare(again, runs("foreach"), jobs=1)
    assert_paired_whole(result)
    assert any(api.api.startswith("Torch._foreach_add_") for api in result.apis)
    found = updates(result)
    assert len(found) == 12 and all(api.bench_api == api.api for api in found)
    for api in found:  # after every call of its step's optimizer
        step_calls = [a for a in result.apis if a.step == api.step and a.api.startswith("Torch._foreach_")]
        assert all(a.order < api.order for a in step_calls)
    rows = {r.row.split(".forward", 1)[1] for r in result.rows if r.row.startswith("Optimizer.fc.weight.0.")}
    assert {".input.param", ".input.grad", ".output.param", ".output.momentum_buffer"} <= rows


def test_same_implementation_without_both_sidecars_adds_no_update(
    runs: Callable[..., Path], tmp_path: Path
) -> None:
    """An older baseline without optimizer.json and the same calls: they pair call by call, nothing is added."""
    again = train(tmp_path / "again", "foreach")
    for sidecar in again.glob("**/optimizer.json"):
        sidecar.unlink()
    result = compare(runs("foreach"), again, jobs=1)
    assert_paired_whole(result)
    assert not updates(result)


# ------------------------------------------------------------------------- dumps without optimizer.json
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_updates_are_derived_from_the_decomposed_calls(
    runs: Callable[..., Path], tmp_path: Path, optimizer: str
) -> None:
    """Without the sidecar (plain msprobe, older dumps of ours) each side's updates are read off its own calls:
    the last in-place write of each weight (AdamW's decay first); the rows are the weight before, the tensor
    applied and the weight after, named by the checklist's parameters."""
    single = plain(runs("single", optimizer=optimizer), tmp_path / "single")
    foreach = plain(runs("foreach", optimizer=optimizer), tmp_path / "foreach")
    result = compare(foreach, single, jobs=1)
    assert_paired_whole(result)
    assert len(updates(result)) == 12
    rows = {r.row for r in result.rows if r.row.startswith("Optimizer.conv.weight.0.forward")}
    assert rows == {
        f"Optimizer.conv.weight.0.forward{s}" for s in (".input.param", ".input.update", ".output.param")
    }
    # a sidecar against a derived side: the rows both have
    mixed = compare(runs("fused", optimizer=optimizer), single, jobs=1)
    assert_paired_whole(mixed)
    assert {r.row.rsplit(".forward", 1)[1] for r in mixed.rows if r.row.startswith("Optimizer.fc.bias.")} == {
        ".input.param",
        ".output.param",
    }


def test_msprobe_shaped_dumps_without_names_pair_by_order(runs: Callable[..., Path], tmp_path: Path) -> None:
    """Synthetic msprobe-shaped dumps: ours without optimizer.json and checklist.json, as plain msprobe writes
    (the records are msprobe's format). Nothing names the parameters: they pair in param-group order."""
    single = plain(runs("single"), tmp_path / "single", checklist=False)
    foreach = plain(runs("foreach"), tmp_path / "foreach", checklist=False)
    result = compare(foreach, single, jobs=1)
    assert_paired_whole(result)
    assert sorted({api.api for api in updates(result)}) == [f"Optimizer.param{k}.0.forward" for k in range(6)]


def test_a_fused_optimizer_without_sidecar_is_set_aside_and_said(
    runs: Callable[..., Path], tmp_path: Path
) -> None:
    """A fused optimizer records nothing decomposed: without optimizer.json the updates cannot be known; the
    other side's optimizer calls are neither compared nor unmatched, and every report says so."""
    fused = plain(runs("fused"), tmp_path / "fused")
    result = compare(runs("single"), fused, jobs=2)  # (each step's pair in a worker: the lines come back)
    assert_paired_whole(result)
    assert not updates(result)
    assert len(result.set_aside) == 2
    line = result.set_aside[0]
    assert line.startswith("step 0, rank 0: the baseline's optimizer (fused) records no update per parameter")
    assert "its 6 parameters' updates are judged where the next step reads them" in line
    assert "the target's 18 optimizer calls set aside" in line
    assert line in console_summary(result)
    assert summary_dict(result)["set_aside"] == list(result.set_aside)
    assert line in advisor_text(result)


# -------------------------------------------------------------------------------------------- faults
@pytest.mark.parametrize("baseline_kind", ["sidecar", "derived"])
def test_a_wrong_update_of_one_parameter_is_named_at_its_update(
    runs: Callable[..., Path], tmp_path: Path, baseline_kind: str
) -> None:
    """A patched optimizer that adds 1e-3 to fc.weight after the step: the first divergence is that weight's
    update, called from the training loop's ``optimizer.step()``. Against a baseline without optimizer.json
    (plain msprobe) the update's inputs cannot be compared (a gradient on one side, the tensor applied on the
    other): it is named as the first breaching call, once no later call is shown to let an error in (this
    model then has no conv bias before its batch norm, whose gradient is rounding noise that differs anywhere)."""
    options: dict[str, Any] = {} if baseline_kind == "sidecar" else {"conv_bias": False}
    baseline = runs("single", **options)
    if baseline_kind == "derived":
        baseline = plain(baseline, tmp_path / "single")
    result = compare(runs("foreach", fault=1e-3, **options), baseline, jobs=2)
    assert not result.passed and result.coverage.passed
    fd = result.first_divergence
    assert fd is not None
    assert (fd.api, fd.step, fd.row) == (
        "Optimizer.fc.weight.0.forward",
        0,
        "Optimizer.fc.weight.0.forward.output.param",
    )
    assert any("opt.step()" in frame for frame in result.stacks[fd.api])
    if baseline_kind == "derived":
        assert "its inputs cannot be compared" in fd.reason
    message = failure_message(result, {}, baseline, "regen")
    assert "first divergence: Optimizer.fc.weight.0.forward (step 0, rank 0)" in message
    assert "called from:" in message and "opt.step()" in message


def test_a_different_learning_rate_is_named_as_a_hyperparameter(runs: Callable[..., Path]) -> None:
    result = compare(runs("foreach", lr=0.06), runs("single"), jobs=1)
    assert result.coverage.passed and not result.passed
    assert result.checklist is not None
    assert [(d.name, d.target, d.baseline) for d in result.checklist.failures][:1] == [("lr", "0.06", "0.05")]


def test_gradient_clipping_of_other_implementations_is_set_aside(runs: Callable[..., Path]) -> None:
    """clip_grad_norm_ over lists against one tensor at a time: set aside with a line, the updates compared."""
    result = compare(runs("foreach", clip=True), runs("single", clip=True), jobs=1)
    assert_paired_whole(result)
    assert len(updates(result)) == 12
    assert [n.split(": ", 1)[1].split(" (")[0] for n in result.set_aside] == [
        "gradient clipping makes other calls on each side"
    ] * 2


# --------------------------------------------------------------------------------------- modes, levels
@pytest.mark.parametrize("task", ["tensor", "md5"])
def test_tensor_and_md5_modes(runs: Callable[..., Path], tmp_path: Path, task: str) -> None:
    result = compare(runs("foreach", task=task), runs("single", task=task), jobs=1)
    assert result.mode == task
    assert_paired_whole(result)
    rows = [r for r in result.rows if r.row.startswith("Optimizer.") and r.row.endswith(".output.param")]
    assert len(rows) == 12
    if task == "tensor":  # the files of the updates, compared as tensors (the sidecar's own files)
        assert all(r.target.data_name == r.row + ".pt" for r in rows)
        derived = compare(
            plain(runs("foreach", task=task), tmp_path / "f"),
            plain(runs("single", task=task), tmp_path / "s"),
            jobs=1,
        )
        assert_paired_whole(derived)
        outs = [r for r in derived.rows if r.row.startswith("Optimizer.") and r.row.endswith(".output.param")]
        # a foreach side's update is element k of its list call's output: that element's own file
        assert outs and all(r.target.data_name.startswith("Torch._foreach_") for r in outs)
    else:
        assert all(r.target.md5 and r.target.md5 == r.baseline.md5 for r in rows)


def test_mix_level(runs: Callable[..., Path], tmp_path: Path) -> None:
    """At mix the optimizer's calls are told by construct.json's parent ``optimizer`` where there is no sidecar."""
    result = compare(runs("foreach", level="mix"), runs("single", level="mix"), jobs=1)
    assert_paired_whole(result)
    assert len(updates(result)) == 12
    derived = compare(
        plain(runs("foreach", level="mix"), tmp_path / "f"),
        plain(runs("single", level="mix"), tmp_path / "s"),
        jobs=1,
    )
    assert_paired_whole(derived)
    assert len(updates(derived)) == 12
    assert {api.module for api in updates(derived)} == {("(optimizer)",)}


# ------------------------------------------------------------------------------------- a real GPU dump
def test_the_h200_foreach_baseline_pairs_every_optimizer_row_with_the_cpu_run() -> None:
    """The ResNet50 example's step 0 dumped on an H200 (foreach SGD, momentum, weight decay: tests/data/
    optimizer/README.md) against its shipped CPU baseline (single-tensor loops): every row pairs."""
    result = compare(RESNET_CPU / "step0", DATA / "optimizer" / "resnet50-cuda" / "step0", jobs=1)
    assert [r.row for r in result.rows if r.status == UNMATCHED] == []
    assert result.coverage.passed
    found = updates(result)
    assert len(found) == 161
    assert (
        found[0].api == "Optimizer.conv1.weight.0.forward" and found[-1].api == "Optimizer.fc.bias.0.forward"
    )
    # the optimizer's own calls gave way (batch norm's num_batches_tracked += 1 stays: Tensor.add_ in the model)
    assert not any(api.api.startswith(("Torch._foreach", "Tensor.clone")) for api in result.apis)


def test_the_sidecar_is_checked(runs: Callable[..., Path], tmp_path: Path) -> None:
    """A broken optimizer.json is unusable input, named with its problem."""
    from pytest_msprobe.errors import DumpFormatError

    broken = tmp_path / "broken"
    shutil.copytree(runs("foreach"), broken)
    path = broken / "step0" / "rank" / "optimizer.json"
    doc = json.loads(path.read_text())
    doc["steps"][0]["implementation"] = "turbo"
    path.write_text(json.dumps(doc))
    with pytest.raises(DumpFormatError, match=r"optimizer\.json.*'implementation' 'turbo'"):
        compare(broken, runs("single"), jobs=1)


def test_a_baseline_check_reads_the_updates_and_their_tensor_files(tmp_path: Path) -> None:
    """The check run on a baseline before the test body (validate) holds optimizer.json to what the compare
    needs: its records, and the header of every tensor file they name; a problem names the file."""
    from pytest_msprobe.compare.dumps import validate
    from pytest_msprobe.errors import DumpFormatError

    dump = train(tmp_path / "dump", "single", task="tensor")
    names = sorted(p.name for p in dump.glob("step0/rank/dump_tensor_data/Optimizer.*.pt"))
    assert names and validate(dump).tensor_files > len(names)
    tensor = dump / "step0" / "rank" / "dump_tensor_data" / names[0]
    whole = tensor.read_bytes()
    tensor.write_bytes(whole[:100])
    with pytest.raises(DumpFormatError) as caught:
        validate(dump)
    assert Path(caught.value.path) == tensor
    tensor.write_bytes(whole)
    sidecar = dump / "step1" / "rank" / "optimizer.json"
    sidecar.write_text(sidecar.read_text()[:200])
    with pytest.raises(DumpFormatError) as caught:
        validate(dump)
    assert Path(caught.value.path) == sidecar


# --------------------------------------------------------------------------------- plain msprobe's own dumps
MSPROBE = Path(__file__).resolve().parents[1] / "data" / "msprobe" / "msprobe-26.2.0" / "dumps"


def test_msprobe_records_no_foreach_update_and_its_single_tensor_one_is_set_aside() -> None:
    """Real msprobe 26.2.0 dumps: a foreach run records no optimizer call at all, the single-tensor bench 20 and 60
    (steps 0, 1). Against each other no row is unmatched for it: the bench's calls are set aside with a line per
    step, and the relu fault of the other foreach run is still named where it enters."""
    clean = compare(MSPROBE / "foreach" / "stat_L1", MSPROBE / "bench" / "stat_L1", jobs=1)
    assert clean.passed and clean.counts()["unmatched"] == 0
    assert [note.split(":", 1)[0] for note in clean.set_aside] == ["step 0, rank 0", "step 1, rank 0"]
    assert "the target's optimizer records no call" in clean.set_aside[0]
    assert "the baseline's 20 optimizer calls set aside" in clean.set_aside[0]
    faulty = compare(MSPROBE / "foreach_npu" / "stat_L1", MSPROBE / "bench" / "stat_L1", jobs=1)
    assert not faulty.passed and faulty.coverage.passed
    fd = faulty.first_divergence
    assert fd is not None and (fd.api, fd.step, fd.rule) == ("Functional.relu.2.forward", 0, "enters")


def test_a_plain_dump_that_skipped_its_backward_and_step_leaves_the_optimizer_unmatched(
    tmp_path: Path,
) -> None:
    """No optimizer call and no backward either: the run did not train (skipped backward() and step()), which
    no implementation explains; the bench's optimizer calls stay without a partner and the coverage fails."""
    skipped = tmp_path / "forward_only"
    shutil.copytree(MSPROBE / "foreach" / "stat_L1", skipped)
    for path in skipped.glob("**/dump.json"):
        doc = json.loads(path.read_text())
        doc["data"] = {name: body for name, body in doc["data"].items() if not name.endswith(".backward")}
        path.write_text(json.dumps(doc))
    result = compare(skipped, MSPROBE / "bench" / "stat_L1", jobs=1)
    assert not result.coverage.passed and not result.set_aside
    first = result.apis[result.coverage.first_unmatched[0]]
    assert first.api.endswith(".backward") or first.api.startswith("Tensor.")
