"""The compare: :func:`compare`, the library entry point the CLI and the pytest plugin call.

Both dumps are found on disk, their dump pairs (step, rank) paired; each pair is compared whole (read,
aligned, built into rows, its tensor files compared, its differences of structure forgiven), in worker
processes when there are several; the pairs are then merged, the calls ordered across ranks, the coverage
measured and the first divergence found.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pytest_msprobe.compare.alignment import Coverage, PairCoverage, align
from pytest_msprobe.compare.build import Builder
from pytest_msprobe.compare.checklist import compare_checklists, compared_calls, from_records
from pytest_msprobe.compare.diagnosis import first_divergence, judge_across
from pytest_msprobe.compare.dumps import (
    OUTPUT,
    Dump,
    Modules,
    place_calls,
    plan_updates,
    read_dump,
    read_stack,
)
from pytest_msprobe.compare.explain import (
    below_measure,
    explain_in_place,
    explain_noise_carry,
    explain_noise_siblings,
    explain_noise_updates,
    explain_structural,
)
from pytest_msprobe.compare.judging import (
    ERROR,
    NO_OWN_ERRORS,
    NONFINITE,
    UNMATCHED,
    ApiResult,
    DumpPair,
    Overflow,
    RowResult,
    broken,
    compare_overflow,
    load_own_errors,
    own_error_verdicts,
    replay_wanted,
)
from pytest_msprobe.compare.pool import PairTask, Unusable, compare_pairs, tensor_metrics_of
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.errors import ConfigError, DumpFormatError, DumpReadError
from pytest_msprobe.format.layout import DumpLocation, discover
from pytest_msprobe.format.names import FORWARD, parse_name
from pytest_msprobe.format.own_errors import SELF_CHECK_JSON
from pytest_msprobe.thresholds import Thresholds

MODES = ("auto", "statistics", "tensor", "md5")
REPLAYS = ("auto", "all", "none")  # which calls of a tensor dump are replayed for their own errors


def compare(
    target: str | os.PathLike[str],
    baseline: str | os.PathLike[str],
    *,
    thresholds: Thresholds | None = None,
    fuzzy: bool = False,
    mode: str = "auto",
    jobs: int | None = None,
    stack: bool = False,
    self_check: bool = False,
    replay: bool | str = "auto",
    steps: Sequence[int] | None = None,
) -> CompareResult:
    """Compare a target dump with a baseline dump.

    ``target`` and ``baseline`` are a dump.json, a rank folder, a step folder or a dump root; all their steps
    and ranks are compared, paired by step and rank. A step or rank that only one side has is reported and the
    rest compared: one the baseline has and the target lacks fails the compare (the run under test did not do
    all the baseline did: it stopped early, a rank died, its steps changed), one only the target has does not
    (there is nothing to hold it to). ``mode`` is ``auto`` (tensor when both dumps hold tensors, md5 when both
    hold CRCs, else statistics) or one of those. ``stack`` attaches every call's stack (for the xlsx); the
    first divergence's stack is always attached.

    Own errors (each call's output against the float64 replay of its own inputs, see
    :mod:`pytest_msprobe.compare.judging.self_check`) are read from each dump's ``self_check.json``, or, in tensor mode with
    ``replay``, computed by replaying the dumps' tensors; the first divergence uses them where they exist.
    ``replay`` is ``"auto"`` (True): the calls whose own errors can change the verdict, those beyond a threshold
    and the calls they read (every call across devices or with ``self_check``, where each call's own error is
    judged); ``"all"``: every call; ``"none"`` (False): no replay.
    With ``self_check`` an out-of-line call fails the compare, and a target dump without own errors raises
    DumpFormatError: the check asked for could not be made.

    ``jobs`` processes (default: the CPUs this process may use) compare the dump pairs (step, rank), each pair
    whole in one process (parsing, alignment, statistics, tensor metrics); a single pair spreads its tensor
    files over them instead. The result is the same whatever ``jobs``. Calls are ordered across ranks through
    the collectives they share (see :mod:`pytest_msprobe.compare.alignment.rank_order`), so the first divergence is the
    earliest over all ranks.

    ``steps`` compares only those steps of both sides (the others are neither compared nor missing): a
    baseline that holds more steps than the run under test dumps (a trend's baseline dumps every step).

    Unusable input (a broken or hostile file, an empty dump, no step and rank in common) raises
    :class:`DumpFormatError` naming the file and the problem, before anything could be reported.

        >>> result = compare("npu_dump", "gpu_dump")          # doctest: +SKIP
        >>> result.passed, result.first_divergence.api         # doctest: +SKIP
        (False, 'Functional.relu.2.forward')
    """
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if isinstance(replay, bool):
        replay = "auto" if replay else "none"
    if replay not in REPLAYS:
        raise ConfigError(f"replay must be one of {', '.join(REPLAYS)}, got {replay!r}")
    jobs = default_jobs() if jobs is None else jobs
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be a whole number >= 1, got {jobs!r}")
    thresholds = thresholds or Thresholds()
    t_locs, b_locs = discover(target), discover(baseline)
    if steps is not None:
        wanted = set(steps)
        t_locs = [loc for loc in t_locs if loc.step in wanted]
        b_locs = [loc for loc in b_locs if loc.step in wanted]
        if not t_locs or not b_locs:
            side, path = ("target", target) if not t_locs else ("baseline", baseline)
            raise DumpFormatError(path, f"the {side} holds none of the steps {sorted(wanted)}")
    refuse_self_compare(t_locs, b_locs, target, baseline)
    pairs, unpaired, missing = pair_locations(t_locs, b_locs, target, baseline)
    builder = Builder(thresholds, mode)
    tasks = [PairTask(t_loc, b_loc, thresholds, mode, fuzzy, 1) for t_loc, b_loc in pairs]
    for part in compare_pairs(_compare_pair, tasks, jobs):
        if isinstance(part, tuple):  # (path, problem): the first unusable input, in pair order
            raise DumpFormatError(part[0], part[1])
        builder.merge(part)
    explain_noise_carry(builder)
    rows, apis, feeds, peers = builder.finish()
    checklist = compare_checklists(
        [(t_loc.path, b_loc.path, t_loc.step, t_loc.rank) for t_loc, b_loc in pairs],
        thresholds,
        breached={(api.step, api.rank) for api in apis if api.status == ERROR},
        calls=compared_calls(apis, rows),
    )
    overflow = compare_overflow(apis, rows)
    if overflow is not None:
        mark_overflow(apis, rows, overflow)
    coverage = measure_coverage(rows, apis, builder.pairs, thresholds.max_unmatched)
    tensors = replay != "none" and builder.mode == "tensor"
    why = checklist.cross_device()
    # (every call's own error is judged across devices and by the self-check: all of them are replayed)
    t_only: Sequence[set[str] | None] = [None] * len(pairs)
    b_only: Sequence[set[str] | None] = [None] * len(pairs)
    if tensors and replay == "auto" and why is None and not self_check:
        t_only, b_only = replay_wanted(apis, feeds, len(pairs))
    t_own = [load_own_errors(t_loc.path, tensors, only) for (t_loc, _), only in zip(pairs, t_only)]
    if self_check:
        for (t_loc, _), own_of in zip(pairs, t_own):
            if own_of is None:
                raise DumpFormatError(t_loc.path, f"no {SELF_CHECK_JSON} beside it: {NO_OWN_ERRORS}")
    b_own = [
        load_own_errors(b_loc.path, tensors, only) if found is not None else None
        for (_, b_loc), found, only in zip(pairs, t_own, b_only)
    ]
    own = own_error_verdicts(apis, t_own, b_own, thresholds)
    noise, relations = noise_rows(rows, thresholds), relation_breaks(apis, rows)
    across = None
    if why is not None:  # values that drift fail nothing: own errors and evidence judge
        across = judge_across(why, apis, rows, feeds, peers, builder.opaque, noise, own, relations, overflow)
    divergence = first_divergence(
        apis,
        rows,
        feeds,
        thresholds.amplification,
        builder.opaque,
        peers,
        builder.structural,
        own,
        self_check,
        noise,
        relations,
        overflow,
        across_devices=why is not None,
    )
    if not checklist.checked:  # dumps without checklists (plain msprobe's): what their records tell of one
        inferred = from_records(apis, rows, divergence)
        if inferred is not None:
            checklist = replace(checklist, differences=(inferred, *checklist.differences))
    stacks: dict[str, tuple[str, ...]] = {}
    pair_stacks: list[dict[str, tuple[str, ...]]] = []
    if stack:
        for p, (t_loc, _) in enumerate(pairs):
            pair_stacks.append({name: tuple(frames) for name, frames in read_stack(t_loc.path).items()})
            pair_stacks[-1].update(builder.extra_stacks.get(p, {}))
            for name, frames in pair_stacks[-1].items():
                stacks.setdefault(name, frames)
    else:  # the stacks of the first divergence, and of the first call each differing setting changes
        named = [(divergence.api_index, divergence.api)] if divergence is not None else []
        named += [(d.call_index, d.call) for d in checklist.failures if d.call_index is not None and d.call]
        read: dict[int, dict[str, Sequence[str]]] = {}
        for index, api in named:
            pair = apis[index].pair
            if pair not in read:
                read[pair] = {**read_stack(pairs[pair][0].path), **builder.extra_stacks.get(pair, {})}
            by_name = read[pair]
            found = by_name.get(api) or by_name.get(parse_name(api).with_direction(FORWARD))
            if found:
                stacks[api] = tuple(found)
    return CompareResult(
        target=os.fspath(target),
        baseline=os.fspath(baseline),
        mode=builder.mode or "statistics",
        rows=tuple(rows),
        apis=tuple(apis),
        first_divergence=divergence,
        pairs=tuple(builder.pairs),
        unpaired=tuple(unpaired),
        missing=tuple(missing),
        thresholds=thresholds,
        timestamp=datetime.datetime.now().strftime("%Y%m%d%H%M%S"),
        coverage=coverage,
        stacks=stacks,
        pair_stacks=tuple(pair_stacks),
        own=own,
        self_check=self_check,
        checklist=checklist,
        overflow=overflow,
        modules=Modules(builder.modules, tuple(builder.module_sources)),
        set_aside=tuple(builder.set_aside),
        across=across,
    )


def mark_overflow(apis: list[ApiResult], rows: list[RowResult], overflow: Overflow) -> None:
    """Make the overflowing call an error (a call only the target makes, unmatched so far, too), with the row
    that holds the inf/nan first: it fails the compare, and the counts and reports say so."""
    assert overflow.api_index is not None and overflow.row_index is not None
    i, j = overflow.api_index, overflow.row_index
    reason = f"overflow ({overflow.where}): {overflow.reason}"
    if rows[j].status != ERROR:  # (an error row already says why: NaN/Inf on one side only)
        rows[j] = dataclasses.replace(
            rows[j], status=ERROR, reason=reason, problem=rows[j].problem or NONFINITE
        )
    if apis[i].status != ERROR:
        apis[i] = dataclasses.replace(apis[i], status=ERROR, reason=reason, output_breach=True, worst_row=j)


def noise_rows(rows: Sequence[RowResult], thresholds: Thresholds) -> frozenset[int]:
    """The rows whose two tensors are below measure (see :func:`pytest_msprobe.compare.explain.below_measure`):
    Adam's second moment of a gradient that is rounding noise (1e-22) is one: its square root differs by half its
    size."""
    return frozenset(
        i for i, row in enumerate(rows) if below_measure(row.target, row.baseline, row.error, thresholds)
    )


def relation_breaks(apis: Sequence[ApiResult], rows: Sequence[RowResult]) -> dict[int, str]:
    """The breaching calls whose statistics break on the target a relation their inputs' statistics fix
    (see :mod:`pytest_msprobe.compare.judging.stat_relations`) and keep on the baseline: call index -> how."""
    found = {}
    for i, api in enumerate(apis):
        if not api.output_breach:
            continue
        pairs = [
            (r.target, r.baseline)
            for j in api.rows
            if (r := rows[j]).target is not None and r.baseline is not None
        ]
        mine = [t for t, _ in pairs if t is not None]
        theirs = [b for _, b in pairs if b is not None]
        dtype = next((leaf.dtype for leaf in theirs if leaf.role == OUTPUT), None)
        hit = broken(api.api, mine, theirs, dtype)
        if hit is not None:
            found[i] = hit.reason
    return found


FIRST_UNMATCHED = 5  # unmatched baseline calls a coverage failure names


def measure_coverage(
    rows: Sequence[RowResult], apis: Sequence[ApiResult], pairs: Sequence[DumpPair], limit: float
) -> Coverage:
    """How much of each dump pair's baseline found a partner in the target, against ``limit`` (a share of
    the pair's baseline rows). A call only the target makes counts nowhere: nothing in the baseline asked
    for it. A paired call's baseline items that the target lacks (an output more on the baseline) count."""
    calls = [0] * len(pairs)
    calls_unmatched = [0] * len(pairs)
    counted = [0] * len(pairs)
    unmatched = [0] * len(pairs)
    for api in apis:
        if api.bench_api is None:  # only in the target
            continue
        p = api.pair
        calls[p] += 1
        if api.status == UNMATCHED:
            calls_unmatched[p] += 1
        for i in api.rows:
            row = rows[i]
            if row.baseline is not None:
                counted[p] += 1
                if row.target is None:
                    unmatched[p] += 1
    per_pair = tuple(
        PairCoverage(calls[p], calls_unmatched[p], counted[p], unmatched[p], step=pair.step, rank=pair.rank)
        for p, pair in enumerate(pairs)
    )
    over = tuple(p for p, c in enumerate(per_pair) if c.share > limit)
    chosen = set(over)
    lonely = sorted(
        (api.order, i)
        for i, api in enumerate(apis)
        if api.pair in chosen and api.status == UNMATCHED and api.bench_api is not None
    )
    return Coverage.of(limit, per_pair, over, tuple(i for _, i in lonely[:FIRST_UNMATCHED]))


def refuse_self_compare(
    t_locs: Sequence[DumpLocation], b_locs: Sequence[DumpLocation], target: Any, baseline: Any
) -> None:
    """Refuse a compare of a dump with itself (the same folder, a link to it, a folder inside it): it passes
    whatever the dump holds, and proves nothing. Files are the same when the file system says so."""

    def identity(path: Path) -> tuple[int, int] | None:
        try:
            info = os.stat(path)
        except OSError:  # (reading it reports the problem)
            return None
        return info.st_dev, info.st_ino

    in_baseline = {identity(loc.path) for loc in b_locs} - {None}
    shared = [loc.path for loc in t_locs if identity(loc.path) in in_baseline]
    if shared:
        more = f" and {len(shared) - 1} more" if len(shared) > 1 else ""
        raise ConfigError(
            f"TARGET {os.fspath(target)} and BASELINE {os.fspath(baseline)} are the same dump (both read "
            f"{shared[0]}{more}): comparing a dump with itself proves nothing; compare the run under test with "
            "a baseline from another run"
        )


def default_jobs() -> int:
    """The CPUs this process may run on (``os.cpu_count()`` where the platform cannot say)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _compare_pair(task: PairTask) -> Builder | Unusable:
    """Everything of one dump pair that needs no other pair: a builder holding that pair alone, or the
    (path, problem) of unusable input."""
    try:
        t_dump, b_dump = read_dump(task.target), read_dump(task.baseline)
        plan = plan_updates(t_dump, b_dump)
        if plan.target is not t_dump.entries or plan.baseline is not b_dump.entries:
            t_dump = replace(t_dump, entries=plan.target)
            b_dump = replace(b_dump, entries=plan.baseline)
        builder = Builder(task.thresholds, task.mode)
        builder.add(t_dump, b_dump, align(t_dump.entries, b_dump.entries, fuzzy=task.fuzzy))
        builder.set_aside.extend(plan.set_aside)
        if plan.stacks or plan.baseline_stacks:
            builder.extra_stacks[0] = {**plan.baseline_stacks, **plan.stacks}
        if plan.opaque:
            builder.opaque.update(i for i, call in enumerate(builder.apis) if call.api in plan.opaque)
        builder.add_tensor_metrics(tensor_metrics_of(builder.tensor_files(), task.jobs))
    except DumpReadError:  # (not the dump's problem but the machine's: raised as it is)
        raise
    except DumpFormatError as exc:
        return (exc.path, exc.problem)
    place_modules(builder, t_dump, b_dump)
    explain_in_place(builder)
    explain_structural(builder)
    explain_noise_siblings(builder)
    explain_noise_updates(builder)
    return builder


def place_modules(builder: Builder, t_dump: Dump, b_dump: Dump) -> None:
    """Note where in the model each call of the builder's one pair was made: a call the target makes where
    the target's files say, one only the baseline makes where the baseline's say."""
    t_places = place_calls(t_dump)
    b_places = None
    for call in builder.apis:
        if call.one_side and call.bench_api is not None:  # only in the baseline
            b_places = b_places or place_calls(b_dump)
            call.module = b_places.of(call.api)
        else:
            call.module = t_places.of(call.api)
    for places in (t_places, b_places):
        if places is None:
            continue
        for path, about in places.about.items():
            builder.modules.setdefault(path, about)
        if places.source and places.source not in builder.module_sources:
            builder.module_sources.append(places.source)


def _describe(loc: DumpLocation) -> str:
    where = []
    if loc.step is not None:
        where.append(f"step {loc.step}")
    if loc.rank is not None:
        where.append(f"rank {loc.rank}")
    return f"{', '.join(where) or 'dump'} ({loc.path})"


def pair_locations(
    t_locs: list[DumpLocation], b_locs: list[DumpLocation], target: Any, baseline: Any
) -> tuple[list[tuple[DumpLocation, DumpLocation]], list[str], list[str]]:
    """Pairs of dumps by (step, rank), notes of the dumps one side only has, and those of them the target
    lacks (which fail the compare)."""
    if len(t_locs) == 1 and len(b_locs) == 1:
        return [(t_locs[0], b_locs[0])], [], []
    b_by_key = {(loc.step, loc.rank): loc for loc in b_locs}
    t_keys = {(loc.step, loc.rank) for loc in t_locs}
    pairs = [(loc, b_by_key[(loc.step, loc.rank)]) for loc in t_locs if (loc.step, loc.rank) in b_by_key]
    missing = [
        f"baseline {_describe(loc)}: not in the target"
        for loc in b_locs
        if (loc.step, loc.rank) not in t_keys
    ]
    unpaired = [
        f"target {_describe(loc)}: no baseline" for loc in t_locs if (loc.step, loc.rank) not in b_by_key
    ]
    if not pairs:

        def keys(locs: list[DumpLocation]) -> str:
            return ", ".join(f"step {loc.step} rank {loc.rank}" for loc in locs)

        raise DumpFormatError(
            baseline,
            f"no step/rank in common with {os.fspath(target)} (target: {keys(t_locs)}; baseline: {keys(b_locs)})",
        )
    return pairs, unpaired + missing, missing
