"""The plugin as a newcomer meets it: the typed fixture, and a misspelt marker keyword with a suggestion."""

from __future__ import annotations

from pathlib import Path

import pytest

import pytest_msprobe

BASE = ["-p", "no:cacheprovider", "-p", "no:randomly"]

FACE_TEST = """
import pytest
import torch
from pytest_msprobe import MsprobeFixture


@pytest.mark.msprobe(steps=[0], seed=7)
def test_face(msprobe: MsprobeFixture):
    assert type(msprobe) is MsprobeFixture
    assert (msprobe.rank, msprobe.world_size, msprobe.steps, msprobe.seed) == (0, 1, (0,), 7)
    assert msprobe.device.type == "cpu"
    for internal in ("finish", "settings", "manifest", "compare_dump", "close"):
        assert not hasattr(msprobe, internal), internal
    with msprobe.step():
        msprobe.loss(torch.ones(3, device=msprobe.device).mul(2.0).sum())
    assert callable(msprobe.debugger.start) and callable(msprobe.debugger.stop)
    assert msprobe.dump_dir.name == "dump"
"""


def test_the_fixture_is_the_public_msprobe_fixture(pytester: pytest.Pytester) -> None:
    assert "MsprobeFixture" in pytest_msprobe.__all__
    assert (Path(pytest_msprobe.__file__).parent / "py.typed").is_file()
    pytester.makepyfile(test_face=FACE_TEST)
    pytester.runpytest(*BASE, "--msprobe-device=cpu").assert_outcomes(passed=1)
    pytester.runpytest(*BASE, "--msprobe-device=cpu", "--msprobe-self-check").assert_outcomes(passed=1)


# -- the marker ---------------------------------------------------------------------------------------------------
def test_a_misspelt_marker_keyword_gets_a_suggestion(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_misspelt="""
        import pytest

        @pytest.mark.msprobe(step=[0, 1])
        def test_misspelt(msprobe):
            pass

        def test_plain():
            pass
        """
    )
    result = pytester.runpytest(*BASE)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*unknown keyword(s) step (did you mean steps?) (known: *"])
