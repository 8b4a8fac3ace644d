"""The training checklist through whole pytest runs: differences in the data, the weights, a buffer, the
optimizer's settings or the structure are named for what they are and come first; the environment is context."""

from __future__ import annotations

import json
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from plugin_sources import BASE

# A small CNN with a buffer; FAULT (an environment variable) changes one thing of its run
CNN_TEST = textwrap.dedent(
    """
    import os
    import pytest
    import torch
    import torch.nn.functional as F


    class Net(torch.nn.Module):
        def __init__(self, width=4):
            super().__init__()
            self.c1 = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.c2 = torch.nn.Conv2d(4, width, 3, padding=1)
            self.fc = torch.nn.Linear(width, 3)
            self.register_buffer("mask", torch.ones(width))

        def forward(self, x):
            x = F.relu(self.c1(x))
            x = F.relu(self.c2(x)) * self.mask[:, None, None]
            return self.fc(x.mean((2, 3)))


    @pytest.mark.msprobe(steps=[0, 1])
    def test_train(msprobe):
        fault = os.environ.get("FAULT", "")
        model = Net(width=5 if fault == "structure" else 4).to(msprobe.device)
        if fault == "weight":  # a re-seeded weight
            torch.manual_seed(99)
            with torch.no_grad():
                model.c2.weight.copy_(torch.randn_like(model.c2.weight) * 0.1)
        if fault == "buffer":
            model.mask[1] = 0.5
        opt = torch.optim.SGD(model.parameters(), lr=0.4 if fault == "lr" else 0.5)
        g = torch.Generator().manual_seed(0)
        data = [(torch.rand(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]
        if fault == "pixel":
            data[int(os.environ.get("FAULT_STEP", "0"))][0][1, 2, 3, 4] += 0.25
        for i, (x, y) in enumerate(data):
            if fault == "between" and i == 1:  # a weight changed between the steps, outside the dumped calls
                with torch.no_grad():
                    model.c2.weight.mul_(1.01)
            with msprobe.step(model):
                loss = F.cross_entropy(model(x.to(msprobe.device)), y.to(msprobe.device))
                opt.zero_grad()
                loss.backward()
                opt.step()
    """
)


@pytest.fixture
def baseline(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("FAULT", raising=False)
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    pytester.makepyfile(test_cnn=CNN_TEST)
    regen = pytester.runpytest(*BASE, "--msprobe-baseline=baselines", "--msprobe-regen-baseline")
    regen.assert_outcomes(passed=1)
    folder = pytester.path / "baselines" / "test_cnn" / "test_train"
    assert (folder / "step0" / "rank" / "checklist.json").is_file()
    return folder


def _summary(pytester: pytest.Pytester) -> dict:
    path = pytester.path / "msprobe-output" / "test_cnn" / "test_train" / "compare" / "summary.json"
    return json.loads(path.read_text())


@pytest.mark.parametrize(
    ("fault", "line", "kind", "name"),
    [
        ("pixel", "*first divergence: data (step 0): input args.0 of the model's forward*", "data", "args.0"),
        (
            "weight",
            "*first divergence: parameter c2.weight (before step 0): its values differ (CRC32*",
            "parameter",
            "c2.weight",
        ),
        ("buffer", "*first divergence: buffer mask (before step 0): *", "buffer", "mask"),
        ("lr", "*first divergence: hyperparameter lr (param group 0): 0.4 vs 0.5*", "hyperparameter", "lr"),
        ("structure", "*first divergence: structure c2.weight (the model): *", "structure", "c2.weight"),
    ],
)
def test_a_checklist_difference_fails_named_for_what_it_is(
    pytester: pytest.Pytester,
    baseline: Path,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    line: str,
    kind: str,
    name: str,
) -> None:
    monkeypatch.setenv("FAULT", fault)
    result = pytester.runpytest(*BASE, "--msprobe-baseline=baselines", "--junitxml=junit.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*msprobe: the runs differ before any call: *checklist difference*", line])
    summary = _summary(pytester)
    assert summary["passed"] is False
    fd = summary["first_divergence"]
    assert (fd["kind"], fd["name"]) == (kind, name)
    assert fd["rule"] == "checklist" and fd["api"] and fd["row"]  # where it shows first: a call and a row
    assert fd["row"].startswith(fd["api"])
    if kind != "structure":
        assert fd["step"] == 0
    props = {p.get("name"): p.get("value") for p in ET.parse(pytester.path / "junit.xml").iter("property")}
    assert props["msprobe_first_divergence"].startswith(f"{kind}")
    advisor = next((pytester.path / "msprobe-output").rglob("advisor_*.txt")).read_text()
    assert advisor.startswith("Line: N/A\nSuspect Nodes: " + kind)
    assert "Checklist differences" in advisor


