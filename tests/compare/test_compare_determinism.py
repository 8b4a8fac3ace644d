"""A compare of two fixed dumps gives the same result whatever runs it: torch's thread count, the compare's
processes, the order a folder is listed in, the caller's torch state, the hash seed of the process.

The same means the same to the last bit: ``passed``, the first divergence, every row's status and metrics,
every call's own error (:func:`fingerprint`: the whole result but its timestamp).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    weight gradient sums over 512 rows) and the sum of its squares (and of it times a ``torch.full``) as the loss. The target's layer norm has another
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
                    loss = torch.sum(y * y) / y.numel() + torch.sum(y * torch.full((512,), 0.1))
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
    """Under the caller's inference mode (no backward replay could run), its default dtype float64, with its
    generator anywhere (a replay that draws would draw from it): the same compare, and the caller's generator is
    left where it was."""
    import torch

    plain = fingerprint(compare(*wide, jobs=1))
    with torch.inference_mode():
        assert fingerprint(compare(*wide, jobs=1)) == plain
    torch.set_default_dtype(torch.float64)  # (the replay of torch.full((512,), 0.1) makes its tensor in it)
    try:
        assert fingerprint(compare(*wide, jobs=1)) == plain
    finally:
        torch.set_default_dtype(torch.float32)
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


@pytest.mark.slow
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
from pytest_msprobe.compare.judging.metrics import tensor_metrics
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


# ------------------------------------------------------------------------------------- the system's refusals
def _refusing(real_open: Any, suffixes: tuple[str, ...], err: int) -> Any:
    """``open`` that fails with ``err`` on the files whose names end with ``suffixes``."""

    def fake(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, os.PathLike)) and os.fspath(file).endswith(suffixes):
            raise OSError(err, os.strerror(err), os.fspath(file))
        return real_open(file, *args, **kwargs)

    return fake


FOREACH = (dump_dir("26.2.0", "foreach", "stat_L1"), dump_dir("26.2.0", "bench", "stat_L1"))


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_helper_file_the_system_fails_to_read_stops_the_compare(
    monkeypatch: pytest.MonkeyPatch, jobs: int
) -> None:
    """stack.json and construct.json help a compare find the optimizer's calls: a foreach SGD, which plain
    msprobe does not record, against a single-tensor one passes by setting its calls aside. An I/O error while
    reading them this time is not their absence (the same compare failed, its optimizer calls left unmatched):
    it raises, from a worker process too. A file that cannot be read for what it is (forbidden) is still taken
    as absent, every time."""
    from pytest_msprobe.errors import DumpReadError
    from pytest_msprobe.format import files

    assert compare(*FOREACH, jobs=jobs).passed
    monkeypatch.setattr(
        files, "open", _refusing(open, ("construct.json", "stack.json"), errno.EIO), raising=False
    )
    with pytest.raises(DumpReadError, match=r"construct\.json: cannot read \(Input/output error\)"):
        compare(*FOREACH, jobs=jobs)
    monkeypatch.setattr(
        files, "open", _refusing(open, ("construct.json", "stack.json"), errno.EACCES), raising=False
    )
    assert not compare(*FOREACH, jobs=jobs).passed  # (without them the optimizer's calls are not found)


def test_a_tensor_file_the_system_fails_to_read_stops_the_replay(
    monkeypatch: pytest.MonkeyPatch, wide: tuple[Path, Path]
) -> None:
    """The replay reads each call's tensors again: an I/O error there skipped the call (its own error left out
    of the verdict) where the compare's own read of the same file had succeeded. It raises; a tensor file that
    is not there still skips its call."""
    from pytest_msprobe.errors import DumpReadError
    from pytest_msprobe.format import tensordata
    from pytest_msprobe.replay.offline import replay_dump

    target = wide[0] / "step0"
    monkeypatch.setattr(tensordata, "open", _refusing(open, (".pt",), errno.EIO), raising=False)
    with pytest.raises(DumpReadError, match="cannot read tensor file"):
        replay_dump(target)
    monkeypatch.setattr(
        tensordata,
        "open",
        _refusing(open, ("layer_norm.0.forward.output.0.pt",), errno.ENOENT),
        raising=False,
    )
    calls = {c.name: c for c in replay_dump(target).calls}
    assert "No such file" in calls["Functional.layer_norm.0.forward"].skipped


class _Trickle(io.RawIOBase):
    """A raw file that gives at most 1000 bytes a read, as a read cut short by a signal does."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b)
        return self.raw.readinto(view[: min(len(view), 1000)])

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def close(self) -> None:
        self.raw.close()
        super().close()


def test_a_read_cut_short_is_read_on(monkeypatch: pytest.MonkeyPatch, wide: tuple[Path, Path]) -> None:
    """A read of a raw file may give fewer bytes than asked while more remain (a signal, a read past 2 GiB):
    the rest is read, not taken for a truncated file."""
    from pytest_msprobe.format import tensordata

    before = fingerprint(compare(*wide, jobs=1))
    real_open = open
    monkeypatch.setattr(tensordata, "open", lambda *a, **k: _Trickle(real_open(*a, **k)), raising=False)
    assert fingerprint(compare(*wide, jobs=1)) == before


def test_a_dump_error_survives_the_way_back_from_a_worker() -> None:
    import pickle

    from pytest_msprobe.errors import DumpFormatError, DumpReadError

    for cls in (DumpFormatError, DumpReadError):
        back = pickle.loads(pickle.dumps(cls("a/dump.json", "cannot read (Input/output error)")))
        assert type(back) is cls and (back.path, back.problem) == (
            "a/dump.json",
            "cannot read (Input/output error)",
        )
