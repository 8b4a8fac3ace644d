"""A precision test whose baseline ran another optimizer implementation passes, its updates compared by
parameter (the CPU's single-tensor loops against foreach lists, as a CUDA run makes them), and still fails on a
wrong update, naming it."""

from __future__ import annotations

import json
import textwrap

import pytest
from plugin_sources import BASE, with_net

# IMPL picks the optimizer's implementation (single, foreach, fused); FAULT adds that much to fc.weight after
# each optimizer step (a patched optimizer)
SOURCE = with_net(
    textwrap.dedent(
        """
        import os

        import pytest
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        FLAGS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


        NET


        @pytest.mark.msprobe(steps=[0, 1])
        def test_train(msprobe):
            model = Net().to(msprobe.device)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, **FLAGS[os.environ["IMPL"]])
            fault = float(os.environ.get("FAULT", "0"))
            if fault:
                opt.register_step_post_hook(lambda o, a, k: model.fc.weight.data.add_(fault))
            g = torch.Generator().manual_seed(0)
            for _ in range(2):
                x = torch.randn(4, 3, 8, 8, generator=g).to(msprobe.device)
                y = torch.randint(0, 4, (4,), generator=g).to(msprobe.device)
                with msprobe.step(model):
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
        """
    ),
    conv2=False,
)


@pytest.fixture
def single_baseline(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(test_train=SOURCE)
    monkeypatch.setenv("IMPL", "single")
    regen = pytester.runpytest(*BASE, "--msprobe-baseline=baselines", "--msprobe-regen-baseline")
    regen.assert_outcomes(passed=1)
    return pytester


def _summary(pytester: pytest.Pytester) -> dict:
    path = pytester.path / "msprobe-output" / "test_train" / "test_train" / "compare" / "summary.json"
    return json.loads(path.read_text())


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_another_implementation_passes_with_every_row_paired(
    single_baseline: pytest.Pytester, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IMPL", impl)
    result = single_baseline.runpytest(*BASE, "--msprobe-baseline=baselines")
    result.assert_outcomes(passed=1)
    summary = _summary(single_baseline)
    assert summary["coverage"]["unmatched_rows"] == 0 and summary["set_aside"] == []
    assert summary["counts"]["unmatched"] == 0


def test_a_wrong_update_fails_naming_it(
    single_baseline: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IMPL", "foreach")
    monkeypatch.setenv("FAULT", "1e-3")
    result = single_baseline.runpytest(*BASE, "--msprobe-baseline=baselines")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*first divergence: Optimizer.fc.weight.0.forward (step 0, rank 0), row "
            "Optimizer.fc.weight.0.forward.output.param",
            "*called from: *opt.step()",
        ]
    )
