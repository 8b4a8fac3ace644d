"""Numerics settings through whole pytest runs: precision tests compute float32 math in float32 on every device
unless they allow TF32 (marker, ini, command line), every switch put back after the test; a run whose recorded
policy differs from its baseline's (here: a run that records CUDA with TF32 convolutions) fails naming the
setting and the first call it changes, in the terminal, junitxml, summary.json and the advisor."""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from plugin_sources import BASE

ARGS = [*BASE, "--strict-config"]  # an unknown ini key is an error

# the switches inside the body of an msprobe test and in a plain test after it; the session starts with the
# production settings a CUDA user would have (cuDNN's TF32 is torch's default, "high" a common choice)
SWITCHES_TEST = textwrap.dedent(
    """
    import pytest
    import torch


    def switches():
        return (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
                torch.get_float32_matmul_precision())


    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")


    MARKER
    def test_inside(msprobe):
        print("INSIDE", switches())


    def test_after():
        print("AFTER", switches())
    """
)
STRICT = "*INSIDE (False, False, 'highest')"
ALLOWED = "*INSIDE (True, True, 'high')"
PUT_BACK = "*AFTER (True, True, 'high')"


@pytest.fixture(autouse=True)
def defaults():
    """The host process's switches as torch sets them, whatever a run in it left."""
    yield
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("highest")


def _switches_test(pytester: pytest.Pytester, marker: str = "@pytest.mark.msprobe()", ini: str = "") -> None:
    pytester.makepyfile(test_switches=SWITCHES_TEST.replace("MARKER", marker))
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")


def test_precision_tests_compute_float32_in_float32_and_put_the_switches_back(
    pytester: pytest.Pytester,
) -> None:
    _switches_test(pytester)
    result = pytester.runpytest(*ARGS, "-s")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([STRICT, PUT_BACK])


@pytest.mark.parametrize(
    ("marker", "ini", "flags", "inside"),
    [
        ("@pytest.mark.msprobe(allow_tf32=True)", "", [], ALLOWED),
        ("@pytest.mark.msprobe()", "msprobe_allow_tf32 = true", [], ALLOWED),
        ("@pytest.mark.msprobe(allow_tf32=False)", "", ["--msprobe-allow-tf32"], ALLOWED),  # CLI > marker
        ("@pytest.mark.msprobe(allow_tf32=False)", "msprobe_allow_tf32 = true", [], STRICT),  # marker > ini
        ("@pytest.mark.msprobe(allow_tf32='no')", "", [], STRICT),
    ],
    ids=["marker", "ini", "command line over marker", "marker over ini", "marker text"],
)
def test_allow_tf32_leaves_the_switches_as_the_device_and_the_user_have_them(
    pytester: pytest.Pytester, marker: str, ini: str, flags: list[str], inside: str
) -> None:
    _switches_test(pytester, marker, ini)
    result = pytester.runpytest(*ARGS, "-s", *flags)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([inside, PUT_BACK])


def test_a_bad_allow_tf32_value_is_refused_naming_where(pytester: pytest.Pytester) -> None:
    _switches_test(pytester, "@pytest.mark.msprobe(allow_tf32='maybe')")
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*@pytest.mark.msprobe on test_switches.py::test_inside: allow_tf32: expected true or false, got 'maybe'*"
        ]
    )
    _switches_test(pytester, ini="msprobe_allow_tf32 = maybe")
    usage = pytester.runpytest(*ARGS)
    assert usage.ret == pytest.ExitCode.USAGE_ERROR
    usage.stderr.fnmatch_lines(["*ini msprobe_allow_tf32: expected true or false, got 'maybe'*"])


# A small CNN; with FAKE_CUDA_TF32 set, the run records the policy of CUDA with cuDNN's TF32 on (this machine
# has no GPU: the numbers are the CPU's, only the recorded setting differs)
CNN_TEST = textwrap.dedent(
    """
    import os
    import pytest
    import torch
    import torch.nn.functional as F

    from pytest_msprobe.dump import switches
    from pytest_msprobe.format.numerics import CUDNN_TF32, TF32, Policy


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(F.relu(self.c1(x)).mean((2, 3)))


    @pytest.mark.msprobe(steps=[0, 1])
    def test_train(msprobe, monkeypatch):
        if os.environ.get("FAKE_CUDA_TF32"):
            cuda = Policy("cuda", conv=TF32, conv_setting=(CUDNN_TF32, "True"))
            monkeypatch.setattr(switches, "current_policy", lambda device, found=None: cuda)
        model = Net().to(msprobe.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            x, y = torch.rand(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
            with msprobe.step(model):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    """
)


