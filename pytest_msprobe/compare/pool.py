"""The compare's process pools, and what crosses them.

Dump pairs (step, rank) go to worker processes whole, one pair at a time per worker, and come back as a
:class:`Builder` packed into plain tuples; the tensor files of a single pair are spread over the workers in
contiguous chunks and come back as their metrics. Unusable input comes back as its ``(path, problem)``: an
exception's own attributes do not survive pickling.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from pytest_msprobe.compare.build import Builder, CallDraft, Draft, TensorRef
from pytest_msprobe.compare.dumps import Leaf, open_tensor
from pytest_msprobe.compare.judging import Check, DumpPair, StatMetrics, TensorMetrics, tensor_metrics
from pytest_msprobe.errors import DumpFormatError, DumpReadError
from pytest_msprobe.format.layout import DumpLocation
from pytest_msprobe.thresholds import Thresholds

Unusable = tuple[str, str]  # the (path, problem) of a DumpFormatError


@dataclass(frozen=True)
class PairTask:
    """One dump pair to compare, everything a worker process needs for it."""

    target: DumpLocation
    baseline: DumpLocation
    thresholds: Thresholds
    mode: str
    fuzzy: bool
    jobs: int  # processes for its tensor files


# the compare of one dump pair: a builder holding that pair alone, or the problem of unusable input
PairJob = Callable[[PairTask], Builder | Unusable]


def compare_pairs(job: PairJob, tasks: list[PairTask], jobs: int) -> list[Builder | Unusable]:
    """``job`` of every pair, in the order of ``tasks``: in this process for one pair or one job (a single
    pair then spreads its tensor files over ``jobs`` processes), else one pair at a time per worker process,
    so that a worker holds one tensor pair in memory. In this process the first unusable pair ends the list."""
    if jobs <= 1 or len(tasks) < 2:
        out: list[Builder | Unusable] = []
        for task in tasks:
            part = job(dataclasses.replace(task, jobs=jobs))
            out.append(part)
            if isinstance(part, tuple):
                break  # unusable input: stop at the first bad pair
        return out
    with _pool(min(jobs, len(tasks))) as pool:
        packed = pool.map(functools.partial(_job_packed, job), tasks)
        return [part if isinstance(part, tuple) else _unpack(part) for part in packed]


def _job_packed(job: PairJob, task: PairTask) -> _Packed | Unusable:
    part = job(task)
    return part if isinstance(part, tuple) else _pack(part)


def tensor_metrics_of(files: list[tuple[TensorRef, TensorRef]], jobs: int) -> list[TensorMetrics]:
    """The metrics of every pair of tensor files, in order, spread over ``jobs`` processes; the first
    unusable file (in order) raises its :class:`DumpFormatError`."""
    results: list[TensorMetrics | Unusable] = []
    if jobs <= 1 or len(files) < 2:
        for f in files:
            results.append(_metrics_of(f))
            if isinstance(results[-1], tuple):
                break  # unusable input: stop at the first bad file
    else:
        jobs = min(jobs, len(files))
        # contiguous chunks: each process reads its own files; results come back in order
        size = max(1, -(-len(files) // (jobs * 4)))
        chunks = [files[i : i + size] for i in range(0, len(files), size)]
        with _pool(jobs) as pool:
            for part in pool.map(_metrics_chunk, chunks):
                results.extend(part)
    metrics = []
    for outcome in results:
        if isinstance(outcome, tuple):
            raise DumpFormatError(outcome[0], outcome[1])
        metrics.append(outcome)
    return metrics


def _metrics_of(files: tuple[TensorRef, TensorRef]) -> TensorMetrics | Unusable:
    try:
        return tensor_metrics(open_tensor(*files[0]), open_tensor(*files[1]))
    except DumpReadError:  # (not the dump's problem but the machine's: raised as it is)
        raise
    except DumpFormatError as exc:
        return (exc.path, exc.problem)


def _metrics_chunk(chunk: Sequence[tuple[TensorRef, TensorRef]]) -> list[TensorMetrics | Unusable]:
    return [_metrics_of(files) for files in chunk]


def _pool(workers: int) -> ProcessPoolExecutor:
    # fork: a worker starts in milliseconds and inherits the imports (never torch: the compare does not need it)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context(method))


# --------------------------------------------------------------------------------------- builders as tuples
@dataclass(frozen=True)
class _Packed:
    """A builder of one dump pair as plain tuples, for the way back from a worker: pickle moves tuples of
    numbers and strings at C speed, dataclasses (metrics per row, a call) through Python code, which cost as
    much as the compare itself."""

    mode: str | None
    pairs: list[DumpPair]
    drafts: list[tuple[Any, ...]]
    apis: list[tuple[Any, ...]]
    feeds: dict[int, list[int]]
    opaque: set[int]
    structural: dict[int, int]
    noise: dict[int, dict[tuple[Any, Any], str]]
    modules: dict[tuple[str, ...], str]
    module_sources: list[str]
    set_aside: list[str]
    extra_stacks: dict[int, dict[str, tuple[str, ...]]]


def _names(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _fields(obj: Any, names: tuple[str, ...]) -> tuple[Any, ...] | None:
    return None if obj is None else tuple(getattr(obj, n) for n in names)


def _pack(builder: Builder) -> _Packed:
    """The builder's rows and calls as tuples (its tensor files are compared: there are none left)."""
    stat_fields, tensor_fields, api_fields = _names(StatMetrics), _names(TensorMetrics), _names(CallDraft)
    drafts = []
    for d in builder.drafts:
        c = d.check
        assert c is not None and d.task is None
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
                (
                    c.status,
                    c.error,
                    c.allowed,
                    c.reason,
                    _fields(c.stat, stat_fields),
                    _fields(c.tensor, tensor_fields),
                    c.msprobe_accuracy,
                    c.problem,
                ),
            )
        )
    apis = [tuple(getattr(a, n) for n in api_fields) for a in builder.apis]
    return _Packed(
        builder.mode,
        builder.pairs,
        drafts,
        apis,
        builder.feeds,
        builder.opaque,
        builder.structural,
        builder.noise,
        builder.modules,
        builder.module_sources,
        builder.set_aside,
        builder.extra_stacks,
    )


def _unpack(packed: _Packed) -> Builder:
    builder = Builder(Thresholds(), "auto", mode=packed.mode, pairs=packed.pairs)
    leaf = Leaf._make
    for row, bench_row, api_index, role, t, b, skip, api, c in packed.drafts:
        status, error, allowed, reason, stat, tensor, accuracy, problem = c
        check = Check(
            status,
            error,
            allowed,
            reason,
            None if stat is None else StatMetrics(*stat),
            None if tensor is None else TensorMetrics(*tensor),
            accuracy,
            problem,
        )
        target = None if t is None else leaf(t)
        baseline = None if b is None else leaf(b)
        builder.drafts.append(
            Draft(row, bench_row, api_index, role, target, baseline, check, None, skip, api)
        )
    builder.apis = [CallDraft(*a) for a in packed.apis]
    builder.feeds, builder.opaque, builder.structural = packed.feeds, packed.opaque, packed.structural
    builder.noise = packed.noise
    builder.modules, builder.module_sources = packed.modules, packed.module_sources
    builder.set_aside, builder.extra_stacks = packed.set_aside, packed.extra_stacks
    return builder
