"""bench/tf32_rounding.py, the device check of how a GPU rounds to TF32, tells roundings apart: on the CPU,
whose float32 math is float32, the replay of the inputs as they are matches and both TF32 roundings do not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_on_the_cpu_only_the_unrounded_replay_matches() -> None:
    spec = importlib.util.spec_from_file_location("tf32_rounding", ROOT / "bench" / "tf32_rounding.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.run(torch.device("cpu"))
    assert [r["case"] for r in rows] == [
        "matmul",
        "conv2d",
        "conv2d input gradient",
        "conv2d weight gradient",
    ]
    for row in rows:
        assert row["float32"]["share_off"] == 0.0, row
        assert row["nearest-even"]["share_off"] > 0.01 and row["truncated"]["share_off"] > 0.01, row