def test_a_changed_batch_at_a_later_step_is_named_at_that_step(
    pytester: pytest.Pytester, baseline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAULT", "pixel")
    monkeypatch.setenv("FAULT_STEP", "1")
    result = pytester.runpytest(*BASE, "--msprobe-baseline=baselines")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*first divergence: data (step 1): input args.0*"])
    assert _summary(pytester)["first_divergence"]["step"] == 1


def test_a_weight_changed_between_two_compared_steps_is_named(
    pytester: pytest.Pytester, baseline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAULT", "between")
    result = pytester.runpytest(*BASE, "--msprobe-baseline=baselines")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*first divergence: parameter c2.weight (before step 1): *a change made outside the dumped calls*"]
    )


def test_an_environment_difference_alone_passes_and_is_shown(
    pytester: pytest.Pytester, baseline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    result = pytester.runpytest(*BASE, "--msprobe-baseline=baselines", "--msprobe-keep-dumps")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*PASSED*test_cnn.py::test_train*differs (context): environment NVIDIA_TF32_OVERRIDE: 0 vs unset*"]
    )
    checklist = _summary(pytester)["checklist"]
    assert checklist["passed"] is True and checklist["checked_dump_pairs"] == 2
    assert [(c["kind"], c["name"], c["target"], c["baseline"]) for c in checklist["context"]] == [
        ("environment", "NVIDIA_TF32_OVERRIDE", "0", "unset")
    ]
    advisor = next((pytester.path / "msprobe-output").rglob("advisor_*.txt")).read_text()
    assert "environment NVIDIA_TF32_OVERRIDE: 0 vs unset" in advisor

    # the same two dumps, offline: exit 0, the context printed
    dump = pytester.path / "msprobe-output" / "test_cnn" / "test_train" / "dump"
    offline = pytester.run(
        sys.executable, "-m", "pytest_msprobe", "config-check", str(dump), str(baseline), "-o", "cc"
    )
    assert offline.ret == 0
    offline.stdout.fnmatch_lines(
        [
            "*config-check: PASSED: 2 dump pair(s) compared, 0 failing*",
            "*context: environment NVIDIA_TF32_OVERRIDE: 0 vs unset*",
        ]
    )
    assert json.loads((pytester.path / "cc" / "config_check.json").read_text())["passed"] is True


def test_config_check_offline_names_the_difference_and_exits_1(
    pytester: pytest.Pytester, baseline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAULT", "lr")
    pytester.runpytest(*BASE, "--msprobe-baseline=baselines").assert_outcomes(failed=1)
    dump = pytester.path / "msprobe-output" / "test_cnn" / "test_train" / "dump"
    offline = pytester.run(sys.executable, "-m", "pytest_msprobe", "config-check", str(dump), str(baseline))
    assert offline.ret == 1
    offline.stdout.fnmatch_lines(
        ["*FAILED*1 failing difference*", "*hyperparameter lr (param group 0): 0.4 vs 0.5*"]
    )


def test_config_check_of_dumps_without_checklists_is_an_error(pytester: pytest.Pytester) -> None:
    data = Path(__file__).parents[1] / "data" / "msprobe"
    dumps = sorted(p for p in data.rglob("dump.json"))
    assert len(dumps) >= 2
    result = pytester.run(
        sys.executable, "-m", "pytest_msprobe", "config-check", str(dumps[0].parent), str(dumps[1].parent)
    )
    assert result.ret == 2
    result.stderr.fnmatch_lines(["*no checklist to compare*has a checklist.json*"])


def test_a_baseline_with_a_broken_checklist_is_an_error_before_training(
    pytester: pytest.Pytester, baseline: Path
) -> None:
    broken = baseline / "step1" / "rank" / "checklist.json"
    broken.write_text('{"format": "pytest-msprobe checklist", "version": 1, "data": [')
    result = pytester.runpytest(*BASE, "--msprobe-baseline=baselines")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*msprobe: unusable baseline: {broken}: invalid JSON*"])
