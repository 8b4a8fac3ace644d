"""``trend.json``: the loss and gradient norms of every step of a run, our own file beside msprobe's.

It lies at the dump root (``trend.json``; ``trend_rank{R}.json`` per rank of a multi-rank run), where msprobe's
readers (and :func:`pytest_msprobe.format.layout.discover`) look only at the ``step{N}`` folders::

    {"format": "pytest-msprobe trend", "version": 1, "dtype": "float32", "rank": null,
     "modules": ["conv", "bn", "fc"],
     "steps": [{"step": 0, "loss": 2.3012, "grad_norm": 1.52, "modules": [0.9, 0.3, 1.1]}, ...]}

``modules[i]`` of a step is the gradient norm of the module ``modules[i]`` names. A value that is not finite is
written as the text ``"nan"``, ``"inf"`` or ``"-inf"`` (JSON has no such numbers), and ``null`` where there was
none (a step whose loss was never given). Free of torch: the dump writes it, the compare reads it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_msprobe.errors import DumpFormatError, PathLike
from pytest_msprobe.format.files import read_json, write_text

TREND_JSON = "trend.json"
_RANK_FILE = re.compile(r"^trend_rank(\d+)\.json$")
_FORMAT = "pytest-msprobe trend"
_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def trend_file(rank: int | None = None) -> str:
    """``trend_file()`` -> ``"trend.json"``; ``trend_file(1)`` -> ``"trend_rank1.json"`` (a multi-rank run)."""
    return TREND_JSON if rank is None else f"trend_rank{rank}.json"


@dataclass(frozen=True)
class TrendStep:
    """One step's values (None where there is none)."""

    step: int
    loss: float | None
    grad_norm: float | None
    modules: tuple[float | None, ...] = ()


@dataclass(frozen=True)
class TrendData:
    """What one run (one rank) recorded: the training dtype, the modules' names and each step's values."""

    dtype: str | None
    modules: tuple[str, ...]
    steps: tuple[TrendStep, ...]
    rank: int | None = None

    def to_json(self) -> str:
        doc = {
            "format": _FORMAT,
            "version": 1,
            "dtype": self.dtype,
            "rank": self.rank,
            "modules": list(self.modules),
            "steps": [
                {
                    "step": s.step,
                    "loss": _out(s.loss),
                    "grad_norm": _out(s.grad_norm),
                    "modules": [_out(v) for v in s.modules],
                }
                for s in self.steps
            ],
        }
        return json.dumps(doc, allow_nan=False) + "\n"


def _out(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"


def _in(value: Any, path: Path, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, str) and value in _TEXT:
        return _TEXT[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DumpFormatError(path, f"{where}: expected a number, null, 'nan' or 'inf', got {value!r}")
    return float(value)


def write_trend(path: PathLike, data: TrendData) -> None:
    """Write ``data`` to ``path`` atomically (OSError as the system gives it)."""
    write_text(path, data.to_json())


def read_trend(path: PathLike) -> TrendData:
    """Read a trend file; anything unusable raises DumpFormatError naming the file and the problem."""
    path = Path(path)
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise DumpFormatError(path, f'not a trend file (no "format": "{_FORMAT}")')
    modules, steps, dtype, rank = doc.get("modules"), doc.get("steps"), doc.get("dtype"), doc.get("rank")
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise DumpFormatError(path, "'modules' must be a list of names")
    if not isinstance(steps, list):
        raise DumpFormatError(path, "'steps' must be a list")
    if dtype is not None and not isinstance(dtype, str):
        raise DumpFormatError(path, f"'dtype' must be a name, got {dtype!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise DumpFormatError(path, f"'rank' must be a whole number, got {rank!r}")
    out = []
    for i, entry in enumerate(steps):
        where = f"steps[{i}]"
        if not isinstance(entry, dict):
            raise DumpFormatError(path, f"{where}: expected an object")
        step, values = entry.get("step"), entry.get("modules", [])
        if isinstance(step, bool) or not isinstance(step, int) or step != i:
            raise DumpFormatError(path, f"{where}: 'step' must be {i}, got {step!r}")
        if not isinstance(values, list) or len(values) != len(modules):
            raise DumpFormatError(path, f"{where}: 'modules' must hold {len(modules)} values")
        out.append(
            TrendStep(
                step,
                _in(entry.get("loss"), path, f"{where}.loss"),
                _in(entry.get("grad_norm"), path, f"{where}.grad_norm"),
                tuple(_in(v, path, f"{where}.modules") for v in values),
            )
        )
    return TrendData(dtype, tuple(modules), tuple(out), rank)


def trend_files(root: PathLike) -> dict[int, Path]:
    """The trend files of a dump root by rank: ``trend.json`` is rank 0 of a run without ranks. Empty when
    there is none."""
    root = Path(root)
    found: dict[int, Path] = {}
    try:
        names: Sequence[str] = sorted(os.listdir(root))
    except OSError:
        return found
    for name in names:
        m = _RANK_FILE.match(name)
        if m:
            found[int(m.group(1))] = root / name
    if (root / TREND_JSON).is_file():
        found.setdefault(0, root / TREND_JSON)
    return found


def read_trends(root: PathLike) -> dict[int, TrendData]:
    """Every rank's trend of a dump root (see :func:`trend_files`)."""
    return {rank: read_trend(path) for rank, path in trend_files(root).items()}
