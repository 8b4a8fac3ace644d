"""The numerics settings in the checklist compare: a setting the two runs compute under differently is a cause
with a name, at the first call it changes.

Each side's settings are compared by what they do on its device (:func:`pytest_msprobe.format.numerics.
setting_states`), not by the raw flags: a CPU run's ``cudnn.allow_tf32`` changes nothing (the CPU has none), a
CUDA run's TF32 convolutions against a CPU run's float32 ones differ. A setting that differs is

- a failure (kind ``setting``), placed at the first call it changes: the earliest compared call, in execution
  order, of the kind it governs (convolutions, matmuls, half-type matmuls, autocast's calls, the
  nondeterministic ones; :data:`pytest_msprobe.format.numerics.CALLS`) with tensors of the dtype it changes;
- context marked ``expected`` where both runs compute a kind of call in a reduced format of their own device
  (CUDA's TF32 against the NPU's HF32, each opted in), or where a switch of how kernels compute (deterministic
  algorithms, cuDNN's deterministic and benchmark, cuBLAS's reduced reductions of half-type matmuls) differs
  between two device types, whose kernels differ anyway; against a device without such a switch (a CPU) it
  says nothing at all;
- context marked ``changes no recorded call`` where the calls it governs do not occur in the dumps (TF32
  matmuls in a model without matmuls).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_msprobe.compare.checklist.differences import SETTING, SWITCH, Difference
from pytest_msprobe.compare.dumps import TENSOR, Leaf, read_dump
from pytest_msprobe.compare.judging import UNMATCHED, ApiResult, RowResult
from pytest_msprobe.format.layout import DumpLocation
from pytest_msprobe.format.numerics import (
    CALLS,
    Aspect,
    Policy,
    SettingState,
    checklist_policy,
    operation,
    setting_states,
    switch_value,
)
from pytest_msprobe.thresholds import FLOATING, normalize_dtype

# a dump pair's two checklists with its step and rank
Read = tuple[Mapping[str, Any], Mapping[str, Any], int | None, int | None]


@dataclass(frozen=True)
class Call:
    """A call a setting may change: its record name, its dump pair, its place in execution order over the
    compare, the dtypes of its tensors on either side, and its index among the compare's calls (where it is
    one)."""

    name: str
    step: int | None
    rank: int | None
    order: int
    dtypes: frozenset[str]
    index: int | None = None


Calls = Callable[[], Sequence[Call]]  # made only when a setting differs: it reads every row


def compared_calls(apis: Sequence[ApiResult], rows: Sequence[RowResult]) -> Calls:
    """The compare's paired calls (a call one side only makes is not compared), as :class:`Call`."""

    def calls() -> list[Call]:
        return [
            Call(
                api.api,
                api.step,
                api.rank,
                api.order,
                _dtypes(s for j in api.rows for s in _sides(rows[j])),
                i,
            )
            for i, api in enumerate(apis)
            if api.status != UNMATCHED
        ]

    return calls


def recorded_calls(pairs: Sequence[tuple[DumpLocation, DumpLocation]]) -> Calls:
    """The calls of dump pairs (target, baseline) read without a compare: the target's records, in each dump's
    order (execution order), that the baseline records under the same name."""

    def calls() -> list[Call]:
        found: list[Call] = []
        for t_loc, b_loc in pairs:
            theirs = {entry.name: entry.leaves for entry in read_dump(b_loc).entries}
            for entry in read_dump(t_loc).entries:
                if entry.name in theirs:
                    leaves = (*entry.leaves, *theirs[entry.name])
                    found.append(Call(entry.name, t_loc.step, t_loc.rank, len(found), _dtypes(leaves)))
        return found

    return calls


def _sides(row: RowResult) -> tuple[Leaf | None, Leaf | None]:
    return row.target, row.baseline


def _dtypes(leaves: Iterable[Leaf | None]) -> frozenset[str]:
    return frozenset(
        str(normalize_dtype(leaf.dtype)) for leaf in leaves if leaf is not None and leaf.kind == TENSOR
    )


@dataclass
class _Differs:
    """An aspect that differs: both sides' states where it first does, and every dump pair where it does."""

    target: SettingState
    baseline: SettingState
    target_device: str
    baseline_device: str
    target_switches: Mapping[str, Any]
    baseline_switches: Mapping[str, Any]
    step: int | None
    rank: int | None
    places: set[tuple[int | None, int | None]] = field(default_factory=set)


@dataclass(frozen=True)
class SettingsCompare:
    """What the settings of the dump pairs say: the failing differences, the context, the checklist switches
    those differences speak for (their raw flags are not listed again), and each pair's two policies."""

    failing: tuple[Difference, ...]
    context: tuple[Difference, ...]
    covered: frozenset[str]
    policies: tuple[tuple[Policy, Policy], ...]


