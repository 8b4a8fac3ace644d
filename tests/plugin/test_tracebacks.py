"""User code that raises inside a dumped step shows the user's traceback: none of the plugin's frames (the API
wrappers, the recorder) stand between the test body and the line that raised."""

from __future__ import annotations

import json
import textwrap

import pytest
from plugin_sources import BASE

RAISING = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 4)

        def forward(self, x):
            return F.relu(self.fc(x))


    @pytest.mark.msprobe(steps=[0])
    def test_wrapped_function_raises(msprobe):
        model = Net()
        with msprobe.step(model):
            y = model(torch.ones(2, 6))
            F.linear(y, torch.ones(3, 5))  # USER LINE 1


    @pytest.mark.msprobe(steps=[0], level="mix")
    def test_wrapped_method_raises(msprobe):
        model = Net()
        with msprobe.step(model):
            model(torch.ones(2, 6)).view(7, 7)  # USER LINE 2


    @pytest.mark.msprobe(steps=[0], level="L0")
    def test_module_raises(msprobe):
        model = Net()
        with msprobe.step(model):
            model(torch.ones(2, 5))  # USER LINE 3


    @pytest.mark.msprobe(steps=[0])
    def test_body_raises(msprobe):
        model = Net()
        with msprobe.step(model):
            model(torch.ones(2, 6))
            raise ValueError("the user's own bug")  # USER LINE 4
    """
)


@pytest.mark.parametrize(
    "mode",
    [
        ["--msprobe-baseline=bl", "--msprobe-regen-baseline"],
        ["--msprobe-self-check", "-k", "not module_raises"],  # (the self-check replays calls: not at L0)
    ],
    ids=["regen", "self-check"],
)
def test_a_failing_step_shows_the_users_frames_only(pytester: pytest.Pytester, mode: list[str]) -> None:
    pytester.makepyfile(test_raises=RAISING)
    result = pytester.runpytest(*BASE, *mode)
    tests = 3 if "-k" in mode else 4
    result.assert_outcomes(failed=tests)
    out = result.stdout.str()
    failures = out.split("= FAILURES =", 1)[1].split("= msprobe =", 1)[0]
    # no frame of the wrappers, the recorder or the step between the test body and the line that raised
    assert "pytest_msprobe/" not in failures, failures
    assert failures.count("# USER LINE") == tests
    result.stdout.fnmatch_lines(
        [
            ">*F.linear(y, torch.ones(3, 5))  # USER LINE 1",
            "*^^^^*",
            "E*RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x4 and 5x3)",
            "",
            "test_raises.py:*: RuntimeError",
        ]
    )
    result.stdout.fnmatch_lines(
        [">*.view(7, 7)  # USER LINE 2", "*^^^^*", "E*RuntimeError: shape * is invalid for input of size 8"]
    )
    # the terminal summary and the session summary say that nothing was compared, and why
    result.stdout.fnmatch_lines(
        [
            "NOT COMPARED test_raises.py::test_body_raises  (the test body raised ValueError: the user's own bug)"
        ]
    )
    summary = json.loads((pytester.path / "msprobe-output" / "summary.json").read_text())
    verdicts = [(t["verdict"], t["outcome"]) for t in summary["tests"]]
    assert verdicts == [("not compared", "failed")] * tests


def test_full_trace_still_shows_the_plugins_frames(pytester: pytest.Pytester) -> None:
    """Hidden, not lost: --full-trace shows every frame (a bug of the plugin stays findable)."""
    pytester.makepyfile(test_raises=RAISING)
    result = pytester.runpytest(*BASE, "--msprobe-self-check", "--full-trace", "-k", "wrapped_function")
    result.assert_outcomes(failed=1)
    assert "pytest_msprobe/dump/api_calls.py" in result.stdout.str()
