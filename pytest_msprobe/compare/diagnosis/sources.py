"""Sources: inputs that no recorded call made, read off the records alone.

A dump records calls, not tensors' origins. An input of a call that differs from the baseline's and that no
earlier recorded call (of its rank, at any compared step) gave as an output came from outside the recorded
calls: a weight, a buffer, the data, or the output of an operation neither tool records (``nn.LSTM``'s
``_VF`` call, a custom kernel). Such an input is where the error enters, at its first reader, whatever that
reader does with it. What it is, by the reader's slot and the record:

- ``parameter``: a weight's place of the call (a conv's or linear's ``weight`` and ``bias``, a norm's affine
  weights, an embedding's table, the weights list of a recurrent call where one is recorded);
- ``buffer``: a batch_norm's running statistics;
- ``data``: an input that does not require grad (the batch, a mask, a constant);
- ``unrecorded``: an input that requires grad in no weight's place: the output of an operation that was not
  recorded, or a parameter read directly (a cls token, a position embedding). Such an operation may compute
  from what the recorded calls before it gave: it is a source only where it differs at least ``ALONE`` (10)
  times more than any recorded call's output before it in the step.

"Made by a recorded call" is read from the target's statistics: the same dtype, element count, Max and Min
(which no view, reshape or transpose changes, and no summation order either), and Mean and Norm within a
relative 1e-5 (a reduction over another memory order may round them otherwise).

**Drift.** A step after the first (step 1 on, or a dump that starts mid-run) begins with what the steps before
left: weights, buffers, an optimizer's state, all of which differ, a little or much, after a fault or a rounding
difference in any step before, compared or not. From outside the recorded calls at such a step, only the data
(an input that does not require grad, read before the step's first backward call; after it, such an input is a
gradient autograd summed or an optimizer's state, never a source) is named as a source; every
other outside input drifts: when any of them differs at all, however little, none of them matches the baseline
(a weight whose statistics agree may differ in its elements): a call reading one is no place for the error to
enter, and its growth is measured from its other inputs and the drift's scale (the largest output error of a
call reading a drifting input before it). At the first step of
training (step 0, or a dump without steps) weights and buffers are the initial ones, and any of them that
differs is a source; so are they at a step whose step before is compared too (a whole run): whatever that
step's calls changed is in the compare, earlier, and a weight that no recorded call of it gave changed outside
them.

Whether a later step drifts is read from what it starts with: the weights, buffers and unrecorded outputs read
before its first backward call. When none of them differs, nothing drifts (a gradient autograd summed after
the backward, or an optimizer's state, differs by what this step did). When the first of them that differs
at all is read after others that match exactly, and the weights and buffers read after it differ at least
10x less (an earlier step's update moves every weight it reaches, the first layers' too), it is no drift
but a change since the step before (``changed``): made outside the recorded calls, or by the step before's
update of that one tensor. It is named at its first reader, after any call whose own error shows (the
update that changes it again), before any growth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pytest_msprobe.compare.diagnosis.rules import (
    BUFFER_SOURCE,
    DATA_SOURCE,
    PARAMETER_SOURCE,
    UNRECORDED_SOURCE,
)
from pytest_msprobe.compare.dumps import INPUT, OUTPUT, TENSOR, Leaf
from pytest_msprobe.compare.judging import ERROR, UNMATCHED, WEIGHT_INPUTS, ApiResult, RowResult
from pytest_msprobe.format.names import parse_name

PARAMETER, BUFFER, DATA, UNRECORDED = PARAMETER_SOURCE, BUFFER_SOURCE, DATA_SOURCE, UNRECORDED_SOURCE
_BUFFER_INPUTS = {"batch_norm": (".input.1", ".input.2", ".input.running_mean", ".input.running_var")}
# recurrent calls (``_VF.lstm`` and the like, where they are recorded) take their weights as one list
_RECURRENT = {"lstm": ".input.2.", "gru": ".input.2.", "rnn_tanh": ".input.2.", "rnn_relu": ".input.2."}
_REL = 1e-5  # how close a Mean or Norm must be to count as the same tensor's

# what each kind is, for the reason text
KIND_TEXT = {
    PARAMETER: "a weight",
    BUFFER: "a running statistic",
    DATA: "data (an input that does not require grad)",
    UNRECORDED: "the output of an operation that is not recorded, or a parameter read directly",
}


@dataclass(frozen=True)
class Source:
    """An input of call ``api_index`` (row ``row_index``) that no earlier recorded call made and that differs."""

    api_index: int
    row_index: int
    kind: str  # one of SOURCE_KINDS


@dataclass(frozen=True)
class Sources:
    """The sources of a compare, by call, and the rows of weights that drift (see the module docstring)."""

    by_call: dict[int, tuple[Source, ...]]
    drifting: frozenset[int]  # rows: weights that differ at a step whose weights drift
    changed: tuple[Source, ...] = ()  # at a later step, the one tensor it starts with that differs

    def first(self, apis: Sequence[ApiResult]) -> Source | None:
        """The source read first, in execution order."""
        found = [s for ss in self.by_call.values() for s in ss]
        return min(found, key=lambda s: (apis[s.api_index].order, s.row_index), default=None)


NO_SOURCES = Sources({}, frozenset())
# how much more than any other tensor a step starts with one must differ to be a change, not drift
ALONE = 10.0
# what such a change is, in words (the first divergence's reason, and the plain dumps' checklist difference)
CHANGED_SINCE = "it changed since the step before, outside the recorded calls or in that step's update of it"


def kind_of(api: str, leaf: Leaf) -> str:
    """What an input from outside the recorded calls is, by its slot in the call and its record."""
    op = parse_name(api).base.rpartition(".")[2]
    if leaf.suffix in _BUFFER_INPUTS.get(op, ()):
        return BUFFER
    if leaf.suffix in WEIGHT_INPUTS.get(op, ()) or (
        op in _RECURRENT and leaf.suffix.startswith(_RECURRENT[op])
    ):
        return PARAMETER
    return UNRECORDED if leaf.requires_grad else DATA


class _Made:
    """The target's tensors given as outputs so far, by a key no view changes."""

    def __init__(self) -> None:
        self._seen: dict[tuple[object, ...], list[tuple[float | None, float | None]]] = {}

    @staticmethod
    def _key(leaf: Leaf) -> tuple[object, ...] | None:
        if leaf.kind != TENSOR or leaf.shape is None or leaf.max is None or leaf.min is None:
            return None
        return (leaf.dtype, math.prod(leaf.shape), leaf.max, leaf.min)

    def add(self, leaf: Leaf) -> None:
        key = self._key(leaf)
        if key is not None:
            self._seen.setdefault(key, []).append((leaf.mean, leaf.norm))

    def __contains__(self, leaf: Leaf) -> bool:
        key = self._key(leaf)
        if key is None:
            return True  # nothing to tell it by: not claimed as a source
        return any(_close(m, leaf.mean) and _close(n, leaf.norm) for m, n in self._seen.get(key, ()))


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= _REL * max(abs(a), abs(b))


