"""A test's trend over many steps (``trend_steps=N``): which steps are dumped, what a baseline must hold, and
when the test body is run again to dump the steps around the trend's first divergence.

A regenerated baseline dumps every trend step (steps ``0..N-1`` besides the test's own), so that a compare of
any step the trend points at has the baseline's side. A compare run dumps only the test's steps and records the
trend of all N; when the trend first differs at a step K that was not dumped, and the compare of the dumped
steps did not already fail at or before K, the body runs again with the same seed and dumps the backward of
K-1 and the forward of K (steps K-1 and K; step 0 alone for K = 0), msprobe's advice for a loss that drifts.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_msprobe.dump.determinism import seed_all
from pytest_msprobe.errors import ConfigError, DumpError, MsprobeError
from pytest_msprobe.format.trendfile import (
    TREND_JSON,
    TrendData,
    read_trend,
    read_trends,
    trend_file,
    trend_files,
)
from pytest_msprobe.format.trendfile import write_trend as write

if TYPE_CHECKING:  # pragma: no cover
    from pytest_msprobe.compare.result import CompareResult
    from pytest_msprobe.compare.trend import TrendResult
    from pytest_msprobe.settings import TestSettings


def spans(steps: Iterable[int]) -> str:
    """``spans([0, 1, 2, 3, 7])`` -> ``"0-3, 7"``; ``"none"`` for no steps."""
    values = sorted(set(steps))
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(
            str(values[i])
            if j == i
            else f"{values[i]}, {values[j]}"
            if j == i + 1
            else f"{values[i]}-{values[j]}"
        )
        i = j + 1
    return ", ".join(parts) or "none"


def baseline_steps(test: TestSettings) -> tuple[int, ...]:
    """The steps a baseline of the test holds: the test's, and every trend step."""
    return tuple(sorted(set(test.steps) | set(range(test.trend_steps or 0))))


def fit_problems(folder: Path, test: TestSettings) -> list[str]:
    """How a baseline's trend falls short of the test's ``trend_steps`` (empty when it fits or the test records
    no trend). An unreadable trend file raises DumpFormatError."""
    wanted = test.trend_steps
    if not wanted:
        return []
    files = trend_files(folder)
    if not files:
        return [f"it holds no trend ({TREND_JSON}), the test compares a trend of trend_steps={wanted} steps"]
    problems = []
    for rank in range(test.world_size):
        path = files.get(rank)
        if path is None:
            problems.append(f"it holds no trend of rank {rank}")
            continue
        held = len(read_trend(path).steps)
        if held != wanted:
            of = f" (rank {rank})" if test.world_size > 1 else ""
            problems.append(f"its trend holds {held} steps{of}, the test compares trend_steps={wanted}")
    return problems


def check_recorded(trends: dict[int, TrendData], wanted: int, world_size: int, nodeid: str) -> None:
    """Every rank recorded the ``wanted`` trend steps; ConfigError in one line otherwise (a loop shorter than
    trend_steps would compare fewer steps than the test asks for)."""
    for rank in range(world_size):
        data = trends.get(rank)
        of = f" on rank {rank}" if world_size > 1 else ""
        ran = 0 if data is None else len(data.steps)
        if ran < wanted:
            raise ConfigError(
                f"{nodeid}: the loop ran {ran} step(s){of}, though the test compares a trend of "
                f"trend_steps={wanted} steps: run every trend step or lower trend_steps"
            )


def rerun_steps(
    result: CompareResult, trend: TrendResult, dumped: Iterable[int], world_size: int
) -> list[int]:
    """The steps to dump again (K-1 and K) when the trend first differs at K, K was not dumped and the compare
    of the dumped steps did not fail at or before K; empty when no re-run is needed or possible (several ranks)."""
    k = trend.first_step
    if k is None or k in set(dumped) or world_size > 1:
        return []
    fd = result.first_divergence
    api_failed = result.missing or not result.coverage.passed or result.failures
    if api_failed and fd is not None and fd.step is not None and fd.step <= k:
        return []
    return [k - 1, k] if k > 0 else [0]


