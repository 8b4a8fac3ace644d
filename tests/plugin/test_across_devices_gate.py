"""The gate across devices, end to end through pytest: a baseline made on the CPU gates a run whose device
computes its float32 convolutions and matmuls in TF32 and says so (``-p tests.devices --simulate-device=tf32``:
another device's numerics simulated on the CPU).

The differing setting is named as the first divergence with the first call it changes; the TF32 drift of every
call after it fails no call (the target's self-check judges each call under its declared precision); an op fault
under that noise is named at its call, before the setting; and with the setting the same on both sides (the
baseline regenerated under the same simulation), the clean run passes and the fault is still named.
"""

from __future__ import annotations

import json

import pytest
from plugin_sources import BASE

ARGS = [*BASE, "--msprobe-baseline=baselines"]
TF32 = ["-p", "tests.devices", "--simulate-device=tf32", "--msprobe-self-check"]


def _summary(pytester: pytest.Pytester) -> dict:
    doc = json.loads((pytester.path / "msprobe-output" / "summary.json").read_text())
    (entry,) = doc["tests"]
    return entry


def test_a_tf32_run_against_a_cpu_baseline_names_the_setting(pytester: pytest.Pytester, train_test) -> None:
    train_test()
    pytester.runpytest(*ARGS, "--msprobe-regen-baseline").assert_outcomes(passed=1)
    result = pytester.runpytest(*ARGS, *TF32)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "msprobe: the runs differ in a numerics setting*",
            "*across devices (the baseline ran on cpu, the target on cuda; the target computes float32 "
            "convolutions in tf32*): * drift beyond the value thresholds and do not fail; each call is judged by "
            "its own error*",
            "first divergence: setting torch.backends.cudnn.allow_tf32 (target True; the baseline's cpu has "
            "none): Functional.conv2d.0.forward (step 0) is the first call it changes",
        ]
    )
    entry = _summary(pytester)
    assert entry["first_divergence"]["kind"] == "setting"
    assert entry["counts"]["breaching_calls"] == 0  # the TF32 drift: warnings, no call fails
    assert "across devices" in entry["across"] and "judged by their own errors" in entry["across"]


@pytest.mark.parametrize(
    ("fault", "call"),
    [
        ("noise:Functional.relu:1", "Functional.relu.1.forward"),
        ("scale:Functional.linear:0", "Functional.linear.0.forward"),
    ],
)
def test_an_op_fault_under_tf32_is_named_at_its_call_before_the_setting(
    pytester: pytest.Pytester, train_test, fault: str, call: str
) -> None:
    train_test()
    pytester.runpytest(*ARGS, "--msprobe-regen-baseline").assert_outcomes(passed=1)
    result = pytester.runpytest(*ARGS, *TF32, f"--simulate-fault={fault}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"first divergence: {call} (step 0, rank 0), row {call}.output.0"])
    entry = _summary(pytester)
    assert (entry["first_divergence"]["kind"], entry["first_divergence"]["rule"]) == ("api", "out of line")
    assert entry["counts"]["breaching_calls"] == 2  # the faulty call at both steps, and nothing else


def test_the_same_setting_on_both_sides_passes_clean_and_names_a_fault(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test()
    pytester.runpytest(*ARGS, *TF32, "--msprobe-regen-baseline").assert_outcomes(passed=1)
    pytester.runpytest(*ARGS, *TF32).assert_outcomes(passed=1)
    result = pytester.runpytest(*ARGS, *TF32, "--simulate-fault=scale:Functional.conv2d:1")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["first divergence: Functional.conv2d.1.forward (step 0, rank 0)*"])