@pytest.fixture
def baseline(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("FAKE_CUDA_TF32", raising=False)
    pytester.makepyfile(test_cnn=CNN_TEST)
    pytester.runpytest(*ARGS, "--msprobe-baseline=baselines", "--msprobe-regen-baseline").assert_outcomes(
        passed=1
    )
    return pytester.path / "baselines" / "test_cnn" / "test_train"


def test_the_baselines_manifest_records_whether_tf32_was_allowed(
    pytester: pytest.Pytester, baseline: Path
) -> None:
    assert json.loads((baseline / "msprobe_manifest.json").read_text())["extra"]["allow_tf32"] is False
    regen = pytester.runpytest(
        *ARGS, "--msprobe-baseline=baselines", "--msprobe-regen-baseline", "--msprobe-allow-tf32"
    )
    regen.assert_outcomes(passed=1)
    assert json.loads((baseline / "msprobe_manifest.json").read_text())["extra"]["allow_tf32"] is True


@pytest.mark.slow
def test_a_setting_that_differs_from_the_baselines_fails_named_with_its_first_call(
    pytester: pytest.Pytester, baseline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_TF32", "1")
    # in a process of its own: in-process runs import the package's modules anew, while the debugger an earlier
    # run loaded would keep the precision module it was made with, not the one the test patches
    result = pytester.runpytest_subprocess(*ARGS, "--msprobe-baseline=baselines", "--junitxml=junit.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*msprobe: the runs differ in a numerics setting: 1 checklist difference (setting); *",
            "first divergence: setting torch.backends.cudnn.allow_tf32 (target True; the baseline's cpu has none): "
            "Functional.conv2d.0.forward (step 0) is the first call it changes",
            "  called from: File *test_cnn.py*, in forward, return self.fc(F.relu(self.c1(x)).mean((2, 3)))",
            "*torch.backends.cudnn.allow_tf32: it lets the device compute float32 convolutions in a reduced format*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "FAILED*test_cnn.py::test_train*(first divergence setting torch.backends.cudnn.allow_tf32 on rank 0*"
        ]
    )
    summary = json.loads((pytester.path / "msprobe-output" / "summary.json").read_text())
    (entry,) = summary["tests"]
    fd = entry["first_divergence"]
    assert (fd["kind"], fd["name"], fd["call"], fd["step"], fd["rank"]) == (
        "setting",
        "torch.backends.cudnn.allow_tf32",
        "Functional.conv2d.0.forward",
        0,
        0,
    )
    assert fd["text"] == "setting torch.backends.cudnn.allow_tf32" and "test_cnn.py" in fd["source"]
    props = {p.get("name"): p.get("value") for p in ET.parse(pytester.path / "junit.xml").iter("property")}
    assert props["msprobe_first_divergence"] == "setting torch.backends.cudnn.allow_tf32"
    compare_dir = pytester.path / "msprobe-output" / "test_cnn" / "test_train" / "compare"
    (advisor,) = compare_dir.glob("advisor_*.txt")
    text = advisor.read_text()
    assert "Suspect Nodes: setting torch.backends.cudnn.allow_tf32" in text
    assert "about 1e-3 relative error" in text and "Run both sides with the same setting" in text
    assert "--msprobe-allow-tf32" in text


RANKS_TEST = textwrap.dedent(
    """
    import os
    import pytest
    import torch

    if "RANK" in os.environ:  # in the rank processes only: pytest's own process imports this module too
        torch.set_float32_matmul_precision("high")


    @pytest.mark.msprobe(world_size=2)
    def test_ranks(msprobe):
        assert os.environ["RANK"] == str(msprobe.rank)
        seen = (torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
        assert seen == EXPECTED, f"rank {msprobe.rank}: {seen}"
    """
)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], (False, "highest")), (["--msprobe-allow-tf32"], (True, "high"))],
    ids=["strict", "allowed"],
)
def test_every_rank_of_a_multi_rank_test_gets_the_same(
    pytester: pytest.Pytester, flags: list[str], expected: tuple[bool, str]
) -> None:
    # (a name of its own: tests/plugin/test_ranks.py may be imported in this process already)
    pytester.makepyfile(test_tf32_ranks=RANKS_TEST.replace("EXPECTED", repr(expected)))
    result = pytester.runpytest(*ARGS, *flags)
    result.assert_outcomes(passed=1)