def check_same_start(first: TrendData, again: TrendData, before: int, dumped: str = "") -> None:
    """The re-run repeated the first run's steps before ``before`` bit for bit; ConfigError in one line
    otherwise (state that outlived the first run: a model, optimizer or data made by a fixture)."""
    for a, b in zip(first.steps[:before], again.steps[:before]):
        if not (_same(a.loss, b.loss) and _same(a.grad_norm, b.grad_norm)):
            raise ConfigError(
                f"the test body was run again with the same seed to dump {dumped or 'the steps'} (the trend first "
                f"differs at step {before}), but it did not repeat the first run: at step {a.step} its loss is "
                f"{b.loss} where the first run's was "
                f"{a.loss}: build the model, the optimizer and the data inside the test body (not in a fixture "
                "or at module level), so that a run with the same seed repeats itself"
            )
    if len(again.steps) < before:
        raise ConfigError(
            f"the test body was run again to dump {dumped or 'the steps'} (the trend first differs at step "
            f"{before}), but its loop ran "
            f"{len(again.steps)} step(s) only"
        )


def _same(a: float | None, b: float | None) -> bool:
    """Equal, bit for bit where they are numbers (NaN equals NaN)."""
    return a == b or (a is not None and b is not None and a != a and b != b)


# ------------------------------------------------------------------------------------------ the run's side
def write_trend(run: Any) -> None:
    """Write the run's recorded trend into its dump folder (``trend_rank{R}.json`` on a rank of several)."""
    rank = run.rank if run.world_size > 1 else None
    path = run.dump_dir / trend_file(rank)
    try:
        run.dump_dir.mkdir(parents=True, exist_ok=True)
        write(path, run.trend.data(rank))
    except OSError as exc:
        raise DumpError(f"{path}: cannot write the trend ({exc.strerror or exc})") from None


def check_trend(run: Any) -> None:
    """After the body: the trend written (by this process, or by each rank) and every trend step recorded."""
    if not run.rank_process and run.world_size == 1:
        write_trend(run)
    check_recorded(read_trends(run.dump_dir), run.trend_steps, run.world_size, run.nodeid)


def compare_with_trend(
    run: Any, result: CompareResult, baseline: Path, rerun: Callable[[], Any] | None
) -> CompareResult:
    """The compare's result with the trend compared; where the trend first differs at a step that was not
    dumped, the result of a compare of the steps there, dumped by running the test body again (``rerun``)."""
    from pytest_msprobe.compare.trend import compare_trends

    target = read_trends(run.dump_dir)
    trend = compare_trends(target, read_trends(baseline), run.trend_steps, run.settings.trend_rtol)
    steps = rerun_steps(result, trend, run.steps, run.world_size)
    if not steps or rerun is None:
        return replace(result, trend=trend)
    k = trend.first_step
    assert k is not None
    _restart(run, tuple(steps))
    try:
        rerun()
    except MsprobeError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"the test body, run again to dump steps {spans(steps)} (the trend first differs at step {k}), "
            f"raised {type(exc).__name__}: {exc}"
        ) from None
    run.debugger.close()
    write_trend(run)
    check_same_start(target[0], run.trend.data(), k, f"step{'s' if len(steps) > 1 else ''} {spans(steps)}")
    run._check_every_step()
    again = run.compare_dump(baseline, steps)
    return replace(again, trend=replace(trend, rerun_steps=tuple(steps)))


def _restart(run: Any, steps: tuple[int, ...]) -> None:
    """Make the run as it was before the body, with a debugger that dumps ``steps`` into ``rerun/dump``."""
    run.debugger.close()
    run.dump_dir = run.output_dir / "rerun" / "dump"
    shutil.rmtree(run.dump_dir, ignore_errors=True)
    run.dump_steps = steps
    run.debugger = run._debugger(run.dump_dir, steps)
    run._new_trend()
    run._in_step = False
    seed_all(seed=run.seed, mode=True)
