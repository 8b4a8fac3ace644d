"""Overflow: the first call whose output holds inf or nan, and where the inf/nan is first seen.

A record's tensor holds inf/nan when its Max or Min is inf or nan (they are exact, in every task: a tensor dump
carries them too), or its Mean or Norm is nan. A call *overflows* when one of its outputs does (a forward call's
output, a backward record's outgoing gradients, a module's parameter gradients); in a compare, only where the
baseline's same output does not (an overflow both runs have, such as a loss scaler's probe, is not the
target's), and a call only the target makes counts. Without a baseline (the self-check), two kinds of
infinity are not overflows: a fill the call was given as an argument (``masked_fill(mask, float('-inf'))``,
``torch.full(..., -inf)``) and, after one, the same infinities carried on by later calls (the scores plus a
``-inf`` mask); a nan is always counted. With a baseline, a fill it has too is no new overflow, and one it
lacks is the target's doing.

Where the first overflow is seen, as msprobe's guide sorts it (:data:`~pytest_msprobe.compare.result.OVERFLOW_PLACES`):

- ``parameter``: an input of the call that is a weight holds inf/nan already: a module's parameter (L0, mix),
  or at L1 an input in a weight's place (``linear``'s, ``conv2d``'s ``weight`` and ``bias``...), a tensor that
  a module record of the step lists as its parameter, or the target of an optimizer's in-place update. The
  weight was broken by the previous step's backward or update.
- ``input``: an input holds inf/nan that no recorded call of the step made (no earlier output has its
  statistics): a call that was not recorded made it (an operation outside the dumped API list or level, a
  tensor made in place, the data).
- ``output``: its inputs are finite (or hold only what an earlier recorded call gave them) and its output is
  not: this call is the suspect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pytest_msprobe.compare.dumps import OUTPUT, PARAMETER, TENSOR, VALUE, ApiEntry, Leaf
from pytest_msprobe.compare.judging.rows import (
    OVERFLOW_INPUT,
    OVERFLOW_OUTPUT,
    OVERFLOW_PARAMETER,
    ApiResult,
    Overflow,
    RowResult,
)
from pytest_msprobe.format.names import parse_name

# the largest finite value of the floating dtypes, for the reason text
DTYPE_MAX = {
    "float16": "65504",
    "bfloat16": "about 3.4e38, float32's range",
    "float32": "about 3.4e38",
    "float64": "about 1.8e308",
    "float8_e4m3fn": "448",
    "float8_e4m3fnuz": "240",
    "float8_e5m2": "57344",
    "float8_e5m2fnuz": "57344",
}

# the inputs of weight-taking APIs that are weights (positional and keyword), by API name
_CONV_LIKE = (".input.1", ".input.2", ".input.weight", ".input.bias")
_NORM_LIKE = (".input.2", ".input.3", ".input.weight", ".input.bias")
WEIGHT_INPUTS: dict[str, tuple[str, ...]] = {
    **{
        op: _CONV_LIKE
        for op in (
            "linear",
            "bilinear",
            "conv1d",
            "conv2d",
            "conv3d",
            "conv_transpose1d",
            "conv_transpose2d",
            "conv_transpose3d",
            "prelu",
        )
    },
    "embedding": (".input.1", ".input.weight"),
    "embedding_bag": (".input.1", ".input.weight"),
    "layer_norm": _NORM_LIKE,
    "group_norm": _NORM_LIKE,
    "rms_norm": (".input.2", ".input.weight"),
    "batch_norm": (".input.3", ".input.4", ".input.weight", ".input.bias"),
    "instance_norm": (".input.3", ".input.4", ".input.weight", ".input.bias"),
}


def nonfinite(leaf: Leaf | None) -> bool:
    """Whether a record holds inf or nan by its statistics (see the module docstring)."""
    if leaf is None or leaf.kind not in (TENSOR, VALUE):
        return False
    for value in (leaf.max, leaf.min):
        if value is not None and not math.isfinite(value):
            return True
    return any(v is not None and math.isnan(v) for v in (leaf.mean, leaf.norm))


def _has_nan(leaf: Leaf) -> bool:
    return any(v is not None and math.isnan(v) for v in leaf.stats)


def values_text(leaf: Leaf) -> str:
    """``Max inf, Min -inf``: the statistics of a record that are inf or nan."""
    named = list(zip(("Max", "Min", "Mean", "Norm"), leaf.stats))
    for chosen in (named[:2], named[2:]):
        parts = [
            f"{name} {value}" for name, value in chosen if value is not None and not math.isfinite(value)
        ]
        if parts:
            return ", ".join(parts)
    return "inf/nan"


def kinds_text(leaf: Leaf) -> str:
    """``inf``, ``-inf``, ``nan`` or ``inf and nan``: what a record holds."""
    found = []
    if leaf.max is not None and math.isinf(leaf.max) and leaf.max > 0:
        found.append("inf")
    if leaf.min is not None and math.isinf(leaf.min) and leaf.min < 0:
        found.append("-inf")
    if leaf.max is not None and math.isinf(leaf.max) and leaf.max < 0 and "-inf" not in found:
        found.append("-inf")
    if _has_nan(leaf):
        found.append("nan")
    return " and ".join(found) or "inf/nan"


def short_dtype(dtype: str | None) -> str:
    return (dtype or "").rsplit(".", 1)[-1]


def _signature(leaf: Leaf) -> tuple[object, ...]:
    # nan != nan: the statistics are compared by their text
    return (leaf.dtype, leaf.shape, *(repr(v) for v in leaf.stats))


@dataclass(frozen=True)
class CallView:
    """One call of a dump as the overflow check sees it: the target's records, each with the baseline's
    record of the same item where the baseline has the call (``None`` where it lacks it), and ``ref``, the
    caller's index of the call (and of each record: ``refs``)."""

    name: str
    step: int | None
    rank: int | None
    leaves: tuple[Leaf, ...]
    baseline: tuple[Leaf | None, ...]
    ref: int
    refs: tuple[int, ...]


