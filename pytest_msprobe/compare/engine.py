"""The compare: load both dumps, pair their steps and ranks, align the calls, judge every row, find the
first divergence. :func:`compare` is the library entry point the CLI and the pytest plugin call."""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pytest_msprobe.compare.align import Alignment, align
from pytest_msprobe.compare.metrics import StatMetrics, TensorMetrics, tensor_metrics
from pytest_msprobe.compare.rank_order import (
    DISTRIBUTED,
    CallPlace,
    collective_keys,
    collective_peers,
    execution_order,
)
from pytest_msprobe.compare.records import (
    INPUT,
    OUTPUT,
    TENSOR,
    ApiEntry,
    Dump,
    Leaf,
    read_dump,
    read_stack,
    tensor_path,
)
from pytest_msprobe.compare.result import (
    ERROR,
    PASS,
    UNMATCHED,
    WARNING,
    ApiResult,
    CompareResult,
    Coverage,
    Divergence,
    DumpPair,
    PairCoverage,
    RowResult,
)
from pytest_msprobe.compare.tensors import open_tensor
from pytest_msprobe.compare.thresholds import Thresholds
from pytest_msprobe.compare.verdict import (
    Check,
    check_kinds,
    check_md5,
    check_statistics,
    check_tensors,
    check_unmatched,
    finish,
    first_divergence,
    other_shape,
    summarize_api,
)
from pytest_msprobe.errors import ConfigError, DumpFormatError
from pytest_msprobe.format.layout import DumpLocation, discover
from pytest_msprobe.format.names import is_parameters_grad, parse_name

MODES = ("auto", "statistics", "tensor", "md5")


def compare(
    target: str | os.PathLike[str],
    baseline: str | os.PathLike[str],
    *,
    thresholds: Thresholds | None = None,
    fuzzy: bool = False,
    mode: str = "auto",
    jobs: int | None = None,
    stack: bool = False,
) -> CompareResult:
    """Compare a target dump with a baseline dump.

    ``target`` and ``baseline`` are a dump.json, a rank folder, a step folder or a dump root; all their steps
    and ranks are compared, paired by step and rank. A step or rank that only one side has is reported and the
    rest compared: one the baseline has and the target lacks fails the compare (the run under test did not do
    all the baseline did: it stopped early, a rank died, its steps changed), one only the target has does not
    (there is nothing to hold it to). ``mode`` is ``auto`` (tensor when both dumps hold tensors, md5 when both
    hold CRCs, else statistics) or one of those. ``stack`` attaches every call's stack (for the xlsx); the
    first divergence's stack is always attached.

    ``jobs`` processes (default: the CPUs this process may use) compare the dump pairs (step, rank), each pair
    whole in one process (parsing, alignment, statistics, tensor metrics); a single pair spreads its tensor
    files over them instead. The result is the same whatever ``jobs``. Calls are ordered across ranks through
    the collectives they share (see :mod:`pytest_msprobe.compare.rank_order`), so the first divergence is the
    earliest over all ranks.

    Unusable input (a broken or hostile file, an empty dump, no step and rank in common) raises
    :class:`DumpFormatError` naming the file and the problem, before anything could be reported.

        >>> result = compare("npu_dump", "gpu_dump")          # doctest: +SKIP
        >>> result.passed, result.first_divergence.api         # doctest: +SKIP
        (False, 'Functional.relu.2.forward')
    """
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    jobs = default_jobs() if jobs is None else jobs
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be a whole number >= 1, got {jobs!r}")
    thresholds = thresholds or Thresholds()
    t_locs, b_locs = discover(target), discover(baseline)
    refuse_self_compare(t_locs, b_locs, target, baseline)
    pairs, unpaired, missing = _pair_locations(t_locs, b_locs, target, baseline)
    builder = _Builder(thresholds, mode)
    for part in _compare_pairs(
        [_PairTask(t_loc, b_loc, thresholds, mode, fuzzy, 1) for t_loc, b_loc in pairs], jobs
    ):
        if isinstance(part, tuple):  # (path, problem): the first unusable input, in pair order
            raise DumpFormatError(part[0], part[1])
        builder.merge(part)
    rows, apis, feeds, peers = builder.finish()
    coverage = measure_coverage(rows, apis, builder.pairs, thresholds.max_unmatched)
    divergence = first_divergence(apis, rows, feeds, thresholds.amplification, builder.opaque, peers)
    divergence = structural_divergence(divergence, apis, rows, builder.structural)
    stacks: dict[str, tuple[str, ...]] = {}
    if stack:
        for t_loc, _ in pairs:
            for name, frames in read_stack(t_loc.path).items():
                stacks.setdefault(name, tuple(frames))
    elif divergence is not None:
        found = read_stack(pairs[apis[divergence.api_index].pair][0].path).get(divergence.api)
        if found:
            stacks[divergence.api] = tuple(found)
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
    )


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
        PairCoverage(pair.step, pair.rank, calls[p], calls_unmatched[p], counted[p], unmatched[p])
        for p, pair in enumerate(pairs)
    )
    over = tuple(p for p, c in enumerate(per_pair) if c.share > limit)
    chosen = set(over)
    lonely = sorted(
        (api.order, i)
        for i, api in enumerate(apis)
        if api.pair in chosen and api.status == UNMATCHED and api.bench_api is not None
    )
    return Coverage(limit, per_pair, over, tuple(i for _, i in lonely[:FIRST_UNMATCHED]))


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