def compare_settings(reads: Sequence[Read], calls: Calls | None) -> SettingsCompare:
    """The settings of the dump pairs' checklists held to each other (see the module docstring). ``calls``
    makes the calls in which a setting's first changed call is looked for (:func:`compared_calls`,
    :func:`recorded_calls`); without them a differing setting fails without a call."""
    found: dict[str, _Differs] = {}
    policies: list[tuple[Policy, Policy]] = []
    for t_doc, b_doc, step, rank in reads:
        t_policy, b_policy = checklist_policy(t_doc), checklist_policy(b_doc)
        policies.append((t_policy, b_policy))
        t_switches, b_switches = _switches(t_doc), _switches(b_doc)
        t_states, b_states = setting_states(t_policy, t_switches), setting_states(b_policy, b_switches)
        for key, t in t_states.items():
            b = b_states[key]
            if t.state == b.state:
                continue
            if t.aspect.algorithm and (t.switch is None or b.switch is None):
                continue  # how kernels compute, against a device without the switch: its kernels are its own
            differs = found.setdefault(
                key, _Differs(t, b, t_policy.device, b_policy.device, t_switches, b_switches, step, rank)
            )
            differs.places.add((step, rank))
    failing: list[Difference] = []
    context: list[Difference] = []
    covered: set[str] = set()
    calls = functools.cache(calls) if calls is not None else None  # made once, for the first that needs them
    for differs in found.values():
        covered.update(differs.target.aspect.recorded)
        difference = _difference(differs, calls)
        (failing if difference.failing else context).append(difference)
    return SettingsCompare(tuple(failing), tuple(context), frozenset(covered), tuple(policies))


def _switches(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    switches = doc.get("switches")
    return switches if isinstance(switches, Mapping) else {}


def _difference(d: _Differs, calls: Calls | None) -> Difference:
    t, b = d.target, d.baseline
    aspect = t.aspect
    # the switch of the side that computes in its own reduced way (or the target's), as users name it
    first, second = (b, t) if b.reduced and not t.reduced else (t, b)
    name = first.switch or second.switch or aspect.key
    t_text = _value(t, name, d.target_device, d.target_switches)
    b_text = _value(b, name, d.baseline_device, d.baseline_switches)
    target = t_text if t_text is not None else f"none ({d.target_device})"
    baseline = b_text if b_text is not None else f"none ({d.baseline_device})"
    where = "; ".join(
        f"the {side}'s {device} has none" if text is None else f"{side} {text}"
        for side, text, device in (
            ("target", t_text, d.target_device),
            ("baseline", b_text, d.baseline_device),
        )
    )
    devices_differ = d.target_device != d.baseline_device
    if devices_differ and (aspect.algorithm or (t.reduced and b.reduced)):
        return Difference(
            SWITCH, name, None, d.rank, target, baseline, f"{target} vs {baseline}", expected=True
        )
    if calls is None:
        why = "the calls it changes were not looked at (the checklists alone were compared)"
        return Difference(SETTING, name, d.step, d.rank, target, baseline, why, where=where)
    call = first_changed_call(calls(), aspect, d.places)
    if call is None:
        return Difference(
            SWITCH, name, None, d.rank, target, baseline, f"{target} vs {baseline}", no_call=True
        )
    return Difference(
        SETTING,
        name,
        call.step,
        call.rank,
        target,
        baseline,
        f"{call.name} (step {call.step}) is the first call it changes",
        where=where,
        call=call.name,
        call_index=call.index,
    )


def _value(state: SettingState, name: str, device: str, switches: Mapping[str, Any]) -> str | None:
    """A side's value of the named switch where the switch acts on its device, else its own switch and value
    (an NPU's HF32 switch against CUDA's TF32 one); None where its device has none."""
    if state.switch is None:
        return None
    if state.switch == name:
        return state.value
    own = switch_value(name, device, switches)
    return own if own is not None else f"{state.switch} {state.value}"


def first_changed_call(
    calls: Sequence[Call], aspect: Aspect, places: Collection[tuple[int | None, int | None]]
) -> Call | None:
    """The earliest call (execution order) of a dump pair in ``places`` that ``aspect`` governs: of its kind,
    with a tensor of a dtype it changes on either side; None when there is none."""
    names = CALLS[aspect.calls]
    dtypes = frozenset(aspect.dtypes) or FLOATING
    best: Call | None = None
    for call in calls:
        if (call.step, call.rank) not in places or (best is not None and call.order >= best.order):
            continue
        if operation(call.name) in names and call.dtypes & dtypes:
            best = call
    return best
