"""Offline replay: each forward call of a real tensor dump rebuilt from its inputs and run in float64."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_msprobe import PrecisionDebugger, seed_all
from pytest_msprobe.cli import main
from pytest_msprobe.replay.offline import replay_dump


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.fc = torch.nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.relu(self.conv(x))
        y = torch.nn.functional.dropout(y, p=0.2, training=True)
        return self.fc(y.flatten(1))


def _dump(root: Path, task: str = "tensor") -> Path:
    seed_all(3)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = PrecisionDebugger(task=task, dump_path=str(root), level="L1", step=[0])
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    debugger.start()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    debugger.stop()
    debugger.step()
    debugger.close()  # the step's files are written in the background: wait for them
    return root


def _noisy(fn: Callable[..., torch.Tensor], scale: float) -> Callable[..., torch.Tensor]:
    def noisy(*args: object, **kwargs: object) -> torch.Tensor:
        out = fn(*args, **kwargs)
        return out * (1 + scale * torch.randn_like(out))

    return noisy


def test_a_clean_dump_has_no_call_out_of_line(tmp_path: Path) -> None:
    result = replay_dump(_dump(tmp_path / "dump"))
    by_name = {c.name: c for c in result.calls}
    for name in ("Functional.conv2d.0.forward", "Functional.relu.0.forward", "Functional.linear.0.forward"):
        call = by_name[name]
        assert not call.skipped and call.outputs and all(o is not None for o in call.outputs), call
        assert not call.out_of_line, call
        own = call.outputs[0]
        assert own is not None and own.max_rel < 1e-4  # float32 against float64: rounding only
    assert result.out_of_line == []
    assert "random op" in by_name["Functional.dropout.0.forward"].skipped  # a draw is never replayed


def test_a_noisy_api_is_out_of_line_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(torch.nn.functional, "relu", _noisy(torch.nn.functional.relu, 1e-3))
    dump = _dump(tmp_path / "dump")
    monkeypatch.undo()  # the replay runs torch's own relu, as it would on another machine
    result = replay_dump(dump)
    # the calls around it are clean: each is judged on its own inputs
    assert [c.name for c in result.out_of_line] == ["Functional.relu.0.forward"]
    # its backward ran through another node (the noise's product) than relu's: not compared, and said so
    backward = next(c for c in result.calls if c.name == "Functional.relu.0.backward")
    assert backward.skipped.startswith("the replay's node gives 1 gradient(s), the dump 2")
    code = main(["replay", str(dump), "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 1 and "Functional.relu.0.forward" in out and "1 out of line" in out
    doc = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert [c["name"] for c in doc["out_of_line"]] == ["Functional.relu.0.forward"] and doc["replayed"] >= 8
    assert doc["out_of_line"][0]["step"] == 0


class _OffGradient(torch.autograd.Function):
    """relu with a gradient 1% off: the forward is exact."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * (x > 0) * 1.01


def test_backward_replay_names_a_gradient_that_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = replay_dump(_dump(tmp_path / "clean"))
    grads = {c.name: c for c in clean.calls if c.name.endswith(".backward")}
    for name in (
        "Functional.conv2d.0.backward",
        "Functional.linear.0.backward",
        "Functional.relu.0.backward",
    ):
        assert not grads[name].skipped and any(o is not None for o in grads[name].outputs), grads[name]
        assert not grads[name].out_of_line, grads[name]
    # linear's node gives the bias's gradient first, summed to its shape as autograd does
    assert len(grads["Functional.linear.0.backward"].outputs) == 3
    monkeypatch.setattr(torch.nn.functional, "relu", lambda x, inplace=False: _OffGradient.apply(x))
    dump = _dump(tmp_path / "off")
    monkeypatch.undo()
    result = replay_dump(dump)
    assert [c.name for c in result.out_of_line] == ["Functional.relu.0.backward"]


