"""seed_all seeds as msprobe does, so runs seeded by either tool draw the same numbers."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pytest_msprobe import seed_all
from pytest_msprobe.errors import ConfigError


def _draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_same_numbers_as_msprobe_seeding() -> None:
    # msprobe's seed_all: random, PYTHONHASHSEED, numpy, torch (every device)
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    expected = _draws()
    seed_all(seed=1234)
    got = _draws()
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    assert os.environ["PYTHONHASHSEED"] == "1234"


def test_mode_switches_deterministic_algorithms() -> None:
    seed_all(seed=7, mode=True)
    assert torch.are_deterministic_algorithms_enabled()
    seed_all(seed=7, mode=False)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seed": -1}, "seed=-1"),
        ({"seed": 2**32}, "seed=4294967296"),
        ({"seed": 1.5}, "seed=1.5"),
        ({"mode": "yes"}, "mode='yes'"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        seed_all(**kwargs)  # type: ignore[arg-type]


def test_rm_dropout_makes_dropout_an_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"):
        monkeypatch.setattr(F, name, getattr(F, name))  # restored after the test
    seed_all(seed=1, rm_dropout=True)
    x = torch.randn(4, 8)
    assert torch.equal(F.dropout(x, p=0.9, training=True), x)
    assert torch.equal(torch.nn.Dropout(0.5).train()(x), x)
    seed_all(seed=1, rm_dropout=True)  # applying twice does not wrap twice
    assert not getattr(F.dropout.__wrapped__, "_msprobe_no_dropout", False)
