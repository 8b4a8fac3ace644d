"""The msprobe ResNet50 tutorial as a precision test.

The test trains torchvision's ResNet50 (random weights) for two steps on synthetic images with statistics
dumping at API level (L1) and compares the dump with the stored baseline:

    # the gate (any runner): compare against the baseline shipped with the example (made on a CPU)
    pytest examples/resnet50 --msprobe-baseline=examples/resnet50/baselines/cpu
    # the GPU runner: write or refresh the baselines from the reference device
    pytest examples/resnet50 --msprobe-baseline=gpu_baselines --msprobe-regen-baseline --msprobe-device=cuda
    # the NPU runner: the precision gate against the GPU baselines (imports torch_npu and transfer_to_npu)
    pytest examples/resnet50 --msprobe-baseline=gpu_baselines --msprobe-device=npu

Without ``--msprobe-baseline`` the training steps run as a plain test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("resnet50_example_main", Path(__file__).with_name("main.py"))
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

STEPS, BATCH, IMAGE_SIZE = 2, 4, 64


@pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1], seed=1234)
def test_resnet50_training_steps(msprobe) -> None:
    model = example.build_model("resnet50").to(msprobe.device)
    criterion = torch.nn.CrossEntropyLoss().to(msprobe.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    batches = example.synthetic_batches(STEPS, BATCH, IMAGE_SIZE)
    # the model given to start() at L1 too: the checklist fingerprints its weights and the batch of its forward
    losses = example.train(
        model, batches, criterion, optimizer, msprobe.device, debugger=msprobe.debugger, pass_model=True
    )
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
