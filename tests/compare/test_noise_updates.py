"""A weight that Adam updates from a gradient that is rounding noise drifts by what no device's precision decides."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from compare_helpers import tensor, write_dump

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.judging import ERROR, PASS, WARNING


def _update(
    weight: dict[str, Any], moment: dict[str, Any], denom: dict[str, Any], out: dict[str, Any]
) -> Any:
    return {
        "input_args": [weight, moment, denom],
        "input_kwargs": {"value": {"type": "float", "value": -0.001}},
        "output": [out],
    }


def _step(
    bias_hi: float, m_hi: float, denom_hi: float, new_hi: float, grad_scale: float = 1.0
) -> dict[str, Any]:
    """One step's records of a key bias: its forward use, then Adam's update (moments of size grad_scale)."""
    bias = tensor([32], -0.17, bias_hi, 0.01, 0.55)
    return {
        "Functional.linear.1.forward": {
            "input_args": [
                tensor([4, 8, 32], -3.0, 3.0, 0.0, 32.0),
                tensor([32, 32], -0.17, 0.17, 0.0, 3.2),
                bias,
            ],
            "input_kwargs": {},
            "output": [tensor([4, 8, 32], -3.2, 3.3, 0.01, 33.0)],
        },
        "Tensor.addcdiv_.7.forward": _update(
            bias,
            tensor([32], -m_hi * grad_scale, m_hi * grad_scale, 0.0, 5 * m_hi * grad_scale),
            tensor([32], 1e-8, denom_hi * grad_scale, 1.02e-8 * grad_scale, 5.8e-8 * grad_scale),
            tensor([32], -0.17, new_hi, 0.01, 0.55),
        ),
    }


def test_a_weight_updated_from_rounding_noise_warns_and_passes(make_dump: Callable[..., Path]) -> None:
    # the first step: the bias matches; its moments are noise (1e-11, 1e-8) that differ below atol; the update
    # divides them, so the new bias differs by 2.3e-5, 1.3e-4 of its size
    first = compare(
        make_dump("t0", _step(0.17361, 4.4e-11, 1.0444e-8, 0.173633)),
        make_dump("b0", _step(0.17361, 2.3e-11, 1.0387e-8, 0.17361)),
    )
    assert first.passed, [r.reason for r in first.failures]
    row = next(r for r in first.rows if r.row == "Tensor.addcdiv_.7.forward.output.0")
    assert row.status == WARNING and "updates from rounding noise" in row.reason
    # a later step: the bias already differs where the linear reads it (its output does not: 1e-6 of it)
    later = compare(
        make_dump("t1", _step(0.173633, 4.4e-11, 1.0444e-8, 0.173660)),
        make_dump("b1", _step(0.17361, 2.3e-11, 1.0387e-8, 0.17361)),
    )
    assert later.passed, [r.reason for r in later.failures]
    use = next(r for r in later.rows if r.row == "Functional.linear.1.forward.input.2")
    assert use.status == WARNING and "Tensor.addcdiv_.7.forward updates from rounding noise" in use.reason
    assert next(r for r in later.rows if r.row == "Functional.linear.1.forward.output.0").status == PASS


def test_an_update_from_a_measured_gradient_still_fails(make_dump: Callable[..., Path]) -> None:
    """The same update with moments of a real gradient (1e-3) that differ: the new weight's difference is real."""
    result = compare(
        make_dump("t", _step(0.17361, 4.4e-11, 1.0444e-8, 0.173633, grad_scale=1e8)),
        make_dump("b", _step(0.17361, 2.3e-11, 1.0387e-8, 0.17361, grad_scale=1e8)),
    )
    assert not result.passed
    assert "Tensor.addcdiv_.7.forward.output.0" in {r.row for r in result.rows if r.status == ERROR}
    assert not any("rounding noise" in r.reason for r in result.rows)


