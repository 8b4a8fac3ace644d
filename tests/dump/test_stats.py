"""The statistics engine: msprobe's statistics per dtype, resolved in one transfer, reused when unchanged."""

from __future__ import annotations

import math
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_msprobe.dump.stats import StatEngine, crc32_hex

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _stats(t: torch.Tensor, **engine_kwargs: Any) -> dict[str, Any]:
    engine = StatEngine(**engine_kwargs)
    item = engine.item(t)
    engine.flush()
    return item


def test_float32_item_has_msprobe_fields_and_torch_values() -> None:
    t = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    item = _stats(t)
    assert list(item) == ["type", "dtype", "shape", "Max", "Min", "Mean", "Norm", "requires_grad"]
    assert item["type"] == "torch.Tensor"
    assert item["dtype"] == "torch.float32"
    assert item["shape"] == [4, 5]
    assert item["Max"] == t.max().item()
    assert item["Min"] == t.min().item()
    # Mean accumulates in float64, Norm blockwise: the exact values, not float32's
    assert item["Mean"] == pytest.approx(t.double().mean().item(), rel=1e-12)
    assert item["Norm"] == pytest.approx(t.double().norm().item(), rel=1e-6)
    assert item["requires_grad"] is False


def test_statistics_wait_for_flush() -> None:
    engine = StatEngine()
    item = engine.item(torch.ones(3))
    assert item["Max"] is None
    engine.flush()
    assert item["Max"] == 1.0


def test_low_precision_mean_and_norm_accumulate_in_float32() -> None:
    t = torch.full((4096,), 0.1, dtype=torch.float16)
    item = _stats(t)
    assert item["dtype"] == "torch.float16"
    exact = t.float()
    assert item["Max"] == exact.max().item()
    assert item["Mean"] == pytest.approx(exact.mean().item(), rel=1e-6)
    assert item["Norm"] == pytest.approx(torch.linalg.vector_norm(exact).item(), rel=1e-6)


def test_float64_keeps_float64_precision() -> None:
    t = torch.tensor([1.0 + 1e-12, 1.0], dtype=torch.float64)
    item = _stats(t)
    assert item["Max"] == 1.0 + 1e-12
    assert item["Mean"] == t.mean().item()


def test_integers_keep_exact_max_min_and_float_mean_norm() -> None:
    t = torch.tensor([2**40 + 1, 3, -7], dtype=torch.int64)
    item = _stats(t)
    assert item["Max"] == 2**40 + 1 and isinstance(item["Max"], int)
    assert item["Min"] == -7
    assert item["Mean"] == pytest.approx((2**40 + 1 + 3 - 7) / 3, rel=1e-6)
    assert item["Norm"] == pytest.approx(math.sqrt((2**40 + 1) ** 2 + 9 + 49), rel=1e-6)


@pytest.mark.parametrize(
    ("value", "dtype", "expected"),
    [(5, torch.int64, 5), (-2.5, torch.float32, -2.5), (0, torch.int64, 0)],
)
def test_zero_dim_tensor_statistics_are_the_value_itself(
    value: float, dtype: torch.dtype, expected: float
) -> None:
    item = _stats(torch.tensor(value, dtype=dtype))
    assert item["shape"] == []
    # as msprobe: all four are the value, so the "Norm" of a negative scalar is negative
    assert [item[k] for k in ("Max", "Min", "Mean", "Norm")] == [expected] * 4
    assert type(item["Max"]) is type(expected)


def test_zero_dim_value_is_snapshot_before_later_in_place_changes() -> None:
    engine = StatEngine()
    counter = torch.tensor(0)
    item = engine.item(counter)
    counter.add_(1)
    engine.flush()
    assert item["Max"] == 0


def test_bool_max_is_any_min_is_all_and_no_mean_norm() -> None:
    item = _stats(torch.tensor([True, False, True]))
    assert (item["Max"], item["Min"], item["Mean"], item["Norm"]) == (True, False, None, None)


def test_empty_and_meta_tensors_have_null_statistics() -> None:
    for t in (torch.empty(0, 3), torch.empty(2, 2, device="meta")):
        item = _stats(t)
        assert [item[k] for k in ("Max", "Min", "Mean", "Norm")] == [None] * 4
        assert item["shape"] == list(t.shape)


def test_complex_uses_absolute_values() -> None:
    t = torch.tensor([3 + 4j, 0 + 1j], dtype=torch.complex64)
    item = _stats(t)
    assert item["Max"] == pytest.approx(5.0)
    assert item["Min"] == pytest.approx(1.0)
    assert item["Mean"] == pytest.approx(3.0)
    assert item["Norm"] is None


