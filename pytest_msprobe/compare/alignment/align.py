"""Pair the API calls of two dumps: exact names first, then an ordered alignment.

When both dumps hold the same sequence of names, calls pair by name. Otherwise names are not to be trusted:
one extra ``relu`` early in a run renumbers every later ``relu`` (``Functional.relu.3`` of one run is
``Functional.relu.2`` of the other), and msprobe 26.x leaves out low-risk APIs that 8.3.3 records. The calls
are then aligned in execution order on their names without the call counter (``Functional.relu.forward``)
with a shortest edit script (Myers' O(ND) diff): inserted and removed calls are left unmatched, the rest pair
up in order whatever their counters say. Among equally short alignments, each call pairs with the call
most like it (same tensor dtypes and shapes, then the closest statistics). APIs that one dump never calls are set aside first (they cannot pair).

``fuzzy`` also pairs the leftovers between two aligned calls one to one, in order, when their tensors have the
same dtypes and shapes although their names differ (``Tensor.__add__`` vs ``Torch.add``, a fused NPU API vs
its GPU counterpart).

Last, independent calls of one API that ran in another order (q, k and v projections) are paired by what they
read rather than by their counters (:mod:`pytest_msprobe.compare.alignment.interchange`).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pytest_msprobe.compare.alignment.editscript import best_script, myers, slide
from pytest_msprobe.compare.alignment.interchange import pair_by_content
from pytest_msprobe.compare.dumps import TENSOR, ApiEntry
from pytest_msprobe.compare.judging import stat_metrics
from pytest_msprobe.format.names import is_parameters_grad

# Beyond this many edits the dumps are too different for an ordered alignment to mean much (and it would be
# slow): calls pair by name instead.
MAX_EDITS = 2000


@dataclass(frozen=True)
class Alignment:
    """Pairs of entry indices (target, baseline) in report order; None on the side that lacks the call."""

    pairs: tuple[tuple[int | None, int | None], ...]
    method: str  # "names", "ordered" or "fuzzy"
    by_content: int = 0  # forward calls paired by their inputs rather than their counters (see interchange)

    @property
    def matched(self) -> int:
        return sum(1 for t, b in self.pairs if t is not None and b is not None)

    @property
    def target_only(self) -> int:
        return sum(1 for t, b in self.pairs if b is None)

    @property
    def baseline_only(self) -> int:
        return sum(1 for t, b in self.pairs if t is None)


def align_key(entry: ApiEntry) -> tuple[str, str | None]:
    parts = entry.parts
    return (parts.base, parts.direction)


def signature(entry: ApiEntry) -> tuple[Hashable, ...]:
    """The dtypes and shapes of an entry's tensors: what two calls of the same computation share."""
    return tuple((leaf.suffix, leaf.dtype, leaf.shape) for leaf in entry.leaves if leaf.kind == TENSOR)


def align(target: Sequence[ApiEntry], baseline: Sequence[ApiEntry], fuzzy: bool = False) -> Alignment:
    """The pairs of two dumps' entries (see the module docstring); interchangeable calls that ran in another
    order are then paired by content (:mod:`pytest_msprobe.compare.alignment.interchange`)."""
    if [e.name for e in target] == [e.name for e in baseline]:
        pairs, moved = pair_by_content([(i, i) for i in range(len(target))], target, baseline)
        return Alignment(tuple(pairs), "names", moved)
    # parameters_grad entries are named by module path, which is unique, but msprobe versions put them in
    # different places (8.3.3 after the module's forward, 26.x in backward order): pair them by name
    t_reg = [i for i, e in enumerate(target) if not is_parameters_grad(e.name)]
    b_reg = [j for j, e in enumerate(baseline) if not is_parameters_grad(e.name)]
    core, method = _align_ordered(target, baseline, t_reg, b_reg)
    if fuzzy:
        core, method = _fuzzy(core, target, baseline), "fuzzy"
    extras = _pair_parameters_grad(target, baseline)
    pairs, moved = pair_by_content(_insert(core, extras), target, baseline)
    return Alignment(tuple(pairs), method, moved)


