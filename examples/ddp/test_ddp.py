"""The DDP example as a multi-rank precision test: two ranks (gloo on the CPU, nccl/hccl on accelerators) train
a DDP TinyResNet for two steps on their own batches, every API and module dumped (level mix), and all ranks are
compared with the baseline:

    # the gate: compare against the baseline shipped with the example (made on a CPU)
    pytest examples/ddp --msprobe-baseline=examples/ddp/baselines/cpu
    # write or refresh the baseline on the reference machine
    pytest examples/ddp --msprobe-baseline=gpu_baselines --msprobe-regen-baseline --msprobe-device=cuda

A failure names the rank the error enters on: ``first divergence: ... (step 0, rank 1)``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("train_ddp", Path(__file__).with_name("train_ddp.py"))
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("train_ddp", example)  # its dataclasses look their module up
_spec.loader.exec_module(example)

STEPS = 2


@pytest.mark.msprobe(world_size=2, task="statistics", level="mix", steps=[0, 1], seed=1234)
def test_ddp_training_steps(msprobe) -> None:
    result = example.train(steps=STEPS, device=msprobe.device.type, debugger=msprobe.debugger, level="mix")
    assert (result.rank, result.world_size) == (msprobe.rank, 2)
    assert len(result.losses) == STEPS and all(torch.isfinite(loss) for loss in result.losses)
