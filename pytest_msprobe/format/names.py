"""msprobe-compatible record names, built and parsed (one grammar), and the per-step call counters.

Names, as msprobe writes them:

- API forward / backward: ``{Prefix}.{api}.{n}.{forward|backward}`` (``Functional.conv2d.0.forward``), where
  ``n`` counts the calls of that API in the step;
- module forward / backward: ``Module.{dotted path}.{Class}.{forward|backward}.{n}``
  (``Module.layer1.0.conv1.Conv2d.forward.0``), ``n`` counting the calls of that module;
- parameter gradients: ``Module.{dotted path}.{Class}.parameters_grad``;
- tensor files (task ``tensor``): the row name plus ``.pt``: ``Functional.conv2d.0.forward.input.0.pt``,
  ``...forward.input.{kwarg}.pt``, nested ``...input.3.0.pt``, ``...backward.output.1.pt``,
  ``Module.fc.Linear.forward.0.parameters.weight.pt``, ``Module.fc.Linear.parameters_grad.weight.pt``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FORWARD = "forward"
BACKWARD = "backward"
PARAMS_GRAD = "parameters_grad"
MODULE_PREFIX = "Module"
OPTIMIZER_NODE = "optimizer"

# namespace key (as used by the interceptor) -> record prefix
PREFIXES: dict[str, str] = {
    "functional": "Functional",
    "tensor": "Tensor",
    "torch": "Torch",
    "vf": "VF",
    "npu": "NPU",
    "distributed": "Distributed",
    "distributed_c10d": "Distributed",
    "distributed_nn": "Distributed",
}


class CallCounter:
    """Counts calls per API (or module) name within one step: the ``n`` of every record name."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}  # read directly on the API hot path

    def next(self, key: str) -> int:
        """Return the index of this call of ``key`` (0 for the first) and advance the count."""
        counts = self.counts
        n = counts.get(key, 0)
        counts[key] = n + 1
        return n

    def reset(self) -> None:
        self.counts.clear()


def api_name(prefix_api: str, index: int, direction: str) -> str:
    """``api_name("Functional.conv2d", 0, "forward")`` -> ``"Functional.conv2d.0.forward"``."""
    return f"{prefix_api}.{index}.{direction}"


def module_base(path: str, cls_name: str) -> str:
    """``module_base("layer1.0.conv1", "Conv2d")`` -> ``"Module.layer1.0.conv1.Conv2d"``."""
    return f"{MODULE_PREFIX}.{path}.{cls_name}"


def module_name(base: str, direction: str, index: int) -> str:
    """``module_name("Module.fc.Linear", "forward", 0)`` -> ``"Module.fc.Linear.forward.0"``."""
    return f"{base}.{direction}.{index}"


def params_grad_name(base: str) -> str:
    """``params_grad_name("Module.fc.Linear")`` -> ``"Module.fc.Linear.parameters_grad"``."""
    return f"{base}.{PARAMS_GRAD}"


def backward_of(forward_name: str) -> str:
    """The backward record name that pairs with a forward record name (API or module)."""
    if forward_name.startswith(MODULE_PREFIX + "."):
        head, _, index = forward_name.rpartition(".")
        return f"{head[: -len(FORWARD)]}{BACKWARD}.{index}"
    return forward_name[: -len(FORWARD)] + BACKWARD


def selected_by_list(name: str, items: tuple[str, ...]) -> bool:
    """Whether a record name is selected by a ``list`` filter.

    An item selects the records whose name contains it as whole dot-separated parts: ``relu`` selects
    ``Functional.relu.0.forward`` (not ``relu6``), ``Functional.relu.0`` selects both directions of that call,
    ``Tensor.add_.3.forward`` only that record, ``Module.layer1`` every record of that module and its children.
    """
    dotted = f".{name}."
    return any(f".{item}." in dotted for item in items)


def scope_key(name: str) -> str:
    """The form of a name used to match ``scope`` bounds: the record name without its direction.

    ``Functional.conv2d.1.forward`` -> ``Functional.conv2d.1``; module names are kept whole.
    """
    if name.endswith("." + FORWARD) or name.endswith("." + BACKWARD):
        return name.rpartition(".")[0]
    return name


# ------------------------------------------------------------------------------------------------ parsing
_DIRECTION = f"(?P<dir>{FORWARD}|{BACKWARD})"
_API_NAME = re.compile(rf"^(?P<base>.+)\.(?P<n>\d+)\.{_DIRECTION}$")
_MODULE_NAME = re.compile(rf"^(?P<base>.+)\.{_DIRECTION}\.(?P<n>\d+)$")
# module records: ours and msprobe's for PyTorch (Module), msprobe's for MindSpore (Cell)
MODULE_PREFIXES = (f"{MODULE_PREFIX}.", "Cell.")


@dataclass(frozen=True)
class NameParts:
    """An entry name split into the call's identity, its per-step call counter and its direction."""

    base: str  # "Functional.relu", "Module.layer1.BasicBlock", "Module.fc.Linear.parameters_grad"
    counter: int | None
    direction: str | None  # "forward", "backward", or None for names of another shape
    module_style: bool = False  # counter after the direction (modules) rather than before it (APIs)

    def with_direction(self, direction: str) -> str:
        """The name of the same call in the other direction (forward <-> backward)."""
        if self.counter is None:
            return f"{self.base}.{direction}"
        if self.module_style:
            return module_name(self.base, direction, self.counter)
        return api_name(self.base, self.counter, direction)


def parse_name(name: str) -> NameParts:
    """Split ``Functional.relu.2.forward`` / ``Module.fc.Linear.backward.0`` / ``...parameters_grad``."""
    if is_parameters_grad(name):
        head, _, tail = name.rpartition(".")
        if tail.isdigit():
            return NameParts(head, int(tail), BACKWARD, module_style=True)
        return NameParts(name, None, BACKWARD)
    if name.startswith(MODULE_PREFIXES):
        m = _MODULE_NAME.match(name)
        if m:
            return NameParts(m.group("base"), int(m.group("n")), m.group("dir"), module_style=True)
    m = _API_NAME.match(name)
    if m:
        return NameParts(m.group("base"), int(m.group("n")), m.group("dir"))
    m = _MODULE_NAME.match(name)
    if m:
        return NameParts(m.group("base"), int(m.group("n")), m.group("dir"), module_style=True)
    return NameParts(name, None, None)


def is_parameters_grad(name: str) -> bool:
    """Whether a record is a module's parameter gradients (``...parameters_grad``, some versions add ``.N``)."""
    parts = name.split(".")
    return parts[-1] == PARAMS_GRAD or (len(parts) >= 2 and parts[-2] == PARAMS_GRAD)


def params_grad_module(base: str) -> str:
    """``params_grad_module("Module.fc.Linear.parameters_grad")`` -> ``"Module.fc.Linear"``."""
    return base.rsplit(f".{PARAMS_GRAD}", 1)[0]