def _align_ordered(
    target: Sequence[ApiEntry], baseline: Sequence[ApiEntry], t_reg: list[int], b_reg: list[int]
) -> tuple[list[tuple[int | None, int | None]], str]:
    t_keys = {i: align_key(target[i]) for i in t_reg}
    b_keys = {j: align_key(baseline[j]) for j in b_reg}
    common = set(t_keys.values()) & set(b_keys.values())
    t_idx = [i for i in t_reg if t_keys[i] in common]
    b_idx = [j for j in b_reg if b_keys[j] in common]
    codes: dict[tuple[str, str | None], int] = {}
    a = [codes.setdefault(t_keys[i], len(codes)) for i in t_idx]
    b = [codes.setdefault(b_keys[j], len(codes)) for j in b_idx]
    matches = myers(a, b, MAX_EDITS)
    if matches is None:
        return _merge(_by_name(target, baseline, t_reg, b_reg), t_reg, b_reg), "names"
    best = best_script(a, b, len(matches), lambda x, y: _score(target[t_idx[x]], baseline[b_idx[y]]))
    if best is not None:
        return _merge([(t_idx[x], b_idx[y]) for x, y in best], t_reg, b_reg), "ordered"
    # too many calls and edits for the exact search: repair the script found, locally
    matches = slide(matches, a, b, lambda x, y: _fit(target[t_idx[x]], baseline[b_idx[y]]))
    merged = _merge([(t_idx[x], b_idx[y]) for x, y in matches], t_reg, b_reg)
    return _resolve_runs(merged, target, baseline), "ordered"


def _pair_parameters_grad(
    target: Sequence[ApiEntry], baseline: Sequence[ApiEntry]
) -> list[tuple[int | None, int | None]]:
    by_base: dict[str, list[int]] = {}
    for j, e in enumerate(baseline):
        if is_parameters_grad(e.name):
            by_base.setdefault(e.parts.base, []).append(j)
    out: list[tuple[int | None, int | None]] = []
    for i, e in enumerate(target):
        if is_parameters_grad(e.name):
            queue = by_base.get(e.parts.base)
            out.append((i, queue.pop(0) if queue else None))
    out.extend((None, j) for queue in by_base.values() for j in queue)
    return out


def _insert(
    core: list[tuple[int | None, int | None]], extras: list[tuple[int | None, int | None]]
) -> list[tuple[int | None, int | None]]:
    """Place extra pairs after the core element holding the nearest earlier index of their own side."""
    if not extras:
        return core
    t_pos = [(t, p) for p, (t, _) in enumerate(core) if t is not None]
    b_pos = [(b, p) for p, (_, b) in enumerate(core) if b is not None]
    t_keys = [t for t, _ in t_pos]
    b_keys = [b for b, _ in b_pos]
    after: dict[int, list[tuple[int | None, int | None]]] = {}
    for t, b in sorted(extras, key=lambda x: (x[0] is None, x[0] if x[0] is not None else x[1])):
        if t is not None:
            k = bisect_left(t_keys, t)
            anchor = t_pos[k - 1][1] if k else -1
        else:
            assert b is not None
            k = bisect_left(b_keys, b)
            anchor = b_pos[k - 1][1] if k else -1
        after.setdefault(anchor, []).append((t, b))
    out = list(after.get(-1, []))
    for p, item in enumerate(core):
        out.append(item)
        out.extend(after.get(p, []))
    return out


def _by_name(
    target: Sequence[ApiEntry], baseline: Sequence[ApiEntry], t_reg: list[int], b_reg: list[int]
) -> list[tuple[int, int]]:
    where = {baseline[j].name: j for j in b_reg}
    pairs = []
    last = -1
    for i in t_reg:
        j = where.get(target[i].name)
        if j is not None and j > last:
            pairs.append((i, j))
            last = j
    return pairs


def _merge(
    pairs: list[tuple[int, int]], t_all: Sequence[int], b_all: Sequence[int]
) -> list[tuple[int | None, int | None]]:
    """Interleave matched pairs with the unmatched entries of both sides, keeping both orders."""
    out: list[tuple[int | None, int | None]] = []
    matched_t = {t for t, _ in pairs}
    matched_b = {b for _, b in pairs}
    t_rest = iter([i for i in t_all if i not in matched_t] + [None])
    b_rest = iter([j for j in b_all if j not in matched_b] + [None])
    next_t, next_b = next(t_rest), next(b_rest)
    for ti, bj in pairs:
        while next_t is not None and next_t < ti:
            out.append((next_t, None))
            next_t = next(t_rest)
        while next_b is not None and next_b < bj:
            out.append((None, next_b))
            next_b = next(b_rest)
        out.append((ti, bj))
    while next_t is not None:
        out.append((next_t, None))
        next_t = next(t_rest)
    while next_b is not None:
        out.append((None, next_b))
        next_b = next(b_rest)
    return out


def distance(x: ApiEntry, y: ApiEntry) -> float:
    """How far apart two calls' recorded statistics are (largest scaled error over their common tensors)."""
    theirs = {leaf.suffix: leaf for leaf in y.leaves if leaf.kind == TENSOR}
    worst = 0.0
    for leaf in x.leaves:
        other = theirs.get(leaf.suffix)
        if leaf.kind != TENSOR or other is None:
            continue
        if leaf.shape != other.shape:
            return math.inf
        error = stat_metrics(leaf.stats, other.stats).error
        if error is not None:
            worst = max(worst, error)
    return worst