def _sequence_dump(root: Path) -> Path:
    """A tensor dump of a linear over a transposed (non-contiguous) 3-D input, as a sequence model's head reads
    its recurrent layer's output: torch computes it as a matmul and an in-place add of the bias, whose node gives
    two gradients, where a contiguous input gives addmm's view (one)."""
    seed_all(5)
    layer = torch.nn.Linear(8, 6)
    debugger = PrecisionDebugger(task="tensor", dump_path=str(root), level="L1", step=[0])
    x = torch.randn(4, 3, 8, requires_grad=True)
    debugger.start()
    h = x.transpose(0, 1)  # (3, 4, 8), not contiguous
    torch.nn.functional.linear(h, layer.weight, layer.bias).square().sum().backward()
    debugger.stop()
    debugger.step()
    debugger.close()
    return root


def test_a_linears_backward_is_replayed_whatever_its_inputs_layout(tmp_path: Path) -> None:
    """The tensor files keep no layout: the replay lays the input out the other way when the dump's node gives
    another number of gradients than the replay's first node."""
    calls = {c.name: c for c in replay_dump(_sequence_dump(tmp_path / "clean")).calls}
    backward = calls["Functional.linear.0.backward"]
    assert not backward.skipped and len(backward.outputs) == 2 and not backward.out_of_line, backward
    assert all(o is not None for o in backward.outputs)


def test_the_cli_passes_a_clean_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = _dump(tmp_path / "dump")
    assert main(["replay", str(dump), "-o", str(tmp_path / "out"), "-q"]) == 0
    assert capsys.readouterr().out == ""
    assert (tmp_path / "out" / "replay.json").is_file()


