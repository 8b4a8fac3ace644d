"""pytest glue: options, marker, fixtures and hooks. Thin by design: the work is done in dump/, compare/, report/."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "msprobe(task, level, steps, seed, ...): run this test's training steps with msprobe dumping and "
        "compare them against the test's baseline.",
    )