# ------------------------------------------------------------------------------------- dump pairs in parallel
@dataclass(frozen=True)
class _PairTask:
    """One dump pair to compare, everything a worker process needs for it."""

    target: DumpLocation
    baseline: DumpLocation
    thresholds: Thresholds
    mode: str
    fuzzy: bool
    jobs: int  # processes for its tensor files


def _compare_pair(task: _PairTask) -> _Builder | tuple[str, str]:
    """Everything of one dump pair that needs no other pair: a builder holding that pair alone, or the
    (path, problem) of unusable input (an exception's own attributes do not survive pickling)."""
    try:
        t_dump, b_dump = read_dump(task.target), read_dump(task.baseline)
        builder = _Builder(task.thresholds, task.mode)
        builder.add(t_dump, b_dump, align(t_dump.entries, b_dump.entries, fuzzy=task.fuzzy))
        builder.run_tensor_tasks(task.jobs)
    except DumpFormatError as exc:
        return (exc.path, exc.problem)
    builder.explain_in_place()
    builder.explain_structural()
    for i in builder.tasks:  # done: no need to carry the file names back
        builder.drafts[i].task = None
    builder.tasks.clear()
    return builder


def _compare_packed(task: _PairTask) -> _Packed | tuple[str, str]:
    part = _compare_pair(task)
    return part if isinstance(part, tuple) else _pack(part)


def _compare_pairs(tasks: list[_PairTask], jobs: int) -> list[_Builder | tuple[str, str]]:
    """Every pair compared, in the order of ``tasks``: in this process for one pair or one job (a single pair
    then spreads its tensor files over ``jobs`` processes), else one pair at a time per worker process, so
    that a worker holds one tensor pair in memory."""
    if jobs <= 1 or len(tasks) < 2:
        out: list[_Builder | tuple[str, str]] = []
        for task in tasks:
            part = _compare_pair(dataclasses.replace(task, jobs=jobs))
            out.append(part)
            if isinstance(part, tuple):
                break  # unusable input: stop at the first bad pair
        return out
    with _pool(min(jobs, len(tasks))) as pool:
        return [
            part if isinstance(part, tuple) else _unpack(part) for part in pool.map(_compare_packed, tasks)
        ]


@dataclass(frozen=True)
class _Packed:
    """A builder of one dump pair as plain tuples, for the way back from a worker: pickle moves tuples of
    numbers and strings at C speed, dataclasses (a Leaf, a Check, metrics per row) through Python code, which
    cost as much as the compare itself."""

    mode: str | None
    pairs: list[DumpPair]
    drafts: list[tuple[Any, ...]]
    apis: list[tuple[Any, ...]]
    feeds: dict[int, list[int]]
    opaque: set[int]
    structural: dict[int, int]