def test_a_statistics_dump_cannot_be_replayed_and_says_so(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    dump = _dump(tmp_path / "dump", task="statistics")
    assert main(["replay", str(dump), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no call could be replayed" in err and "without its file" in err
    assert not (tmp_path / "out").exists()  # nothing judged, nothing written


MSPROBE = Path(__file__).resolve().parents[1] / "data" / "msprobe"


@pytest.mark.parametrize("version", ["8.3.3", "26.2.0"])
def test_real_msprobe_tensor_dumps(version: str) -> None:
    """msprobe's own dumps of a TinyResNet: the "npu" side's third relu returns relu(x) + 1e-3 * N(0, 1)."""
    dumps = MSPROBE / f"msprobe-{version}" / "dumps"
    bench = replay_dump(dumps / "bench" / "tensor_L1")
    assert bench.out_of_line == []  # CPU float32 against float64, every call: no false alarm
    assert all(
        not c.skipped for c in bench.calls
    )  # batch_norm's backward too (its running stats take no grad)
    npu = replay_dump(dumps / "npu" / "tensor_L1")
    assert [c.name for c in npu.out_of_line] == ["Functional.relu.2.forward"]


def test_a_call_its_inputs_do_not_rebuild_is_listed_with_the_reason(tmp_path: Path) -> None:
    from pytest_msprobe.replay.offline import replay_call

    entry = {"input_args": [{"type": "int", "value": 1}], "input_kwargs": {}, "output": []}
    outputs, why, _ = replay_call("Torch.matmul.0.forward", entry, tmp_path)
    assert outputs == () and why.startswith("the replay raised TypeError: ")
    outputs, why, _ = replay_call("Torch.no_such_api.0.forward", entry, tmp_path)
    assert outputs == () and why == "Torch.no_such_api is not an API this torch has"
    assert replay_call("Distributed.all_reduce.0.forward", entry, tmp_path)[1].startswith("a collective")


def test_aten_names_resolve_to_their_overloads() -> None:
    from pytest_msprobe.replay.apis import resolve

    assert resolve("Aten.add.Tensor.0.forward").fn is torch.ops.aten.add.Tensor
    assert resolve("Aten.mul.2.forward").fn is torch.ops.aten.mul
    assert "random op" in resolve("Aten.native_dropout.default.0.forward").reason
    assert "not an API this torch has" in resolve("Aten.no_such_op.default.0.forward").reason


def test_calls_whose_output_is_a_draw_or_garbage_are_not_replayed(tmp_path: Path) -> None:
    """An attention with dropout, a fractional max-pool without its samples and ``empty_like`` give another
    output each time they run (a draw, whatever the allocator hands out): their replay would judge the dumped
    output against another draw, and change with the generator or the memory of the process that replays. They
    are skipped with the reason, online and offline alike; the same attention without dropout is replayed."""
    import torch.nn.functional as F

    from tests.dump.self_check_sidecars import sidecar_calls

    seed_all(5)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    debugger = PrecisionDebugger(
        task="tensor", dump_path=str(tmp_path / "d"), level="L1", step=[0], self_check=True
    )
    debugger.start()
    drawn = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    plain = F.scaled_dot_product_attention(q, q, q)
    pooled = F.fractional_max_pool2d(q, 2, output_size=(5, 3))
    garbage = torch.empty_like(plain)
    (drawn.sum() + plain.sum() + pooled.sum() + garbage.copy_(plain).sum()).backward()
    debugger.stop()
    debugger.step()
    debugger.close()
    torch.manual_seed(1)
    first = replay_dump(tmp_path / "d")
    torch.manual_seed(2)
    assert replay_dump(tmp_path / "d") == first  # nothing of it depends on the generator
    calls = {c.name: c for c in first.calls}
    for name, why in (
        ("Functional.scaled_dot_product_attention.0", "a random op with dropout_p=0.5"),
        ("Functional.fractional_max_pool2d.0", "a random op without _random_samples"),
        ("Torch.empty_like.0", "uninitialized memory"),
    ):
        assert why in calls[f"{name}.forward"].skipped, calls[f"{name}.forward"]
    assert "_random_samples" in calls["Functional.fractional_max_pool2d.0.backward"].skipped
    assert "dropout_p" in calls["Functional.scaled_dot_product_attention.0.backward"].skipped
    for direction in ("forward", "backward"):
        replayed = calls[f"Functional.scaled_dot_product_attention.1.{direction}"]
        assert not replayed.skipped and not replayed.out_of_line, replayed
    online = sidecar_calls(tmp_path / "d")
    for call in first.calls:  # the self-check skipped the same calls for the same reasons
        assert online[(0, call.name)].skipped == call.skipped, call.name


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"),
    ],
    ids=["numpy", "torch"],
)
def test_a_replay_that_runs_out_of_memory_raises_instead_of_skipping_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """Out of memory is the machine's state at that moment, not the call's: a call skipped for it would leave
    its own error out of the verdict on a loaded machine and in it on an idle one. Any other error of the
    replay skips the call with the reason."""
    from pytest_msprobe.replay import pristine

    dump = _dump(tmp_path / "dump")

    def raising(exc: Exception) -> Callable[..., torch.Tensor]:
        def fn(*args: object, **kwargs: object) -> torch.Tensor:
            raise exc

        return fn

    pristine.capture()  # (the replay runs torch's functions as captured: the relu it runs is replaced there)
    monkeypatch.setitem(pristine._CAPTURED["Functional"], "relu", raising(error))
    with pytest.raises(type(error)):
        replay_dump(dump)
    monkeypatch.setitem(pristine._CAPTURED["Functional"], "relu", raising(RuntimeError("bad")))
    calls = {c.name: c for c in replay_dump(dump).calls}
    assert calls["Functional.relu.0.forward"].skipped == "the replay raised RuntimeError: bad"


def test_a_function_replaced_when_torchs_are_taken_is_not_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the plugin, torch's functions are taken on first use: one that something replaced by then (a
    test's fault, a library's patch) would be what the replay runs, and the verdict would depend on what the
    process did before. Such a call is skipped with the reason, whenever the replay runs."""
    from pytest_msprobe.replay import pristine

    dump = _dump(tmp_path / "dump")
    monkeypatch.setattr(pristine, "_CAPTURED", {})  # (as in a process that has not taken them yet)
    monkeypatch.setattr(pristine, "_REPLACED", {})
    monkeypatch.setattr(torch.nn.functional, "relu", _noisy(torch.nn.functional.relu, 1e-3))
    calls = {c.name: c for c in replay_dump(dump).calls}
    relu = calls["Functional.relu.0.forward"]
    assert "stood replaced by test_replay._noisy.<locals>.noisy" in relu.skipped, relu
    assert not calls["Functional.conv2d.0.forward"].skipped