def test_non_contiguous_and_grad_requiring_tensors() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    view = base.t()[1:]
    assert not view.is_contiguous()
    item = _stats(view)
    assert item["Max"] == view.max().item()
    assert item["Norm"] == pytest.approx(view.double().norm().item(), rel=1e-6)
    leaf = torch.ones(3, requires_grad=True)
    engine = StatEngine()
    item = engine.item(leaf)
    engine.flush()
    assert item["requires_grad"] is True
    assert leaf.grad_fn is None and leaf.grad is None


def test_remembered_tensor_reuses_statistics_until_it_changes() -> None:
    engine = StatEngine()
    t = torch.ones(4)
    first = engine.item(t, remember=True)
    again = engine.item(t)
    assert engine.computed == 1  # the second item computed nothing
    t.mul_(3)  # bumps t._version: the cached statistics no longer apply
    changed = engine.item(t)
    engine.flush()
    assert first["Max"] == again["Max"] == 1.0
    assert changed["Max"] == 3.0


def test_inputs_are_not_remembered() -> None:
    engine = StatEngine()
    running_mean = torch.zeros(3)
    engine.item(running_mean)  # an input: batch_norm may change it without bumping _version
    engine.item(running_mean)
    assert engine.computed == 2


def test_crc32_is_of_the_raw_bytes() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert crc32_hex(t) == f"{zlib.crc32(t.numpy().tobytes()):08x}"
    assert crc32_hex(t.t()) == f"{zlib.crc32(t.t().contiguous().numpy().tobytes()):08x}"
    bf16 = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    assert crc32_hex(bf16) == f"{zlib.crc32(bf16.view(torch.int16).numpy().tobytes()):08x}"
    assert len(crc32_hex(torch.empty(0))) == 8


def test_md5_is_taken_when_the_item_is_built() -> None:
    engine = StatEngine(md5=True)
    t = torch.ones(5)
    item = engine.item(t)
    expected = crc32_hex(t)
    t.add_(1)
    engine.flush()
    assert item["md5"] == expected
    assert list(item)[-1] == "md5"


def test_tensor_sink_receives_a_private_copy() -> None:
    saved: dict[str, torch.Tensor] = {}
    engine = StatEngine(tensor_sink=lambda name, tensor: saved.__setitem__(name, tensor))
    t = torch.ones(2, 2).t()
    item = engine.item(t, data_name="X.forward.input.0.pt")
    t.add_(1)
    engine.flush()
    assert item["data_name"] == "X.forward.input.0.pt"
    snapshot = saved["X.forward.input.0.pt"]
    assert torch.equal(snapshot, torch.ones(2, 2)) and snapshot.is_contiguous()
    assert snapshot.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_the_reuse_cache_keeps_no_tensor_alive() -> None:
    import weakref

    engine = StatEngine()
    t = torch.randn(1000)
    engine.item(t, remember=True)
    alive = weakref.ref(t)
    del t
    assert alive() is None  # an activation or gradient is freed when training drops it
    engine.flush()


def test_small_and_large_tensors_give_the_same_statistics() -> None:
    base = torch.randn(10000, generator=torch.Generator().manual_seed(1))
    engine = StatEngine()
    small, large = engine.item(base[:100].clone()), engine.item(base)
    engine.flush()
    for item, t in ((small, base[:100]), (large, base)):
        assert item["Max"] == t.max().item() and item["Min"] == t.min().item()
        assert item["Mean"] == pytest.approx(t.double().mean().item(), rel=1e-12)
        assert item["Norm"] == pytest.approx(t.double().norm().item(), rel=1e-6)


