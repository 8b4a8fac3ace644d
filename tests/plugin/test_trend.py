"""Trend over many steps (``trend_steps=N``), in whole pytest runs: a baseline holding every trend step, a pass,
a relu gone wrong from step 25 named at step 25 by a re-run of the body, and whatever would make the gate
check less than the test asks for."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from plugin_sources import BASE, with_faulty_relu, with_net

# A small CNN; FAULT (a relative error of the functional relus) from step FAULT_FROM, counted by the debugger.
TREND_TEST = with_faulty_relu(
    with_net(
        textwrap.dedent(
            """
        import os
        import pytest
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        NET


        FAULTY_RELU


        def fault(msprobe, monkeypatch):
            scale, start = float(os.environ.get("FAULT", "0")), int(os.environ.get("FAULT_FROM", "0"))
            if not scale:
                return
            orig = F.relu

            def relu(x, inplace=False):
                if msprobe.debugger.current_step >= start:
                    return FaultyRelu.apply(x, scale)
                return orig(x, inplace=inplace)

            monkeypatch.setattr(F, "relu", relu)


        def train(msprobe, steps, model=None, give_loss=True, loss_scale_from=None):
            model = model if model is not None else Net().to(msprobe.device)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            g = torch.Generator().manual_seed(0)
            for step in range(steps):
                x = torch.randn(4, 3, 8, 8, generator=g).to(msprobe.device)
                y = torch.randint(0, 4, (4,), generator=g).to(msprobe.device)
                with msprobe.step(model):
                    loss = F.cross_entropy(model(x), y)
                    if give_loss:
                        off = loss_scale_from is not None and step >= loss_scale_from
                        msprobe.loss(loss.item() * (1.001 if off else 1.0))
                    opt.zero_grad()
                    loss.backward()
                    opt.step()


        BODY
        """
        )
    )
)


def _write(pytester: pytest.Pytester, body: str) -> None:
    pytester.makepyfile(test_train=TREND_TEST.replace("BODY", textwrap.dedent(body)))


def _folder(pytester: pytest.Pytester) -> Path:
    return pytester.path / "bl" / "test_train" / "test_train"


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(*BASE, "--msprobe-baseline=bl", *args)


FORTY = """
    @pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1], trend_steps=40)
    def test_train(msprobe, monkeypatch):
        fault(msprobe, monkeypatch)
        train(msprobe, 40)
    """


@pytest.mark.slow
def test_a_relu_wrong_from_step_25_is_named_at_step_25(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(pytester, FORTY)
    _run(pytester, "--msprobe-regen-baseline").assert_outcomes(passed=1)
    folder = _folder(pytester)
    # every trend step is dumped (statistics: small), and the trend is stored with it
    assert {p.name for p in folder.iterdir()} == {f"step{i}" for i in range(40)} | {
        "trend.json",
        "msprobe_manifest.json",
    }
    assert json.loads((folder / "msprobe_manifest.json").read_text())["extra"]["trend_steps"] == 40
    trend = json.loads((folder / "trend.json").read_text())
    assert len(trend["steps"]) == 40 and trend["dtype"] == "float32" and trend["modules"][0] == "conv"

    same = _run(pytester)
    same.assert_outcomes(passed=1)

    monkeypatch.setenv("FAULT", "0.05")
    monkeypatch.setenv("FAULT_FROM", "25")
    fail = _run(pytester, "-rN")
    fail.assert_outcomes(failed=1, errors=0)
    fail.stdout.fnmatch_lines(
        [
            "msprobe: * of * API calls breach the thresholds * steps 24, 25)",
            "trend: the * first differs at step 25 (* vs *; allowed rel 1e-4); steps 24, 25 dumped again and compared",
            "first divergence: Functional.relu.*.forward (step 25, rank 0), row Functional.relu.*",
            "*FAILED*test_train.py::test_train*(first divergence Functional.relu.*; trend differs from step 25)",
        ]
    )
    assert "Traceback" not in fail.stdout.str()
    out = pytester.path / "msprobe-output" / "test_train" / "test_train"
    summary = json.loads((out / "compare" / "summary.json").read_text())
    assert summary["passed"] is False and summary["first_divergence"]["step"] == 25
    assert summary["trend"]["first_step"] == 25 and summary["trend"]["rerun_steps"] == [24, 25]
    assert summary["trend"]["steps"] == 40 and summary["trend"]["rtol"] == 1e-4
    assert (out / "rerun" / "dump" / "step25").is_dir() and not (out / "rerun" / "dump" / "step23").exists()
    advisor = next((out / "compare").glob("advisor_*.txt")).read_text()
    assert "the backward of step 24 and the forward of step 25" in advisor


SHORT = """
    @pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1], trend_steps=8)
    def test_train(msprobe, monkeypatch):
        fault(msprobe, monkeypatch)
        train(msprobe, int(os.environ.get("LOOP", "8")), loss_scale_from=int(os.environ.get("OFF", "99")))
    """


@pytest.mark.slow
def test_a_trend_that_differs_where_every_api_agrees_fails_and_says_so(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(pytester, SHORT)
    _run(pytester, "--msprobe-regen-baseline").assert_outcomes(passed=1)
    monkeypatch.setenv("OFF", "5")  # the loss given is off from step 5, the computation is not
    fail = _run(pytester)
    fail.assert_outcomes(failed=1)
    fail.stdout.fnmatch_lines(
        [
            "msprobe: trend: the loss first differs at step 5 (* vs *; allowed rel 1e-4); steps 4, 5 dumped again*",
            "  the dumped steps 4, 5 agree within the API thresholds (*): the trend's difference builds up from "
            "rounding*--msprobe-trend-rtol*",
        ]
    )
    # a looser tolerance lets it pass
    _run(pytester, "--msprobe-trend-rtol=0.01").assert_outcomes(passed=1)


def test_a_loop_shorter_than_trend_steps_fails_in_regeneration_and_compare(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(pytester, SHORT)
    monkeypatch.setenv("LOOP", "5")
    regen = _run(pytester, "--msprobe-regen-baseline")
    regen.assert_outcomes(failed=1)
    regen.stdout.fnmatch_lines(
        ["*the loop ran 5 step(s), though the test compares a trend of trend_steps=8 steps*"]
    )
    assert not _folder(pytester).exists()  # no baseline is written
    monkeypatch.setenv("LOOP", "8")
    _run(pytester, "--msprobe-regen-baseline").assert_outcomes(passed=1)
    monkeypatch.setenv("LOOP", "5")
    short = _run(pytester)
    short.assert_outcomes(failed=1)
    short.stdout.fnmatch_lines(
        ["*the loop ran 5 step(s), though the test compares a trend of trend_steps=8*"]
    )


def test_a_baseline_without_the_trend_or_with_fewer_steps_is_an_error_before_training(
    pytester: pytest.Pytester,
) -> None:
    _write(pytester, SHORT)
    _run(pytester, "--msprobe-regen-baseline", "--msprobe-trend-steps=2").assert_outcomes(passed=1)
    before = (_folder(pytester) / "trend.json").read_bytes()
    fewer = _run(pytester)
    fewer.assert_outcomes(errors=1)
    fewer.stdout.fnmatch_lines(
        ["*does not fit this test: *its trend holds 2 steps, the test compares trend_steps=8; regenerate it*"]
    )
    (_folder(pytester) / "trend.json").unlink()  # a baseline made without a trend (steps 0, 1 only)
    without = _run(pytester, "--msprobe-trend-steps=2")
    without.assert_outcomes(errors=1)
    without.stdout.fnmatch_lines(
        ["*it holds no trend (trend.json), the test compares a trend of trend_steps=2*"]
    )
    assert before  # (the store wrote it whole)


def test_a_loss_never_given_fails_with_one_line(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        @pytest.mark.msprobe(steps=[0], trend_steps=3)
        def test_train(msprobe):
            train(msprobe, 3, give_loss=False)
        """,
    )
    result = _run(pytester, "--msprobe-regen-baseline")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*msprobe: msprobe.loss() was not called in step 0: the trend (trend_steps=3)*"]
    )
    assert "Traceback" not in result.stdout.str()


