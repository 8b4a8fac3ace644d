"""Diagnosis from plain dumps (no checklist.json, no self_check.json): where the error enters when it comes from
outside the recorded calls, from a dtype change, or from a call computed at a lower precision, read off what
msprobe's own files hold. Real torch trainings, dumped by our PrecisionDebugger, our own files removed."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_msprobe import compare
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.report.summary import first_divergence_dict

torch = pytest.importorskip("torch")
F = torch.nn.functional
nn = torch.nn

_MUL = torch.mul  # captured before any debugger wraps it: a change no call records
OURS = ("checklist.json", "self_check.json", "optimizer.json", "replay.json", "trend.json")


class LstmLm(nn.Module):
    """Embedding -> nn.LSTM (its ``_VF`` call is recorded by no tool) -> a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.head = nn.Linear(8, 16)
        self.head.weight = self.emb.weight

    def forward(self, tokens: Any) -> Any:
        out, _ = self.lstm(self.emb(tokens))
        return self.head(F.relu(out))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: Any) -> Any:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def _strip(root: Path) -> Path:
    for name in OURS:
        for f in root.rglob(name):
            f.unlink()
    for f in root.rglob("dump_tensor_data/Optimizer.*"):
        f.unlink()
    return root


def _train(
    path: Path,
    model_name: str,
    *,
    steps: int = 2,
    task: str = "statistics",
    before_step: Callable[[Any, int], None] | None = None,
    patch: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    autocast: bool = False,
    level: str = "L1",
) -> Path:
    from pytest_msprobe import PrecisionDebugger, seed_all

    seed_all(seed=7, mode=True)
    model = LstmLm() if model_name == "lstm" else Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    g = torch.Generator().manual_seed(3)
    if model_name == "lstm":
        batches = [(torch.randint(0, 16, (2, 5), generator=g), torch.randint(0, 16, (2, 5), generator=g))]
    else:
        batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))]
    batches *= steps
    debugger = PrecisionDebugger(task=task, dump_path=str(path), level=level, step=list(range(steps)))
    try:
        for step, (x, y) in enumerate(batches):
            if before_step is not None:
                before_step(model, step)
                x = getattr(model, "_data", x)
            with patch() if patch is not None else contextlib.nullcontext():
                debugger.start(model if level != "L1" else None)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    out = model(x)
                loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                debugger.stop()
                debugger.step()
    finally:
        debugger.close()
    return _strip(path)


@contextlib.contextmanager
def _on_call(name: str, index: int, change: Callable[..., Any]) -> Iterator[None]:
    """``F.<name>``'s ``index``-th call of the step computed by ``change(orig, *args, **kwargs)``."""
    orig = getattr(F, name)
    count = [0]

    def patched(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] - 1 == index:
            return change(orig, *args, **kwargs)
        return orig(*args, **kwargs)

    setattr(F, name, patched)
    try:
        yield
    finally:
        setattr(F, name, orig)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clean")
    return {
        "lstm": _train(root / "lstm", "lstm"),
        "mlp": _train(root / "mlp", "mlp"),
        "mlp-bf16": _train(root / "mlp-bf16", "mlp", autocast=True),
    }


def _fd(target: Path, baseline: Path) -> dict[str, Any]:
    return _summary(compare(target, baseline))


def _summary(result: CompareResult) -> dict[str, Any]:
    assert not result.passed
    summary = first_divergence_dict(result)
    assert summary is not None and summary["api"] and summary["row"]  # always a call and a slot
    return summary


def _perturb_weight(model: Any, step: int) -> None:
    if step == 0:
        with torch.no_grad():
            model.lstm.weight_hh_l0.mul_(1.01) if hasattr(model, "lstm") else model.fc2.weight.mul_(1.01)


def test_a_weight_changed_before_training_is_named_at_its_first_reader(tmp_path: Path, clean: dict) -> None:
    target = _train(tmp_path / "t", "mlp", before_step=_perturb_weight)
    fd = _fd(target / "step0", clean["mlp"] / "step0")
    assert (fd["api"], fd["row"], fd["kind"], fd["step"]) == (
        "Functional.linear.1.forward",
        "Functional.linear.1.forward.input.1",
        "parameter",
        0,
    )
    # the whole run names the same reader, not a call after it where the error "grows"
    run = _fd(target, clean["mlp"])
    assert (run["api"], run["step"]) == ("Functional.linear.1.forward", 0)


def _lstm_output_off(model: Any, step: int) -> None:
    if step == 0:
        model.lstm.register_forward_hook(lambda m, args, out: (_MUL(out[0], 1.01), out[1]))


