"""bench/faults_plugin.py: each fault changes exactly what it says, keeps the call's own autograd node, fires on
the call it names in every step, and says when it never fired."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from processes import NO_HYPOTHESIS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def faults() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("faults_plugin", ROOT / "bench" / "faults_plugin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["faults_plugin"] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("faults_plugin", None)


@pytest.fixture
def install(faults: ModuleType) -> Iterator[object]:
    injectors = []

    def make(text: str) -> object:
        injector = faults.Injector(faults.FaultSpec.parse(text))
        injector.install()
        injectors.append(injector)
        return injector

    yield make
    for injector in injectors:
        injector.uninstall()


def _linear_calls(x: torch.Tensor, w: torch.Tensor, n: int) -> list[torch.Tensor]:
    return [F.linear(x, w) for _ in range(n)]


def test_op_fault_scales_one_call_of_each_step_and_keeps_its_node(install, faults: ModuleType) -> None:
    original = F.linear
    x, w = torch.randn(4, 3), torch.randn(5, 3, requires_grad=True)
    clean = original(x, w)
    injector = install("op:Functional.linear.1")
    opt = torch.optim.SGD([w], lr=0.0)
    for _ in range(2):
        outs = _linear_calls(x, w, 3)
        assert torch.equal(outs[0], clean) and torch.equal(outs[2], clean)
        assert torch.equal(outs[1], clean * (1 + faults.OP_SCALE))
        assert type(outs[1].grad_fn) is type(
            clean.grad_fn
        )  # the op's own node, no multiplication node after it
        outs[1].sum().backward()  # its saved tensors are still usable
        opt.step()  # a step ends: the count starts again
    assert injector.fired == [
        {"step": 0, "at": "Functional.linear.1.forward"},
        {"step": 1, "at": "Functional.linear.1.forward"},
    ]
    injector.uninstall()
    assert F.linear is original


def test_a_fault_at_one_step_fires_at_that_step_only(install, faults: ModuleType) -> None:
    original = F.linear
    x, w = torch.randn(4, 3), torch.randn(5, 3, requires_grad=True)
    clean = original(x, w)
    injector = install("op:Functional.linear.1@1")
    opt = torch.optim.SGD([w], lr=0.0)
    for step in range(3):
        outs = _linear_calls(x, w, 3)
        assert torch.equal(outs[1], clean * (1 + faults.OP_SCALE) if step == 1 else clean)
        opt.step()
    assert injector.fired == [{"step": 1, "at": "Functional.linear.1.forward"}]


def test_backward_fault_scales_what_the_calls_backward_gives_out_only(install, faults: ModuleType) -> None:
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    (x_clean, w_clean) = torch.autograd.grad(F.linear(x, w).pow(2).sum(), (x, w))
    install("backward:Functional.linear.0")
    out = F.linear(x, w)
    assert torch.equal(out, F.linear(x.detach(), w.detach()))  # the forward is untouched
    x_grad, w_grad = torch.autograd.grad(out.pow(2).sum(), (x, w))
    scale = 1 + faults.GRAD_SCALE
    torch.testing.assert_close(x_grad, x_clean * scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(w_grad, w_clean * scale, rtol=1e-6, atol=0)


def test_optimizer_fault_moves_the_named_weight_after_each_step(install, faults: ModuleType) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the update itself changes nothing
    injector = install("optimizer:2.weight")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    after = dict(model.named_parameters())
    for name, value in before.items():
        if name == "2.weight":
            expected = value + faults.UPDATE_SCALE * value.std()
            torch.testing.assert_close(after[name].detach(), expected, rtol=0, atol=1e-7)
        else:
            assert torch.equal(after[name].detach(), value)
    assert injector.fired == [{"step": 0, "at": "2.weight (after optimizer.step())"}]


@pytest.mark.parametrize(
    "text",
    [
        "op:Functional.no_such_api.1",
        "op:Functional.linear",
        "sideways:Functional.linear.1",
        "optimizer:",
        "op",
        "op:Functional.linear.1@",
        "op:Functional.linear.1@one",
    ],
)
def test_a_fault_that_names_nothing_is_a_usage_error(faults: ModuleType, text: str) -> None:
    with pytest.raises(pytest.UsageError, match="INJECT_FAULT="):
        faults.FaultSpec.parse(text)


def test_a_fault_that_never_fires_fails_the_run(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text(
        textwrap.dedent(
            """
            import torch.nn.functional as F
            import torch

            def test_two_linear_calls():
                x = torch.ones(2, 2)
                F.linear(x, x)
                F.linear(x, x)
            """
        )
    )
    env = {**os.environ, "INJECT_FAULT": "op:Functional.linear.2"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "bench"), env.get("PYTHONPATH", "")) if p)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "faults_plugin",
            "-p",
            "no:cacheprovider",
            *NO_HYPOTHESIS,
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "injected fault: op at Functional.linear.2" in run.stdout  # the header
    assert "injected fault op:Functional.linear.2: NEVER FIRED" in run.stdout
    assert "1 passed" in run.stdout
