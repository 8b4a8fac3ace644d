"""The self-check: each call judged by its own error (its output against the float64 replay of its own
inputs), in a compare and in a dump without a baseline.

Where they come from, per dump.json: its ``self_check.json`` (written while the step ran, with
``--msprobe-self-check``), else, for a tensor dump, a replay of its tensor files now (:mod:`pytest_msprobe.replay`,
which needs torch: imported here only when a dump must be replayed).

How a call is judged (:func:`own_error_verdict`): its target's own error is out of line when, for one of its outputs,
elements finite on one side only, or more of its elements than its dtype's share (1e-3 for float32 and
float64, 1e-2 for half types; per API with the thresholds file's ``own_share``) are off by more than the
measuring bound (or, computed at a lower precision than its dtype, more than that share are off by a tenth of it
while its RMSE and mean relative error are a hundred times the baseline's own), and, where the baseline has its
own error for that output too, the target's exceeds it by
one of the ratios of its guard level (``own_level``; msprobe's L0/L1/L2: small values 2, RMSE and mean
relative error 2/1.5/1.2, largest relative error 10/5/2). A baseline whose own error is as large says the
call computes no worse than the reference device does: not out of line.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from pytest_msprobe.compare.dumps import read_dump, read_stack
from pytest_msprobe.compare.judging.overflow import CallView, dump_overflow, entry_views
from pytest_msprobe.compare.judging.rows import (
    ERROR,
    WARNING,
    ApiResult,
    OwnErrorVerdict,
    SelfCheckCall,
    SelfCheckResult,
    fmt_number,
)
from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.files import read_json
from pytest_msprobe.format.layout import discover
from pytest_msprobe.format.names import FORWARD, parse_name
from pytest_msprobe.format.own_errors import SELF_CHECK_JSON, SHARE_BOUNDS, CallOwn, OwnError, read_own_errors
from pytest_msprobe.thresholds import OwnRatios, Thresholds

OwnErrors = dict[str, CallOwn]
NO_OWN_ERRORS = "the dump was made without the self-check, so its calls have no own errors to judge"


def load_own_errors(dump_json: Path, replay: bool, only: Collection[str] | None = None) -> OwnErrors | None:
    """The own errors of one dump.json: its sidecar, else (``replay``) a float64 replay of its tensor
    files, of the calls named in ``only`` where given (every call otherwise); None when there are none (a
    statistics dump without a sidecar, or torch is not installed)."""
    found = read_own_errors(dump_json)
    if found is not None or not replay:
        return found
    if only is not None and not only:  # nothing to replay: no torch to import
        return {}
    try:
        from pytest_msprobe.replay.offline import replay_dump  # needs torch: only for a tensor dump
    except ImportError:
        return None
    return {c.name: CallOwn(c.outputs, c.skipped, c.emulated) for c in replay_dump(dump_json, only).calls}


def replay_wanted(
    apis: Sequence[ApiResult], feeds: Mapping[int, Sequence[int]], pairs: int
) -> tuple[list[set[str]], list[set[str]]]:
    """The calls whose own errors can change a same-device compare's verdict, by dump pair, as the target's and
    the baseline's record names: those beyond a threshold (an error or a warning) and the calls whose outputs
    they read (the first divergence asks whether the error came in with an input, or at the call)."""
    chosen = {i for i, api in enumerate(apis) if api.status in (ERROR, WARNING)}
    chosen |= {j for i in list(chosen) for j in feeds.get(i, ())}
    target: list[set[str]] = [set() for _ in range(pairs)]
    baseline: list[set[str]] = [set() for _ in range(pairs)]
    for i in chosen:
        api = apis[i]
        target[api.pair].add(api.api)
        if api.bench_api:
            baseline[api.pair].add(api.bench_api)
    return target, baseline


def own_error_verdict(
    target: CallOwn | None, baseline: CallOwn | None, api: str, thresholds: Thresholds
) -> OwnErrorVerdict | None:
    """How the target's call stands by its own error (see the module docstring); None where the target
    has no own error for it."""
    if target is None:
        return None
    if target.skipped:
        return OwnErrorVerdict(None, None, False, "", target.skipped)
    base = baseline.outputs if baseline is not None and not baseline.skipped else ()
    worst_t: OwnError | None = None
    worst_b: OwnError | None = None
    worst_key: tuple[bool, float, float] = (False, -1.0, -1.0)
    reasons: list[str] = []
    excused: list[str] = []
    for k, t in enumerate(target.outputs):
        if t is None:
            continue
        b = base[k] if k < len(base) else None
        # the baseline's dtype decides, as for the thresholds: a bfloat16 output where the reference device
        # gives float32 is held to float32's standard
        bound, share, ratios = thresholds.own_standard(api, b.dtype if b is not None else t.dtype)
        broken = breaks_standard(t, bound, share) or reduced_precision(t, b, bound, share)
        if worst_t is None or (bool(broken), t.share_over(bound), t.max_rel) > worst_key:
            worst_t, worst_b = t, b
            worst_key = (bool(broken), t.share_over(bound), t.max_rel)
        if not broken:
            continue
        where = f"output {k}" if len(target.outputs) > 1 else "its output"
        if b is None:
            reasons.append(f"{where}: {broken}")
            continue
        over = exceeds(t, b, ratios)
        if over:
            reasons.append(f"{where}: {broken}; {over}")
        else:
            excused.append(f"{where}: {broken}, as the baseline's own error is too (within its ratios)")
    if reasons:
        return OwnErrorVerdict(worst_t, worst_b, True, "; ".join(reasons))
    return OwnErrorVerdict(worst_t, worst_b, False, "; ".join(excused))


def breaks_standard(err: OwnError, bound: float, share: float) -> str:
    """Why one output's own error breaks its standard ("" when it does not): elements finite on one side
    only, or more than ``share`` of its elements more than ``bound`` off."""
    if err.nonfinite_mismatch:
        return f"{err.nonfinite_mismatch} element(s) finite on one side only"
    if err.shares == (1.0, 1.0, 1.0) and err.max_rel == 0.0 and err.reason:  # not measured: another shape
        return err.reason
    off = err.share_over(bound)
    if off > share:
        return f"{off:.3%} of its elements more than {bound:g} off (at most {share:.2%})"
    return ""


# how many times the baseline's own RMSE and mean relative error a target's must be, with a tenth of the
# bound's share of elements off, for its output to have been computed at a lower precision than its dtype's
REDUCED_FACTOR = 100.0


def reduced_precision(t: OwnError, b: OwnError | None, bound: float, share: float) -> str:
    """Why one output looks computed at a lower precision than its dtype ("" when it does not): within its
    standard, but more than ``share`` of its elements more than a tenth of ``bound`` off, and its RMSE and mean
    relative error :data:`REDUCED_FACTOR` times the baseline's own or more (a float32 softmax computed in float16
    is 5e-4 off where float32's own rounding gives 1e-7). Without the baseline's own error, nothing to hold it to."""
    finer = bound / 10
    if b is None or finer not in SHARE_BOUNDS or t.share_over(finer) <= share:
        return ""
    if t.rmse < REDUCED_FACTOR * b.rmse or t.mean_rel < REDUCED_FACTOR * b.mean_rel or t.rmse == 0:
        return ""
    return (
        f"{t.share_over(finer):.3%} of its elements more than {finer:g} off (at most {share:.2%}) with an RMSE "
        f"{_times(t.rmse, b.rmse)} the baseline's own: computed at a lower precision than {t.dtype}"
    )


def _times(got: float, ref: float) -> str:
    return f"{got / ref:.3g}x" if ref > 0 else f"{fmt_number(got)} where 0 is"


def exceeds(t: OwnError, b: OwnError, ratios: OwnRatios) -> str:
    """Which ratio of the target's own error to the baseline's is over its level ("" when none is)."""
    if t.nonfinite_mismatch and not b.nonfinite_mismatch:
        return "the baseline's replay has no such element"
    for name, got, ref, limit in (
        ("RMSE", t.rmse, b.rmse, ratios.rmse),
        ("mean relative error", t.mean_rel, b.mean_rel, ratios.mean_rel),
        ("largest relative error", t.max_rel, b.max_rel, ratios.max_rel),
        ("count of small values off", float(t.small_breaches), float(b.small_breaches), ratios.small),
    ):
        if got > limit * ref and got > 0:
            if ref == 0:
                return f"its {name} is {fmt_number(got)} where the baseline's own is 0"
            return (
                f"its {name} {fmt_number(got)} is {got / ref:.3g}x the baseline's own {fmt_number(ref)} "
                f"(at most {limit:g}x)"
            )
    return ""


def own_error_verdicts(
    apis: Sequence[ApiResult],
    target_own: Sequence[OwnErrors | None],
    baseline_own: Sequence[OwnErrors | None],
    thresholds: Thresholds,
) -> dict[int, OwnErrorVerdict]:
    """The verdict of each call whose target has own errors (``*_own[p]``: the own errors of dump pair
    ``p``'s two dump.json files, None where a side has none)."""
    found: dict[int, OwnErrorVerdict] = {}
    for i, api in enumerate(apis):
        t_own = target_own[api.pair]
        if t_own is None or api.api not in t_own or api.direction is None:
            continue
        b_own = baseline_own[api.pair]
        b_call = b_own.get(api.bench_api) if b_own is not None and api.bench_api else None
        v = own_error_verdict(t_own[api.api], b_call, api.api, thresholds)
        if v is not None:
            found[i] = v
    return found


def check_dump(path: str | os.PathLike[str], thresholds: Thresholds | None = None) -> SelfCheckResult:
    """The self-check of a dump without a baseline: every call judged by its own error alone.

    Every dump.json of ``path`` must have its ``self_check.json`` (written with ``--msprobe-self-check``):
    one without it raises DumpFormatError naming it, since a gate that checked only part of the run would
    pass for the wrong reason. The first call whose output holds inf/nan (see
    :mod:`pytest_msprobe.compare.judging.overflow`) fails the check too (``SelfCheckResult.overflow``).

        >>> check_dump("out/dump").out_of_line[0].name     # doctest: +SKIP
        'Functional.relu.2.forward'
    """
    thresholds = thresholds or Thresholds()
    calls: list[SelfCheckCall] = []
    views: list[CallView] = []
    for loc in discover(path):
        # a call whose output holds inf/nan is no precision pass, whatever its own error says
        views.extend(entry_views(read_dump(loc).entries, loc.step, loc.rank))
        own = read_own_errors(loc.path)
        if own is None:
            raise DumpFormatError(loc.path, f"no {SELF_CHECK_JSON} beside it: {NO_OWN_ERRORS}")
        stacks = read_stack(loc.path)
        for name in _recorded_order(loc.path, own):
            v = own_error_verdict(own[name], None, name, thresholds)
            if v is None:
                continue
            parts = parse_name(name)
            stack = stacks.get(name) or stacks.get(parts.with_direction(FORWARD)) or []
            calls.append(SelfCheckCall(name, loc.step, loc.rank, v, tuple(stack)))
    return SelfCheckResult(os.fspath(path), tuple(calls), dump_overflow(views))


def _recorded_order(dump_json: Path, own: Mapping[str, CallOwn]) -> list[str]:
    """The sidecar's calls in the dump's own order (its dump.json records), those it lacks after them."""
    doc = read_json(dump_json)
    data = doc.get("data") if isinstance(doc, dict) else None
    order = [name for name in data if name in own] if isinstance(data, dict) else []
    seen = set(order)
    return order + [name for name in own if name not in seen]