def test_the_output_of_an_unrecorded_operation_is_named_at_its_first_reader(
    tmp_path: Path, clean: dict
) -> None:
    """What nn.LSTM gives the relu after it, changed where no call records it (msprobe records no ``_VF``
    call at all): the relu's input is where the error comes in, of kind unrecorded."""
    target = _train(tmp_path / "t", "lstm", before_step=_lstm_output_off)
    fd = _fd(target / "step0", clean["lstm"] / "step0")
    assert fd["api"].startswith("Functional.relu.0.forward"), fd
    assert (fd["row"], fd["rule"], fd.get("source")) == (
        "Functional.relu.0.forward.input.0",
        "source",
        "unrecorded",
    )
    assert "no recorded call made it" in fd["reason"] and "level mix" in fd["reason"]
    # at level mix the modules are recorded too: the LSTM module's output is where the error enters
    baseline = _train(tmp_path / "mb", "lstm", level="mix", steps=1)
    target = _train(tmp_path / "mt", "lstm", level="mix", steps=1, before_step=_lstm_output_off)
    fd = _fd(target / "step0", baseline / "step0")
    assert (fd["api"], fd["row"], fd["rule"]) == (
        "Module.lstm.LSTM.forward.0",
        "Module.lstm.LSTM.forward.0.output.0",
        "enters",
    ), fd


def test_the_data_of_a_later_step_is_a_source_and_the_weights_of_a_later_step_are_not(
    tmp_path: Path, clean: dict
) -> None:
    def data(model: Any, step: int) -> None:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(4, 8, generator=g)
        model._data = x * 1.01 if step == 1 else x

    target = _train(tmp_path / "t", "mlp", before_step=data)
    fd = _fd(target / "step1", clean["mlp"] / "step1")
    assert (fd["api"], fd["row"], fd["kind"]) == (
        "Functional.linear.0.forward",
        "Functional.linear.0.forward.input.0",
        "data",
    )
    # a weight that differs at step 1 after a fault at step 0 is what step 0 left: never a source there
    drifted = _train(
        tmp_path / "d", "mlp", patch=lambda: _on_call("gelu", 1, lambda orig, *a, **k: orig(*a, **k) * 1.01)
    )
    fd = _fd(drifted / "step1", clean["mlp"] / "step1")
    assert fd["rule"] != "source" and fd["api"] == "Functional.gelu.1.forward", fd


def test_the_weights_of_a_recurrent_call_are_parameters(tmp_path: Path, clean: dict) -> None:
    target = _train(tmp_path / "t", "lstm", before_step=_perturb_weight)
    fd = _fd(target / "step0", clean["lstm"] / "step0")
    assert (fd["api"], fd["kind"]) == ("VF.lstm.0.forward", "parameter"), fd
    assert fd["row"].startswith("VF.lstm.0.forward.input.2.")


def test_a_dtype_change_breaches_at_the_call_that_makes_it_at_any_step(tmp_path: Path, clean: dict) -> None:
    """Under bfloat16 autocast, fc2's output in float16 at every step: it agrees with bfloat16's values to
    bfloat16's tolerance, yet that call is where the run computes otherwise; at step 1 every weight has drifted,
    yet no drift changes a dtype."""

    def half() -> Any:
        return _on_call("linear", 1, lambda orig, *a, **k: orig(*a, **k).to(torch.float16))

    target = _train(tmp_path / "t", "mlp", autocast=True, patch=half)
    result = compare(target / "step0", clean["mlp-bf16"] / "step0")
    fd = result.first_divergence
    assert fd is not None and (fd.api, fd.rule) == ("Functional.linear.1.forward", "enters"), fd
    row = result.rows[fd.row_index]
    assert row.problem == "dtype" and "dtype differs: torch.float16 vs torch.bfloat16" in row.reason
    result = compare(target / "step1", clean["mlp-bf16"] / "step1")
    fd = result.first_divergence
    assert fd is not None and fd.api == "Functional.linear.1.forward" and fd.row.endswith(".output.0"), fd
    assert "float16 where the baseline's is torch.bfloat16" in fd.reason


def test_a_call_computed_at_a_lower_precision_is_out_of_line_before_its_backward(
    tmp_path: Path, clean: dict
) -> None:
    """A float32 gelu computed in float16 and cast back: 5e-4 off where float32 is 1e-7 off, within the
    float32 standard's 1e-3; its forward is named, not its backward (which autograd runs in float16)."""

    def half() -> Any:
        return _on_call("gelu", 0, lambda orig, x, **k: orig(x.half(), **k).to(x.dtype))

    target = _train(tmp_path / "t", "mlp", task="tensor", patch=half)
    baseline = _train(tmp_path / "b", "mlp", task="tensor")
    result = compare(target / "step0", baseline / "step0")
    fd = result.first_divergence
    assert fd is not None and (fd.api, fd.rule) == ("Functional.gelu.0.forward", "out of line"), fd
    assert "lower precision than float32" in fd.reason


