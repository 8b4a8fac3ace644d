"""The figures of an own error (:mod:`.standard`), computed fast: a step's outputs are judged while it runs.

A tensor pair is read block by block into buffers that stay in the cache (numpy's whole-array passes would each
go to memory, and allocate), in one pass; the blocks of a large tensor are shared among worker threads (as many
as torch's own: numpy lets go of the GIL in its loops). The blocks are taken in spans of a fixed size, whatever
the number of workers, and the sums of the spans added in their order: the figures are the same to the last bit
with one worker or sixteen.

The relative errors' floor needs the median magnitude, which is known only at the end: the pass brackets it
from a sample, counts the magnitudes below, at and within the bracket (the median is then selected among the
few within it: a partition of the whole array costs ~20 ns an element), and measures the relative errors
against the highest floor the bracket allows. They are exact for every element at or above that floor; those
below it are kept aside and measured again once the floor is known. When the median falls outside the bracket
(the sample missed it), a second pass measures them all. A block whose values are all equal to their replay's
(relu, max_pool2d, a gradient passed through) gives nothing but its magnitudes to the median.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import numpy as np
import torch

BLOCK = 1 << 15  # elements of a block
_SPAN = 4  # blocks of a span: the part of a tensor whose figures are summed on their own, then added in order
_SHARED = _SPAN * BLOCK  # tensors from this size on are shared among the workers
_SAMPLE = 1 << 13  # magnitudes sampled to bracket the median
_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass
class _Sums:
    """What the figures of a tensor pair and a pass over some of its blocks both add up."""

    max_abs: float = 0.0
    sum_sq: float = 0.0
    small_breaches: int = 0
    ulp_sum: float = 0.0
    max_rel: float = 0.0
    sum_rel: float = 0.0


@dataclass
class Figures(_Sums):
    """The figures of one tensor pair (of its finite elements)."""

    size: int = 0
    over: tuple[int, ...] = ()  # per bound: the elements whose relative error passes it
    finite: bool = True  # False: some value is not finite on a side (nothing else is filled in)


class _Bracket(NamedTuple):
    """Magnitudes that enclose the median of ``|r|`` (checked by the counts), and the floors they allow."""

    lo: float
    hi: float
    least: bool  # the floor is its least for any median up to hi: only that the median is, is counted
    floor_hi: float  # the highest floor a median within the bracket gives


@dataclass
class _Pass(_Sums):
    """What the pass over a range of blocks gives (with the relative errors against ``floor_hi``)."""

    over: list[int] = field(default_factory=list)
    inexact: list[int] = field(default_factory=list)  # starts of the blocks that differ from the replay
    unbracketed: list[int] = field(default_factory=list)  # starts of exact blocks whose magnitudes wait
    below: int = 0  # magnitudes under the median's bracket
    at_lo: int = 0  # magnitudes at its low end (least: up to its high end)
    inside: list[np.ndarray] = field(default_factory=list)  # magnitudes within it
    low: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (diff, magnitude) under floor_hi


def figures(
    d: np.ndarray,
    r: np.ndarray,
    small: tuple[float, float],
    rel_bounds: tuple[float, ...],
    floor_of: Callable[[float], float],
    ulp_type: Any,
) -> Figures:
    """The figures of ``d`` (as dumped: float64, float32 or float16) against ``r`` (float64), flat arrays.

    ``small``: (small-value bound, the absolute error allowed below it); ``rel_bounds``: the relative errors
    whose elements are counted; ``floor_of(median magnitude)``: the floor of the relative errors' denominator
    (non-decreasing); ``ulp_type``: the dtype whose ULPs the mean error is counted in (None: not counted).
    ``finite`` is False when some value is not finite on a side (or a difference overflows): judge the
    finite elements alone.
    """
    n = int(d.size)
    out = Figures(size=n, over=(0,) * len(rel_bounds))
    if not n:
        return out
    if n >= 4 * _SAMPLE:
        bracket = _bracket(r, floor_of)
    else:  # a small tensor: its median first, the plain way (cheap at this size), and its floor is known
        floor = floor_of(float(np.median(np.abs(r))))
        bracket = _Bracket(0.0, 0.0, True, floor)
    parts = _map(lambda span: _first(d, r, span, small, rel_bounds, ulp_type, bracket), _ranges(n))
    if any(p is None for p in parts):
        return Figures(size=n, over=out.over, finite=False)
    done = [p for p in parts if p is not None]
    out.max_abs = max(p.max_abs for p in done)
    if out.max_abs == 0.0:  # the replay's values exactly: every figure is 0
        return out
    out.sum_sq = sum(p.sum_sq for p in done)
    out.small_breaches = sum(p.small_breaches for p in done)
    out.ulp_sum = sum(p.ulp_sum for p in done)
    late = [start for p in done for start in p.unbracketed]
    if n >= 4 * _SAMPLE and late:  # blocks passed over while their range was exact: their magnitudes
        done.extend(_map(lambda starts: _bracket_blocks(r, starts, bracket), _split(late)))
    floor = _floor(r, bracket, done, floor_of) if n >= 4 * _SAMPLE else bracket.floor_hi
    if floor > bracket.floor_hi:  # the median is above the bracket: every relative error measured again
        seconds = _map(lambda p: _second(d, r, p.inexact, floor, rel_bounds), done)
        out.over = tuple(sum(s[0][i] for s in seconds) for i in range(len(rel_bounds)))
        out.max_rel = max(s[1] for s in seconds)
        out.sum_rel = sum(s[2] for s in seconds)
        return out
    over = [sum(p.over[i] for p in done if p.over) for i in range(len(rel_bounds))]
    out.max_rel = max(p.max_rel for p in done)
    out.sum_rel = sum(p.sum_rel for p in done)
    low = [pair for p in done for pair in p.low]
    if low and floor < bracket.floor_hi:  # those under floor_hi again, against the floor they have
        diff = np.concatenate([a for a, _ in low])
        magnitude = np.concatenate([m for _, m in low])
        provisional = diff / bracket.floor_hi
        exact = diff / np.maximum(magnitude, floor)
        over = [c - int(np.count_nonzero(provisional > b)) + int(np.count_nonzero(exact > b))
                for c, b in zip(over, rel_bounds)]  # fmt: skip
        out.sum_rel += float(exact.sum()) - float(provisional.sum())
        out.max_rel = max(out.max_rel, float(exact.max()))  # (a provisional one is never above its own)
    out.over = tuple(over)
    return out


class _Buffers:
    """The buffers of one thread, reused from block to block and from tensor to tensor (:func:`_buffers`)."""

    def __init__(self) -> None:
        width = BLOCK
        self.diff = np.empty(width)
        self.magnitude = np.empty(width)
        self.spare = np.empty(width)
        self.mask = np.empty(width, dtype=bool)
        self.mask2 = np.empty(width, dtype=bool)
        self.narrow: np.ndarray | None = None  # magnitudes in the dumped dtype (ULPs)
        self.exponents = np.empty(width, dtype=np.int64)

    def fill(self, d: np.ndarray, r: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
        """|d - r| and |r| of the block at ``start``."""
        stop = min(start + BLOCK, d.size)
        diff, magnitude = self.diff[: stop - start], self.magnitude[: stop - start]
        np.subtract(d[start:stop], r[start:stop], out=diff)
        np.abs(diff, out=diff)
        np.abs(r[start:stop], out=magnitude)
        return diff, magnitude

    def count_bracket(self, magnitude: np.ndarray, bracket: _Bracket, into: _Pass) -> None:
        """Count the magnitudes under the bracket and at its low end (the zeros of a relu, say: many), and keep
        those above it within it."""
        lo, hi, least, _ = bracket
        k = magnitude.size
        mask = self.mask[:k]
        if least:  # the floor is its least if the median is at most hi: count the magnitudes up to hi only
            into.at_lo += int(np.count_nonzero(np.less_equal(magnitude, hi, out=mask)))
            return
        into.below += int(np.count_nonzero(np.less(magnitude, lo, out=mask)))
        into.at_lo += int(np.count_nonzero(np.equal(magnitude, lo, out=mask)))
        np.greater(magnitude, lo, out=mask)
        np.logical_and(mask, np.less_equal(magnitude, hi, out=self.mask2[:k]), out=mask)
        into.inside.append(np.compress(mask, magnitude))  # (3x faster than magnitude[mask])

    def ulps(self, diff: np.ndarray, magnitude: np.ndarray, ulp_type: Any) -> float:
        """The sum of ``diff`` in ULPs of ``magnitude`` in ``ulp_type``, float32 or float16."""
        k = diff.size
        if ulp_type is not np.float32:  # as np.spacing gives them (NaN where the rounding overflows)
            if self.narrow is None or self.narrow.dtype != ulp_type:
                self.narrow = np.empty(self.diff.size, dtype=ulp_type)
            narrow = self.narrow[:k]
            narrow[...] = magnitude
            return float(np.divide(diff, np.spacing(narrow), out=self.spare[:k]).sum())  # (never 0)
        # float32: an ULP is 2^(E - 150) for a biased exponent E in 1..254 (2^-149 below), E the float64 one
        # less 896: the inverse is built as a float64 from the bits (np.spacing takes 4 ns an element); a value
        # that rounds up to the next power of two in float32 counts at the ULP below it, one beyond float32's
        # range at its last
        e = self.exponents[:k]
        np.right_shift(magnitude.view(np.int64), 52, out=e)
        np.clip(e, 896 + 1, 896 + 254, out=e)
        np.subtract(150 + 1023 + 896, e, out=e)
        np.left_shift(e, 52, out=e)
        return float(np.einsum("i,i->", diff, e.view(np.float64)))

    def relative(
        self, diff: np.ndarray, magnitude: np.ndarray, floor: float, rel_bounds: tuple[float, ...], into: Any
    ) -> None:
        """The relative errors against ``floor``, counted into ``into`` (over, max_rel, sum_rel). Overwrites
        both arrays."""
        rel = np.divide(diff, np.maximum(magnitude, floor, out=magnitude), out=diff)
        mask = self.mask[: rel.size]
        for i in sorted(
            range(len(rel_bounds)), key=lambda i: rel_bounds[i]
        ):  # none over the least: none over any
            count = int(np.count_nonzero(np.greater(rel, rel_bounds[i], out=mask)))
            into.over[i] += count
            if not count:
                break
        into.max_rel = max(into.max_rel, float(rel.max()))
        into.sum_rel += float(rel.sum())


def _first(
    d: np.ndarray,
    r: np.ndarray,
    span: range,
    small: tuple[float, float],
    rel_bounds: tuple[float, ...],
    ulp_type: Any,
    bracket: _Bracket,
) -> _Pass | None:
    """The pass over the blocks at ``span``; None when a value is not finite (or a difference overflows)."""
    out = _Pass(over=[0] * len(rel_bounds))
    buffers = _buffers()
    small_bound, small_abs = small
    median_wanted = d.size >= 4 * _SAMPLE
    floor_hi = bracket.floor_hi
    with np.errstate(invalid="ignore", over="ignore"):  # (per thread) inf - inf, an overflow: found below
        for start in span:
            diff, magnitude = buffers.fill(d, r, start)
            top = float(diff.max())
            if not math.isfinite(top):
                return None
            # the replay's values exactly: only the median needs its magnitudes, if anything does
            if top == 0.0:
                if median_wanted and out.inexact:
                    buffers.count_bracket(magnitude, bracket, out)
                elif median_wanted:
                    out.unbracketed.append(start)
                continue
            if median_wanted and not out.inexact and out.unbracketed:
                late, out.unbracketed = out.unbracketed, []
                _bracket_into(r, late, bracket, buffers, out)
                diff, magnitude = buffers.fill(d, r, start)
            out.inexact.append(start)
            out.max_abs = max(out.max_abs, top)
            out.sum_sq += float(np.einsum("i,i->", diff, diff))  # (np.dot: BLAS threads, which spin)
            mask = buffers.mask[: diff.size]
            if np.less(magnitude, small_bound, out=mask).any():
                out.small_breaches += int(np.count_nonzero(np.compress(mask, diff) > small_abs))
            if median_wanted:
                buffers.count_bracket(magnitude, bracket, out)
            if ulp_type is not None:  # the mean error in ULPs of the dumped dtype
                out.ulp_sum += buffers.ulps(diff, magnitude, ulp_type)
            if median_wanted and not bracket.least and np.less(magnitude, floor_hi, out=mask).any():
                out.low.append((np.compress(mask, diff), np.compress(mask, magnitude)))  # measured again
            buffers.relative(diff, magnitude, floor_hi, rel_bounds, out)
    return out


def _bracket_into(
    r: np.ndarray, starts: list[int], bracket: _Bracket, buffers: _Buffers, into: _Pass
) -> None:
    for start in starts:
        stop = min(start + BLOCK, r.size)
        magnitude = buffers.magnitude[: stop - start]
        np.abs(r[start:stop], out=magnitude)
        buffers.count_bracket(magnitude, bracket, into)


def _bracket_blocks(r: np.ndarray, starts: list[int], bracket: _Bracket) -> _Pass:
    out = _Pass()
    _bracket_into(r, starts, bracket, _buffers(), out)
    return out


_LOCAL = threading.local()


def _buffers() -> _Buffers:
    """The calling thread's buffers (made on its first use: fresh ones would be fresh pages each time)."""
    buffers = getattr(_LOCAL, "buffers", None)
    if buffers is None:
        buffers = _LOCAL.buffers = _Buffers()
    return cast(_Buffers, buffers)