@dataclass(frozen=True)
class Found:
    """Where the first overflow is (indices into the calls given and into the call's records)."""

    call: int
    where: str
    output: int  # the overflowing output record
    first: int  # the record that holds the inf/nan first (an input, a parameter or the output)
    source: str | None  # the recorded call that made the overflowing input, where one did
    reason: str


def _fill(call: CallView, out: Leaf) -> bool:
    """An infinity the call was given as an argument, and only that (no nan)."""
    if _has_nan(out):
        return False
    given = {
        leaf.value
        for leaf in call.leaves
        if leaf.role != OUTPUT
        and leaf.kind == VALUE
        and isinstance(leaf.value, float)
        and math.isinf(leaf.value)
    }
    return bool(given) and all(v in given for v in (out.max, out.min) if v is not None and math.isinf(v))


def _carried(call: CallView, out: Leaf) -> bool:
    """The same infinities as an input already holds, and no nan: carried on from a fill."""
    if _has_nan(out):
        return False
    ins = [leaf for leaf in call.leaves if leaf.role != OUTPUT and leaf.kind == TENSOR]
    for v in (out.max, out.min):
        if v is None or not math.isinf(v):
            continue
        if not any(v in (leaf.max, leaf.min) for leaf in ins):
            return False
    return True


def _new_outputs(call: CallView) -> list[int]:
    """The call's output records that hold inf/nan where the baseline's same record does not."""
    return [
        k
        for k, leaf in enumerate(call.leaves)
        if leaf.role == OUTPUT and nonfinite(leaf) and not nonfinite(call.baseline[k])
    ]


def find_overflow(calls: Sequence[CallView], fills: bool = False) -> Found | None:
    """The first call (in the order given: execution order) that overflows, and where (the module
    docstring's rules); None when none does. ``fills``: leave out the infinities of fills and those carried
    on from them (without a baseline; with one, a fill the baseline has too is no new overflow anyway, and
    one it lacks is the target's doing)."""
    filled: set[tuple[int | None, int | None]] = set()  # the dumps (step, rank) in which a fill was seen
    for n, call in enumerate(calls):
        new = _new_outputs(call)
        if not new:
            continue
        place = (call.step, call.rank)
        real = []
        for k in new:
            out = call.leaves[k]
            if not fills:
                real.append(k)
            elif _fill(call, out):
                filled.add(place)
            elif not (place in filled and _carried(call, out)):
                real.append(k)
        if not real:
            continue
        return _classify(calls, n, real[0])
    return None


def _classify(calls: Sequence[CallView], n: int, k: int) -> Found:
    call = calls[n]
    out = call.leaves[k]
    dtype = short_dtype(out.dtype)
    shown = f"{out.suffix}: {values_text(out)}, {dtype}" if dtype else f"{out.suffix}: {values_text(out)}"
    bad = [j for j, leaf in enumerate(call.leaves) if leaf.role != OUTPUT and nonfinite(leaf)]
    if not bad:
        limit = DTYPE_MAX.get(dtype)
        if _has_nan(out) and not (out.max is not None and math.isinf(out.max)):
            why = (
                f"its output holds {kinds_text(out)} ({shown}) while its inputs are finite: the nan appears here "
                "(an invalid operation such as 0/0, inf - inf, the log or square root of a negative number, or "
                "an overflow inside the kernel)"
            )
        else:
            why = f"its output holds {kinds_text(out)} ({shown}) while its inputs are finite: the overflow happens here"
            if limit:
                why += f" ({dtype}'s largest value is {limit})"
        return Found(n, OVERFLOW_OUTPUT, k, k, None, why)
    j = bad[0]
    x = call.leaves[j]
    held = f"{x.suffix}: {values_text(x)}, {short_dtype(x.dtype)}"
    same = [calls[m] for m in range(n) if (calls[m].step, calls[m].rank) == (call.step, call.rank)]
    if x.role == PARAMETER:
        why = (
            f"its parameter {x.suffix} holds {kinds_text(x)} already ({held}): the weight was broken before this "
            "step's forward, by the previous step's backward or optimizer update: look there"
        )
        return Found(n, OVERFLOW_PARAMETER, k, j, None, why)
    source = _producer(same, x)
    if source is not None:
        why = (
            f"its input {x.suffix} holds {kinds_text(x)} from {source} ({held}), which is no new overflow there "
            f"(a fill, or the baseline's too), and its output holds {kinds_text(out)} ({shown}): the new "
            f"{kinds_text(out)} appears here"
        )
        return Found(n, OVERFLOW_OUTPUT, k, k, source, why)
    if _is_weight(call, x, calls):
        why = (
            f"its input {x.suffix} is a weight that holds {kinds_text(x)} already ({held}): the weight was broken "
            "before this step's forward, by the previous step's backward or optimizer update: look there"
        )
        return Found(n, OVERFLOW_PARAMETER, k, j, None, why)
    why = (
        f"its input {x.suffix} holds {kinds_text(x)} already ({held}) and no recorded call made it: a call that "
        "was not recorded made it (an operation outside the dumped API list or level, a tensor made in place, "
        "or the data)"
    )
    return Found(n, OVERFLOW_INPUT, k, j, None, why)