def test_a_model_built_by_a_fixture_cannot_be_re_run_and_the_message_says_where_to_build_it(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _write(
        pytester,
        """
        @pytest.fixture
        def model():
            return Net()


        @pytest.mark.msprobe(steps=[0, 1], trend_steps=8)
        def test_train(msprobe, monkeypatch, model):
            fault(msprobe, monkeypatch)
            train(msprobe, 8, model=model)
        """,
    )
    _run(pytester, "--msprobe-regen-baseline").assert_outcomes(passed=1)
    monkeypatch.setenv("FAULT", "0.05")
    monkeypatch.setenv("FAULT_FROM", "5")
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*the test body was run again with the same seed to dump steps 4, 5 (the trend first differs at step 5), "
            "but it did not repeat the first run: at step 0 its loss is * where the first run's was *: build the "
            "model, the optimizer "
            "and the data inside the test body*"
        ]
    )


DDP_TREND = textwrap.dedent(
    """
    import os
    import pytest
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP


    @pytest.mark.msprobe(world_size=2, steps=[0], trend_steps=3)
    def test_ddp(msprobe):
        model = DDP(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 4)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(msprobe.rank)
        for step in range(3):
            x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
            with msprobe.step(model):
                loss = F.cross_entropy(model(x), y)
                off = os.environ.get("OFF") and msprobe.rank == 1 and step >= 2
                msprobe.loss(loss * (1.01 if off else 1.0))
                opt.zero_grad()
                loss.backward()
                opt.step()
    """
)


@pytest.mark.slow
def test_each_rank_has_its_trend_and_a_multi_rank_test_names_the_steps_to_dump(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytester.makepyfile(test_ddp=DDP_TREND)
    _run(pytester, "--msprobe-regen-baseline").assert_outcomes(passed=1)
    folder = pytester.path / "bl" / "test_ddp" / "test_ddp"
    assert {"trend_rank0.json", "trend_rank1.json", "step2"} <= {p.name for p in folder.iterdir()}
    monkeypatch.setenv("OFF", "1")
    fail = _run(pytester)
    fail.assert_outcomes(failed=1)
    fail.stdout.fnmatch_lines(
        [
            "msprobe: trend: the loss first differs at step 2, rank 1 (* vs *; allowed rel 1e-4); dump steps 1, 2 "
            "(the backward of step 1 and the forward of step 2) to find the API",
            "  the dumped step 0 agrees within the API thresholds (*); the test body was not run again*",
        ]
    )
