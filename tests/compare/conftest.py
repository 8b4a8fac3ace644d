"""Fixtures of the compare tests (helpers live in compare_helpers.py, importable from the tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from compare_helpers import dump_dir, write_dump


@pytest.fixture
def real() -> Callable[..., Path]:
    """``real(version, side, kind, step=None)``: a folder of msprobe's real dumps."""
    return dump_dir


@pytest.fixture(scope="module")
def dumps(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``dumps(name, **options)``: a ``model_dumps.dump_model`` dump, made once per test module."""
    from model_dumps import dump_model  # (it needs torch: only the modules that ask for dumps import it)

    root = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    made: dict[str, Path] = {}

    def get(name: str, **options: Any) -> Path:
        if name not in made:
            made[name] = dump_model(root / name, **options)
        return made[name]

    return get


@pytest.fixture
def make_dump(tmp_path: Path) -> Callable[..., Path]:
    """``make_dump(name, data, task=..., step=0, rank_dir="rank")`` writes a one-step dump under tmp_path."""

    def make(
        name: str, data: dict[str, Any], task: str = "statistics", step: int = 0, rank: str = "rank"
    ) -> Path:
        return write_dump(tmp_path / name / f"step{step}" / rank, data, task).parent.parent.parent

    return make
