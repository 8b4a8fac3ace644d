"""Metrics of one compared row: msprobe's definitions, every edge case defined.

Tensor rows (task ``tensor``), both sides flattened:

=========================== ==================================================================================
Cosine                      n·b / (|n| |b|); 1.0 when both norms are <= float32 eps; undefined (None) when only
                            one is, or with fewer than 2 elements (0-d, length 1).
EucDist                     |n - b|₂
MaxAbsErr                   max |n - b|
MaxRelativeErr              max |n - b| / |b|, with |b| replaced by float32 eps where b == 0 (as msprobe 26.x)
One / Five Thousandths      share of elements whose relative error (as above) is < 0.001 / < 0.005
Err Ratio
RelL2Err (ours)             EucDist / max(|n|₂, |b|₂); 0 when both are zero
ScaledMaxAbsErr (ours)      MaxAbsErr / max(max|n|, max|b|); 0 when both are zero
=========================== ==================================================================================

**A fill that sets the scale.** A tensor whose largest values are a mask fill (``masked_fill(mask, -1e4)``,
``-1e9``, ``finfo.min``, or scores plus a ``-1e4`` mask) would have its differences measured against the fill: a
drift of 1% of the unmasked scores is 1e-6 of a -1e4 fill. A fill is found as the tensor is read: the baseline's
elements within a factor 2 of its largest magnitude, when every other element of both sides is at least
:data:`FILL_GAP` times smaller (and there are two or more: one is an outlier). RelL2Err and ScaledMaxAbsErr are
then also given for the values outside it (``rest_rel_l2``, ``rest_scaled_max_abs``), their differences against
their own size; the fill's own differences stay in the whole tensor's. NaN/Inf at the same places are set to 0
first (a ``-inf`` mask needs nothing more).

Edge cases: NaN/Inf at the same positions with the same values are set to 0 on both sides and the rest is
compared (``nonfinite="same"``); anywhere else no metric is given (``nonfinite="different"``). A shape
mismatch gives no metric. Empty tensors give no metric. int and bool are compared as floats. A 0-d tensor is
one element: every metric but Cosine is defined for it (msprobe leaves EucDist and the ratios out).

Statistics rows (task ``statistics``): ``diff = n - b`` for Max, Min, Mean and Norm; msprobe's relative error
``|diff| / |b|`` (None where b == 0) as a fraction (the reports write it as msprobe does, ``x 100`` then ``%``);
and ours, the **scaled error**: Max, Min and Mean differences divided by the tensor's range ``max(|Max|, |Min|)``
over both sides, the Norm difference by the larger Norm. The scale of a statistic that sits near zero (the mean
of a normalised output) is the tensor's range, not the statistic itself, so its tiny absolute noise does not
look like a huge relative error.

Float32 data is compared in float32 with float64 accumulation across blocks of 64 Ki elements: the metrics
agree with msprobe's float64 values to about 1e-6 relative, at a fraction of the cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pytest_msprobe.format.tensordata import TensorFile, compute_dtype

EPS = float(np.finfo(np.float32).eps)
BLOCK = 1 << 16
# a fill must be at least this many times every other value of its tensor (on both sides) to be set apart: a
# scale that includes it understates the other values' differences by as much
FILL_GAP = 64.0


@dataclass(frozen=True)
class TensorMetrics:
    """Metrics of a tensor pair; None where a metric is undefined (``note`` says why)."""

    cosine: float | None = None
    euc_dist: float | None = None
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    one_thousandth: float | None = None
    five_thousandths: float | None = None
    rel_l2: float | None = None
    scaled_max_abs: float | None = None
    nonfinite: str | None = None  # None, "same" or "different"
    numel: int = 0  # values compared (a complex element is two)
    note: str = ""
    shape_differs: bool = False  # the two tensors have other shapes: no metric at all
    # the baseline's value at the top of a fill that dominates every other value (see the module doc)
    fill: float | None = None
    fill_count: int = 0  # elements in the fill
    rest_rel_l2: float | None = None  # RelL2Err of the values outside the fill
    rest_scaled_max_abs: float | None = None  # ScaledMaxAbsErr of the values outside the fill

    @property
    def error(self) -> float | None:
        """The scaled error the verdict uses: RelL2Err, and that of the values outside the fill when there is one.

        The error of the tensor as a whole (its norm against the tensor's), not of its worst element: an
        element-wise operation that divides by a value near zero (Adam's ``m / (sqrt(v) + eps)`` for a weight
        whose gradient is rounding noise) turns rounding into a few elements far off on any two devices.
        """
        if self.rel_l2 is None:
            return None
        return self.rel_l2 if self.rest_rel_l2 is None else max(self.rel_l2, self.rest_rel_l2)

    @property
    def peak(self) -> float | None:
        """The worst element's scaled error: ScaledMaxAbsErr, and that of the values outside the fill."""
        if self.scaled_max_abs is None:
            return None
        if self.rest_scaled_max_abs is None:
            return self.scaled_max_abs
        return max(self.scaled_max_abs, self.rest_scaled_max_abs)


class _Acc:
    """Running sums of a tensor pair, block by block."""

    __slots__ = (
        "aa",
        "ab",
        "bb",
        "c1",
        "c5",
        "count",
        "dd",
        "fill",
        "fill_aa",
        "fill_bb",
        "fill_d",
        "fill_dd",
        "fill_low",
        "fill_n",
        "fill_top_a",
        "fill_value",
        "max_a",
        "max_abs",
        "max_b",
        "max_rel",
        "nonfinite",
        "rest_aa",
        "rest_bb",
        "rest_d",
        "rest_dd",
        "rest_top",
    )

    def __init__(self) -> None:
        self.aa = self.bb = self.dd = self.ab = 0.0
        self.max_abs = self.max_rel = self.max_a = self.max_b = 0.0
        self.c1 = self.c5 = self.count = 0
        self.nonfinite: str | None = None
        # the fill candidate: the baseline's largest magnitude so far and the elements within a factor 2 of it
        # (count, sums of squares of both sides and of the difference, largest difference, smallest baseline
        # and largest target magnitude, the baseline's value at the top); the same sums of every other element
        self.fill = self.fill_value = self.fill_aa = self.fill_bb = self.fill_dd = self.fill_d = 0.0
        self.fill_top_a, self.fill_low, self.fill_n = 0.0, math.inf, 0
        self.rest_aa = self.rest_bb = self.rest_dd = self.rest_d = self.rest_top = 0.0


def _as_blocks(x: TensorFile | np.ndarray, block: int) -> Iterator[np.ndarray]:
    if isinstance(x, TensorFile):
        yield from x.blocks(block)
        return
    flat = np.asarray(x)
    if flat.dtype.kind == "c":
        flat = np.ascontiguousarray(flat).view(flat.real.dtype)
    flat = flat.reshape(-1)
    target = (
        np.float32 if flat.dtype in (np.float32, np.float16, np.bool_, np.int8, np.uint8, np.int16) else None
    )
    for start in range(0, flat.size, block):
        part = flat[start : start + block]
        yield part.astype(target or np.float64, copy=False)


def _shape_dtype(x: TensorFile | np.ndarray) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(x, TensorFile):
        return x.shape, compute_dtype(x.dtype)
    arr = np.asarray(x)
    kind32 = arr.dtype in (np.float32, np.float16, np.bool_, np.int8, np.uint8, np.int16, np.complex64)
    return tuple(arr.shape), np.dtype(np.float32 if kind32 else np.float64)


def tensor_metrics(
    n: TensorFile | np.ndarray, b: TensorFile | np.ndarray, block: int = BLOCK
) -> TensorMetrics:
    """Compare two tensors (files or arrays), reading them block by block: one block pair in memory at a time."""
    n_shape, n_dt = _shape_dtype(n)
    b_shape, b_dt = _shape_dtype(b)
    if n_shape != b_shape:
        return TensorMetrics(note=f"shape differs: {list(n_shape)} vs {list(b_shape)}", shape_differs=True)
    numel = math.prod(n_shape)
    if numel == 0:
        return TensorMetrics(numel=0, note="empty tensor")
    work = np.dtype(np.float64) if np.float64 in (n_dt, b_dt) else np.dtype(np.float32)
    acc = _Acc()
    buf_d = buf_r = np.empty(0, dtype=work)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow in a float32 dot is handled, not an error
        for a, bb in zip(_as_blocks(n, block), _as_blocks(b, block)):
            a = a.astype(work, copy=False)
            bb = bb.astype(work, copy=False)
            if a.size > buf_d.size:  # (complex blocks hold two values per element)
                buf_d, buf_r = np.empty(a.size, dtype=work), np.empty(a.size, dtype=work)
            if not _block(acc, a, bb, buf_d[: a.size], buf_r[: a.size]):
                break
            acc.count += a.size
    if acc.nonfinite == "different":
        return TensorMetrics(
            nonfinite="different", numel=numel, note="NaN/Inf at different positions (or with other values)"
        )
    return _finish(acc, acc.count)


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    """``x . y`` of two flat arrays, by numpy's own loop: BLAS (``np.dot``) splits a long product over its
    threads, as many as the machine has CPUs or ``OPENBLAS_NUM_THREADS`` says, and a float64 sum split otherwise
    rounds otherwise. (It is also faster: BLAS wakes its threads for every block.)"""
    return float(np.einsum("i,i->", x, y))


def _block(acc: _Acc, a: np.ndarray, b: np.ndarray, d: np.ndarray, r: np.ndarray) -> bool:
    aa = _dot(a, a)
    bb = _dot(b, b)
    if not (math.isfinite(aa) and math.isfinite(bb)):
        fa, fb = np.isfinite(a), np.isfinite(b)
        if not fa.all() or not fb.all():
            same = np.array_equal(fa, fb) and np.array_equal(a[~fa], b[~fb], equal_nan=True)
            if not same:
                acc.nonfinite = "different"
                return False
            acc.nonfinite = "same"
            a = np.where(fa, a, 0)
            b = np.where(fb, b, 0)
        # large finite values can overflow a float32 dot: accumulate this block in float64
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        aa, bb, ab = _dot(a64, a64), _dot(b64, b64), _dot(a64, b64)
        d64 = a64 - b64
        dd = _dot(d64, d64)
        np.copyto(d, d64, casting="unsafe")
    else:
        ab = _dot(a, b)
        np.subtract(a, b, out=d)
        dd = _dot(d, d)
    acc.aa += aa
    acc.ab += ab
    acc.bb += bb
    acc.dd += dd
    top_a = max(float(a.max()), -float(a.min()))
    acc.max_a = max(acc.max_a, top_a)
    absb = np.abs(b, out=r)
    top_b = float(absb.max())
    acc.max_b = max(acc.max_b, top_b)
    np.abs(d, out=d)
    block_max = float(d.max())
    _track_fill(acc, a, b, absb, (aa, bb, dd), (top_a, top_b, block_max))
    if block_max == 0.0:  # identical block: every relative error is 0
        acc.c1 += a.size
        acc.c5 += a.size
        return True
    acc.max_abs = max(acc.max_abs, block_max)
    np.copyto(absb, EPS, where=absb == 0)
    rel = np.divide(d, absb, out=r)
    acc.max_rel = max(acc.max_rel, float(rel.max()))
    acc.c1 += int(np.count_nonzero(rel < 0.001))
    acc.c5 += int(np.count_nonzero(rel < 0.005))
    return True


def _track_fill(
    acc: _Acc,
    a: np.ndarray,
    b: np.ndarray,
    absb: np.ndarray,
    sums: tuple[float, float, float],
    tops: tuple[float, float, float],
) -> None:
    """Follow the fill candidate through one block (see :data:`FILL_GAP`): the elements whose baseline magnitude
    is within a factor 2 of the largest so far, when nothing else comes within :data:`FILL_GAP` of it.

    ``sums`` are the block's sums of squares (target, baseline, difference), ``tops`` its largest magnitudes
    (target, baseline, difference)."""
    aa, bb, dd = sums
    top_a, top_b, top_d = tops
    if top_b > acc.fill:
        if acc.fill_n and acc.fill_low < top_b / 2:  # the old candidate leaves the band: values like the rest
            _to_rest(acc, acc.fill_aa, acc.fill_bb, acc.fill_dd, max(acc.fill, acc.fill_top_a), acc.fill_d)
            acc.fill_n, acc.fill_aa, acc.fill_bb, acc.fill_dd, acc.fill_d = 0, 0.0, 0.0, 0.0, 0.0
            acc.fill_low, acc.fill_top_a = math.inf, 0.0
        acc.fill = top_b
    top = acc.fill
    band = None
    # (once anything comes near the top, as in almost every tensor, no block needs more than this test)
    if top_b >= top / 2 and acc.rest_top * FILL_GAP <= top and top > 0:
        n_band = int(np.count_nonzero(absb >= top / 2))
        if np.count_nonzero(absb >= top / FILL_GAP) == n_band:
            band = absb >= top / 2
    if band is None:
        _to_rest(acc, aa, bb, dd, max(top_a, top_b), top_d)
        return
    rest = ~band
    if rest.any():
        ra, rb = a[rest].astype(np.float64), b[rest].astype(np.float64)
        rd = ra - rb
        _to_rest(
            acc,
            _dot(ra, ra),
            _dot(rb, rb),
            _dot(rd, rd),
            max(float(np.abs(ra).max()), float(np.abs(rb).max())),
            float(np.abs(rd).max()),
        )
    fa, fb = a[band].astype(np.float64), b[band].astype(np.float64)
    fd = fa - fb
    acc.fill_aa += _dot(fa, fa)
    acc.fill_bb += _dot(fb, fb)
    acc.fill_dd += _dot(fd, fd)
    acc.fill_d = max(acc.fill_d, float(np.abs(fd).max()))
    acc.fill_top_a = max(acc.fill_top_a, float(np.abs(fa).max()))
    acc.fill_low = min(acc.fill_low, float(np.abs(fb).min()))
    acc.fill_n += int(fb.size)
    if top_b == top:
        acc.fill_value = float(b[int(np.argmax(absb))])


def _to_rest(acc: _Acc, aa: float, bb: float, dd: float, top: float, top_d: float) -> None:
    acc.rest_aa += aa
    acc.rest_bb += bb
    acc.rest_dd += dd
    acc.rest_top = max(acc.rest_top, top)
    acc.rest_d = max(acc.rest_d, top_d)


def _rest_errors(acc: _Acc) -> tuple[float | None, float | None]:
    """RelL2Err and ScaledMaxAbsErr of the values outside the fill; (None, None) when there is no fill."""
    if acc.fill_n < 2 or acc.fill < FILL_GAP * acc.rest_top:  # (one element is an outlier, not a fill)
        return None, None
    norm = math.sqrt(max(acc.rest_aa, acc.rest_bb))
    if norm == 0.0:  # the rest is zero on both sides: nothing else to measure
        return 0.0, 0.0
    return math.sqrt(acc.rest_dd) / norm, acc.rest_d / acc.rest_top


def _finish(acc: _Acc, numel: int) -> TensorMetrics:
    norm_a, norm_b = math.sqrt(acc.aa), math.sqrt(acc.bb)
    note = ""
    cosine: float | None
    if numel < 2:
        cosine, note = None, "cosine needs at least 2 elements"
    elif norm_a <= EPS and norm_b <= EPS:
        cosine = 1.0
    elif norm_a <= EPS or norm_b <= EPS:
        side = "target" if norm_a <= EPS else "baseline"
        cosine, note = None, f"cosine undefined: the {side} is all zero"
    else:
        gap = norm_a - norm_b
        if acc.dd + gap * gap <= norm_a * norm_b:
            # close vectors: from the distance, so that 1 - cos of a small perturbation survives float32
            # sums (|n - b|² is summed from the differences themselves; n·b would cancel against |n||b|)
            cosine = 1.0 - (acc.dd - gap * gap) / (2.0 * norm_a * norm_b)
        else:
            # far apart or of very different sizes: the distance form would cancel, n·b does not
            cosine = acc.ab / (norm_a * norm_b)
        cosine = max(-1.0, min(1.0, cosine))
    euc = math.sqrt(acc.dd)
    top_norm = max(norm_a, norm_b)
    top_abs = max(acc.max_a, acc.max_b)
    if acc.nonfinite == "same":
        note = (note + "; " if note else "") + "NaN/Inf at the same positions on both sides were set to 0"
    rest_rel_l2, rest_scaled = _rest_errors(acc)
    return TensorMetrics(
        cosine=cosine,
        euc_dist=euc,
        max_abs_err=acc.max_abs,
        max_rel_err=acc.max_rel,
        one_thousandth=acc.c1 / numel,
        five_thousandths=acc.c5 / numel,
        rel_l2=euc / top_norm if top_norm > 0 else (0.0 if euc == 0 else math.inf),
        scaled_max_abs=acc.max_abs / top_abs if top_abs > 0 else (0.0 if acc.max_abs == 0 else math.inf),
        nonfinite=acc.nonfinite,
        numel=numel,
        note=note,
        fill=acc.fill_value if rest_rel_l2 is not None else None,
        fill_count=acc.fill_n if rest_rel_l2 is not None else 0,
        rest_rel_l2=rest_rel_l2,
        rest_scaled_max_abs=rest_scaled,
    )


# ------------------------------------------------------------------------------------------------ statistics
STAT_NAMES = ("Max", "Min", "Mean", "Norm")


@dataclass(frozen=True)
class StatMetrics:
    """Differences of the four statistics (target - baseline), msprobe's relative errors and our scaled errors."""

    diff: tuple[float | None, float | None, float | None, float | None]
    rel: tuple[float | None, float | None, float | None, float | None]
    scaled: tuple[float | None, float | None, float | None, float | None]
    nonfinite: str | None = None  # None, "same" or "different"
    # a mask fill that is the tensor's Min (or Max) on both sides, dominating the other extreme (see
    # :func:`stat_metrics`); None when there is none
    fill: float | None = None

    @property
    def error(self) -> float | None:
        """The largest scaled error over the statistics both sides have."""
        known = [s for s in self.scaled if s is not None]
        return max(known) if known else None

    @property
    def worst(self) -> int | None:
        """Index (into STAT_NAMES) of the statistic with the largest scaled error."""
        known = [(s, i) for i, s in enumerate(self.scaled) if s is not None]
        return max(known)[1] if known else None


def _same_nonfinite(x: float, y: float) -> bool:
    return (math.isnan(x) and math.isnan(y)) or x == y


def stat_metrics(
    n: tuple[float | None, float | None, float | None, float | None],
    b: tuple[float | None, float | None, float | None, float | None],
    dtype: str | None = None,
) -> StatMetrics:
    """Compare (Max, Min, Mean, Norm) of the two sides; a statistic missing on either side is skipped.

    Max, Min and Mean are scaled by the tensor's largest magnitude, Norm by the larger Norm. **A mask fill**:
    when the Min (or the Max) is the same on both sides (to 1e-6) and at least :data:`FILL_GAP` times the
    other extreme of both sides (``masked_fill(mask, -1e4)`` on attention scores), it says nothing of the other
    values, and scaling by it would hide a drift of theirs (a 1e-3 drift of scores near 3 is 3e-7 of -1e4): the
    other extreme and the Mean are then scaled by the other extreme's magnitude (a bound on every other
    value's, the Mean's difference being the mean of theirs), and ``fill`` holds the fill.
    """
    nonfinite: str | None = None
    finite_range = [abs(v) for v in (n[0], n[1], b[0], b[1]) if v is not None and math.isfinite(v)]
    value_range = max(finite_range, default=0.0)
    fill, rest_scale = _stat_fill(n, b, dtype)
    norms = [abs(v) for v in (n[3], b[3]) if v is not None and math.isfinite(v)]
    norm_scale = max(norms, default=0.0)
    diff: list[float | None] = []
    rel: list[float | None] = []
    scaled: list[float | None] = []
    for i, (x, y) in enumerate(zip(n, b)):
        if x is None or y is None:
            diff.append(None)
            rel.append(None)
            scaled.append(None)
            continue
        if not (math.isfinite(x) and math.isfinite(y)):
            if _same_nonfinite(x, y):
                nonfinite = nonfinite or "same"
                diff.append(0.0)
                rel.append(0.0)
                scaled.append(0.0)
            else:
                nonfinite = "different"
                diff.append(x - y if not (math.isnan(x) or math.isnan(y)) else math.nan)
                rel.append(None)
                scaled.append(math.inf)
            continue
        dv = x - y
        diff.append(dv)
        rel.append(abs(dv) / abs(y) if y != 0 else None)
        scale = norm_scale if i == 3 else value_range
        if fill is not None and i in rest_scale:
            scale = rest_scale[i]
        scaled.append(abs(dv) / scale if scale > 0 else (0.0 if dv == 0 else math.inf))
    return StatMetrics(
        tuple(diff),  # type: ignore[arg-type]
        tuple(rel),  # type: ignore[arg-type]
        tuple(scaled),  # type: ignore[arg-type]
        nonfinite,
        fill,
    )


MASK_FILLS = (1e4, 1e9)  # the usual mask fills (with +-inf and the dtype's extreme)


def is_mask_fill(value: float, other: float, dtype: str | None) -> bool:
    """Whether ``value`` is a mask fill of a tensor of ``dtype`` whose other extreme is ``other``."""
    size = abs(value)
    if math.isinf(size):
        return True
    if math.isnan(size) or size < 64 * abs(other):  # it must dominate the tensor's other values
        return False
    name = (dtype or "").replace("torch.", "")
    extremes = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}
    candidates = [*MASK_FILLS, extremes.get(name, 0.0), 1.7976931348623157e308]
    if name == "bfloat16":  # -1e4 is -9984 there, -1e9 -999292928
        candidates += [9984.0, 999292928.0]
    return any(math.isclose(size, c, rel_tol=1e-3) for c in candidates)  # (scores plus a mask: -1e4 +- 10)


