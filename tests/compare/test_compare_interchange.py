"""Independent calls of one API that ran in another order, paired by what they read (synthetic entries)."""

from __future__ import annotations

from typing import Any

from pytest_msprobe.compare.alignment import align
from pytest_msprobe.compare.alignment.interchange import input_distance
from pytest_msprobe.compare.dumps.reader import ApiEntry, flatten_entry


def stats(
    top: float, mean: float = 0.01, norm: float = 3.0, shape: tuple[int, ...] = (8, 8)
) -> dict[str, Any]:
    return {
        "type": "torch.Tensor",
        "dtype": "torch.float32",
        "shape": list(shape),
        "Max": top,
        "Min": -top,
        "Mean": mean,
        "Norm": norm,
    }


X = stats(2.0, 0.0, 10.0, (4, 8))  # the input the three projections read
WEIGHTS = {"q": stats(0.35, 0.011, 1.6), "k": stats(0.34, -0.02, 1.5), "v": stats(0.33, 0.004, 1.7)}
OUTPUTS = {
    "q": stats(1.1, 0.1, 5.0, (4, 8)),
    "k": stats(1.2, 0.2, 6.0, (4, 8)),
    "v": stats(1.3, 0.3, 7.0, (4, 8)),
}


def projection(counter: int, which: str, index: int, output: dict[str, Any] | None = None) -> ApiEntry:
    name = f"Functional.linear.{counter}.forward"
    body = {"input_args": [X, WEIGHTS[which]], "input_kwargs": {}, "output": [output or OUTPUTS[which]]}
    return ApiEntry(name, index, tuple(flatten_entry(name, body)))


def backward(counter: int, which: str, index: int) -> ApiEntry:
    name = f"Functional.linear.{counter}.backward"
    grad = {"q": stats(0.1), "k": stats(0.2), "v": stats(0.3)}[which]
    body = {"input": [grad], "output": [grad]}
    return ApiEntry(name, index, tuple(flatten_entry(name, body)))


def run(order: str, faulty: str = "") -> list[ApiEntry]:
    """Forward projections in ``order``, then their backward records in reverse (as autograd runs them)."""
    out = []
    for counter, which in enumerate(order):
        output = stats(1.5, 0.5, 9.0, (4, 8)) if which == faulty else None
        out.append(projection(counter, which, len(out), output))
    for counter, which in reversed(list(enumerate(order))):
        out.append(backward(counter, which, len(out)))
    return out


def named(t: list[ApiEntry], b: list[ApiEntry]) -> list[tuple[str, str]]:
    return [(t[i].name, b[j].name) for i, j in align(t, b).pairs if i is not None and j is not None]


def test_calls_in_another_order_pair_by_their_inputs_forward_and_backward() -> None:
    target, baseline = run("vkq"), run("qkv")
    result = align(target, baseline)
    assert result.by_content == 2
    assert named(target, baseline) == [
        ("Functional.linear.0.forward", "Functional.linear.2.forward"),  # v
        ("Functional.linear.1.forward", "Functional.linear.1.forward"),  # k
        ("Functional.linear.2.forward", "Functional.linear.0.forward"),  # q
        ("Functional.linear.2.backward", "Functional.linear.0.backward"),
        ("Functional.linear.1.backward", "Functional.linear.1.backward"),
        ("Functional.linear.0.backward", "Functional.linear.2.backward"),
    ]


def test_a_call_whose_output_differs_keeps_its_counterpart() -> None:
    # a fault in q changes what q computes, not what it reads: q is still paired with q
    target, baseline = run("vkq", faulty="q"), run("qkv")
    assert ("Functional.linear.2.forward", "Functional.linear.0.forward") in named(target, baseline)
    target, baseline = run("qkv", faulty="q"), run("qkv")
    assert align(target, baseline).by_content == 0


def test_calls_whose_inputs_match_no_other_call_keep_their_counters() -> None:
    # an error upstream: every projection reads another x, and no other pairing reads the same
    other_x = stats(2.1, 0.0, 10.5, (4, 8))
    target = []
    for counter, which in enumerate("qkv"):
        body = {"input_args": [other_x, WEIGHTS[which]], "input_kwargs": {}, "output": [OUTPUTS[which]]}
        target.append(
            ApiEntry(
                f"Functional.linear.{counter}.forward",
                counter,
                tuple(flatten_entry(f"Functional.linear.{counter}.forward", body)),
            )
        )
    baseline = run("qkv")[:3]
    assert align(target, baseline).by_content == 0
    # weights that differ (a changed init): nothing matches, nothing moves
    changed = {"input_args": [X, stats(0.5, 0.0, 2.0)], "input_kwargs": {}, "output": [OUTPUTS["q"]]}
    target = [
        ApiEntry(
            "Functional.linear.0.forward", 0, tuple(flatten_entry("Functional.linear.0.forward", changed))
        ),
        *run("qkv")[1:3],
    ]
    assert align(target, baseline).by_content == 0


def test_calls_of_other_shapes_or_arguments_are_not_interchangeable() -> None:
    x = projection(0, "q", 0)
    wide = {
        "input_args": [stats(2.0, 0.0, 10.0, (4, 16)), WEIGHTS["q"]],
        "input_kwargs": {},
        "output": [OUTPUTS["q"]],
    }
    y = ApiEntry("Functional.linear.1.forward", 1, tuple(flatten_entry("Functional.linear.1.forward", wide)))
    assert input_distance(x, y) == float("inf")
    kw = {
        "input_args": [X, WEIGHTS["q"]],
        "input_kwargs": {"bias": {"type": "int", "value": 3}},
        "output": [],
    }
    z = ApiEntry("Functional.linear.1.forward", 1, tuple(flatten_entry("Functional.linear.1.forward", kw)))
    assert input_distance(x, z) == float("inf")
    assert input_distance(x, projection(2, "q", 2)) == 0.0


def test_module_calls_in_another_order_pair_by_name() -> None:
    def modules(order: str) -> list[ApiEntry]:
        out = []
        for which in order:
            name = f"Module.attn.{which}.Linear.forward.0"
            body = {"input_args": [X], "input_kwargs": {}, "output": [OUTPUTS[which]]}
            out.append(ApiEntry(name, len(out), tuple(flatten_entry(name, body))))
        return out

    target, baseline = modules("vkq"), modules("qkv")
    pairs = named(target, baseline)
    assert sorted(pairs) == sorted((n.name, n.name) for n in target)
    assert all(t is not None and b is not None for t, b in align(target, baseline).pairs)
