"""The self-check judges each call by the precision its device declares: TF32 convolutions and matmuls (another
device, simulated on the CPU by tests/devices.py) and bfloat16 autocast are in line, a fault under them is not;
the offline replay of a tensor dump gives the same verdicts."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytest_msprobe import PrecisionDebugger, seed_all
from pytest_msprobe.cli import main
from pytest_msprobe.compare.judging import check_dump
from pytest_msprobe.format.numerics import kind_of
from pytest_msprobe.format.own_errors import CallOwn
from pytest_msprobe.replay.offline import replay_dump
from tests.devices import Fault, Simulation, simulated_device, simulated_tf32  # noqa: F401 (a fixture)
from tests.dump.self_check_sidecars import sidecar_calls

STEPS = (0, 1)


class CNN(nn.Module):
    """conv2d (with bias) / batch_norm / relu, conv2d (with bias) / relu, pool, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Transformer(nn.Module):
    """embedding, layer_norm, q/k/v linear (3-D: linear.0-2), matmul (q k^T: matmul.0), softmax, matmul (att v:
    matmul.1), o (linear.3), a gelu MLP (linear.4-5), the head (linear.6)."""

    def __init__(self, vocab: int = 16, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.ln1 = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln2 = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        att = F.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads), dim=-1)
        x = x + self.o(torch.matmul(att, v).transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x)


def _train(
    root: Path, model_name: str, task: str = "statistics", autocast: torch.dtype | None = None
) -> Path:
    """Two steps of ``model_name`` ("cnn": SGD with momentum; "transformer": Adam), self-checked."""
    seed_all(5, mode=True)
    g = torch.Generator().manual_seed(0)
    model: nn.Module
    if model_name == "cnn":
        model = CNN()
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        batches = [
            (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in STEPS
        ]
    else:
        model = Transformer()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        batches = [
            (torch.randint(0, 16, (2, 6), generator=g), torch.randint(0, 16, (2, 6), generator=g))
            for _ in STEPS
        ]
    debugger = PrecisionDebugger(
        dump_path=str(root), task=task, level="L1", step=list(STEPS), self_check=True
    )
    for x, y in batches:
        debugger.start(model=model)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).backward()
        opt.step()
        debugger.stop()
        debugger.step()
    debugger.close()
    return root


def _out_of_line(calls: dict[tuple[int | None, str], CallOwn]) -> set[tuple[int | None, str]]:
    return {key for key, call in calls.items() if call.out_of_line}


def _header(root: Path, step: int = 0) -> dict[str, Any]:
    return json.loads((root / f"step{step}" / "rank" / "self_check.json").read_text())


# the convolutions and matrix products of each model, forward and backward (every one replayed)
GOVERNED = {
    "cnn": [f"Functional.conv2d.{i}.{d}" for i in (0, 1) for d in ("forward", "backward")]
    + ["Functional.linear.0.forward", "Functional.linear.0.backward"],
    "transformer": [f"Functional.linear.{i}.{d}" for i in range(7) for d in ("forward", "backward")]
    + [f"Torch.matmul.{i}.{d}" for i in (0, 1) for d in ("forward", "backward")],
}


@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_a_device_computing_in_tf32_as_it_declares_is_in_line(tmp_path: Path, model: str) -> None:
    with simulated_tf32() as sim:
        root = _train(tmp_path / "dump", model)
    assert sim.kernels is not None and sim.kernels.rounded > 0
    calls = sidecar_calls(root)
    assert not _out_of_line(calls)
    for step in STEPS:
        for name in GOVERNED[model]:
            call = calls[(step, name)]
            assert not call.skipped and any(o is not None for o in call.outputs), (step, name, call)
            assert call.emulated == "tf32", (step, name)
    # only convolutions and matrix products are replayed as TF32
    assert {name for (_, name), call in calls.items() if call.emulated} == set(GOVERNED[model])
    assert all(kind_of(name) is not None for name in GOVERNED[model])
    header = _header(root)
    assert header["precision"]["device"] == "cuda"
    assert (header["precision"]["conv"], header["precision"]["matmul"]) == ("tf32", "tf32")
    assert header["precision"]["conv_setting"] == ["torch.backends.cudnn.allow_tf32", "True"]


@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_the_same_rounding_undeclared_puts_the_convolutions_and_matmuls_out_of_line(
    tmp_path: Path, model: str
) -> None:
    with simulated_tf32(declare=False):
        root = _train(tmp_path / "dump", model)
    calls = sidecar_calls(root)
    found = {name for _, name in _out_of_line(calls)}
    forward = {name for name in GOVERNED[model] if name.endswith(".forward")}
    if model == "cnn":  # the head's one linear of 4x8: its 20 outputs may all be within 0.1%
        forward.discard("Functional.linear.0.forward")
        # a convolution's backward reads the incoming gradient and its weight rounded too
        assert {"Functional.conv2d.0.backward", "Functional.conv2d.1.backward"} <= found
    assert forward <= found
    assert all(kind_of(name) is not None for name in found), found  # nothing else is out of line
    assert not any(call.emulated for call in calls.values())
    assert _header(root)["precision"]["conv"] == "float32"


