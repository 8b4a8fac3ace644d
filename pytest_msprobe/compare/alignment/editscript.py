"""Shortest edit scripts between two sequences of codes, and the best-fitting of the equally short ones.

:func:`myers` finds a shortest edit script (Myers' O(ND) diff) as the pairs it matches. Calls repeat, so a
shortest script is not unique: :func:`best_script` picks, among all of them, the one whose pairs fit best
(when the band of diagonals they use is small enough), and :func:`slide` repairs a script found by
:func:`myers` locally, sliding each run of unmatched items to where the pairs around it fit best. The
sequences are codes (equal codes may pair); how well two items fit is the caller's ``score`` or ``fit``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

_BAND_LIMIT = 400_000  # most cells of the exact search: (calls) x (edits + 1)


def myers(a: Sequence[int], b: Sequence[int], max_edits: int) -> list[tuple[int, int]] | None:
    """Matched index pairs of a shortest edit script from ``a`` to ``b``; None past ``max_edits`` edits."""
    # common prefix and suffix cost nothing and are by far the bulk of two runs of the same code
    n, m = len(a), len(b)
    head = 0
    while head < n and head < m and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < n - head and tail < m - head and a[n - 1 - tail] == b[m - 1 - tail]:
        tail += 1
    mid_a, mid_b = a[head : n - tail], b[head : m - tail]
    inner = _myers_core(mid_a, mid_b, max_edits)
    if inner is None:
        return None
    out = [(k, k) for k in range(head)]
    out.extend((x + head, y + head) for x, y in inner)
    out.extend((n - tail + k, m - tail + k) for k in range(tail))
    return out


def _myers_core(a: Sequence[int], b: Sequence[int], max_edits: int) -> list[tuple[int, int]] | None:
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return []
    limit = min(n + m, max_edits)
    offset = limit + 1
    v = [0] * (2 * limit + 3)
    trace: list[list[int]] = []
    for d in range(limit + 1):
        trace.append(v[offset - d - 1 : offset + d + 2])
        for k in range(-d, d + 1, 2):
            if k == -d or (k != d and v[offset + k - 1] < v[offset + k + 1]):
                x = v[offset + k + 1]
            else:
                x = v[offset + k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x += 1
                y += 1
            v[offset + k] = x
            if x >= n and y >= m:
                return _backtrack(trace, n, m, d)
    return None


def _backtrack(trace: list[list[int]], n: int, m: int, dmax: int) -> list[tuple[int, int]]:
    """Walk the saved frontiers back from (n, m), collecting the diagonal (matching) moves."""
    matches: list[tuple[int, int]] = []
    x, y = n, m
    for d in range(dmax, 0, -1):
        v = trace[d]  # frontier after step d-1; v[k + d + 1] is the furthest x on diagonal k

        k = x - y
        if k == -d or (k != d and v[k - 1 + d + 1] < v[k + 1 + d + 1]):
            prev_k = k + 1  # came down: a baseline-only entry
            x_start = v[prev_k + d + 1]
        else:
            prev_k = k - 1  # came right: a target-only entry
            x_start = v[prev_k + d + 1] + 1
        y_start = x_start - k
        while x > x_start and y > y_start:
            matches.append((x - 1, y - 1))
            x -= 1
            y -= 1
        x = v[prev_k + d + 1]
        y = x - prev_k
    while x > 0 and y > 0:
        matches.append((x - 1, y - 1))
        x -= 1
        y -= 1
    matches.reverse()
    return matches


def best_script(
    a: Sequence[int], b: Sequence[int], length: int, score: Callable[[int, int], float]
) -> list[tuple[int, int]] | None:
    """Of all the longest common subsequences of ``a`` and ``b`` (of ``length``), the one whose pairs fit best.

    Every shortest edit script has ``len(a) - length`` deletions and ``len(b) - length`` insertions, so it
    never leaves the band of diagonals between them: a dynamic program over that band finds the best of them
    in O((len(a) + len(b)) x edits). None when the band is too large (many calls and many edits).
    """
    n, m = len(a), len(b)
    only_a, only_b = n - length, m - length
    if (min(n, m) + 1) * (only_a + only_b + 1) > _BAND_LIMIT:
        return None
    weight = float(length + 1)  # one more pair outweighs any fit of all the pairs
    neg = -math.inf

    def lo(x: int) -> int:
        return max(0, x - only_a)

    def hi(x: int) -> int:
        return min(m, x + only_b)

    moves: list[bytearray] = [bytearray()] * (n + 1)  # 1: skip a[x], 2: skip b[y], 3: pair them
    below: list[float] = []
    for x in range(n, -1, -1):
        x_lo, x_hi = lo(x), hi(x)
        row = [neg] * (x_hi - x_lo + 1)
        move = bytearray(x_hi - x_lo + 1)
        n_lo, n_hi = lo(x + 1), hi(x + 1)
        for y in range(x_hi, x_lo - 1, -1):
            if x == n and y == m:
                row[y - x_lo] = 0.0
                continue
            value, how = neg, 0
            if x < n and n_lo <= y <= n_hi and below[y - n_lo] > value:
                value, how = below[y - n_lo], 1
            if y < x_hi and row[y + 1 - x_lo] > value:
                value, how = row[y + 1 - x_lo], 2
            if x < n and y < m and a[x] == b[y] and n_lo <= y + 1 <= n_hi and below[y + 1 - n_lo] > neg:
                paired = below[y + 1 - n_lo] + weight + score(x, y)
                if paired > value:
                    value, how = paired, 3
            row[y - x_lo] = value
            move[y - x_lo] = how
        moves[x] = move
        below = row
    pairs = []
    x = y = 0
    while x < n or y < m:
        how = moves[x][y - lo(x)]
        if how == 3:
            pairs.append((x, y))
            x, y = x + 1, y + 1
        elif how == 1:
            x += 1
        else:
            y += 1
    return pairs if len(pairs) == length else None


_SLIDE_LIMIT = 4096  # furthest a gap is slid, in calls


def slide(
    matches: list[tuple[int, int]],
    a: Sequence[int],
    b: Sequence[int],
    fit: Callable[[int, int], tuple[int, float]],
) -> list[tuple[int, int]]:
    """Move each run of calls only one side makes to where the pairs around it fit best.

    A shortest edit script is not unique when the calls repeat: an extra block ``relu, conv`` inserted into a
    run of ``relu, conv, relu, conv ...`` can be matched at its own place or, shifted by whole periods, as
    if every later block were the one inserted (each then pairs with the block before it: every call is
    compared with the wrong one). All those scripts differ only by where the run of unmatched calls sits, and
    sliding it by one call keeps the script valid whenever the call it passes has the name of the run's far
    end. Each run (of the target's unmatched calls, then of the baseline's) is slid to the position whose
    pairs fit best: same tensor signatures, then closest statistics; ties keep the position found.
    """
    t_match = [-1] * len(a)
    for x, y in matches:
        t_match[x] = y
    _slide_side(t_match, a, len(b), fit)
    b_match = [-1] * len(b)
    for x, y in enumerate(t_match):
        if y != -1:
            b_match[y] = x
    _slide_side(b_match, b, len(a), lambda y, x: fit(x, y))
    return sorted((x, y) for y, x in enumerate(b_match) if x != -1)


def _add(x: tuple[int, float], y: tuple[int, float], sign: int = 1) -> tuple[int, float]:
    return (x[0] + sign * y[0], x[1] + sign * y[1])


def _slide_side(
    match: list[int], codes: Sequence[int], other_len: int, fit: Callable[[int, int], tuple[int, float]]
) -> None:
    """:func:`slide` for the unmatched runs of one side (``match[x]``: the other side's index, or -1)."""
    n = len(match)
    x = 0
    while x < n:
        if match[x] != -1:
            x += 1
            continue
        p = x
        while x < n and match[x] == -1:
            x += 1
        k = x - p  # the run is [p, x)
        prev_y = match[p - 1] if p > 0 else -1
        next_y = match[x] if x < n else other_len
        if next_y != prev_y + 1:
            continue  # the other side has unmatched calls here too: left to the caller
        best, best_shift, score = (0, 0.0), 0, (0, 0.0)
        # up: the call before the run hands its partner to the run's last call
        j = 1
        while j <= _SLIDE_LIMIT and p - j >= 0 and match[p - j] == prev_y - j + 1 and prev_y - j + 1 >= 0:
            if codes[p - j] != codes[p + k - j]:
                break
            y = match[p - j]
            score = _add(_add(score, fit(p + k - j, y)), fit(p - j, y), -1)
            if score > best:
                best, best_shift = score, -j
            j += 1
        score = (0, 0.0)
        # down: the call after the run hands its partner to the run's first call
        j = 1
        while j <= _SLIDE_LIMIT and p + k + j - 1 < n and match[p + k + j - 1] == next_y + j - 1:
            if codes[p + j - 1] != codes[p + k + j - 1]:
                break
            y = match[p + k + j - 1]
            score = _add(_add(score, fit(p + j - 1, y)), fit(p + k + j - 1, y), -1)
            if score > best:
                best, best_shift = score, j
            j += 1
        if best_shift < 0:
            for j in range(1, -best_shift + 1):
                match[p + k - j], match[p - j] = match[p - j], -1
        elif best_shift > 0:
            for j in range(1, best_shift + 1):
                match[p + j - 1], match[p + k + j - 1] = match[p + k + j - 1], -1
            x = p + k + best_shift
        # (after an upward slide the run ends before x: scanning goes on from x)