def _stat_fill(
    n: tuple[float | None, float | None, float | None, float | None],
    b: tuple[float | None, float | None, float | None, float | None],
    dtype: str | None,
) -> tuple[float | None, dict[int, float]]:
    """The mask fill of :func:`stat_metrics` (None when there is none) and the scale of each statistic it
    leaves to the other values (index into (Max, Min, Mean, Norm)): a known fill value (:func:`is_mask_fill`)
    the same on both sides, whose other extreme has the other sign (the other values lie between it and 0, so it
    bounds their magnitude) on both sides."""
    for at, other in ((1, 0), (0, 1)):  # a fill at the Min (the usual -1e4), else at the Max
        f_n, f_b, o_n, o_b = n[at], b[at], n[other], b[other]
        if f_n is None or f_b is None or o_n is None or o_b is None:
            continue
        if not all(math.isfinite(v) for v in (f_n, f_b, o_n, o_b)):
            continue
        size = max(abs(o_n), abs(o_b))
        if (
            size == 0.0
            or not math.isclose(f_n, f_b, rel_tol=1e-6)
            or f_b * o_n >= 0.0
            or f_b * o_b >= 0.0
            or not is_mask_fill(f_b, size, dtype)
            or not is_mask_fill(f_n, size, dtype)
        ):
            continue
        return f_b, {other: size, 2: size}
    return None, {}