@pytest.mark.parametrize(
    ("model", "fault"),
    [
        ("cnn", Fault("noise", "Functional.relu", 1)),  # after conv2d.1, 1e-3 noise
        ("cnn", Fault("scale", "Functional.conv2d", 1)),  # a convolution itself 1.001 off
        ("transformer", Fault("scale", "Functional.linear", 4)),  # fc1
        ("transformer", Fault("noise", "Torch.matmul", 1)),  # att @ v
    ],
    ids=lambda v: v.record if isinstance(v, Fault) else v,
)
def test_a_fault_under_tf32_is_out_of_line_at_its_call(
    tmp_path: Path,
    model: str,
    fault: Fault,
    simulated_device: Callable[..., Simulation],  # noqa: F811 (the fixture imported above)
) -> None:
    sim = simulated_device(inject=fault)
    root = _train(tmp_path / "dump", model)
    assert sim.fired == [fault.record] * len(STEPS)
    assert _out_of_line(sidecar_calls(root)) == {(step, fault.record) for step in STEPS}
    result = check_dump(root)  # the gate's own-error verdicts (compare/judging/self_check.py)
    assert [(c.step, c.name) for c in result.out_of_line] == [(step, fault.record) for step in STEPS]


@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_bfloat16_autocast_on_the_cpu_is_in_line(tmp_path: Path, model: str) -> None:
    root = _train(tmp_path / "dump", model, autocast=torch.bfloat16)
    calls = sidecar_calls(root)
    assert not _out_of_line(calls)
    # every call autocast casts from float32 is replayed from its inputs cast to bfloat16
    emulated = {name for (_, name), call in calls.items() if call.emulated == "bfloat16"}
    if model == "cnn":
        assert set(GOVERNED["cnn"]) <= emulated
    else:  # the matmuls' inputs are already the linears' bfloat16 outputs: nothing to cast
        assert {f"Functional.linear.{i}.forward" for i in range(7)} <= emulated
    assert all(kind_of(name) is not None for name in emulated)
    header = _header(root)
    assert header["precision"]["autocast"] == "bfloat16" and header["precision"]["conv"] == "float32"


def _agree(root: Path) -> None:
    online = sidecar_calls(root)
    offline = replay_dump(root)
    assert {(c.step, c.name) for c in offline.calls} == set(online)
    for call in offline.calls:
        mine = online[(call.step, call.name)]
        assert mine.skipped == call.skipped, call.name
        assert mine.emulated == call.emulated, call.name
        assert len(mine.outputs) == len(call.outputs), call.name
        for a, b in zip(mine.outputs, call.outputs):
            assert (a is None) == (b is None), call.name
            if a is not None and b is not None:
                assert a.out_of_line == b.out_of_line and a.rel_share == pytest.approx(b.rel_share), call.name
    assert {(c.step, c.name) for c in offline.out_of_line} == _out_of_line(online)


@pytest.mark.parametrize(
    "case", ["tf32", "tf32-fault", "bfloat16-autocast"], ids=["tf32", "tf32-fault", "bfloat16-autocast"]
)
def test_the_offline_replay_of_a_tensor_dump_agrees_with_the_online_self_check(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if case == "bfloat16-autocast":
        root = _train(tmp_path / "dump", "cnn", task="tensor", autocast=torch.bfloat16)
    else:
        fault = Fault("noise", "Functional.relu", 1) if case == "tf32-fault" else None
        with simulated_tf32(inject=fault):
            root = _train(tmp_path / "dump", "cnn", task="tensor")
    _agree(root)
    offline = replay_dump(root)
    assert any(c.emulated for c in offline.calls)
    code = main(["replay", str(root), "-o", str(tmp_path / "out")])
    assert code == (1 if case == "tf32-fault" else 0)
    fmt = "bfloat16" if case == "bfloat16-autocast" else "tf32"
    emulated = sum(1 for c in offline.calls if c.emulated)
    assert f"calls replayed in float64 ({emulated} with {fmt} operands, as the device declares)" in (
        capsys.readouterr().out
    )
    doc = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert {c["name"] for c in doc["calls"] if c["emulated"] == fmt} == {
        c.name for c in offline.calls if c.emulated
    }
    assert [d["policy"]["conv"] if d["policy"] else None for d in doc["precision"]] == [
        "float32" if case == "bfloat16-autocast" else "tf32"
    ] * len(STEPS)
    if case != "bfloat16-autocast":
        assert [d.policy.conv if d.policy else None for d in offline.precision] == ["tf32", "tf32"]
        # the checklist declares the precision: without it, the same dump is judged as float32
        bare = tmp_path / "bare"
        shutil.copytree(root, bare)
        for step in STEPS:
            (bare / f"step{step}" / "rank" / "checklist.json").unlink()
        found = {c.name for c in replay_dump(bare).out_of_line}
        assert {"Functional.conv2d.0.forward", "Functional.conv2d.1.forward"} <= found