def _names(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _fields(obj: Any, names: tuple[str, ...]) -> tuple[Any, ...] | None:
    return None if obj is None else tuple(getattr(obj, n) for n in names)


def _pack(builder: _Builder) -> _Packed:
    stat_fields, tensor_fields, api_fields = _names(StatMetrics), _names(TensorMetrics), _names(_ApiDraft)
    drafts = []
    for d in builder.drafts:
        c = d.check
        assert c is not None
        drafts.append(
            (
                d.row,
                d.bench_row,
                d.api_index,
                d.role,
                None if d.target is None else tuple(d.target),
                None if d.baseline is None else tuple(d.baseline),
                d.skip,
                d.api,
                (c.status, c.error, c.allowed, c.reason, c.msprobe_accuracy),
                _fields(c.stat, stat_fields),
                _fields(c.tensor, tensor_fields),
            )
        )
    apis = [tuple(getattr(a, n) for n in api_fields) for a in builder.apis]
    return _Packed(
        builder.mode, builder.pairs, drafts, apis, builder.feeds, builder.opaque, builder.structural
    )


def _unpack(packed: _Packed) -> _Builder:
    builder = _Builder(Thresholds(), "auto", mode=packed.mode, pairs=packed.pairs)
    leaf = Leaf._make
    for row, bench_row, api_index, role, t, b, skip, api, c, stat, tensor in packed.drafts:
        check = Check(
            c[0],
            c[1],
            c[2],
            c[3],
            None if stat is None else StatMetrics(*stat),
            None if tensor is None else TensorMetrics(*tensor),
            c[4],
        )
        target = None if t is None else leaf(t)
        baseline = None if b is None else leaf(b)
        builder.drafts.append(
            _Draft(row, bench_row, api_index, role, target, baseline, check, None, skip, api)
        )
    builder.apis = [_ApiDraft(*a) for a in packed.apis]
    builder.feeds, builder.opaque, builder.structural = packed.feeds, packed.opaque, packed.structural
    return builder


def _pool(workers: int) -> ProcessPoolExecutor:
    import multiprocessing

    # fork: a worker starts in milliseconds and inherits the imports (never torch: the compare does not need it)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context(method))


def _describe(loc: DumpLocation) -> str:
    where = []
    if loc.step is not None:
        where.append(f"step {loc.step}")
    if loc.rank is not None:
        where.append(f"rank {loc.rank}")
    return f"{', '.join(where) or 'dump'} ({loc.path})"


def _pair_locations(
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


# --------------------------------------------------------------------------------------------------- build
@dataclass
class _Draft:
    """A row under construction (tensor rows wait for their metrics)."""

    row: str
    bench_row: str | None
    api_index: int
    role: str
    target: Leaf | None
    baseline: Leaf | None
    check: Check | None = None
    task: tuple[TensorRef, TensorRef] | None = None  # tensor files to compare
    skip: bool = False
    api: str = ""


@dataclass
class _ApiDraft:
    api: str
    bench_api: str | None
    step: int | None
    rank: int | None
    pair: int
    position: float  # execution position within its dump pair
    direction: str | None
    row_start: int
    row_stop: int
    one_side: bool
    base: str = ""


@dataclass
class _Builder:
    thresholds: Thresholds
    requested_mode: str
    mode: str | None = None
    drafts: list[_Draft] = field(default_factory=list)
    apis: list[_ApiDraft] = field(default_factory=list)
    pairs: list[DumpPair] = field(default_factory=list)
    feeds: dict[int, list[int]] = field(default_factory=dict)
    tasks: list[int] = field(default_factory=list)  # draft indices waiting for tensor metrics
    opaque: set[int] = field(default_factory=set)  # calls whose inputs are unknown
    structural: dict[int, int] = field(default_factory=dict)  # call -> the one-side call that fed it

    def merge(self, part: _Builder) -> None:
        """Append the pairs of ``part`` (a builder of later dump pairs) to this one."""
        if part.mode is not None:
            if self.mode is not None and part.mode != self.mode:
                raise DumpFormatError(
                    part.pairs[0].target,
                    f"is a {part.mode} dump while earlier steps/ranks were compared as {self.mode}",
                )
            self.mode = part.mode
        rows, calls, pairs = len(self.drafts), len(self.apis), len(self.pairs)
        for d in part.drafts:
            d.api_index += calls
        for a in part.apis:
            a.row_start += rows
            a.row_stop += rows
            a.pair += pairs
        self.drafts.extend(part.drafts)
        self.apis.extend(part.apis)
        self.pairs.extend(part.pairs)
        self.feeds.update({i + calls: [j + calls for j in fed] for i, fed in part.feeds.items()})
        self.opaque.update(i + calls for i in part.opaque)
        self.structural.update({i + calls: j + calls for i, j in part.structural.items()})

    def _resolve_mode(self, t: Dump, b: Dump) -> str:
        if self.requested_mode == "auto":
            if t.task == "tensor" and b.task == "tensor":
                mode = "tensor"
            elif t.has_md5 and b.has_md5:
                mode = "md5"
            else:
                mode = "statistics"
        else:
            mode = self.requested_mode
            for dump in (t, b):
                if mode == "tensor" and dump.task != "tensor":
                    raise DumpFormatError(
                        dump.path, "has no tensor files (task 'statistics'): use statistics mode"
                    )
                if mode == "md5" and not dump.has_md5:
                    raise DumpFormatError(dump.path, "has no md5 (CRC32) values: use statistics mode")
        if self.mode is not None and mode != self.mode:
            raise DumpFormatError(
                t.path, f"is a {mode} dump while earlier steps/ranks were compared as {self.mode}"
            )
        self.mode = mode
        return mode

    def add(self, t: Dump, b: Dump, alignment: Alignment) -> None:
        mode = self._resolve_mode(t, b)
        pair = len(self.pairs)
        step = t.location.step if t.location.step is not None else b.location.step
        rank = t.location.rank if t.location.rank is not None else b.location.rank
        self.pairs.append(
            DumpPair(
                step,
                rank,
                str(t.path),
                str(b.path),
                alignment.method,
                alignment.matched,
                alignment.target_only,
                alignment.baseline_only,
            )
        )
        first_api = len(self.apis)
        for position, (ti, bj) in enumerate(alignment.pairs):
            te = t.entries[ti] if ti is not None else None
            be = b.entries[bj] if bj is not None else None
            self._add_api(te, be, t, b, mode, step, rank, pair, float(position))
        self._link(first_api)

    def _add_api(
        self,
        te: ApiEntry | None,
        be: ApiEntry | None,
        t: Dump,
        b: Dump,
        mode: str,
        step: int | None,
        rank: int | None,
        pair: int,
        position: float,
    ) -> None:
        main = te or be
        assert main is not None
        api_index = len(self.apis)
        parts = main.parts
        start = len(self.drafts)
        if te is None or be is None:
            for leaf in main.leaves:
                tl, bl = (leaf, None) if te is not None else (None, leaf)
                draft = _Draft(leaf.name, None if bl is None else leaf.name, api_index, leaf.role, tl, bl)
                draft.check = check_unmatched(tl, bl)
                draft.api = main.name
                self.drafts.append(draft)
        else:
            b_rows = {leaf.suffix: leaf for leaf in be.leaves}
            seen = set()
            for leaf in te.leaves:
                other = b_rows.get(leaf.suffix)
                seen.add(leaf.suffix)
                self._add_row(leaf, other, te.name, be.name, api_index, t, b, mode)
            for leaf in be.leaves:
                if leaf.suffix not in seen:
                    self._add_row(None, leaf, te.name, be.name, api_index, t, b, mode)
        self.apis.append(
            _ApiDraft(
                api=main.name,
                bench_api=be.name if be is not None else None,
                step=step,
                rank=rank,
                pair=pair,
                position=position,
                direction=parts.direction,
                row_start=start,
                row_stop=len(self.drafts),
                one_side=te is None or be is None,
                base=parts.base,
            )
        )

    def _add_row(
        self,
        tl: Leaf | None,
        bl: Leaf | None,
        t_api: str,
        b_api: str,
        api_index: int,
        t: Dump,
        b: Dump,
        mode: str,
    ) -> None:
        main = tl or bl
        assert main is not None
        draft = _Draft(
            row=tl.name if tl is not None else b_api + main.suffix,
            bench_row=bl.name if bl is not None else None,
            api_index=api_index,
            role=main.role,
            target=tl,
            baseline=bl,
            api=t_api,
        )
        self.drafts.append(draft)
        if tl is None or bl is None:
            draft.check = check_unmatched(tl, bl)
            return
        kinds = check_kinds(tl, bl)
        if kinds is not None:
            draft.check = kinds
            return
        # the baseline's dtype sets the tolerance: the target must reproduce the baseline to its precision
        tol, draft.skip = self.thresholds.tolerance(bl.dtype, t_api, draft.row, statistics=True)
        if mode == "md5":
            draft.check = finish(check_md5(tl, bl, tol), draft.skip, t_api)
        elif mode == "tensor" and tl.data_name and bl.data_name and tl.shape == bl.shape:
            draft.task = (
                TensorRef(str(tensor_path(t, tl.data_name)), tl.dtype, tl.shape),
                TensorRef(str(tensor_path(b, bl.data_name)), bl.dtype, bl.shape),
            )
            self.tasks.append(len(self.drafts) - 1)
        else:
            check = check_statistics(tl, bl, tol)
            if mode == "tensor" and tl.shape == bl.shape:
                check = Check(
                    check.status,
                    check.error,
                    check.allowed,
                    "; ".join(
                        x for x in (check.reason, "no tensor file on one side: statistics compared") if x
                    ),
                    check.stat,
                )
            draft.check = finish(check, draft.skip, t_api)

    def _link(self, first_api: int) -> None:
        """Backward calls read their forward call's tensors; parameters_grad runs with its module's backward."""
        by_name: dict[str, int] = {}
        backward_of: dict[str, list[int]] = {}
        for i in range(first_api, len(self.apis)):
            api = self.apis[i]
            by_name.setdefault(api.api, i)
            if api.direction == "backward" and not is_parameters_grad(api.api):
                backward_of.setdefault(api.base, []).append(i)
        backward_end = max(
            (
                a.position
                for a in self.apis[first_api:]
                if a.direction == "backward" and not is_parameters_grad(a.api)
            ),
            default=0.0,
        )
        for i in range(first_api, len(self.apis)):
            api = self.apis[i]
            if is_parameters_grad(api.api):
                module = api.base.rsplit(".parameters_grad", 1)[0]
                calls = backward_of.get(module, [])
                self.feeds[i] = list(calls)
                if calls:  # the gradient is complete once the module's last backward call ran
                    api.position = self.apis[calls[-1]].position + 0.5
                else:
                    # no backward record of the module (msprobe loses it behind an in-place ReLU): the gradient
                    # arrives during backward from calls we cannot see
                    api.position = backward_end + 0.5
                    self.opaque.add(i)
            elif api.direction == "backward":
                forward = parse_name(api.api).with_direction("forward")
                if forward in by_name:
                    self.feeds[i] = [by_name[forward]]

    def run_tensor_tasks(self, jobs: int) -> None:
        if not self.tasks:
            return
        files = [self.drafts[i].task for i in self.tasks]
        assert all(f is not None for f in files)
        results = _compute_all([f for f in files if f is not None], jobs)
        for i, outcome in zip(self.tasks, results):
            draft = self.drafts[i]
            if isinstance(outcome, tuple):  # (path, problem) from a worker
                raise DumpFormatError(outcome[0], outcome[1])
            assert draft.target is not None and draft.baseline is not None
            tol, _ = self.thresholds.tolerance(draft.baseline.dtype, draft.api, draft.row)
            check = check_tensors(draft.target, draft.baseline, outcome, tol, self.thresholds.msprobe_rule)
            draft.check = finish(check, draft.skip, draft.api)

    def explain_in_place(self) -> None:
        """Forgive input rows that differ only because one side recorded an in-place op's input after the update.

        msprobe versions disagree on when an in-place module (``nn.ReLU(inplace=True)``) records its input:
        before the op, or after it, when it already equals the output. When one side's input equals its own
        output, the other's does not, and the first side's input matches the other side's output, the two
        recorded the same tensor at different moments; that row is compared with the other side's output.
        """
        for api in self.apis:
            if api.one_side:
                continue
            drafts = self.drafts[api.row_start : api.row_stop]
            outputs = [
                d for d in drafts if d.role == OUTPUT and d.target is not None and d.baseline is not None
            ]
            for d in drafts:
                check = d.check
                if d.role == OUTPUT or check is None or check.status not in (ERROR, WARNING):
                    continue
                if (
                    d.target is None
                    or d.baseline is None
                    or d.target.kind != TENSOR
                    or d.baseline.kind != TENSOR
                ):
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
                        tol, _ = self.thresholds.tolerance(pair[1].dtype, d.api, d.row, statistics=True)
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

    def explain_structural(self) -> None:
        """Forgive a call whose differing inputs are the outputs of a call only one side makes.

        An inserted or removed call (one extra relu after a max-pool, say) changes the structure of the run,
        and with it what flows into the next call: a relu's backward zeroes the gradient where its input is 0,
        so the max-pool's backward reads a different gradient although every weight gradient stays the same.
        The call that reads the one-side call's output is then a warning, not an error; the one-side call
        itself is reported as unmatched. When the difference really changes the numbers, it reaches the calls
        after that one through matched calls, and those still fail (the first divergence then names the
        one-side call: see :func:`structural_divergence`). A tensor is recognised by its record (shape, dtype
        and statistics), which the producing and the consuming call share within one dump.
        """
        produced: dict[tuple[int, str, tuple[Any, ...]], int] = {}
        for index, api in enumerate(self.apis):
            if not api.one_side:
                continue
            for d in self.drafts[api.row_start : api.row_stop]:
                for side, leaf in (("target", d.target), ("baseline", d.baseline)):
                    if (
                        leaf is not None
                        and d.role == OUTPUT
                        and leaf.kind == TENSOR
                        and None not in leaf.stats
                    ):
                        produced.setdefault((api.pair, side, _fingerprint(leaf)), index)
        if not produced:
            return
        for index, api in enumerate(self.apis):
            if api.one_side:
                continue
            drafts = self.drafts[api.row_start : api.row_stop]
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
                only = "target" if self.drafts[self.apis[source].row_start].target is not None else "baseline"
                note = (
                    f"follows {self.apis[source].api}, a call only the {only} makes: a difference of structure, "
                    "not of precision"
                )
                for d in failing:
                    assert d.check is not None
                    d.check = _escalate_to(d.check, WARNING, note)
                self.structural[index] = source

    def finish(
        self,
    ) -> tuple[list[RowResult], list[ApiResult], dict[int, list[int]], dict[int, list[int]]]:
        """Rows and calls as results, with the calls each call reads (``feeds``) and each collective's
        counterparts on the other ranks (``peers``)."""
        rows = []
        for d in self.drafts:
            check = d.check
            assert check is not None
            rows.append(
                RowResult(
                    row=d.row,
                    bench_row=d.bench_row,
                    api_index=d.api_index,
                    role=d.role,
                    target=d.target,
                    baseline=d.baseline,
                    status=check.status,
                    error=check.error,
                    allowed=check.allowed,
                    reason=check.reason,
                    stat=check.stat,
                    tensor=check.tensor,
                    msprobe_accuracy=check.msprobe_accuracy,
                )
            )
        places = [
            CallPlace(
                a.api,
                a.step,
                a.rank,
                a.position,
                # only a collective's group orders anything: the other calls' rows are not searched
                _process_group(self.drafts[a.row_start : a.row_stop])
                if a.api.startswith(DISTRIBUTED)
                else None,
            )
            for a in self.apis
        ]
        keys = collective_keys(places)
        order = {i: n for n, i in enumerate(execution_order(places, keys))}
        apis = []
        for i, a in enumerate(self.apis):
            summary = summarize_api(rows[a.row_start : a.row_stop], a.row_start, a.one_side)
            apis.append(
                ApiResult(
                    api=a.api,
                    bench_api=a.bench_api,
                    step=a.step,
                    rank=a.rank,
                    order=order[i],
                    direction=a.direction,
                    status=summary.status if not a.one_side else UNMATCHED,
                    reason=summary.reason,
                    input_error=summary.input_error,
                    output_error=summary.output_error,
                    input_breach=summary.input_breach,
                    output_breach=summary.output_breach,
                    row_start=a.row_start,
                    row_stop=a.row_stop,
                    worst_row=summary.worst_row,
                    pair=a.pair,
                )
            )
        return rows, apis, self.feeds, collective_peers(places, keys)


def _process_group(drafts: list[_Draft]) -> tuple[int, ...] | None:
    """The ranks of the process group a call names among its inputs (msprobe's ``torch.ProcessGroup`` record)."""
    for d in drafts:
        leaf = d.target or d.baseline
        if leaf is None or leaf.role != INPUT or leaf.type != "torch.ProcessGroup":
            continue
        ranks = leaf.value.get("group_ranks") if isinstance(leaf.value, dict) else None
        if isinstance(ranks, list) and ranks and all(type(r) is int for r in ranks):
            return tuple(sorted(ranks))
    return None


def _same_record(x: Leaf, y: Leaf) -> bool:
    return x.shape == y.shape and x.dtype == y.dtype and x.stats == y.stats and None not in x.stats


def _fingerprint(leaf: Leaf) -> tuple[Any, ...]:
    return (leaf.shape, leaf.dtype, leaf.stats)


def _escalate_to(check: Check, status: str, note: str) -> Check:
    """The same check with another status and a note appended to its reason."""
    reason = f"{check.reason}; {note}" if check.reason else note
    return Check(status, check.error, check.allowed, reason, check.stat, check.tensor, check.msprobe_accuracy)


def structural_divergence(
    divergence: Divergence | None,
    apis: Sequence[ApiResult],
    rows: Sequence[RowResult],
    structural: Mapping[int, int],
) -> Divergence | None:
    """Name a one-side call as the first divergence when the error has no matched origin before it.

    Unless a matched call shows the error entering (its outputs breach while its inputs match), an error that
    first shows after a call that read the output of a call only one side makes comes from that call.
    """
    if divergence is None or divergence.rule == "enters" or not structural:
        return divergence
    first_error = min((api.order for api in apis if api.status == ERROR), default=None)
    if first_error is None:
        return divergence
    if divergence.rule == "inherited" and any(
        rows[j].role != OUTPUT and rows[j].status == ERROR and other_shape(rows[j])
        for j in apis[divergence.api_index].rows
    ):
        return divergence  # inputs of other shapes: another model or data, more than a call added or removed
    before = [(apis[c].order, source) for c, source in structural.items() if apis[c].order <= first_error]
    if not before:
        return divergence
    _, source = min(before)
    api = apis[source]
    out_rows = [j for j in api.rows if rows[j].role == OUTPUT] or list(api.rows)
    side = "target" if rows[out_rows[0]].target is not None else "baseline"
    first = min((a for a in apis if a.status == ERROR), key=lambda a: a.order)
    why = (
        f"{api.api} is a call only the {side} makes, and the numbers after it differ (first breach: {first.api}, "
        f"{first.reason}): the error enters with this extra call"
    )
    return Divergence(
        api.api, rows[out_rows[0]].row, api.step, api.rank, why, "structural", source, out_rows[0]
    )


# ------------------------------------------------------------------------------------------ tensor metrics
class TensorRef(NamedTuple):
    """A tensor file to read, with the dtype and shape its dump.json record gives it."""

    path: str
    dtype: str | None
    shape: tuple[int, ...] | None


def _metrics_of(files: tuple[TensorRef, TensorRef]) -> TensorMetrics | tuple[str, str]:
    try:
        return tensor_metrics(open_tensor(*files[0]), open_tensor(*files[1]))
    except DumpFormatError as exc:
        return (exc.path, exc.problem)


def _metrics_chunk(chunk: Sequence[tuple[TensorRef, TensorRef]]) -> list[TensorMetrics | tuple[str, str]]:
    return [_metrics_of(files) for files in chunk]


def _compute_all(
    files: list[tuple[TensorRef, TensorRef]], jobs: int
) -> list[TensorMetrics | tuple[str, str]]:
    if jobs <= 1 or len(files) < 2:
        out = []
        for f in files:
            result = _metrics_of(f)
            out.append(result)
            if isinstance(result, tuple):
                break  # unusable input: stop at the first bad file
        return out
    jobs = min(jobs, len(files))
    # contiguous chunks: each process reads its own files; results come back in order
    size = max(1, -(-len(files) // (jobs * 4)))
    chunks = [files[i : i + size] for i in range(0, len(files), size)]
    with _pool(jobs) as pool:
        results = []
        for part in pool.map(_metrics_chunk, chunks):
            results.extend(part)
    return results
