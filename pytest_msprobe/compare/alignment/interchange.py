"""Independent calls of one API that ran in another order: paired by what they read, not by their counters.

A transformer may compute its q, k and v projections in any order: the numbers are the same, only the call
counters differ (``Functional.linear.0`` is q on the baseline and v on the target), so pairing by counter
compares q with v. Within a run of **interchangeable** pairs (paired calls of one API, forward, consecutive
among that API's pairs, whose tensors have the same dtypes and shapes on both sides), a pair whose inputs breach
(their statistics differ beyond the tolerance of the baseline's dtype: the weight of another projection) is
re-paired with a call of the run whose inputs match (within a tenth of it), both being the best for each other.
The statistics identify a tensor (a weight's Max, Min, Mean and Norm), so this works in every mode.

Module calls, whose names (path and counter) are their identity, that an ordered alignment left unpaired on
both sides under the same name are paired by name.

Outputs play no part: a fault in one of the calls changes what it computes, not what it reads, so it keeps its
counterpart and is named there. A pair whose inputs match, or differ everywhere alike (an error upstream), keeps
its partner. The backward records of re-paired calls follow their forward's pairing. Collectives are never
re-paired: their order is what pairs them across ranks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from pytest_msprobe.compare.dumps import INPUT, PARAMETER, TENSOR, VALUE, ApiEntry, Leaf
from pytest_msprobe.format.names import BACKWARD, FORWARD
from pytest_msprobe.thresholds import DEFAULT_DTYPE_TOLERANCES, is_integral, normalize_dtype

Pairs = list[tuple[int | None, int | None]]

MATCH = 0.1  # inputs within this fraction of their tolerance match (the first divergence's "clean" inputs)
WINDOW = 16  # how far apart in a run (in calls of the API) two calls may be re-paired


def pair_by_content(
    pairs: Pairs, target: Sequence[ApiEntry], baseline: Sequence[ApiEntry]
) -> tuple[Pairs, int]:
    """``pairs`` with interchangeable calls re-paired by their inputs, and how many forward calls were."""
    out, moved = _pair_modules_by_name(pairs, target, baseline)
    runs: dict[tuple[str, object], list[list[int]]] = {}  # (base, signature): runs of positions in ``out``
    last: dict[str, object] = {}
    for pos, (t, b) in enumerate(out):
        if t is None or b is None or not _maybe_forward(target[t].name):
            continue
        te, be = target[t], baseline[b]
        tp, bp = te.parts, be.parts
        if tp.direction != FORWARD or (tp.base, tp.direction) != (bp.base, bp.direction):
            continue
        if tp.base.startswith("Distributed.") or tp.counter is None:
            continue
        sig = _signature(te)
        if sig is None or sig != _signature(be):
            continue
        key = (tp.base, sig)
        groups = runs.setdefault(key, [])
        if last.get(tp.base) != sig or not groups:  # another signature between: a new run
            groups.append([])
        groups[-1].append(pos)
        last[tp.base] = sig
    bases = set()
    for (base, _), groups in runs.items():
        for run in groups:
            changed = _repair_run(run, out, target, baseline)
            if changed:
                moved += changed
                bases.add(base)
    if bases:
        _follow_backward(out, target, baseline, bases)
    return out, moved


def _pair_modules_by_name(
    pairs: Pairs, target: Sequence[ApiEntry], baseline: Sequence[ApiEntry]
) -> tuple[Pairs, int]:
    """Module calls left unpaired on both sides under the same name, paired (at the target's place).

    A module call's name is its path and its call counter, an identity: q, k and v modules that ran in another
    order are the same calls, which an ordered alignment cannot pair across each other."""
    left: dict[str, int] = {}
    for pos, (t, b) in enumerate(pairs):
        if t is None and b is not None and baseline[b].parts.module_style:
            left.setdefault(baseline[b].name, pos)
    if not left:
        return list(pairs), 0
    out = list(pairs)
    gone = set()
    moved = 0
    for pos, (t, b) in enumerate(pairs):
        if b is None and t is not None and target[t].parts.module_style and target[t].name in left:
            other = left.pop(target[t].name)
            out[pos] = (t, pairs[other][1])
            gone.add(other)
            moved += target[t].parts.direction == FORWARD
    return [p for pos, p in enumerate(out) if pos not in gone], moved


def _maybe_forward(name: str) -> bool:
    """Whether a name can be a forward call's (a cheap test before the name is parsed)."""
    return name.endswith(".forward") or ".forward." in name


def _signature(entry: ApiEntry) -> tuple[tuple[str, str | None, tuple[int, ...] | None], ...] | None:
    """The suffixes, dtypes and shapes of an entry's tensors (None without tensors)."""
    parts = tuple((leaf.suffix, leaf.dtype, leaf.shape) for leaf in entry.leaves if leaf.kind == TENSOR)
    return parts or None


@functools.lru_cache(maxsize=64)
def _tolerance(dtype: str | None) -> float:
    name = normalize_dtype(dtype)
    tol = DEFAULT_DTYPE_TOLERANCES.get("float32" if name is None or is_integral(name) else name)
    return tol.error if tol is not None and tol.error > 0 else DEFAULT_DTYPE_TOLERANCES["float32"].error


def input_distance(x: ApiEntry, y: ApiEntry) -> float | None:
    """How far apart the inputs of two calls are, in tolerances of the baseline's (``y``'s) dtypes: the largest
    scaled error of their statistics; inf for other plain values or items; None when nothing can be measured."""
    theirs = {leaf.suffix: leaf for leaf in y.leaves if leaf.role in (INPUT, PARAMETER)}
    mine = [leaf for leaf in x.leaves if leaf.role in (INPUT, PARAMETER)]
    if len(mine) != len(theirs):
        return math.inf
    worst: float | None = None
    for leaf in mine:
        other = theirs.get(leaf.suffix)
        if other is None or other.kind != leaf.kind:
            return math.inf
        if leaf.kind == VALUE:
            if leaf.value != other.value:
                return math.inf
            continue
        if leaf.kind != TENSOR:
            continue
        error = _tensor_distance(leaf, other)
        if error is not None:
            worst = error if worst is None else max(worst, error)
    return worst


def _tensor_distance(x: Leaf, y: Leaf) -> float | None:
    if x.shape != y.shape:
        return math.inf
    if (x.md5 is not None and x.md5 == y.md5) or (x.stats == y.stats and None not in x.stats):
        return 0.0
    error = _scaled_gap(x.stats, y.stats)
    return None if error is None else error / _tolerance(y.dtype)


def _scaled_gap(x: Sequence[float | None], y: Sequence[float | None]) -> float | None:
    """The largest scaled error of two records' (Max, Min, Mean, Norm): :func:`stat_metrics`'s ``error``, written
    out for the many pairs an alignment looks at."""
    top = max((abs(v) for v in (x[0], x[1], y[0], y[1]) if v is not None and math.isfinite(v)), default=0.0)
    norm = max((abs(v) for v in (x[3], y[3]) if v is not None and math.isfinite(v)), default=0.0)
    worst: float | None = None
    for i in range(4):
        a, b = x[i], y[i]
        if a is None or b is None:
            continue
        if not (math.isfinite(a) and math.isfinite(b)):
            gap = 0.0 if a == b or (math.isnan(a) and math.isnan(b)) else math.inf
        else:
            scale = norm if i == 3 else top
            gap = abs(a - b) / scale if scale > 0 else (0.0 if a == b else math.inf)
        worst = gap if worst is None else max(worst, gap)
    return worst


def _repair_run(run: list[int], out: Pairs, target: Sequence[ApiEntry], baseline: Sequence[ApiEntry]) -> int:
    """Re-pair the pairs of one run (positions in ``out``) whose inputs breach; the number re-paired."""
    if len(run) < 2:
        return 0
    t_of = [out[p][0] for p in run]
    b_of = [out[p][1] for p in run]
    bad = []
    for k, (t, b) in enumerate(zip(t_of, b_of)):
        assert t is not None and b is not None
        own = input_distance(target[t], baseline[b])
        if own is not None and own > 1.0:
            bad.append(k)
    if len(bad) < 2:
        return 0
    near: dict[tuple[int, int], float] = {}
    for i in bad:
        for j in bad:
            if i != j and abs(i - j) <= WINDOW:
                t, b = t_of[i], b_of[j]
                assert t is not None and b is not None
                d = input_distance(target[t], baseline[b])
                if d is not None and d <= MATCH:
                    near[(i, j)] = d
    best_t = {i: min((d, j) for (i2, j), d in near.items() if i2 == i)[1] for i in {i for i, _ in near}}
    best_b = {j: min((d, i) for (i, j2), d in near.items() if j2 == j)[1] for j in {j for _, j in near}}
    chosen = {i: j for i, j in best_t.items() if best_b.get(j) == i}  # each the other's best
    if not chosen:
        return 0
    free_t = [i for i in bad if i not in chosen]
    free_b = [j for j in bad if j not in chosen.values()]
    chosen.update(zip(free_t, free_b))  # the rest keep their order
    for i, j in chosen.items():
        out[run[i]] = (t_of[i], b_of[j])
    return sum(1 for i, j in chosen.items() if i != j)


def _follow_backward(
    out: Pairs, target: Sequence[ApiEntry], baseline: Sequence[ApiEntry], bases: set[str]
) -> None:
    """Pair the backward records of ``bases`` as their forward calls are paired (by call counter)."""
    forward: dict[str, dict[int, int]] = {base: {} for base in bases}
    backward: dict[str, list[int]] = {base: [] for base in bases}
    for pos, (t, b) in enumerate(out):
        if t is None or b is None:
            continue
        tp, bp = target[t].parts, baseline[b].parts
        if tp.base not in bases or bp.base != tp.base or tp.counter is None or bp.counter is None:
            continue
        if tp.direction == FORWARD:
            forward[tp.base][tp.counter] = bp.counter
        elif tp.direction == BACKWARD and bp.direction == BACKWARD:
            backward[tp.base].append(pos)
    for base, positions in backward.items():
        wanted = forward[base]
        pool = {baseline[b].parts.counter: b for _, b in (out[p] for p in positions) if b is not None}
        moves: dict[int, int] = {}
        for p in positions:
            t, b = out[p]
            assert t is not None and b is not None
            counter = target[t].parts.counter
            partner = wanted.get(counter) if counter is not None else None
            if partner is not None and partner != baseline[b].parts.counter and partner in pool:
                moves[p] = pool[partner]
        if not moves:
            continue
        # the baselines handed on go to the positions whose baselines were taken, in order
        taken = set(moves.values())
        given = [b for b in (out[p][1] for p in moves) if b is not None and b not in taken]
        for p in positions:
            if p not in moves and out[p][1] in taken and given:
                moves[p] = given.pop(0)
        for p, b in moves.items():
            out[p] = (out[p][0], b)
