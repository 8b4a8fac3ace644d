"""A small transformer as a precision test: two AdamW steps of ``model.TinyTransformer`` (embeddings, two
attention blocks with linear, matmul, softmax and layer_norm, a gelu MLP; float32, random weights, synthetic
tokens), every API call dumped with its statistics (level L1), compared with the stored baseline:

    # the gate: compare against the baseline shipped with the example (made on a CPU)
    pytest examples/transformer --msprobe-baseline=examples/transformer/baselines/cpu
    # write or refresh a baseline on the reference device
    pytest examples/transformer --msprobe-baseline=gpu_baselines --msprobe-regen-baseline --msprobe-device=cuda

A run takes a few seconds on a CPU. Without ``--msprobe-baseline`` the steps run as a plain test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "transformer_example_model", Path(__file__).with_name("model.py")
)
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

STEPS = 2


@pytest.mark.msprobe(task="statistics", level="L1", steps=[0, 1], seed=1234)
def test_transformer_training_steps(msprobe) -> None:
    model = example.TinyTransformer().to(msprobe.device)  # weights drawn on the CPU: the same on every device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for tokens, targets in example.synthetic_batches(STEPS):
        tokens, targets = tokens.to(msprobe.device), targets.to(msprobe.device)
        with msprobe.step(model):
            loss = example.loss_of(model, tokens, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(loss.detach())
    assert len(losses) == STEPS and all(torch.isfinite(loss) for loss in losses)