def find_sources(apis: Sequence[ApiResult], rows: Sequence[RowResult], differs: frozenset[int]) -> Sources:
    """The inputs from outside the recorded calls that differ (``differs``: rows that do not match the
    baseline), by call, and the rows that drift (see the module docstring)."""
    made: dict[int | None, _Made] = {}
    backward_seen: set[tuple[int | None, int | None]] = set()
    # the steps whose step before is compared too (of the same rank): what that step left is in the compare
    places = {(a.step, a.rank) for a in apis if a.step is not None}
    continued = {(s, r) for s, r in places if (s - 1, r) in places}
    by_call: dict[int, list[Source]] = {}
    # outside inputs of a later step: (reader, row, kind, read before the step's first backward)
    carried: dict[tuple[int | None, int | None], list[tuple[int, int, str, bool]]] = {}
    # the largest output error of the recorded calls so far, by step and rank: an unrecorded operation's
    # output that differs less than ALONE times it may be made from theirs
    so_far: dict[tuple[int | None, int | None], float] = {}
    for i in sorted(range(len(apis)), key=lambda i: apis[i].order):
        api = apis[i]
        seen = made.setdefault(api.rank, _Made())
        place = (api.step, api.rank)
        if api.direction == "backward":
            backward_seen.add(place)
        if api.status != UNMATCHED and api.direction == "forward":
            for j in api.rows:
                t = rows[j].target
                if rows[j].role != INPUT or t is None or t.kind != TENSOR or t in seen:
                    continue
                kind = kind_of(api.api, t)
                if kind == DATA and place not in backward_seen:  # the step's data: read, never drifts
                    if j in differs:
                        by_call.setdefault(i, []).append(Source(i, j, kind))
                elif (api.step not in (0, None) and place not in continued) or kind == DATA:
                    # what the steps before left (weights, buffers, an optimizer's state), or, after the
                    # step's backward, a gradient autograd summed
                    carried.setdefault(place, []).append((i, j, kind, place not in backward_seen))
                elif j in differs and (
                    kind != UNRECORDED or (rows[j].error or 0.0) >= ALONE * so_far.get(place, 0.0)
                ):
                    by_call.setdefault(i, []).append(Source(i, j, kind))
        for j in api.rows:
            leaf = rows[j].target
            if leaf is not None and rows[j].role == OUTPUT:
                seen.add(leaf)
                error = rows[j].error
                if api.status != UNMATCHED and error is not None and math.isfinite(error):
                    so_far[place] = max(so_far.get(place, 0.0), error)
    drifting: set[int] = set()
    changed: list[Source] = []
    for place, found in carried.items():
        if place[0] in (0, None) or place in continued:
            continue
        # what the step starts with decides whether it drifts; after its backward, a gradient autograd summed
        # or an optimizer's state differs with it, or by what this step did
        start = [(i, j, kind) for i, j, kind, before in found if before]
        if not any(rows[j].error for _, j, _ in start):
            continue
        alone = _changed_alone(rows, start)
        if alone is None:
            drifting.update(j for _, j, _, _ in found)
            continue
        changed.append(alone)
        own = _identity(rows, alone.row_index)
        drifting.update(
            j for _, j, _, before in found if before and rows[j].error and _identity(rows, j) != own
        )
    return Sources({i: tuple(ss) for i, ss in by_call.items()}, frozenset(drifting), tuple(changed))