def test_tensors_off_the_fast_path_never_break_the_capture() -> None:
    import warnings

    with torch.inference_mode():
        inference = torch.arange(4.0)  # no version counter
    sparse = torch.eye(3).to_sparse()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])

    class Tagged(torch.Tensor):
        pass

    tagged = torch.tensor([1.0, -2.0]).as_subclass(Tagged)
    saved: dict[str, torch.Tensor] = {}
    engine = StatEngine(md5=True, tensor_sink=lambda name, t: saved.__setitem__(name, t))
    items = [
        engine.item(t, f"{i}.pt", remember=True) for i, t in enumerate((inference, sparse, nested, tagged))
    ]
    engine.flush()
    assert items[0]["Max"] == 3.0 and items[0]["md5"] == crc32_hex(torch.arange(4.0))
    assert items[1]["shape"] == [3, 3] and (items[1]["Max"], items[1]["Min"]) == (1.0, 0.0)
    assert items[1]["md5"] is None
    assert torch.equal(saved["1.pt"].to_dense(), torch.eye(3))
    assert items[2]["shape"] is None and items[2]["Max"] is None and "2.pt" not in saved
    assert (items[3]["Max"], items[3]["Min"]) == (1.0, -2.0) and type(saved["3.pt"]) is torch.Tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_tensors_statistics_do_not_depend_on_the_others_of_its_step(dtype: torch.dtype) -> None:
    """Small tensors of one shape are reduced together at flush: each gets, bit for bit, what it gets alone,
    so a baseline and a run that dump other tensors beside it agree on it."""
    g = torch.Generator().manual_seed(3)
    for shape in ((7,), (3, 50), (2048,), (4096,)):
        tensors = [(torch.randn(shape, generator=g) * 10 ** (i - 2)).to(dtype) for i in range(5)]
        engine = StatEngine()
        together = [engine.item(t) for t in tensors]
        engine.flush()
        for t, item in zip(tensors, together):
            assert {k: item[k] for k in ("Max", "Min", "Mean", "Norm")} == {
                k: _stats(t)[k] for k in ("Max", "Min", "Mean", "Norm")
            }, (dtype, shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size", [3, 4096, 5000, 300_000, 1 << 20])
def test_mean_and_norm_are_within_1e_6_of_float64_at_any_size(dtype: torch.dtype, size: int) -> None:
    """Values that cancel (zero-mean: the sum is small beside its terms) and values far from zero (a large
    offset: a float32 norm accumulation drifts), in small tensors (reduced together at flush) and large."""
    g = torch.Generator().manual_seed(size)
    for shift in (0.0, 3.0, 1e4 if dtype is not torch.float16 else 100.0):
        tensors = [(torch.randn(size, generator=g) + shift).to(dtype) for _ in range(8)]
        engine = StatEngine()
        items = [engine.item(t) for t in tensors]
        engine.flush()
        for item, t in zip(items, tensors):
            exact = t.double()
            assert item["Max"] == exact.max().item() and item["Min"] == exact.min().item()
            assert item["Mean"] == pytest.approx(exact.mean().item(), rel=1e-6, abs=0)
            assert item["Norm"] == pytest.approx(exact.norm().item(), rel=1e-6, abs=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_tensors_statistics_do_not_depend_on_torchs_thread_count(dtype: torch.dtype) -> None:
    """Above two chunks a tensor's float64 sum is one operator over rows of a chunk, each row summed by one
    thread: a CPU baseline made with 16 threads has the bits of a run with 2 (one sum over a whole chunk is
    split between threads, and its last bits moved with their number)."""
    from pytest_msprobe.dump import reductions

    chunk = reductions._CHUNK
    g = torch.Generator().manual_seed(11)
    threads = torch.get_num_threads()
    for n in (2 * chunk, 5 * chunk + 2047, 37 * chunk + 5):
        # magnitudes 2^-40 to 2^40: the order of a float64 sum shows in its last bits
        scale = torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
        t = (torch.randn(n, generator=g) * scale).to(dtype)
        seen = set()
        try:
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                item = _stats(t)
                seen.add((item["Mean"], item["Norm"]))
        finally:
            torch.set_num_threads(threads)
        assert len(seen) == 1, (n, seen)
        exact = t.double()
        ((mean, norm),) = seen
        assert mean == pytest.approx(exact.mean().item(), rel=1e-12)
        assert norm == pytest.approx(exact.norm().item(), rel=1e-6)


@pytest.mark.slow
def test_the_norm_and_mean_of_a_100m_element_tensor_are_within_1e_6_of_float64() -> None:
    """Where float32 accumulation fails most: 1e8 elements (torch's float32 CPU norm was 1% off here)."""
    g = torch.Generator().manual_seed(7)
    for shift in (0.0, 1e4):
        t = torch.randn(100_000_000, generator=g)
        t += shift
        item = _stats(t)
        exact_mean = torch.sum(t, dtype=torch.float64).item() / t.numel()
        exact_norm = torch.linalg.vector_norm(t, dtype=torch.float64).item()
        assert abs(torch.linalg.vector_norm(t).item() - exact_norm) > 1e-4 * exact_norm, "float32 drifts here"
        assert item["Mean"] == pytest.approx(exact_mean, rel=1e-6, abs=0)
        assert item["Norm"] == pytest.approx(exact_norm, rel=1e-6, abs=0)
        assert item["Max"] == t.max().item() and item["Min"] == t.min().item()
        del t


@pytest.mark.filterwarnings("ignore:Sparse")
def test_a_sparse_tensor_gets_the_statistics_of_its_dense_equivalent() -> None:
    """Implicit zeros count in Max, Min and the Mean; duplicate COO entries add up; every sparse layout."""
    g = torch.Generator().manual_seed(5)
    # all positive: the implicit zeros show in Min
    dense = torch.randn(40, 30, generator=g).clamp(min=0.5) + 1.0
    dense[dense < 1.8] = 0
    negative = -dense  # all non-positive: the zeros show in Max
    duplicated = torch.sparse_coo_tensor(
        torch.tensor([[0, 0, 1], [2, 2, 0]]), torch.tensor([1.5, 2.0, -4.0]), (3, 4)
    )  # position (0, 2) twice: 3.5 there
    cases = [
        (dense.to_sparse(), dense),
        (negative.to_sparse_csr(), negative),
        (dense.to_sparse_csc(), dense),
        (dense.to_sparse_bsr((2, 3)), dense),
        (duplicated, duplicated.to_dense()),
        (torch.zeros(5, 5).to_sparse(), torch.zeros(5, 5)),
        ((dense > 0).to_sparse(), dense > 0),
        (dense.to(torch.int64).to_sparse(), dense.to(torch.int64)),
    ]
    for sparse, equivalent in cases:
        got, want = _stats(sparse), _stats(equivalent)
        assert got["shape"] == want["shape"] and got["dtype"] == want["dtype"], sparse.layout
        for name in ("Max", "Min", "Mean", "Norm"):
            expected = None if want[name] is None else pytest.approx(want[name], rel=1e-12)
            assert got[name] == expected, (sparse.layout, sparse.dtype, name)


@pytest.mark.filterwarnings("ignore:torch.quantize_per")
def test_a_quantized_tensor_gets_the_statistics_of_the_values_it_stands_for() -> None:
    x = torch.randn(10, 10, generator=torch.Generator().manual_seed(2))
    for q in (
        torch.quantize_per_tensor(x, 0.05, 3, torch.qint8),
        torch.quantize_per_channel(
            x, torch.rand(10) + 0.01, torch.zeros(10, dtype=torch.long), 0, torch.quint8
        ),
    ):
        got, values = _stats(q), q.dequantize().double()
        assert got["dtype"] == str(q.dtype) and (got["Max"], got["Min"]) == (
            values.max().item(),
            values.min().item(),
        )
        assert got["Mean"] == pytest.approx(values.mean().item(), rel=1e-12)
        assert got["Norm"] == pytest.approx(values.norm().item(), rel=1e-12)


_PEAK_SCRIPT = r"""
import sys, torch
from pytest_msprobe.dump.stats import StatEngine

def peak_mb():  # the process's resident high-water mark, reset by clear_refs
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024

device, md5 = sys.argv[1], sys.argv[2] == "md5"
# 25M elements on the CPU: a whole float64 copy (200 MB), a whole flat copy (100 MB) are far beyond the bound
n = 100_000_000 if device == "cuda" else 25_000_000
side = 10_000 if device == "cuda" else 5_000
make = {
    "float32": lambda: torch.randn(n, device=device),
    "float32, non-contiguous": lambda: torch.randn(side, side, device=device).t(),
    "bfloat16": lambda: torch.randn(n, device=device).bfloat16(),
    "int64": lambda: torch.randint(0, 1000, (n,), device=device),
    "complex64": lambda: torch.randn(n // 2, dtype=torch.complex64, device=device),
    "float8_e4m3fn": lambda: torch.randn(n, device=device).to(torch.float8_e4m3fn),
}
for name, build in make.items():
    t = build()
    StatEngine().flush()  # the engine's own first-use allocations are not the tensor's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    host = peak_mb()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    engine = StatEngine(md5=md5)
    item = engine.item(t)
    engine.flush()
    added = peak_mb() - host
    assert not md5 or len(item["md5"]) == 8
    on_device = (torch.cuda.max_memory_allocated() - held) / 2**20 if device == "cuda" else 0.0
    print(f"{name}|{added:.1f}|{on_device:.1f}|{item['Max']}|{item['Mean']}")
    del t
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resident high-water mark"
)
@pytest.mark.parametrize("task", ["statistics", "md5"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_needs_cuda)])
def test_the_statistics_of_a_large_tensor_add_at_most_64_mb(device: str, task: str) -> None:
    """A float64 reduction converts its whole input first, a non-contiguous tensor's flat view is a copy: the
    statistics of a tensor of any size and layout are taken a piece at a time, in a scratch buffer. Measured in
    a process of its own (25M elements on the CPU, 100M on CUDA): the resident high-water mark the statistics add,
    and the device's peak allocation. With md5, a CRC is taken a piece at a time too (of a device tensor, from a
    private copy on the device, taken on purpose: that copy is the tensor's size)."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, device, task],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    rows = [line.split("|") for line in done.stdout.splitlines()]
    assert len(rows) == 6, done.stdout + done.stderr
    for name, host, on_device, mx, mean in rows:
        limit = 64 if task == "statistics" or device == "cpu" else 64 + 800  # (the private copy of 100M)
        assert float(host) <= 64 and float(on_device) <= limit, (name, host, on_device)
        assert mx != "None" and mean != "None", name
