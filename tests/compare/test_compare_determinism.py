"""A compare of two fixed dumps gives the same result whatever runs it: torch's thread count, the compare's
processes, the order a folder is listed in, the caller's torch state, the hash seed of the process.

The same means the same to the last bit: ``passed``, the first divergence, every row's status and metrics,
every call's own error (:func:`fingerprint`: the whole result but its timestamp).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from compare_helpers import dump_dir, seeded

from pytest_msprobe import compare
from pytest_msprobe.compare.result import CompareResult

ROOT = Path(__file__).resolve().parents[2]


def fingerprint(result: CompareResult) -> str:
    """Everything a compare found, as text (``repr`` keeps every float's last bit; NaN equals NaN)."""
    return repr(dataclasses.replace(result, timestamp=""))


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Tensor dumps (two steps) of a layer wide enough for torch and the judging of its own errors to split
    their sums over threads: a linear layer's 512x512 output (a quarter million elements), its layer norm (whose
    weight gradient sums over 512 rows) and the sum of its squares as the loss. The target's layer norm has another
    eps: the compare fails and names it."""
    import torch
    import torch.nn.functional as F

    from pytest_msprobe import PrecisionDebugger

    root = tmp_path_factory.mktemp("wide")

    def run(path: Path, fault: bool) -> Path:
        with seeded(11):
            linear = torch.nn.Linear(256, 512)
            norm = torch.nn.LayerNorm(512)
            params = [*linear.parameters(), *norm.parameters()]
            opt = torch.optim.SGD(params, lr=0.01, foreach=False)
            data = torch.Generator().manual_seed(3)
            with PrecisionDebugger(dump_path=str(path), task="tensor", level="L1", step=[0, 1]) as debugger:
                for _ in range(2):
                    x = torch.randn(512, 256, generator=data)
                    debugger.start()
                    h = linear(x)
                    y = F.layer_norm(h, (512,), norm.weight, norm.bias, eps=1e-2 if fault else 1e-5)
                    loss = torch.sum(y * y) / y.numel()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    debugger.stop()
                    debugger.step()
        return path

    return run(root / "target", True), run(root / "baseline", False)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_the_dumps_fail_where_the_fault_is(wide: tuple[Path, Path]) -> None:
    result = compare(*wide, jobs=1)
    fd = result.first_divergence
    assert (
        not result.passed and fd is not None and fd.api == "Functional.layer_norm.0.forward" and fd.step == 0
    )
    replayed = [v for v in result.own.values() if not v.skipped]
    assert len(replayed) >= 8  # forward and backward: the own errors are part of what must not change


def test_torch_threads_change_nothing(wide: tuple[Path, Path]) -> None:
    """The replay's float64 sums (the loss, the layer norm's weight gradient) and the figures of the 512x512
    outputs are split over torch's threads: with one, two or three the compare is the same."""
    seen = {}
    for n in (1, 2, 3):
        with torch_threads(n):
            seen[n] = fingerprint(compare(*wide, jobs=1))
    assert seen[2] == seen[1] and seen[3] == seen[1]


def test_processes_change_nothing(wide: tuple[Path, Path]) -> None:
    """Two steps: one process, one per step, or more processes than steps; a single step spread over two."""
    by_jobs = {jobs: fingerprint(compare(*wide, jobs=jobs)) for jobs in (1, 2, 3)}
    assert by_jobs[2] == by_jobs[1] and by_jobs[3] == by_jobs[1]
    one = [fingerprint(compare(wide[0] / "step1", wide[1] / "step1", jobs=jobs)) for jobs in (1, 2)]
    assert one[0] == one[1]


def test_the_callers_torch_state_changes_nothing(wide: tuple[Path, Path]) -> None:
    """Under the caller's inference mode (no backward replay could run), with its generator anywhere (a replay
    that draws would draw from it): the same compare, and the caller's generator is left where it was."""
    import torch

    plain = fingerprint(compare(*wide, jobs=1))
    with torch.inference_mode():
        assert fingerprint(compare(*wide, jobs=1)) == plain
    torch.manual_seed(123)
    state = torch.get_rng_state()
    assert fingerprint(compare(*wide, jobs=1)) == plain
    assert torch.equal(torch.get_rng_state(), state)


def _real_pairs() -> list[tuple[Path, Path]]:
    """Real msprobe dumps: statistics (L1 and mix), md5, tensor (replayed), and the fault cases."""
    pairs = [
        (dump_dir("26.2.0", "npu", kind), dump_dir("26.2.0", "bench", kind))
        for kind in ("stat_mix", "md5_L1", "tensor_L1")
    ]
    faults = ROOT / "tests" / "data" / "msprobe" / "faults" / "msprobe-26.2.0"
    pairs += [(faults / case, faults / "none") for case in ("relu", "bf16", "extrarelu")]
    return pairs


def test_the_listing_order_changes_nothing(monkeypatch: pytest.MonkeyPatch, wide: tuple[Path, Path]) -> None:
    """Folders listed in the reverse order (a file system lists in its own order): the same compares."""
    pairs = [*_real_pairs(), wide]
    before = [fingerprint(compare(t, b, jobs=1)) for t, b in pairs]
    iterdir, listdir = Path.iterdir, os.listdir
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(sorted(iterdir(self), reverse=True)))
    monkeypatch.setattr(os, "listdir", lambda path=".": sorted(listdir(path), reverse=True))
    assert [fingerprint(compare(t, b, jobs=1)) for t, b in pairs] == before


_HASHES = """
import dataclasses, hashlib, sys
from pytest_msprobe import compare
for t, b in zip(sys.argv[1::2], sys.argv[2::2]):
    r = compare(t, b, jobs=2)
    print(hashlib.sha256(repr(dataclasses.replace(r, timestamp="")).encode()).hexdigest())
"""


def test_the_hash_seed_changes_nothing(wide: tuple[Path, Path]) -> None:
    """Sets of strings iterate in another order in every process (PYTHONHASHSEED): two processes with other
    seeds make the same compares, in two processes each (the pairs' worker processes inherit the seed)."""
    args = [os.fspath(p) for pair in [*_real_pairs(), wide] for p in pair]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.fspath(ROOT), os.environ.get("PYTHONPATH", "")])}
    runs = []
    for seed in ("1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", _HASHES, *args],
            env={**env, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=False,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(done.stdout.split())
    here = [
        hashlib.sha256(fingerprint(compare(t, b, jobs=1)).encode()).hexdigest()
        for t, b in [*_real_pairs(), wide]
    ]
    assert len(runs[0]) == len(here) and runs[0] == runs[1] == here


_METRICS = """
import numpy as np
from pytest_msprobe.compare.metrics import tensor_metrics
rng = np.random.default_rng(4)
for dtype in (np.float64, np.float32):
    b = rng.standard_normal(300_000).astype(dtype)
    t = (b * (1 + 1e-4 * rng.standard_normal(b.size))).astype(dtype)
    print(repr(tensor_metrics(t, b)))
"""


def test_blas_threads_change_no_metric() -> None:
    """The tensor metrics' sums of products: BLAS splits a long float64 product over its threads (as many as
    the machine has CPUs, or OPENBLAS_NUM_THREADS says), numpy's own loop does not."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.fspath(ROOT), os.environ.get("PYTHONPATH", "")])}
    outs = []
    for threads in ("1", "2", "3"):
        blas = {name: threads for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        done = subprocess.run(
            [sys.executable, "-c", _METRICS], env={**env, **blas}, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(done.stdout)
    assert outs[0].count("TensorMetrics") == 2 and outs[1] == outs[0] and outs[2] == outs[0]
