"""Record names and counters, as msprobe spells them."""

from __future__ import annotations

import pytest

from pytest_msprobe.format import names as naming


def test_api_and_module_names() -> None:
    assert naming.api_name("Functional.conv2d", 0, "forward") == "Functional.conv2d.0.forward"
    base = naming.module_base("layer1.0.conv1", "Conv2d")
    assert base == "Module.layer1.0.conv1.Conv2d"
    assert naming.module_name(base, "backward", 3) == "Module.layer1.0.conv1.Conv2d.backward.3"
    assert naming.params_grad_name("Module.fc.Linear") == "Module.fc.Linear.parameters_grad"


@pytest.mark.parametrize(
    ("forward", "backward"),
    [
        ("Functional.conv2d.0.forward", "Functional.conv2d.0.backward"),
        ("Tensor.__add__.12.forward", "Tensor.__add__.12.backward"),
        ("Module.layer1.0.conv1.Conv2d.forward.2", "Module.layer1.0.conv1.Conv2d.backward.2"),
        # a module path may itself contain "forward"
        ("Module.forward.Linear.forward.0", "Module.forward.Linear.backward.0"),
    ],
)
def test_backward_of(forward: str, backward: str) -> None:
    assert naming.backward_of(forward) == backward


def test_counter_counts_per_name_and_resets() -> None:
    counter = naming.CallCounter()
    assert [counter.next("Functional.relu") for _ in range(3)] == [0, 1, 2]
    assert counter.next("Tensor.add_") == 0
    assert counter.next("Functional.relu") == 3
    counter.reset()
    assert counter.next("Functional.relu") == 0


@pytest.mark.parametrize(
    ("name", "items", "selected"),
    [
        ("Functional.relu.0.forward", ("relu",), True),
        ("Functional.relu6.0.forward", ("relu",), False),
        ("Functional.relu.0.backward", ("Functional.relu.0",), True),
        ("Functional.relu.10.forward", ("Functional.relu.1",), False),
        ("Functional.relu.0.backward", ("Functional.relu.0.forward",), False),
        ("Module.layer1.conv1.Conv2d.forward.0", ("Module.layer1",), True),
        ("Module.layer10.conv1.Conv2d.forward.0", ("Module.layer1",), False),
        ("Tensor.add_.3.forward", ("conv2d", "add_"), True),
    ],
)
def test_list_filter_matches_whole_parts(name: str, items: tuple[str, ...], selected: bool) -> None:
    assert naming.selected_by_list(name, items) is selected


def test_scope_key_drops_the_direction_of_api_names_only() -> None:
    assert naming.scope_key("Functional.conv2d.1.forward") == "Functional.conv2d.1"
    assert naming.scope_key("Functional.conv2d.1") == "Functional.conv2d.1"
    assert naming.scope_key("Module.fc.Linear.forward.0") == "Module.fc.Linear.forward.0"