def _changed_alone(rows: Sequence[RowResult], start: Sequence[tuple[int, int, str]]) -> Source | None:
    """The tensor a step starts with that changed since the step before, at its first reader: the first read
    that differs at all (everything read before it matches exactly), breaching, and ``ALONE`` times further
    off than any weight or buffer read after it (one tensor read by several calls counts once); None when
    there is none (the step drifts)."""
    errors: dict[object, float] = {}
    first: dict[object, Source] = {}
    breaches: set[object] = set()
    for i, j, kind in start:
        key = _identity(rows, j)
        errors[key] = max(errors.get(key, 0.0), rows[j].error or 0.0)
        first.setdefault(key, Source(i, j, kind))
        if rows[j].status == ERROR:
            breaches.add(key)
    ordered = list(first)  # by first read
    top = next((k for k in ordered if errors[k]), None)
    if top is None or top not in breaches or not math.isfinite(errors[top]):
        return None
    later = ordered[ordered.index(top) + 1 :]
    # (an unrecorded operation's output read later may be made from it, and grow: only weights and buffers)
    e2 = max((errors[k] for k in later if first[k].kind in (PARAMETER, BUFFER)), default=0.0)
    return first[top] if errors[top] >= ALONE * e2 else None


def _identity(rows: Sequence[RowResult], j: int) -> object:
    """What tells row ``j``'s target tensor from others (one tensor read by several calls, or as a view)."""
    leaf = rows[j].target
    key = _Made._key(leaf) if leaf is not None else None
    return key if key is not None else ("row", j)
