"""A dump made by plain msprobe, dropped in as a test's baseline, gates the same training run."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
from plugin_sources import BASE

DATA = Path(__file__).resolve().parents[1] / "data" / "msprobe"

# the training of tests/data/msprobe/make_dumps.py (the script msprobe dumped), as a precision test
TEST = textwrap.dedent(
    f"""
    import importlib.util, os
    import pytest, torch
    import torch.nn.functional as F

    spec = importlib.util.spec_from_file_location("make_dumps_for_test", {str(DATA / "make_dumps.py")!r})
    md = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(md)


    @pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1])
    def test_tiny_resnet(msprobe):
        relu = F.relu
        try:
            if os.environ.get("PERTURB"):
                md.install_perturbation("relu@2", None)  # msprobe's fault case: the 3rd relu of each forward
            torch.manual_seed(1234)
            model = md.TinyResNet()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            loss_fn = torch.nn.CrossEntropyLoss()
            for step in range(2):
                x, y = md.make_batch(step, 8, 16)
                with msprobe.step():
                    loss = loss_fn(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        finally:
            F.relu = relu
    """
)


@pytest.mark.parametrize("version", ["msprobe-8.3.3", "msprobe-26.2.0"])
def test_a_plain_msprobe_dump_works_as_a_baseline(
    pytester: pytest.Pytester, version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_tiny=TEST)
    shutil.copytree(
        DATA / version / "dumps" / "bench" / "stat_L1",
        pytester.path / "bl" / "test_tiny" / "test_tiny_resnet",
    )
    clean = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    clean.assert_outcomes(passed=1)

    monkeypatch.setenv("PERTURB", "1")
    faulty = pytester.runpytest(*BASE, "--msprobe-baseline=bl")
    faulty.assert_outcomes(failed=1, errors=0)
    faulty.stdout.fnmatch_lines(["*first divergence: Functional.relu.2.forward (step 0, rank 0)*"])
