"""A precision test whose run pairs too little of its baseline FAILS, and the limit is set like the others."""

from __future__ import annotations

import json
import textwrap

import pytest
from plugin_sources import BASE, with_net

# A small CNN's training steps; NO_BACKWARD=1 leaves out backward() and optimizer.step(), MAX_UNMATCHED sets the
# marker's max_unmatched= (absent: the marker leaves it to the ini and the default).
SOURCE = with_net(
    textwrap.dedent(
        """
        import os

        import pytest
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        NET


        EXTRA = {"max_unmatched": os.environ["MAX_UNMATCHED"]} if "MAX_UNMATCHED" in os.environ else {}


        @pytest.mark.msprobe(steps=[0], **EXTRA)
        def test_train(msprobe):
            model = Net().to(msprobe.device)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            g = torch.Generator().manual_seed(0)
            x = torch.randn(4, 3, 8, 8, generator=g).to(msprobe.device)
            y = torch.randint(0, 4, (4,), generator=g).to(msprobe.device)
            with msprobe.step(model):
                loss = F.cross_entropy(model(x), y)
                if not os.environ.get("NO_BACKWARD"):
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        """
    ),
    conv2=False,
)


@pytest.fixture
def gated(pytester: pytest.Pytester) -> pytest.Pytester:
    """The test module and its baseline, regenerated from the full training step."""
    pytester.makepyfile(test_train=SOURCE)
    regen = pytester.runpytest(*BASE, "--msprobe-baseline=baselines", "--msprobe-regen-baseline")
    regen.assert_outcomes(passed=1)
    return pytester


def _summary(pytester: pytest.Pytester) -> dict:
    path = pytester.path / "msprobe-output" / "test_train" / "test_train" / "compare" / "summary.json"
    return json.loads(path.read_text())


def test_a_run_without_backward_fails_naming_what_was_not_compared(
    gated: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert gated.runpytest(*BASE, "--msprobe-baseline=baselines").ret == 0  # the same run passes
    monkeypatch.setenv("NO_BACKWARD", "1")
    result = gated.runpytest(*BASE, "--msprobe-baseline=baselines")
    result.assert_outcomes(failed=1, errors=0)
    result.stdout.fnmatch_lines(
        [
            "*msprobe: too little compared: * of * baseline calls (* of * rows, *%) found no partner in the "
            "target; the limit is 5%",
            "*first baseline calls without a partner (execution order): *backward*",
            "*usual causes: an optimizer step made on one side only*a skipped backward() or optimizer.step()*",
            "*raise the limit with --msprobe-max-unmatched=SHARE or the marker's max_unmatched=*",
            "*of what was compared, no API call breaches the thresholds*",
            "*regenerate the baseline*",
        ]
    )
    text = result.stdout.str()
    assert "first divergence:" not in text and "Traceback" not in text
    summary = _summary(gated)
    assert summary["passed"] is False and summary["first_divergence"] is None
    assert summary["coverage"]["passed"] is False and summary["coverage"]["max_unmatched"] == 0.05


@pytest.mark.parametrize(
    ("how", "args"),
    [
        ("cli", ["--msprobe-max-unmatched=90%"]),
        ("ini", ["-o", "msprobe_max_unmatched=0.9"]),
        ("marker", []),
    ],
)
def test_the_limit_from_the_command_line_the_ini_or_the_marker(
    gated: pytest.Pytester, how: str, args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NO_BACKWARD", "1")
    if how == "marker":
        monkeypatch.setenv("MAX_UNMATCHED", "90%")
    result = gated.runpytest(*BASE, "--msprobe-baseline=baselines", *args)
    result.assert_outcomes(passed=1)
    assert _summary(gated)["coverage"]["max_unmatched"] == pytest.approx(0.9)


def test_the_command_line_wins_over_the_marker(
    gated: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NO_BACKWARD", "1")
    monkeypatch.setenv("MAX_UNMATCHED", "90%")
    result = gated.runpytest(*BASE, "--msprobe-baseline=baselines", "--msprobe-max-unmatched=0")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*too little compared: *; the limit is 0%"])


def test_an_l1_run_against_an_l0_baseline_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_train=SOURCE)
    regen = pytester.runpytest(
        *BASE, "--msprobe-baseline=baselines", "--msprobe-regen-baseline", "-o", "msprobe_level=L0"
    )
    regen.assert_outcomes(passed=1)
    # with a manifest (or a dump.json naming its level) the baseline does not fit: an error before training
    fit = pytester.runpytest(*BASE, "--msprobe-baseline=baselines")  # level L1 (the default)
    fit.assert_outcomes(errors=1)
    fit.stdout.fnmatch_lines(["*does not fit this test: it was dumped at level L0, the test runs level L1*"])
    # a dump that does not say its level is caught by what it compares: nothing
    for manifest in pytester.path.glob("baselines/**/msprobe_manifest.json"):
        manifest.unlink()
    for dump in pytester.path.glob("baselines/**/dump.json"):
        doc = json.loads(dump.read_text())
        del doc["level"]
        dump.write_text(json.dumps(doc))
    result = pytester.runpytest(*BASE, "--msprobe-baseline=baselines")
    result.assert_outcomes(failed=1)
    # the module records have no partner; only the optimizer's updates (optimizer.json on both sides) pair
    result.stdout.fnmatch_lines(["*msprobe: too little compared: * (* of * rows, *%) found no partner*"])
    result.stdout.fnmatch_lines(
        ["*first baseline calls without a partner (execution order): Module.conv.Conv2d*"]
    )


@pytest.mark.parametrize(
    ("args", "quoted"),
    [(["--msprobe-max-unmatched=5"], "'5'"), (["--msprobe-max-unmatched=120%"], "'120%'")],
)
def test_bad_limits_are_usage_errors(pytester: pytest.Pytester, args: list[str], quoted: str) -> None:
    pytester.makepyfile(test_train=SOURCE)
    result = pytester.runpytest(*BASE, "--msprobe-baseline=baselines", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--msprobe-max-unmatched*{quoted}*"])


def test_a_bad_marker_value_names_the_test(gated: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_UNMATCHED", "lots")
    result = gated.runpytest(*BASE, "--msprobe-baseline=baselines")
    result.assert_outcomes(errors=1)  # as every bad marker value: from the fixture, at set-up
    result.stdout.fnmatch_lines(
        ["*@pytest.mark.msprobe on test_train.py::test_train: max_unmatched: *'lots'*"]
    )
