"""``task="overflow_check"`` under the plugin: the gate is that the target has no overflowing call the baseline
(regenerated with the same task) does not have; a failure names the first one and where it overflowed first."""

from __future__ import annotations

import json
import textwrap

import pytest
from plugin_sources import BASE

TEST = textwrap.dedent(
    """
    import os

    import pytest
    import torch
    import torch.nn.functional as F


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, x):
            h = F.relu(self.fc1(x)) * float(os.environ.get("OVERFLOW_FACTOR", "1"))
            return self.fc2(h)


    @pytest.mark.msprobe(task="overflow_check", steps=[0, 1])
    def test_half(msprobe):
        model = Net().half()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            x = torch.randn(4, 8, generator=g).half()
            with msprobe.step(model):
                loss = model(x).float().pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    """
)


def test_overflow_check_regen_pass_then_an_overflow_fails_naming_its_call(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_half=TEST)
    regen = pytester.runpytest(*BASE, "--msprobe-baseline=bl", "--msprobe-regen-baseline")
    regen.assert_outcomes(passed=1)
    baseline = pytester.path / "bl" / "test_half" / "test_half"
    manifest = json.loads((baseline / "msprobe_manifest.json").read_text())
    assert manifest["task"] == "overflow_check"
    doc = json.loads((baseline / "step0" / "rank" / "dump.json").read_text())
    assert doc["task"] == "overflow_check" and doc["data"] == {}

    same = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    same.assert_outcomes(passed=1)

    monkeypatch.setenv("OVERFLOW_FACTOR", "1e5")
    bad = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    bad.assert_outcomes(failed=1)
    bad.stdout.fnmatch_lines(
        [
            "*msprobe: 1 of * API calls breach the thresholds*",
            "overflow: Tensor.__mul__.0.forward (step 0, rank 0) is the first call whose output holds inf/nan on "
            "the target and not on the baseline; where: output (its inputs are finite: this call is the suspect)",
            "first divergence: Tensor.__mul__.0.forward (step 0, rank 0), row Tensor.__mul__.0.forward.output.0",
            "  its output holds inf (.output.0: Max inf, float16) while its inputs are finite: the overflow "
            "happens here (float16's largest value is 65504)",
            "FAILED*test_half.py::test_half*",
        ]
    )
    summary = json.loads(
        (
            pytester.path / "msprobe-output" / "test_half" / "test_half" / "compare" / "summary.json"
        ).read_text()
    )
    assert (
        summary["first_divergence"]["rule"] == "overflow"
        and summary["first_divergence"]["overflow"] == "output"
    )

    # no baseline, the self-check: the dump's first overflowing call fails it
    checked = pytester.runpytest(*BASE, "--msprobe-self-check")
    checked.assert_outcomes(failed=1)
    checked.stdout.fnmatch_lines(
        [
            "*msprobe self-check: Tensor.__mul__.0.forward (step 0, rank 0) overflows: its output holds inf/nan",
            "first overflow: Tensor.__mul__.0.forward (step 0, rank 0), row Tensor.__mul__.0.forward.output.0; "
            "where: output*",
        ]
    )
