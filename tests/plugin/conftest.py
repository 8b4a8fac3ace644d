"""Fixtures for whole-workflow tests of the pytest plugin, driven with pytester.

What the test modules write into their pytester folders (the small CNN, the training test, the fault plugin) and
the arguments every run starts with (BASE) live in plugin_sources.py; the fixtures here hand them out.
"""

from __future__ import annotations

import pytest

# In-process pytester runs restore sys.modules afterwards: anything first imported inside a run is dropped and
# imported again by the next one. torch cannot be imported twice in one process, so it is imported here, once.
import torch  # noqa: F401
import torchvision  # noqa: F401
from plugin_sources import FAULT_PLUGIN, TRAIN_TEST


@pytest.fixture
def train_test(pytester: pytest.Pytester):
    """Write the training test with a given marker line; returns a function making more variants."""

    def make(
        marker: str = '@pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1])',
        name: str = "test_train",
    ):
        return pytester.makepyfile(**{name: TRAIN_TEST.replace("MARKER", marker)})

    return make


@pytest.fixture
def train_source() -> str:
    """The training test module's source, with MARKER where the marker line goes."""
    return TRAIN_TEST


@pytest.fixture
def fault_plugin(pytester: pytest.Pytester):
    pytester.makepyfile(faultplugin=FAULT_PLUGIN)
    pytester.syspathinsert()
    return "faultplugin"