def _producer(earlier: Sequence[CallView], x: Leaf) -> str | None:
    """The latest earlier call of the dump with an output of ``x``'s dtype, shape and statistics."""
    sig = _signature(x)
    for call in reversed(earlier):
        if any(leaf.role == OUTPUT and _signature(leaf) == sig for leaf in call.leaves):
            return call.name
    return None


def _in_place(name: str) -> bool:
    op = parse_name(name).base.rsplit(".", 1)[-1]
    return op.endswith("_") and not op.startswith("__")


def _updated(call: CallView, leaf: Leaf) -> bool:
    """Whether ``leaf`` is the target of an in-place call (what an optimizer updates), which requires grad."""
    return (
        _in_place(call.name)
        and leaf.requires_grad is True
        and (leaf.suffix == ".input.0" or leaf.suffix.startswith(".input.0."))
    )


def _is_weight(call: CallView, x: Leaf, calls: Sequence[CallView]) -> bool:
    """Whether input ``x`` of ``call`` is a weight: see the module docstring."""
    if x.requires_grad is False:
        return False
    if _updated(call, x):
        return True
    op = parse_name(call.name).base.rsplit(".", 1)[-1]
    if x.suffix in WEIGHT_INPUTS.get(op, ()):
        return True
    sig = _signature(x)
    for other in calls:
        if (other.step, other.rank) != (call.step, call.rank):
            continue
        for leaf in other.leaves:
            if _signature(leaf) != sig:
                continue
            if leaf.role == PARAMETER or _updated(other, leaf):
                return True
    return False


# ------------------------------------------------------------------------------------------------ adapters
def compare_overflow(apis: Sequence[ApiResult], rows: Sequence[RowResult]) -> Overflow | None:
    """The first call of a compare that overflows on the target and not on the baseline (execution order over
    steps and ranks), as an :class:`~pytest_msprobe.compare.result.Overflow` pointing into ``apis`` and ``rows``."""
    views = []
    for i in sorted(range(len(apis)), key=lambda i: apis[i].order):
        api = apis[i]
        mine = [j for j in api.rows if rows[j].target is not None]
        if not mine:
            continue  # a call only the baseline makes
        leaves = tuple(rows[j].target for j in mine)
        views.append(
            CallView(
                api.api,
                api.step,
                api.rank,
                leaves,  # type: ignore[arg-type]
                tuple(rows[j].baseline for j in mine),
                i,
                tuple(mine),
            )
        )
    found = find_overflow(views)
    if found is None:
        return None
    call = views[found.call]
    reason = found.reason
    base = call.baseline[found.output]
    if base is not None and base.kind == TENSOR:
        shown = ", ".join(f"{n} {v:.6g}" for n, v in (("Max", base.max), ("Min", base.min)) if v is not None)
        reason += f"; the baseline's is finite ({shown})" if shown else "; the baseline's is finite"
    return _overflow(call, found, reason, call.ref, call.refs[found.first])


def dump_overflow(calls: Sequence[CallView]) -> Overflow | None:
    """The first call of a dump (no baseline: ``CallView.baseline`` all None) that overflows."""
    found = find_overflow(calls, fills=True)
    if found is None:
        return None
    call = calls[found.call]
    return _overflow(call, found, found.reason, None, None)


def entry_views(entries: Sequence[ApiEntry], step: int | None, rank: int | None) -> list[CallView]:
    """The calls of one parsed dump.json, without a baseline."""
    return [
        CallView(e.name, step, rank, e.leaves, (None,) * len(e.leaves), e.index, tuple(range(len(e.leaves))))
        for e in entries
    ]


def _overflow(
    call: CallView, found: Found, reason: str, api_index: int | None, row_index: int | None
) -> Overflow:
    out = call.leaves[found.output]
    return Overflow(
        api=call.name,
        step=call.step,
        rank=call.rank,
        where=found.where,
        row=call.leaves[found.first].name,
        output_row=out.name,
        values=values_text(call.leaves[found.first]),
        dtype=call.leaves[found.first].dtype,
        reason=reason,
        api_index=api_index,
        row_index=row_index,
        source=found.source,
    )
