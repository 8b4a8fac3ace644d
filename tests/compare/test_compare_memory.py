"""Compare memory is bounded by the largest tensor pair, whatever the size of the dump.

How: a torch archive stores each storage uncompressed, so :func:`open_tensor` reads only the pickle and the
offset of the values (nothing of the data); :func:`tensor_metrics` then reads both files block by block
(64 Ki elements) into one reused buffer per side and keeps running sums, and the engine computes one pair at a
time, keeping only its metrics. Only a view with gaps or a compressed member is gathered whole, one tensor
at a time. The test measures it with tracemalloc (numpy reports its buffers to it): comparing 16 pairs of
4 MiB tensors never holds as much as one pair.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
from compare_helpers import tensor, write_dump
from test_hostile_inputs import tensor_pickle, torch_archive

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.dumps import open_tensor
from pytest_msprobe.compare.judging.metrics import BLOCK

ELEMENTS = 1 << 20  # 4 MiB of float32 per tensor
CALLS = 16


def tensor_dump(root: Path, seed: int) -> Path:
    """A tensor dump of CALLS calls, each with one float32 output of ELEMENTS values, saved as torch.save does."""
    rank = root / "step0" / "rank"
    (rank / "dump_tensor_data").mkdir(parents=True)
    rng = np.random.default_rng(seed)
    data = {}
    for i in range(CALLS):
        name = f"Functional.relu.{i}.forward"
        values = rng.standard_normal(ELEMENTS, dtype=np.float32)
        file = f"{name}.output.0.pt"
        torch_archive(
            rank / "dump_tensor_data" / file, tensor_pickle(ELEMENTS, (ELEMENTS,), (1,)), values.tobytes()
        )
        item = tensor([ELEMENTS], float(values.min()), float(values.max()), float(values.mean()), 1.0)
        data[name] = {"output": [{**item, "data_name": file}]}
    write_dump(rank, data, task="tensor")
    return root


def test_opening_a_tensor_reads_none_of_its_values(tmp_path: Path) -> None:
    root = tensor_dump(tmp_path / "d", 0)
    path = root / "step0" / "rank" / "dump_tensor_data" / "Functional.relu.0.forward.output.0.pt"
    tracemalloc.start()
    try:
        opened = open_tensor(path, "torch.float32", [ELEMENTS])
        after_open = tracemalloc.get_traced_memory()[1]
        sizes = [block.size for block in opened.blocks(BLOCK)]
    finally:
        tracemalloc.stop()
    assert opened.array is None and opened.data_offset > 0  # values stay on disk
    assert after_open < 256 << 10
    assert sizes == [BLOCK] * (ELEMENTS // BLOCK)


def test_compare_holds_less_than_one_tensor_pair(tmp_path: Path) -> None:
    target, baseline = tensor_dump(tmp_path / "t", 1), tensor_dump(tmp_path / "b", 2)
    pair = 2 * ELEMENTS * 4
    tracemalloc.start()
    try:
        # in this process, where tracemalloc sees it; the replay (torch, one call at a time) is not measured
        result = compare(target, baseline, jobs=1, replay=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.mode == "tensor" and len(result.rows) == CALLS
    assert all(r.tensor is not None and r.tensor.numel == ELEMENTS for r in result.rows)  # every value read
    # 16 pairs (128 MiB) compared; never one whole pair (8 MiB) in memory
    assert peak < pair, f"peak {peak / 2**20:.1f} MiB"
