"""Independent calls computed in another order (a transformer's q, k and v projections), on dumps of a real
model: paired by what they read, forward and backward, in statistics and tensor mode; a fault in one of them is
still named at that call."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch")

from model_dumps import perturb

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.judging import UNMATCHED
from pytest_msprobe.compare.result import CompareResult


def pairing(result: CompareResult, step: int) -> dict[str, str | None]:
    """target API -> baseline API of the projections (linear 0-2: layer 0, 6-8: layer 1) of one step."""
    projections = {f"Functional.linear.{n}.{d}" for n in (0, 1, 2, 6, 7, 8) for d in ("forward", "backward")}
    return {a.api: a.bench_api for a in result.apis if a.step == step and a.api in projections}


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_projections_in_another_order_pair_by_what_they_read(dumps: Callable[..., Path], task: str) -> None:
    baseline = dumps(f"qkv-{task}", task=task, steps=2)
    result = compare(dumps(f"vkq-{task}", task=task, steps=2, order="vkq"), baseline, jobs=1)
    assert result.passed, [a.reason for a in result.failures]
    swapped = {0: 2, 1: 1, 2: 0, 6: 8, 7: 7, 8: 6}  # v, k, q against q, k, v
    for step in (0, 1):
        assert pairing(result, step) == {
            f"Functional.linear.{t}.{d}": f"Functional.linear.{b}.{d}"
            for t, b in swapped.items()
            for d in ("forward", "backward")
        }
    assert all(a.status != UNMATCHED for a in result.apis)


def test_a_fault_in_one_projection_is_named_at_its_call(dumps: Callable[..., Path]) -> None:
    baseline = dumps("qkv-tensor", task="tensor", steps=2)
    # the target's third linear call computes q (in the order v, k, q): its output 1e-3 off
    faulty = dumps("vkq-q", task="tensor", steps=2, order="vkq", variant=lambda: perturb("linear", 2, 1e-3))
    result = compare(faulty, baseline, jobs=1)
    fd = result.first_divergence
    assert not result.passed and fd is not None
    assert (fd.api, fd.step, fd.rule) == ("Functional.linear.2.forward", 0, "out of line")
    assert result.apis[fd.api_index].bench_api == "Functional.linear.0.forward"  # the baseline's q
    assert pairing(result, 0)["Functional.linear.0.forward"] == "Functional.linear.2.forward"  # v with v


def test_module_calls_in_another_order_pair_by_name(dumps: Callable[..., Path]) -> None:
    baseline = dumps("qkv-mix", task="statistics", level="mix", steps=1)
    result = compare(dumps("vkq-mix", task="statistics", level="mix", steps=1, order="vkq"), baseline, jobs=1)
    assert result.passed, [a.reason for a in result.failures]
    modules = {a.api: a.bench_api for a in result.apis if a.api.startswith("Module.blocks.0.attn.")}
    assert modules["Module.blocks.0.attn.v.Linear.forward.0"] == "Module.blocks.0.attn.v.Linear.forward.0"
    assert modules["Module.blocks.0.attn.q.Linear.backward.0"] == "Module.blocks.0.attn.q.Linear.backward.0"
    assert all(a.status != UNMATCHED for a in result.apis)
