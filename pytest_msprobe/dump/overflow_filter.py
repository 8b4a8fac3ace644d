"""Task ``overflow_check``: of a step's records, keep those of the calls whose outputs hold inf or nan.

The step is recorded as for task ``statistics`` (statistics on the device, moved once per step); once they are
on the host, the records whose outputs (a forward call's output, a backward record's outgoing gradients, a
module's parameter gradients) have a Max or Min that is inf or nan, or a Mean or Norm that is nan, are kept whole,
inputs included, and every other record is left out. No host sync is added per call: the choice is a pass over
numbers already on the host.

``overflow_nums`` is msprobe's setting: how many overflowing calls the dump keeps, over all its steps, before it
keeps no more (-1: all of them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from pytest_msprobe.format.names import is_parameters_grad

_STATS = ("Max", "Min")


def holds_nonfinite(node: Any) -> bool:
    """Whether a record item (or nested items) holds inf or nan by its statistics.

    Max and Min are exact: one of them is inf or nan exactly when the tensor holds such a value. A Mean or
    Norm that is nan says so too; an infinite Norm of finite values (a float32 accumulation that overflowed)
    does not.
    """
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            for key in _STATS:
                value = node.get(key)
                if isinstance(value, float) and not math.isfinite(value):
                    return True
            for key in ("Mean", "Norm"):
                value = node.get(key)
                if isinstance(value, float) and math.isnan(value):
                    return True
            return False
        return any(holds_nonfinite(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(holds_nonfinite(v) for v in node)
    return False


def overflows(name: str, entry: Any) -> bool:
    """Whether the record ``name`` is of a call whose outputs hold inf or nan."""
    if not isinstance(entry, dict):
        return False
    if is_parameters_grad(name):
        return holds_nonfinite(list(entry.values()))
    return holds_nonfinite(entry.get("output"))


def keep_overflows(data: Mapping[str, Any], limit: int) -> dict[str, Any]:
    """The records of ``data`` whose calls overflow, in their order, at most ``limit`` (-1: all)."""
    kept: dict[str, Any] = {}
    for name, entry in data.items():
        if limit != -1 and len(kept) >= limit:
            break
        if overflows(name, entry):
            kept[name] = entry
    return kept


def keep_stacks(stacks: Mapping[str, list[list[str]]], names: Iterable[str]) -> dict[str, list[list[str]]]:
    """stack.json's content (``{"0": [[names...], [lines...]]}``) reduced to the records ``names``."""
    wanted = set(names)
    out: dict[str, list[list[str]]] = {}
    for value in stacks.values():
        chosen = [n for n in value[0] if n in wanted]
        if chosen:
            out[str(len(out))] = [chosen, value[1]]
    return out
