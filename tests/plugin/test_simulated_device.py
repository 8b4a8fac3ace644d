"""The simulated TF32 device as a pytest plugin (``-p tests.devices``): whole pytest runs with
``--msprobe-self-check`` on a side that computes its convolutions and matmuls in TF32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plugin_sources import BASE

ARGS = [*BASE, "-p", "tests.devices", "--msprobe-self-check"]


def _rank(pytester: pytest.Pytester, step: int) -> Path:
    return pytester.path / "msprobe-output" / "test_train" / "test_train" / "dump" / f"step{step}" / "rank"


def test_a_device_that_computes_as_it_declares_passes(pytester: pytest.Pytester, train_test) -> None:
    train_test(marker="")
    result = pytester.runpytest(*ARGS, "--simulate-device=tf32", "--msprobe-keep-dumps")
    result.assert_outcomes(passed=1)
    for step in (0, 1):
        doc = json.loads((_rank(pytester, step) / "self_check.json").read_text())
        assert (doc["precision"]["device"], doc["precision"]["conv"]) == ("cuda", "tf32")
        for name in (
            "Functional.conv2d.0.forward",
            "Functional.conv2d.1.backward",
            "Functional.linear.0.forward",
        ):
            assert doc["calls"][name]["emulated"] == "tf32", name
        assert "emulated" not in doc["calls"]["Functional.relu.0.forward"]
        checklist = json.loads((_rank(pytester, step) / "checklist.json").read_text())
        assert checklist["device"] == "cuda" and checklist["switches"]["cudnn.allow_tf32"] is True


def test_the_same_numbers_undeclared_fail_at_the_first_convolution(
    pytester: pytest.Pytester, train_test
) -> None:
    train_test(marker="")
    result = pytester.runpytest(*ARGS, "--simulate-device=tf32-undeclared")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "first out of line: Functional.conv2d.0.forward (step 0, rank 0)",
            "*of its elements more than 0.001 off*",
        ]
    )


def test_an_op_fault_under_tf32_fails_naming_its_call(pytester: pytest.Pytester, train_test) -> None:
    train_test(marker="")
    result = pytester.runpytest(*ARGS, "--simulate-device=tf32", "--simulate-fault=noise:Functional.relu:1")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "msprobe self-check: 2 of * replayed API calls are out of line*",
            "first out of line: Functional.relu.1.forward (step 0, rank 0)",
            "  called from: File */test_train.py, line *, in forward, x = F.relu(self.conv2(x))",
            "also out of line: Functional.relu.1.forward (step 1, rank 0)*",
        ]
    )
    assert "Functional.conv2d" not in result.stdout.str()