def _bracket(r: np.ndarray, floor_of: Callable[[float], float]) -> _Bracket:
    # positions spread by the golden ratio: a regular stride would fall in step with a tensor's rows
    picks = (np.arange(min(_SAMPLE, r.size)) * _GOLDEN % 1.0 * r.size).astype(np.intp)
    sample = np.abs(r[picks])
    m = sample.size
    spread = 2 * int(math.sqrt(m)) + 8  # four standard deviations of the sample median's rank, and some
    ranks = [max(0, m // 2 - spread), min(m - 1, m // 2 + spread)]
    lo, hi = (float(v) for v in np.partition(sample, ranks)[ranks])
    least = floor_of(hi) == floor_of(0.0)
    return _Bracket(lo, hi, least, floor_of(hi))


def _floor(r: np.ndarray, bracket: _Bracket, parts: list[_Pass], floor_of: Callable[[float], float]) -> float:
    """``floor_of(np.median(|r|))``, the median selected within its bracket."""
    n = int(r.size)
    below = sum(p.below for p in parts)
    at_lo = below + sum(p.at_lo for p in parts)  # magnitudes up to the bracket's low end
    inside = [a for p in parts for a in p.inside]
    top = at_lo + sum(a.size for a in inside)  # ... up to its high end
    ranks = [(n - 1) // 2, n // 2]  # the middle one, or the middle two
    if bracket.least and ranks[1] < at_lo:  # (at_lo: those up to the top, here)
        return floor_of(0.0)  # the median is at most the top: the floor is its least
    if bracket.least or not below <= ranks[0] or not ranks[1] < top:
        return floor_of(float(np.median(np.abs(r))))
    above = [k - at_lo for k in ranks if k >= at_lo]
    middle = np.partition(np.concatenate(inside), above) if above else np.empty(0)
    a, b = (bracket.lo if k < at_lo else middle[k - at_lo] for k in ranks)
    return floor_of(float(a) if n % 2 else float(np.mean([a, b])))


def _second(
    d: np.ndarray, r: np.ndarray, starts: list[int], floor: float, rel_bounds: tuple[float, ...]
) -> tuple[list[int], float, float]:
    """(per bound, the elements whose relative error passes it; the largest; their sum) over the blocks at
    ``starts``, with the floor known: the measure when the median falls outside its bracket."""
    again = _Pass(over=[0] * len(rel_bounds))
    buffers = _buffers()
    for start in starts:
        diff, magnitude = buffers.fill(d, r, start)
        buffers.relative(diff, magnitude, floor, rel_bounds, again)
    return again.over, again.max_rel, again.sum_rel


# ------------------------------------------------------------------------------------------------ workers
_POOL: dict[str, Any] = {}  # the pool, its size and the process that made it (a forked child makes its own)
_POOL_LOCK = threading.Lock()


def _workers() -> int:
    return max(1, torch.get_num_threads())


def _ranges(n: int) -> list[range]:
    """The block starts of a tensor of ``n`` elements, in spans of :data:`_SPAN` blocks: a split that does not
    depend on the number of workers (floating-point sums depend on how they are split)."""
    starts = range(0, n, BLOCK)
    return [starts[i : i + _SPAN] for i in range(0, len(starts), _SPAN)]


def _split(items: Any) -> list[Any]:
    """``items`` in contiguous runs, one per worker."""
    k = min(_workers(), len(items))
    size = -(-len(items) // k)
    return [items[i : i + size] for i in range(0, len(items), size)]


def _map(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``[fn(item) for item in items]``, in order, the items shared among the workers in contiguous runs (the
    last run on this thread). Which worker takes an item changes nothing of its result."""
    runs = _split(items) if len(items) > 1 else [items]
    if len(runs) <= 1:
        return [fn(item) for item in items]
    pool = _pool()
    futures = [pool.submit(_each, fn, run) for run in runs[:-1]]
    last = _each(fn, runs[-1])
    return [out for f in futures for out in f.result()] + last


def _each(fn: Callable[[Any], Any], items: Any) -> list[Any]:
    return [fn(item) for item in items]


def _pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        key = (_workers(), os.getpid())
        if _POOL.get("key") != key:
            old = _POOL.get("pool")
            if old is not None and _POOL["key"][1] == key[1]:
                old.shutdown(wait=False)
            _POOL["pool"] = ThreadPoolExecutor(
                max_workers=key[0] - 1 or 1, thread_name_prefix="pytest-msprobe-judge"
            )
            _POOL["key"] = key
        return cast(ThreadPoolExecutor, _POOL["pool"])