def test_a_weight_changed_between_two_compared_steps_is_a_source_of_the_whole_run(
    tmp_path: Path, clean: dict
) -> None:
    """Step 0's update of fc2 is recorded and compared: fc2 at step 1 that no recorded call gave changed outside
    them (a checkpoint reloaded, a hook), and the whole run names its first reader; step 1 alone names it too, as
    the one tensor step 1 starts with that changed since the step before."""

    def between(model: Any, step: int) -> None:
        if step == 1:
            with torch.no_grad():
                model.fc2.weight.mul_(1.01)

    target = _train(tmp_path / "t", "mlp", before_step=between)
    run = _fd(target, clean["mlp"])
    assert (run["api"], run["row"], run["step"], run.get("source")) == (
        "Functional.linear.1.forward",
        "Functional.linear.1.forward.input.1",
        1,
        "parameter",
    ) or (run["kind"], run["api"], run["step"]) == ("parameter", "Functional.linear.1.forward", 1), run
    # step 1 alone: fc2 is the one tensor step 1 starts with that differs (every other weight matches), so it
    # changed since step 0, and its first reader is named: no drift of every weight after an earlier fault
    result = compare(target / "step1", clean["mlp"] / "step1")
    alone = _summary(result)
    assert (alone["kind"], alone["api"], alone["row"], alone["step"]) == (
        "parameter",
        "Functional.linear.1.forward",
        "Functional.linear.1.forward.input.1",
        1,
    ), alone
    assert "changed since the step before" in alone["reason"]  # the plain dumps' checklist difference says so
    fd = result.first_divergence
    assert fd is not None and (fd.rule, fd.source, fd.changed) == ("source", "parameter", True), fd
    assert "changed since the step before" in fd.reason


def test_a_difference_within_tolerance_that_breaches_later_is_named_where_it_starts(
    tmp_path: Path, clean: dict
) -> None:
    """gelu.0's output off by a part in 1e5 (within float32's statistics tolerance): every call before it
    matches exactly, the calls after it breach, and no unrecorded operation or call downstream is blamed."""

    def off() -> Any:
        return _on_call("gelu", 0, lambda orig, x, **k: _MUL(orig(x, **k), 1 + 3e-5))

    target = _train(tmp_path / "t", "mlp", patch=off, steps=1)
    result = compare(target / "step0", clean["mlp"] / "step0")
    fd = result.first_divergence
    assert fd is not None and fd.api == "Functional.gelu.0.forward", fd
    row = result.rows[fd.row_index]
    assert (
        row.status != "error" and "every call before it in the step, match the baseline exactly" in fd.reason
    )


def test_under_autocast_the_call_that_grows_the_error_is_named_though_only_the_loss_breaches(
    tmp_path: Path, clean: dict
) -> None:
    """gelu.1 noisy at every step, under bfloat16 autocast: at step 1 the weights have drifted (every linear
    reads one that differs); gelu.1's bfloat16 output grows the error some 300x yet stays within bfloat16's
    tolerance, and no call before it breaches. The call that grows it is named, not a call after it."""

    def noisy() -> Any:
        g = torch.Generator().manual_seed(11)

        def off(orig: Any, x: Any, **k: Any) -> Any:
            y = orig(x, **k)
            return y * (1 + 0.004 * torch.randn(y.shape, generator=g)).to(y.dtype)

        return _on_call("gelu", 1, off)

    target = _train(tmp_path / "t", "mlp", autocast=True, patch=noisy)
    result = compare(target / "step1", clean["mlp-bf16"] / "step1")
    fd = result.first_divergence
    assert fd is not None and fd.api == "Functional.gelu.1.forward", fd
    assert result.rows[fd.row_index].status != "error" and fd.rule == "grows", fd


def _ints_as_msprobe(root: Path) -> Path:
    """msprobe 26 records no Mean and no Norm of an integer tensor: the dumps' int64 records made so."""
    for path in root.rglob("dump.json"):
        doc = json.loads(path.read_text())

        def strip(node: Any) -> None:
            if isinstance(node, dict):
                if node.get("dtype") == "torch.int64":
                    node["Mean"] = node["Norm"] = None
                for value in node.values():
                    strip(value)
            elif isinstance(node, list):
                for value in node:
                    strip(value)

        strip(doc)
        path.write_text(json.dumps(doc))
    return root


def test_data_whose_statistics_agree_is_named_at_its_first_reader_at_a_later_step(
    tmp_path: Path, clean: dict
) -> None:
    """Two token ids changed at every step, within the ids' range: msprobe records no Mean or Norm of integers,
    so the ids' records agree; the embedding's output does not. At step 1 the weights have drifted after step 0's
    change, and the embedding is the step's first call: no drift is measured before it, so its weight's own
    statistics are what its output error is held against, and it is named, not a call after it."""

    def change(model: Any, step: int) -> None:
        g = torch.Generator().manual_seed(3)
        x = torch.randint(0, 16, (2, 5), generator=g)
        lo, hi = int(x.min()), int(x.max())
        inner = [(i, j) for i in range(2) for j in range(5) if lo < int(x[i, j]) < hi][:2]  # not an extreme
        for i, j in inner:
            x[i, j] = lo + 1 + (int(x[i, j]) - lo) % (hi - lo - 1)  # another id strictly inside the range
        model._data = x

    target = _ints_as_msprobe(_train(tmp_path / "t", "lstm", before_step=change))
    baseline = _ints_as_msprobe(_train(tmp_path / "b", "lstm"))
    result = compare(target / "step1", baseline / "step1")
    fd = result.first_divergence
    assert fd is not None and fd.api == "Functional.embedding.0.forward", fd
    ids = next(r for r in result.rows if r.row == "Functional.embedding.0.forward.input.0")
    assert ids.status != "error" and fd.rule == "grows", (ids, fd)
