"""Whether a stored baseline can be compared with a test, checked before the test body runs.

A baseline that is broken (a dump.json or tensor file the compare cannot read) or made by another kind of run
(other steps, ranks, task, level or seed) is an error of the test's set-up, reported before any training.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_msprobe.errors import BaselineMismatchError
from pytest_msprobe.run.baseline import read_manifest

if TYPE_CHECKING:  # pragma: no cover
    from pytest_msprobe.settings import TestSettings


def check_baseline(folder: Path, test: TestSettings | None = None) -> None:
    """Raise DumpFormatError or BaselineError, naming the file and the problem, when the baseline in ``folder``
    cannot be compared, or (given the test's settings) does not fit the test.

    Checks every dump.json the compare would read, and the header of every tensor file they name, with the
    compare's own checks (:func:`~pytest_msprobe.compare.dumps.validate.validate`), and our manifest; run before the
    test body, so that a broken baseline is an error of the test's set-up rather than a failure after training.
    """
    from pytest_msprobe.compare.dumps import validate

    check = validate(folder)
    manifest = read_manifest(folder)
    if test is not None:
        from pytest_msprobe.run.trend import fit_problems as trend_problems

        problems = fit_problems(check, manifest, test) + trend_problems(folder, test)
        if problems:
            raise BaselineMismatchError(
                f"the baseline {folder} does not fit this test: {'; '.join(problems)}"
            )


def numbers(values: Any) -> str:
    """``numbers({2, 0})`` -> ``"0, 2"``; ``"none"`` for no values: steps and ranks in messages."""
    values = sorted(values)
    return ", ".join(map(str, values)) if values else "none"


def fit_problems(check: Any, manifest: dict[str, Any] | None, test: TestSettings) -> list[str]:
    """How a baseline differs from what the test runs: steps and ranks from what the folder holds; task, level
    and seed from our manifest, or for a plain msprobe dump from its dump.json files. Empty when it fits."""
    problems: list[str] = []
    locations = check.locations
    steps = {loc.step for loc in locations}
    if test.trend_steps:  # a trend's baseline holds every trend step too
        from pytest_msprobe.run.trend import baseline_steps, spans

        if steps != set(baseline_steps(test)):
            problems.append(
                f"it holds steps {spans(s for s in steps if s is not None)}, the test needs steps "
                f"{spans(baseline_steps(test))} (its steps {numbers(test.steps)} and trend_steps={test.trend_steps})"
            )
    elif steps != set(test.steps):
        problems.append(f"it holds steps {numbers(steps)}, the test dumps steps {numbers(test.steps)}")
    expected = set(range(test.world_size))
    for step in sorted(s for s in steps if s is not None):
        ranks = {loc.rank or 0 for loc in locations if loc.step == step}
        if ranks != expected:
            problems.append(
                f"its step {step} holds rank(s) {numbers(ranks)}, the test runs world_size={test.world_size} "
                f"(ranks {numbers(expected)})"
            )
            break
    if manifest is not None:
        task, level = manifest.get("task"), manifest.get("level")
    else:  # a plain msprobe dump: what its dump.json files say
        tasks = {
            h.task if h.task in ("tensor", "overflow_check") else "md5" if h.md5 else "statistics"
            for h in check.headers
        }
        levels = {h.level for h in check.headers if h.level is not None}
        task = tasks.pop() if len(tasks) == 1 else None
        level = levels.pop() if len(levels) == 1 else None
    if task is not None and task != test.task:
        problems.append(f"it was dumped with task {task}, the test runs task {test.task}")
    if level is not None and level != test.level:
        problems.append(f"it was dumped at level {level}, the test runs level {test.level}")
    seed = manifest.get("seed") if manifest is not None else None
    if seed is not None and seed != test.seed:
        problems.append(f"it was made with seed {seed}, the test runs seed {test.seed}")
    return problems