def _score(x: ApiEntry, y: ApiEntry) -> float:
    """How well two calls of one API fit, in (0, 1]: half for the same tensor signature, half for how close
    their statistics are."""
    return (0.5 if signature(x) == signature(y) else 0.0) + 0.5 / (1.0 + min(distance(x, y), 1e6))


_RUN_LIMIT = 40_000  # largest m*n of a run of equal calls re-paired by dynamic programming


def _fit(x: ApiEntry, y: ApiEntry) -> tuple[int, float]:
    """Higher is better: same tensor signature first, then closer statistics."""
    return (int(signature(x) == signature(y)), -min(distance(x, y), 1e6))


def _resolve_runs(
    merged: list[tuple[int | None, int | None]],
    target: Sequence[ApiEntry],
    baseline: Sequence[ApiEntry],
) -> list[tuple[int | None, int | None]]:
    """Re-pair runs of calls of one API that contain an unmatched call, so that each call pairs with the
    call most like it.

    A shortest edit script does not say which of several consecutive ``relu`` calls is the inserted one; the
    one whose tensors (dtypes, shapes, then statistics) fit no baseline call is.
    """

    def key(item: tuple[int | None, int | None]) -> tuple[str, str | None]:
        t, b = item
        return align_key(target[t]) if t is not None else align_key(baseline[b])  # type: ignore[index]

    out: list[tuple[int | None, int | None]] = []
    start = 0
    while start < len(merged):
        stop = start + 1
        while stop < len(merged) and key(merged[stop]) == key(merged[start]):
            stop += 1
        run = merged[start:stop]
        start = stop
        t_run = [t for t, _ in run if t is not None]
        b_run = [b for _, b in run if b is not None]
        complete = all(t is not None and b is not None for t, b in run)
        if complete or not t_run or not b_run or len(t_run) * len(b_run) > _RUN_LIMIT:
            out.extend(run)
        else:
            out.extend(_best_pairing(t_run, b_run, target, baseline))
    return out


def _best_pairing(
    t_run: list[int], b_run: list[int], target: Sequence[ApiEntry], baseline: Sequence[ApiEntry]
) -> list[tuple[int | None, int | None]]:
    """Order-preserving pairing of two runs with as many pairs as possible and the best total fit."""
    m, n = len(t_run), len(b_run)
    fit = [[_fit(target[t], baseline[b]) for b in b_run] for t in t_run]
    # score[i][j]: best (pairs, same signatures, -distances) pairing t_run[i:] with b_run[j:]
    score = [[(0, 0, 0.0)] * (n + 1) for _ in range(m + 1)]
    for i in range(m - 1, -1, -1):
        for j in range(n - 1, -1, -1):
            rest = score[i + 1][j + 1]
            take = (rest[0] + 1, rest[1] + fit[i][j][0], rest[2] + fit[i][j][1])
            score[i][j] = max(take, score[i + 1][j], score[i][j + 1])
    out: list[tuple[int | None, int | None]] = []
    i = j = 0
    while i < m and j < n:
        rest = score[i + 1][j + 1]
        if score[i][j] == (rest[0] + 1, rest[1] + fit[i][j][0], rest[2] + fit[i][j][1]):
            out.append((t_run[i], b_run[j]))
            i, j = i + 1, j + 1
        elif score[i][j] == score[i + 1][j]:
            out.append((t_run[i], None))
            i += 1
        else:
            out.append((None, b_run[j]))
            j += 1
    out.extend((t, None) for t in t_run[i:])
    out.extend((None, b) for b in b_run[j:])
    return out


def _fuzzy(
    merged: list[tuple[int | None, int | None]], target: Sequence[ApiEntry], baseline: Sequence[ApiEntry]
) -> list[tuple[int | None, int | None]]:
    """Pair leftovers between aligned calls in order when their tensor signatures agree."""
    out: list[tuple[int | None, int | None]] = []
    gap_t: list[int] = []
    gap_b: list[int] = []

    def flush() -> None:
        jb = 0
        for i in gap_t:
            sig = signature(target[i])
            k = jb
            while k < len(gap_b) and not (sig and signature(baseline[gap_b[k]]) == sig):
                k += 1
            if k < len(gap_b):
                out.extend((None, j) for j in gap_b[jb:k])
                out.append((i, gap_b[k]))
                jb = k + 1
            else:
                out.append((i, None))
        out.extend((None, j) for j in gap_b[jb:])
        gap_t.clear()
        gap_b.clear()

    for t, b in merged:
        if t is not None and b is not None:
            flush()
            out.append((t, b))
        elif t is not None:
            gap_t.append(t)
        else:
            assert b is not None
            gap_b.append(b)
    flush()
    return out
