"""Differences that are not of precision, forgiven in the rows of one dump pair before the calls are judged.

Three cases, recognised by the records alone: an input that one side recorded after an in-place op updated it
(:func:`explain_in_place`), inputs that are the outputs of a call only one side makes
(:func:`explain_structural`), and a weight updated from rounding noise (:func:`explain_noise_updates`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from pytest_msprobe.compare.build import Builder, Draft
from pytest_msprobe.compare.dumps import OUTPUT, PARAM_IN, TENSOR, Leaf, open_tensor
from pytest_msprobe.compare.judging import ERROR, PASS, WARNING, Check, amend, check_statistics
from pytest_msprobe.errors import DumpFormatError, DumpReadError
from pytest_msprobe.format.layout import TENSOR_DIR
from pytest_msprobe.format.names import FORWARD
from pytest_msprobe.format.optimizerfile import UPDATE_PREFIX, is_update
from pytest_msprobe.thresholds import Thresholds, normalize_dtype


def explain_in_place(builder: Builder) -> None:
    """Forgive input rows that differ only because one side recorded an in-place op's input after the update.

    msprobe versions disagree on when an in-place module (``nn.ReLU(inplace=True)``) records its input:
    before the op, or after it, when it already equals the output. When one side's input equals its own
    output, the other's does not, and the first side's input matches the other side's output, the two
    recorded the same tensor at different moments; that row is compared with the other side's output.
    """
    for api in builder.apis:
        if api.one_side:
            continue
        drafts = builder.drafts[api.row_start : api.row_stop]
        outputs = [d for d in drafts if d.role == OUTPUT and d.target is not None and d.baseline is not None]
        for d in drafts:
            check = d.check
            if d.role == OUTPUT or check is None or check.status not in (ERROR, WARNING):
                continue
            if d.target is None or d.baseline is None or d.target.kind != TENSOR or d.baseline.kind != TENSOR:
                continue
            for out in outputs:
                assert out.target is not None and out.baseline is not None
                for mine, theirs_in, theirs_out, side in (
                    (d.target, d.baseline, out.baseline, "target"),
                    (d.baseline, d.target, out.target, "baseline"),
                ):
                    own_out = out.target if side == "target" else out.baseline
                    if not (_same_record(mine, own_out) and not _same_record(theirs_in, theirs_out)):
                        continue
                    pair = (mine, theirs_out) if side == "target" else (theirs_out, mine)
                    tol, _ = builder.thresholds.tolerance(pair[1].dtype, d.api, d.row, statistics=True)
                    again = check_statistics(pair[0], pair[1], tol)
                    if again.status == PASS:
                        note = (
                            f"the {side} recorded this input after the in-place update (it equals its output "
                            f"{own_out.suffix[1:]}); compared with the other side's output instead"
                        )
                        d.check = Check(PASS, again.error, again.allowed, note, again.stat)
                        break
                if d.check is not check:
                    break


def explain_structural(builder: Builder) -> None:
    """Forgive a call whose differing inputs are the outputs of a call only one side makes.

    An inserted or removed call (one extra relu after a max-pool, say) changes the structure of the run,
    and with it what flows into the next call: a relu's backward zeroes the gradient where its input is 0,
    so the max-pool's backward reads a different gradient although every weight gradient stays the same.
    The call that reads the one-side call's output is then a warning, not an error; the one-side call
    itself is reported as unmatched. When the difference really changes the numbers, it reaches the calls
    after that one through matched calls, and those still fail (the first divergence then names the
    one-side call: see :mod:`pytest_msprobe.compare.diagnosis.divergence`). A tensor is recognised by its record (shape, dtype
    and statistics), which the producing and the consuming call share within one dump.
    """
    produced: dict[tuple[int, str, tuple[Any, ...]], int] = {}
    for index, api in enumerate(builder.apis):
        if not api.one_side:
            continue
        for d in builder.drafts[api.row_start : api.row_stop]:
            for side, leaf in (("target", d.target), ("baseline", d.baseline)):
                if leaf is not None and d.role == OUTPUT and leaf.kind == TENSOR and None not in leaf.stats:
                    produced.setdefault((api.pair, side, _fingerprint(leaf)), index)
    if not produced:
        return
    for index, api in enumerate(builder.apis):
        if api.one_side:
            continue
        drafts = builder.drafts[api.row_start : api.row_stop]
        failing = [d for d in drafts if d.check is not None and d.check.status == ERROR]
        inputs = [d for d in failing if d.role != OUTPUT]
        if not inputs:
            continue
        sources = []
        for d in inputs:
            found = None
            for side, leaf in (("target", d.target), ("baseline", d.baseline)):
                if leaf is not None and leaf.kind == TENSOR and None not in leaf.stats:
                    found = produced.get((api.pair, side, _fingerprint(leaf)))
                    if found is not None:
                        break
            if found is None:
                break
            sources.append(found)
        else:
            source = sources[0]
            only = (
                "target" if builder.drafts[builder.apis[source].row_start].target is not None else "baseline"
            )
            note = (
                f"follows {builder.apis[source].api}, a call only the {only} makes: a difference of structure, "
                "not of precision"
            )
            for d in failing:
                assert d.check is not None
                d.check = amend(d.check, note, WARNING)
            builder.structural[index] = source


def _same_record(x: Leaf, y: Leaf) -> bool:
    return x.shape == y.shape and x.dtype == y.dtype and x.stats == y.stats and None not in x.stats


def _fingerprint(leaf: Leaf) -> tuple[Any, ...]:
    return (leaf.shape, leaf.dtype, leaf.stats)


def below_measure(
    target: Leaf | None, baseline: Leaf | None, error: float | None, thresholds: Thresholds
) -> bool:
    """Whether two tensors differ by no more than their dtype's ``atol`` (so the difference counts as none) while
    their values are so small that such a difference is beyond the tolerance relative to them: not measured, they
    cannot be shown to match either (Adam's moments of a gradient that is rounding noise)."""
    if target is None or baseline is None or target.kind != TENSOR or baseline.kind != TENSOR:
        return False
    if target.stats == baseline.stats or error != 0.0:
        return False
    values = [abs(v) for v in (target.max, target.min, baseline.max, baseline.min) if v is not None]
    tol = thresholds.for_dtype(baseline.dtype)
    return len(values) == 4 and tol.error > 0 and max(values) * tol.error <= tol.atol


# a float32 tensor whose values are all this many float32 epsilons of the largest value its API's calls of the
# same step see, or fewer, holds rounding noise: a sum that is zero in exact arithmetic
_NOISE_EPS = {"float32": 2.0**-23, "float64": 2.0**-52}
_NOISE_ULPS = 1024


def explain_noise_siblings(builder: Builder) -> None:
    """Forgive the difference of a tensor that is rounding noise beside its API's other calls.

    A gradient that is zero in exact arithmetic (an attention key's bias, which the softmax ignores) comes out of
    a float32 sum as rounding noise, its size that of the terms summed times float32's epsilon: another summation
    order gives other noise, 50% off. Gradient clipping then takes its norm with every other gradient's, where it
    is 1e-8 beside norms near 1. A failing row of a float32 (or float64) tensor whose largest magnitude, on both
    sides, is at most 1024 epsilons of the largest magnitude of the same slot (``output.0``) of the same API and
    direction in this dump pair is such noise: a warning that says so, not a failure."""
    magnitude: dict[tuple[str, str | None, str], float] = {}
    sized = [(d, _sibling_key(builder, d), _magnitude(d)) for d in builder.drafts]
    for _, key, size in sized:
        if size is not None:
            magnitude[key] = max(magnitude.get(key, 0.0), size)
    for d, key, size in sized:
        check = d.check
        if check is None or check.status != ERROR or size is None or d.baseline is None:
            continue
        eps = _NOISE_EPS.get(normalize_dtype(d.baseline.dtype) or "")
        largest = magnitude[key]
        if eps is None or not largest or size > _NOISE_ULPS * eps * largest:
            continue
        note = (
            (
                f"rounding noise: its values (at most {size:.3g}) are {largest / size:.3g}x smaller than the largest "
                "its API's calls of this step see, the size float32 sums that are zero in exact arithmetic come out at"
            )
            if size > 0
            else "rounding noise: zero beside its API's other calls"
        )
        d.check = amend(check, note, WARNING)


def _sibling_key(builder: Builder, d: Draft) -> tuple[str, str | None, str]:
    """The API, direction and slot of a row: its siblings are the rows of the same slot of its API's other calls
    (an output beside outputs; a softmax's input holds its mask fill, -1e4, and says nothing of its output), and
    the tensors of one list argument are siblings of one another."""
    call = builder.apis[d.api_index]
    suffix = d.row[len(d.api) :] if d.api and d.row.startswith(d.api) else d.row
    # the argument, not the element: a list's tensors (torch.stack's norms) are siblings of one another; the
    # updates of optimizer.json, one record per parameter, are siblings of one another
    base = UPDATE_PREFIX if is_update(call.api) else call.base
    return base, call.direction, ".".join(suffix.split(".")[:3])


def _magnitude(d: Draft) -> float | None:
    """The largest magnitude of a row's tensors on both sides, by their Max and Min (None for no finite tensor)."""
    values = [
        v
        for leaf in (d.target, d.baseline)
        if leaf is not None and leaf.kind == TENSOR
        for v in (leaf.max, leaf.min)
        if v is not None
    ]
    if not values or not all(math.isfinite(v) for v in values):
        return None
    return max(abs(v) for v in values)


def explain_noise_updates(builder: Builder) -> None:
    """Forgive the drift of a weight that an optimizer updates from rounding noise.

    A gradient that is zero in exact arithmetic (an attention key's bias, which the softmax ignores) is rounding
    noise, below measure on both sides, and so are Adam's moments of it; but the update divides one by the root of
    the other (``param.addcdiv_(m, sqrt(v) + eps, value=-lr)``), which makes of that noise a step of up to the
    learning rate, another on each device. The weight then differs by what no precision of either device decides.
    An in-place call of a tensor method (its name ends in ``_``) is such an update when no other input than the
    one it updates differs measurably and either an input is below measure as a whole (see
    :func:`below_measure`) or, with tensor files, the output's difference lies on the elements where a differing
    input is below measure (:func:`_noise_elements_explain`: a few gradient elements of rounding size among
    large ones, each divided by its own small root). Its failing rows, and those of every record of the weight
    it updates in this dump pair (the same tensor record on both sides: its forward uses, the in-place calls
    before the update), are warnings that say so; the weight's records are kept in ``builder.noise`` for the
    next step (:func:`explain_noise_carry`).
    """
    thresholds = builder.thresholds
    # the records (target, baseline) of a weight updated from noise -> the update's name (None, the key of a
    # row that holds no tensor, is looked up, never stored)
    weights: dict[tuple[Any, Any] | None, str] = {}
    for api in builder.apis:
        written = _written_row(api)
        if written is None:
            continue
        drafts = builder.drafts[api.row_start : api.row_stop]
        self_rows = [d for d in drafts if d.role != OUTPUT and d.row.endswith(written)]
        others = [d for d in drafts if d.role != OUTPUT and not d.row.endswith(written)]
        if len(self_rows) != 1:
            continue
        noise = [
            d
            for d in others
            if d.check is not None and below_measure(d.target, d.baseline, d.check.error, thresholds)
        ]
        measured = [
            d for d in others if d not in noise and d.check is not None and d.check.status in (ERROR, WARNING)
        ]
        if measured:
            continue
        if not noise:
            outputs = [
                d for d in drafts if d.role == OUTPUT and d.check is not None and d.check.status == ERROR
            ]
            if len(outputs) != 1 or not _noise_elements_explain(
                builder, api, self_rows[0], others, outputs[0]
            ):
                continue
        for d in (self_rows[0], *(d for d in drafts if d.role == OUTPUT)):
            key = _records(d)
            if key is not None:
                weights[key] = api.api
                if d.role == OUTPUT:  # the weight as the update left it: how it enters the next step
                    builder.noise.setdefault(api.pair, {})[key] = api.api
    if not weights:
        return
    # the in-place calls before an update (AdamW's weight decay) make the record it updates: their inputs too
    for api in reversed(builder.apis):
        if not _in_place(api):
            continue
        drafts = builder.drafts[api.row_start : api.row_stop]
        update = next(
            (u for d in drafts if d.role == OUTPUT if (u := weights.get(_records(d))) is not None), None
        )
        if update is not None:
            for d in drafts:
                key = _records(d)
                if d.role != OUTPUT and d.row.endswith(".input.0") and key is not None:
                    weights.setdefault(key, update)
    for d in builder.drafts:
        check = d.check
        update = weights.get(_records(d))
        if check is not None and check.status == ERROR and update is not None:
            note = (
                f"a weight {update} updates from rounding noise (inputs below measure, divided one by another): "
                "its difference is that noise's, not a precision problem of either device"
            )
            d.check = amend(check, note, WARNING)


def _noise_elements_explain(
    builder: Builder, api: Any, self_row: Any, others: list[Any], output: Any
) -> bool:
    """Whether an in-place update's failing output differs only where a differing input is below measure.

    Every other input must match within the tolerance at its own scale (no element further apart than the
    tolerance times the input's largest value); an element whose two values are further apart than the
    tolerance relative to themselves is then below measure: a value of rounding size among large ones (Adam's
    moments of a gradient element 1e-7 among gradients of 1e-3), whose own precision no compare of the tensor
    can see, and whose quotient in the update is a step as large as any other. The output's difference outside
    those elements must be within the tolerance: nothing measurable explains the rest, and a wrong update kernel
    moves every element. Needs the tensor files of both sides (tensor mode); False wherever one cannot be read.
    """
    tol = builder.thresholds.for_dtype(output.baseline.dtype if output.baseline is not None else None)
    pair = builder.pairs[api.pair] if api.pair < len(builder.pairs) else None
    if pair is None or tol.error <= 0:
        return False
    try:
        out_t, out_b = _values(pair.target, output.target), _values(pair.baseline, output.baseline)
        if out_t is None or out_b is None or out_t.shape != out_b.shape:
            return False
        hidden = np.zeros(out_b.shape, dtype=bool)
        for d in others:
            if d.target is None or d.baseline is None or d.target.kind != TENSOR:
                continue
            x_t, x_b = _values(pair.target, d.target), _values(pair.baseline, d.baseline)
            if x_t is None or x_b is None or x_t.shape != x_b.shape:
                return False
            if x_t.shape != out_b.shape:
                if np.array_equal(x_t, x_b):
                    continue  # a broadcast input that does not differ explains nothing, hides nothing
                return False
            with np.errstate(over="ignore", invalid="ignore"):
                size = np.maximum(np.abs(x_t), np.abs(x_b))
                gap = np.abs(x_t - x_b)
            scale = float(np.max(size, initial=0.0))
            if not np.isfinite(scale) or float(np.max(gap, initial=0.0)) > tol.error * scale:
                return False  # the input differs measurably at its own scale: that is no noise
            hidden |= gap > tol.error * size  # its own precision lost: a value of rounding size
    except DumpReadError:  # (as out of memory, the machine's state at that moment: it raises)
        raise
    except (DumpFormatError, OSError, ValueError):
        return False
    if not hidden.any():
        return False
    with np.errstate(over="ignore", invalid="ignore"):
        diff = np.where(hidden, 0.0, out_t - out_b)
        # (numpy's own loop, not BLAS's: np.linalg.norm's sum is split over as many threads as BLAS has)
        norm = math.sqrt(float(np.einsum("i,i->", out_b.ravel(), out_b.ravel())))
        rest = math.sqrt(float(np.einsum("i,i->", diff.ravel(), diff.ravel())))
    return bool(np.isfinite(rest) and norm > 0 and rest <= tol.error * norm)


def _values(dump_json: str, leaf: Leaf | None) -> np.ndarray | None:
    """A tensor row's values in float64 (None for a row without a tensor file)."""
    if leaf is None or leaf.kind != TENSOR or not leaf.data_name:
        return None
    path = Path(dump_json).parent / TENSOR_DIR / leaf.data_name
    tensor = open_tensor(path, leaf.dtype, leaf.shape)
    if tensor.numel > _NOISE_ELEMENTS_LIMIT or tensor.dtype.startswith("complex"):
        return None
    return tensor.read().astype(np.float64, copy=False)


# an update's tensors are read whole for the element-wise check: an optimizer's state of one weight, never huge
_NOISE_ELEMENTS_LIMIT = 1 << 24


def explain_noise_carry(builder: Builder) -> None:
    """Carry the weights updated from rounding noise (:func:`explain_noise_updates`) to the next step.

    A weight that such an update moved at step N enters step N + 1 (of the same rank) with that difference: its
    records there (the same tensor records on both sides: its forward uses, its next update's input) are
    warnings that say where it comes from, and so is the next update of it whose other inputs do not differ
    measurably; that update's output goes on to the step after. Runs on the whole compare, after its dump pairs
    are merged.
    """
    if not builder.noise:
        return
    by_place = {(pair.rank, pair.step): p for p, pair in enumerate(builder.pairs)}
    # in step order: what an update carries into step N + 1 goes on to N + 2 from there
    for p in sorted(
        range(len(builder.pairs)), key=lambda p: (builder.pairs[p].rank or 0, builder.pairs[p].step or 0)
    ):
        pair, carried = builder.pairs[p], builder.noise.get(p)
        if pair.step is None or not carried:
            continue
        following = by_place.get((pair.rank, pair.step + 1))
        if following is None:
            continue
        calls = [a for a in builder.apis if a.pair == following]
        for api in calls:
            drafts = builder.drafts[api.row_start : api.row_stop]
            for d in drafts:
                key = _records(d)
                update = carried.get(key) if key is not None else None
                if update is None or d.check is None or d.check.status != ERROR:
                    continue
                note = (
                    f"a weight that {update} updated from rounding noise at step {pair.step} (inputs below "
                    "measure, divided one by another): its difference is that noise's, not a precision problem"
                )
                d.check = amend(d.check, note, WARNING)
            written = _written_row(api)
            if written is None:
                continue
            self_rows = [d for d in drafts if d.role != OUTPUT and d.row.endswith(written)]
            others = [d for d in drafts if d.role != OUTPUT and not d.row.endswith(written)]
            weight = _records(self_rows[0]) if len(self_rows) == 1 else None
            if weight is None or weight not in carried:
                continue
            if any(d.check is not None and d.check.status in (ERROR, WARNING) for d in others):
                continue
            update = carried[weight]
            for d in drafts:
                key = _records(d)
                if d.role != OUTPUT or key is None:
                    continue
                builder.noise.setdefault(following, {})[key] = update
                if d.check is not None and d.check.status == ERROR:
                    note = f"updates a weight that {update} moved from rounding noise at step {pair.step}"
                    d.check = amend(d.check, note, WARNING)


def _written_row(api: Any) -> str | None:
    """The row of the tensor an update (of both sides) writes, as it was before: ``.input.0`` of an in-place
    tensor method (``add_``), ``.input.param`` of a parameter's update (``Optimizer.fc.weight.0.forward``, whatever
    kernels made it: see :mod:`pytest_msprobe.compare.dumps.optimizer`); None for any other call."""
    if is_update(api.api):
        return PARAM_IN if not api.one_side and api.direction == FORWARD else None
    return ".input.0" if _in_place(api) and api.api.startswith("Tensor.") else None


def _in_place(api: Any) -> bool:
    """Whether a call (of both sides) is the forward of an in-place method (``add_``, not ``__iadd__``)."""
    base = api.base
    return not api.one_side and api.direction == FORWARD and base.endswith("_") and not base.endswith("__")


def _records(d: Any) -> tuple[Any, Any] | None:
    """A tensor row's records (target, baseline), by which a tensor is recognised within a dump pair."""
    if d.target is None or d.baseline is None or d.target.kind != TENSOR or d.baseline.kind != TENSOR:
        return None
    return (_fingerprint(d.target), _fingerprint(d.baseline))
