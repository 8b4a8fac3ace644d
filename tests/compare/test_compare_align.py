"""Alignment of two dumps' calls: names when they agree, an ordered alignment when they do not."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msprobe.compare.alignment.align import MAX_EDITS, align
from pytest_msprobe.compare.alignment.editscript import myers as _myers
from pytest_msprobe.compare.dumps.reader import ApiEntry, flatten_entry


def entry(name: str, index: int = 0, shape: tuple[int, ...] = (4,), value: float = 1.0) -> ApiEntry:
    item = {
        "type": "torch.Tensor",
        "dtype": "torch.float32",
        "shape": list(shape),
        "Max": value,
        "Min": -value,
        "Mean": 0.0,
        "Norm": 2 * value,
    }
    if ".parameters_grad" in name:
        body: dict[str, object] = {"weight": [item]}
    elif name.endswith("backward") or ".backward." in name:
        body = {"input": [item], "output": [item]}
    else:
        body = {"input_args": [item], "input_kwargs": {}, "output": [item]}
    return ApiEntry(name, index, tuple(flatten_entry(name, body)))


def entries(*names: str) -> list[ApiEntry]:
    return [entry(n, i) for i, n in enumerate(names)]


def named_pairs(
    t: list[ApiEntry], b: list[ApiEntry], fuzzy: bool = False
) -> list[tuple[str | None, str | None]]:
    result = align(t, b, fuzzy=fuzzy)
    return [
        (t[i].name if i is not None else None, b[j].name if j is not None else None) for i, j in result.pairs
    ]


def test_identical_names_pair_by_name() -> None:
    t = entries("Functional.conv2d.0.forward", "Functional.relu.0.forward")
    result = align(t, entries("Functional.conv2d.0.forward", "Functional.relu.0.forward"))
    assert result.method == "names" and result.pairs == ((0, 0), (1, 1))
    assert (result.matched, result.target_only, result.baseline_only) == (2, 0, 0)


def test_an_extra_call_renumbers_the_rest_but_they_still_pair_in_order() -> None:
    t = entries(
        "Functional.relu.0.forward",
        "Functional.conv2d.0.forward",
        "Functional.relu.1.forward",  # the extra one
        "Functional.relu.2.forward",
        "Functional.relu.3.forward",
    )
    t[2] = entry("Functional.relu.1.forward", 2, shape=(9,))
    b = entries(
        "Functional.relu.0.forward",
        "Functional.conv2d.0.forward",
        "Functional.relu.1.forward",
        "Functional.relu.2.forward",
    )
    pairs = named_pairs(t, b)
    assert ("Functional.relu.1.forward", None) in pairs
    assert ("Functional.relu.2.forward", "Functional.relu.1.forward") in pairs
    assert ("Functional.relu.3.forward", "Functional.relu.2.forward") in pairs
    assert align(t, b).method == "ordered"


def test_apis_one_side_never_calls_are_set_aside() -> None:
    t = entries("Functional.linear.0.forward", "Torch.flatten.0.forward", "Functional.relu.0.forward")
    b = entries("Functional.linear.0.forward", "Functional.relu.0.forward")
    assert named_pairs(t, b) == [
        ("Functional.linear.0.forward", "Functional.linear.0.forward"),
        ("Torch.flatten.0.forward", None),
        ("Functional.relu.0.forward", "Functional.relu.0.forward"),
    ]


def test_baseline_only_calls_keep_their_place() -> None:
    t = entries("A.x.0.forward", "A.z.0.forward")
    b = entries("A.x.0.forward", "A.y.0.forward", "A.z.0.forward")
    assert named_pairs(t, b) == [
        ("A.x.0.forward", "A.x.0.forward"),
        (None, "A.y.0.forward"),
        ("A.z.0.forward", "A.z.0.forward"),
    ]


def test_forward_and_backward_of_the_same_api_never_pair() -> None:
    t = entries("Functional.relu.0.forward", "Functional.relu.0.backward")
    b = entries("Functional.relu.0.backward")
    assert named_pairs(t, b) == [
        ("Functional.relu.0.forward", None),
        ("Functional.relu.0.backward", "Functional.relu.0.backward"),
    ]


def test_parameter_gradients_pair_by_module_wherever_the_versions_put_them() -> None:
    # 8.3.3: after the module's forward, unnumbered; 26.x: in backward order, numbered
    t = entries(
        "Module.fc.Linear.forward.0",
        "Module.fc.Linear.parameters_grad",
        "Module.head.Linear.forward.0",
        "Module.head.Linear.parameters_grad",
        "Torch.flatten.0.forward",
        "Module.head.Linear.backward.0",
        "Module.fc.Linear.backward.0",
    )
    b = entries(
        "Module.fc.Linear.forward.0",
        "Module.head.Linear.forward.0",
        "Module.head.Linear.backward.0",
        "Module.head.Linear.parameters_grad.0",
        "Module.fc.Linear.backward.0",
        "Module.fc.Linear.parameters_grad.0",
    )
    pairs = named_pairs(t, b)
    assert ("Module.fc.Linear.parameters_grad", "Module.fc.Linear.parameters_grad.0") in pairs
    assert ("Module.head.Linear.parameters_grad", "Module.head.Linear.parameters_grad.0") in pairs
    assert [p[0] for p in pairs if p[0] is not None] == [e.name for e in t]  # target order kept
    assert sorted(p[1] for p in pairs if p[1] is not None) == sorted(e.name for e in b)  # each exactly once


def test_ties_go_to_the_call_with_the_same_shapes() -> None:
    t = [entry("Functional.relu.0.forward", 0, shape=(2,)), entry("Functional.relu.1.forward", 1, shape=(8,))]
    b = [entry("Functional.relu.0.forward", 0, shape=(8,))]
    assert named_pairs(t, b) == [
        ("Functional.relu.0.forward", None),
        ("Functional.relu.1.forward", "Functional.relu.0.forward"),
    ]


def test_ties_go_to_the_call_with_the_closest_statistics() -> None:
    t = [entry("Functional.relu.0.forward", 0, value=5.0), entry("Functional.relu.1.forward", 1, value=1.0)]
    b = [entry("Functional.relu.0.forward", 0, value=1.0)]
    assert named_pairs(t, b)[-1] == ("Functional.relu.1.forward", "Functional.relu.0.forward")


def test_fuzzy_pairs_leftovers_of_other_names_with_the_same_tensors() -> None:
    t = [
        entry("A.x.0.forward", 0),
        entry("Tensor.__add__.0.forward", 1, shape=(3,)),
        entry("A.z.0.forward", 2),
    ]
    b = [entry("A.x.0.forward", 0), entry("Torch.add.0.forward", 1, shape=(3,)), entry("A.z.0.forward", 2)]
    assert ("Tensor.__add__.0.forward", None) in named_pairs(t, b)
    assert ("Tensor.__add__.0.forward", "Torch.add.0.forward") in named_pairs(t, b, fuzzy=True)
    assert align(t, b, fuzzy=True).method == "fuzzy"
    # different tensors: left alone even in fuzzy mode
    b[1] = entry("Torch.add.0.forward", 1, shape=(5,))
    assert ("Tensor.__add__.0.forward", None) in named_pairs(t, b, fuzzy=True)


def test_too_different_dumps_fall_back_to_names() -> None:
    n = MAX_EDITS + 10
    t = [entry(f"A.t{i}.0.forward", i) for i in range(n)] + [entry("A.same.0.forward", n)]
    b = [entry("A.same.0.forward", 0), *[entry(f"A.t{i}.0.forward", i + 1) for i in range(n)][::-1]]
    result = align(t, b)
    assert result.method == "names"
    assert result.matched >= 1


def _lcs(a: list[int], b: list[int]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=25), st.lists(st.integers(0, 3), max_size=25))
def test_myers_finds_a_longest_common_subsequence(a: list[int], b: list[int]) -> None:
    matches = _myers(a, b, 10_000)
    assert matches is not None
    assert all(a[x] == b[y] for x, y in matches)
    assert all(p[0] < q[0] and p[1] < q[1] for p, q in zip(matches, matches[1:]))
    assert len(matches) == _lcs(a, b)


def test_myers_gives_up_past_its_edit_budget() -> None:
    assert _myers([1, 2, 3], [4, 5, 6], 2) is None
    assert _myers([1, 2, 3], [1, 2, 3], 0) == [(0, 0), (1, 1), (2, 2)]


def test_an_inserted_block_that_repeats_the_pattern_is_the_one_left_unmatched() -> None:
    """``conv, relu`` inserted before ``conv, relu``: the first calls have the right names to pair, so the
    first shortest edit script found pairs the inserted block with the base one (and every later block with
    the block before it); the statistics say which one is new."""
    base = [
        ("Functional.conv2d", 1.0),
        ("Functional.relu", 2.0),
        ("Functional.conv2d", 3.0),
        ("Functional.relu", 4.0),
    ]
    extra = [("Functional.conv2d", 9.0), ("Functional.relu", 8.0)]

    def build(calls: list[tuple[str, float]]) -> list[ApiEntry]:
        counters: dict[str, int] = {}
        out = []
        for i, (api, value) in enumerate(calls):
            counters[api] = counters.get(api, -1) + 1
            out.append(entry(f"{api}.{counters[api]}.forward", i, value=value))
        return out

    target, baseline = build(extra + base), build(base)
    result = align(target, baseline)
    assert result.pairs == ((0, None), (1, None), (2, 0), (3, 1), (4, 2), (5, 3))
    # the same block inserted in the middle, where the greedy prefix would pair it with the next block
    target = build(base[:2] + extra + base[2:])
    assert align(target, baseline).pairs == ((0, 0), (1, 1), (2, None), (3, None), (4, 2), (5, 3))
