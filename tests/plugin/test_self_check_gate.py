"""``--msprobe-self-check``: each API call replayed in float64 while the steps run; without a baseline the test
dumps its steps and fails on a call whose own error is out of line, naming it and where it is called from."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from plugin_sources import BASE, with_net

# faults put in the test's own body (monkeypatch): relu 1e-3 noisy (its node stays relu's), or the functional
# relu (the second of a forward, after conv2) with a gradient 1% off and an exact forward
FAULTS = textwrap.dedent(
    """

    _relu = F.relu


    def noisy_relu(input, inplace=False):
        out = _relu(input, inplace=inplace)
        out.data.mul_(1 + 1e-3 * torch.randn_like(out))
        return out


    class _OffGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clamp(min=0)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * (x > 0) * 1.01


    def off_gradient_relu(input, inplace=False):
        return _relu(input, inplace=True) if inplace else _OffGradient.apply(input)


    def test_noisy(msprobe, monkeypatch):
        monkeypatch.setattr(F, "relu", noisy_relu)
        train(msprobe)


    @pytest.mark.msprobe(steps=[3, 4])
    def test_off_gradient_mid_run(msprobe, monkeypatch):
        monkeypatch.setattr(F, "relu", off_gradient_relu)
        train(msprobe, steps=5)
    """
)


@pytest.fixture
def self_check_tests(pytester: pytest.Pytester, train_source: str) -> Path:
    return pytester.makepyfile(test_train=train_source.replace("MARKER", "") + FAULTS)


def _output(pytester: pytest.Pytester, test: str) -> Path:
    return pytester.path / "msprobe-output" / "test_train" / test


def test_a_clean_run_passes_and_each_dumped_step_has_its_sidecar(
    pytester: pytest.Pytester, self_check_tests: Path
) -> None:
    result = pytester.runpytest(
        *BASE, "--msprobe-self-check", "--msprobe-keep-dumps", "test_train.py::test_train"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*msprobe*", "PASSED*test_train.py::test_train*"])
    dump = _output(pytester, "test_train") / "dump"
    for step in (0, 1):
        doc = json.loads((dump / f"step{step}" / "rank" / "self_check.json").read_text())
        data = json.loads((dump / f"step{step}" / "rank" / "dump.json").read_text())["data"]
        assert list(doc["calls"]) == list(data) and doc["source"] == "online"
        judged = [name for name, call in doc["calls"].items() if "outputs" in call]
        assert "Functional.conv2d.1.backward" in judged and "Functional.batch_norm.0.forward" in judged
    # without --msprobe-keep-dumps a pass leaves nothing behind
    again = pytester.runpytest(*BASE, "--msprobe-self-check", "test_train.py::test_train")
    again.assert_outcomes(passed=1)
    assert not (_output(pytester, "test_train") / "dump").exists()


def test_a_noisy_relu_fails_the_call_phase_naming_its_forward_and_where_it_is_called(
    pytester: pytest.Pytester, self_check_tests: Path
) -> None:
    result = pytester.runpytest(*BASE, "--msprobe-self-check", "test_train.py::test_noisy")
    result.assert_outcomes(failed=1)  # a failure of the call phase, no error
    result.stdout.fnmatch_lines(
        [
            "*msprobe self-check: * of * replayed API calls are out of line against the float64 replay of "
            "their own inputs*",
            "first out of line: Functional.relu.0.forward (step 0, rank 0)",
            "  called from: File */test_train.py, line *, in forward, x = self.relu(self.bn(self.conv(x)))",
            "*of its elements more than 0.001 off*",
            "FAILED*test_train.py::test_noisy*(first out of line Functional.relu.0.forward)",
        ]
    )
    assert "_ test_noisy _" in result.stdout.str() and "ERROR" not in result.stdout.str()
    assert (_output(pytester, "test_noisy") / "dump" / "step0" / "rank" / "self_check.json").is_file()


def test_a_gradient_off_in_a_dump_from_the_middle_of_the_run_is_named_by_its_backward(
    pytester: pytest.Pytester, self_check_tests: Path
) -> None:
    result = pytester.runpytest(*BASE, "--msprobe-self-check", "test_train.py::test_off_gradient_mid_run")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "first out of line: Functional.relu.1.backward (step 3, rank 0)",
            "  called from: File */test_train.py, line *, in forward, x = F.relu(self.conv2(x))",
            "also out of line: Functional.relu.1.backward (step 4, rank 0)*",
        ]
    )
    assert "Functional.relu.1.forward" not in result.stdout.str()  # its forward is exact


def test_the_marker_and_the_ini_turn_it_on(pytester: pytest.Pytester, train_source: str) -> None:
    pytester.makepyfile(
        test_train=train_source.replace("MARKER", "@pytest.mark.msprobe(self_check=True)")
        + FAULTS.replace(
            "def test_noisy(msprobe", "@pytest.mark.msprobe(self_check=False)\ndef test_noisy(msprobe"
        )
    )
    marker = pytester.runpytest(*BASE, "test_train.py::test_train", "test_train.py::test_noisy")
    marker.assert_outcomes(passed=2)  # test_noisy is not checked: its marker says so
    pytester.makeini("[pytest]\nmsprobe_self_check = true\n")
    ini = pytester.runpytest(*BASE, "test_train.py::test_off_gradient_mid_run")
    ini.assert_outcomes(failed=1)
    ini.stdout.fnmatch_lines(["first out of line: Functional.relu.1.backward (step 3, rank 0)"])


def test_a_bad_value_is_refused_with_where_it_was_given(pytester: pytest.Pytester, train_source: str) -> None:
    pytester.makepyfile(test_train=train_source.replace("MARKER", "@pytest.mark.msprobe(self_check='maybe')"))
    marker = pytester.runpytest(*BASE)
    marker.assert_outcomes(errors=1)
    marker.stdout.fnmatch_lines(
        [
            "msprobe: @pytest.mark.msprobe on test_train.py::test_train: self_check: expected true or false, got 'maybe'"
        ]
    )
    pytester.makeini("[pytest]\nmsprobe_self_check = sometimes\n")
    ini = pytester.runpytest(*BASE)
    assert ini.ret == pytest.ExitCode.USAGE_ERROR
    ini.stderr.fnmatch_lines(["*ini msprobe_self_check: expected true or false, got 'sometimes'*"])


def test_a_dump_folder_without_its_sidecar_is_an_error_not_a_pass(
    pytester: pytest.Pytester, train_source: str
) -> None:
    body = train_source.replace("MARKER", "").replace(
        "def test_train(msprobe):\n    train(msprobe)\n",
        "def test_train(msprobe):\n    train(msprobe)\n    msprobe.debugger.wait()\n"
        "    (msprobe.dump_dir / 'step1' / 'rank' / 'self_check.json').unlink()\n",
    )
    pytester.makepyfile(test_train=body)
    result = pytester.runpytest(*BASE, "--msprobe-self-check")
    result.assert_outcomes(errors=1)
    lines = [line for line in result.stdout.str().splitlines() if line.startswith("msprobe: ")]
    assert len(lines) == 1, lines
    result.stdout.fnmatch_lines(
        [
            "msprobe: unusable dump: */step1/rank/dump.json: no self_check.json beside it: the dump was made without*"
        ]
    )


def test_a_regenerated_baseline_holds_the_sidecars_and_the_compare_gates_on_own_errors(
    pytester: pytest.Pytester, self_check_tests: Path
) -> None:
    regen = pytester.runpytest(
        *BASE,
        "--msprobe-self-check",
        "--msprobe-baseline=bl",
        "--msprobe-regen-baseline",
        "test_train.py::test_train",
    )
    regen.assert_outcomes(passed=1)
    baseline = pytester.path / "bl" / "test_train" / "test_train"
    assert sorted(str(p.relative_to(baseline)) for p in baseline.rglob("self_check.json")) == [
        "step0/rank/self_check.json",
        "step1/rank/self_check.json",
    ]
    manifest = json.loads((baseline / "msprobe_manifest.json").read_text())
    assert manifest["extra"]["self_check"] is True
    clean = pytester.runpytest(
        *BASE, "--msprobe-self-check", "--msprobe-baseline=bl", "test_train.py::test_train"
    )
    clean.assert_outcomes(passed=1)
    # the noisy test against the clean test's baseline: its relu is out of line, and the compare says so
    (pytester.path / "bl" / "test_train" / "test_noisy").symlink_to(baseline)
    noisy = pytester.runpytest(
        *BASE, "--msprobe-self-check", "--msprobe-baseline=bl", "test_train.py::test_noisy"
    )
    noisy.assert_outcomes(failed=1)
    noisy.stdout.fnmatch_lines(
        ["first divergence: Functional.relu.0.forward (step 0, rank 0)*", "  its own error is out of line*"]
    )


DDP_SELF_CHECK = with_net(
    textwrap.dedent(
        """
        import os

        import pytest
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel as DDP


        NET


        _relu = F.relu


        def noisy_relu(input, inplace=False):
            out = _relu(input, inplace=inplace)
            out.data.mul_(1 + 1e-3 * torch.randn_like(out))
            return out


        @pytest.mark.msprobe(world_size=2, steps=[0, 1])
        def test_ddp(msprobe, monkeypatch):
            if msprobe.rank == 1:
                monkeypatch.setattr(F, "relu", noisy_relu)
            model = DDP(Net().to(msprobe.device))
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(msprobe.rank)
            for _ in range(2):
                x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
                with msprobe.step(model):
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        """
    ),
    bn=False,
    conv2=False,
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups")
def test_each_rank_writes_its_sidecars_and_a_fault_on_rank_one_is_named_there(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_ddp=DDP_SELF_CHECK)
    result = pytester.runpytest(*BASE, "--msprobe-self-check")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["first out of line: Functional.relu.0.forward (step 0, rank 1)"])
    assert "(step 0, rank 0)" not in result.stdout.str()
    dump = pytester.path / "msprobe-output" / "test_ddp" / "test_ddp" / "dump"
    sidecars = sorted(str(p.parent.relative_to(dump)) for p in dump.rglob("self_check.json"))
    assert sidecars == ["step0/rank0", "step0/rank1", "step1/rank0", "step1/rank1"]