def _adam_run(path: Path, noise: float, update_fault: float = 0.0) -> Path:
    """Three steps of torch's Adam on a linear layer whose 64-element bias gets a gradient with one element of
    rounding size (2e-8 to 3e-8, Adam's eps is 1e-8) among gradients of 1e-4 to 1e-3 of both signs, dumped with
    tensors. ``noise`` is that element's relative rounding at the second step (another device's); the third
    step updates only the weight (the bias has no gradient), so the bias enters it as the second step left it.
    ``update_fault`` scales every element of each update's result (a wrong kernel)."""
    import torch

    from pytest_msprobe import PrecisionDebugger

    generator = torch.Generator().manual_seed(3)
    signs = torch.randint(0, 2, (3, 64), generator=generator).double() * 2 - 1
    grads = signs * (torch.rand(3, 64, generator=generator, dtype=torch.float64) * 9e-4 + 1e-4)
    grads[:, 10] = torch.tensor([2e-8, 3e-8, 2.5e-8], dtype=torch.float64)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 64)
    torch.nn.init.zeros_(model.bias)  # a bias starts at zero: its size is the updates' own
    x = torch.randn(4, 8, generator=generator)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    real_addcdiv = torch.Tensor.addcdiv_

    def faulty(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real_addcdiv(self, *args, **kwargs)
        with torch.no_grad():
            out.mul_(1 + update_fault)
        return out

    debugger = PrecisionDebugger(dump_path=path, task="tensor", level="L1", step=[0, 1, 2])
    try:
        if update_fault:
            torch.Tensor.addcdiv_ = faulty  # type: ignore[method-assign]
        for step in range(3):
            grad = grads[step].clone()
            grad[10] *= 1 + (noise if step == 1 else 0.0)
            bias_grad = grad.float() if step < 2 else None
            debugger.start(model=model)
            opt.zero_grad()
            model(x).sum().backward()
            model.bias.grad = bias_grad  # the gradient the case is about
            opt.step()
            debugger.stop()
            debugger.step()
    finally:
        torch.Tensor.addcdiv_ = real_addcdiv  # type: ignore[method-assign]
        debugger.close()
    return path


def test_a_tensor_dump_forgives_an_update_whose_difference_lies_on_a_gradient_element_of_rounding_size(
    tmp_path: Path,
) -> None:
    """At the second step every gradient matches within 1e-4 at its scale, but one element of rounding size
    differs by 3% of itself: Adam divides it by its own small root, and the new bias differs by more than 1e-4
    of its norm. The update, and the bias where the next step reads it, are warnings that say so; the compare
    passes."""
    baseline = _adam_run(tmp_path / "baseline", noise=0.0)
    result = compare(_adam_run(tmp_path / "target", noise=0.03), baseline, jobs=1)
    assert result.mode == "tensor"
    update = next(
        r
        for r in result.rows
        if r.row == "Tensor.addcdiv_.1.forward.output.0" and result.apis[r.api_index].step == 1
    )
    assert (update.error or 0) > 1e-4, "the case must breach the tolerance, or it proves nothing"
    assert update.status == WARNING and "updates from rounding noise" in update.reason
    use = next(
        r
        for r in result.rows
        if r.row == "Functional.linear.0.forward.input.2" and result.apis[r.api_index].step == 2
    )
    assert (use.error or 0) > 1e-4 and use.status == WARNING
    # the weight's last recorded update is its entry of optimizer.json, which follows the addcdiv_ that made it
    assert "Optimizer.bias.0.forward updated from rounding noise at step 1" in use.reason
    assert result.passed, [(a.api, a.step, a.reason) for a in result.failures]


def test_a_tensor_dump_still_fails_an_update_that_is_wrong_everywhere(tmp_path: Path) -> None:
    baseline = _adam_run(tmp_path / "baseline", noise=0.0)
    result = compare(_adam_run(tmp_path / "target", noise=0.01, update_fault=1e-3), baseline, jobs=1)
    assert not result.passed
    failing = {r.row for r in result.rows if r.status == ERROR}
    assert "Tensor.addcdiv_.1.forward.output.0" in failing
    assert not any("rounding noise" in r.reason for r in result.rows if r.status != PASS)


def test_running_out_of_memory_in_the_noise_check_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The update's tensors are read whole to see where it differs: out of memory there says nothing of the
    update (the compare above passes on an idle machine), so it raises instead of leaving the update an error."""
    from pytest_msprobe.compare import explain

    baseline = _adam_run(tmp_path / "baseline", noise=0.0)
    target = _adam_run(tmp_path / "target", noise=0.03)

    def exhausted(*args: object) -> None:
        raise MemoryError

    monkeypatch.setattr(explain, "_values", exhausted)
    with pytest.raises(MemoryError):
        compare(target, baseline, jobs=1)


def _norms(folder: Path, key_bias: tuple[float, float], other: float = 0.5) -> Path:
    """Gradient clipping's per-parameter norms: four gradients near ``other`` and a key bias's of ``key_bias``
    (its Max and Min), a gradient that is zero in exact arithmetic."""
    data = {}
    for i in range(5):
        hi, lo = key_bias if i == 2 else (other, -other)
        size = max(abs(hi), abs(lo))
        data[f"Torch.linalg.vector_norm.{i}.forward"] = {
            "input_args": [tensor([32], lo, hi, 0.0, size * 3)],
            "input_kwargs": {},
            "output": [tensor([], size * 3, size * 3, size * 3, size * 3)],
        }
    write_dump(folder, data)
    return folder


def test_a_gradient_of_rounding_noise_beside_the_others_is_no_failure(tmp_path: Path) -> None:
    baseline = _norms(tmp_path / "b", (4.7e-9, -3.5e-9))
    target = _norms(tmp_path / "t", (2.3e-9, -1.7e-9))  # another summation order: other noise, half as large
    result = compare(target, baseline)
    assert result.passed, result.first_divergence
    noisy = [r for r in result.rows if r.row.startswith("Torch.linalg.vector_norm.2.")]
    assert noisy and all(r.status == "warning" and "rounding noise" in r.reason for r in noisy)
    # a gradient as large as the others, off by as much, fails: it is no noise
    target = _norms(tmp_path / "t2", (0.5, -0.5), other=0.5)
    baseline = _norms(tmp_path / "b2", (0.25, -0.25), other=0.5)
    assert not compare(target, baseline).passed


def test_the_tensors_of_one_list_argument_are_siblings(tmp_path: Path) -> None:
    """torch.stack of clipping's norms: the key bias's norm, rounding noise, beside the others in one list."""

    def stacked(folder: Path, noise: float) -> Path:
        items = [tensor([], v, v, v, v) for v in (0.5, 0.4, noise, 0.3)]
        data = {
            "Torch.stack.0.forward": {
                "input_args": [items],
                "input_kwargs": {},
                "output": [tensor([4], noise, 0.5, (1.2 + noise) / 4, 0.7071)],
            }
        }
        write_dump(folder, data)
        return folder

    result = compare(stacked(tmp_path / "t", 4.6e-9), stacked(tmp_path / "b", 1.03e-8))
    assert result.passed, result.first_divergence
    row = next(r for r in result.rows if r.row == "Torch.stack.0.forward.input.0.2")
    assert row.status == WARNING and "rounding noise" in row.reason
