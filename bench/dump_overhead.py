"""Dump overhead as a training loop sees it: median dumped step / median undumped step of the same loop.

    python bench/dump_overhead.py                                # every model and configuration
    python bench/dump_overhead.py --quick                        # a smoke run: 6 steps, steps 2-3 dumped
    python bench/dump_overhead.py --models tiny large --configs statistics_L1 tensor_L1 --json out.json
    python bench/dump_overhead.py --profile statistics_L1 tiny   # where a dumped step's time goes (cProfile)
    python bench/dump_overhead.py --breakdown statistics_L1 large   # the same, measured inside the loop
    python bench/dump_overhead.py --device cuda --count-syncs    # on a GPU: host synchronisations per step

**The loop.** Each (tool, model, configuration) runs in a process of its own (msprobe's PrecisionDebugger is a
process-wide singleton; ours runs the same way so that both are measured alike): a training loop of ``--steps``
steps (default 14: forward, loss, zero_grad, backward, SGD step) whose debugger dumps the consecutive steps
``--dump`` (default 6-10), the way a loop dumps ``step=[...]``, with torch's default number of threads. A step is
timed from ``debugger.start()`` to ``debugger.step()`` inclusive (and ``torch.cuda.synchronize()`` on a GPU, where
a loop reading its loss waits too). The files are written as the loop goes: our debugger writes a step's JSON
files on a background thread while the next steps train, and nothing waits for them outside the timed steps;
after the loop ``debugger.close()`` waits for the last dumped step's files, and that wait is reported
(``wait ms``); ``next step ms`` is the first undumped step after the window, during which the last dumped step's
files are written. The first ``--warmup`` steps (default 3) are not measured.

- ``ratio``: median(dumped steps) / median(undumped steps of the same loop: after the warm-up, before and after
  the dumped window), what a training loop sees;
- ``MB`` and ``files``: the bytes and the number of files of one dumped step (the last one);
- task ``tensor``: after the loop, the tensor files of the last dumped step are read back and their bytes written
  again, timed, to the same disk: (a) raw, as one file, and (b) with ``torch.save``, one file per tensor as the
  dump has them. The goal is a dumped step of at most plain + 1.5 x (b) (``vs goal``: dumped / that).
- ``self_check_L1``: task statistics L1 with ``PrecisionDebugger(self_check=True)``, every call replayed on the
  CPU in float64 and judged; ``trend``: no dump, the trend recorder (``trend_steps``, loss and gradient norms
  of every step, pytest_msprobe.dump.trend_recorder) on during the window: the trend's own cost per step.

With ``mindstudio-probe`` importable (``pip install -e '.[bench]'``), msprobe's own PrecisionDebugger runs the same
loop on the same models (a config.json with task, level, step and dump_path; summary_mode ``md5`` for md5), and
both ratios are printed side by side with ours / msprobe. msprobe 26.2.0 has no overflow_check task for PyTorch, no
self-check and no trend: those rows are ours only. ``--alternating`` adds the figure this script used to give
(one torch thread, dumped and plain steps alternating, the files waited for outside the timed steps) as a column.

Models: TinyResNet of ``tests/data/msprobe/make_dumps.py`` at width 8 (batch 8x3x16x16, the model of msprobe's
reference dumps) and width 32 (32x3x32x32), and torchvision's ``resnet50(weights=None)`` (4x3x64x64).

``--profile CONFIG MODEL`` runs our loop in this process under cProfile (``--profiler torch``: torch.profiler,
the aten ops) over the dumped steps only, and prints the top functions of the training thread by cumulative and
by own time and those of the dump's background threads (the writer, the CRC pool). ``--count-syncs`` (CUDA) runs
each loop once more, untimed, counting host synchronisations per step and thread (see :class:`SyncCounter`).
``--calls`` times one API wrapper instead, in nanoseconds per call. ``--breakdown CONFIG MODEL`` runs our loop
in this process with timers (no profiler) around the dump's parts and prints, for the median dumped step, what
start(), the step's body beyond an undumped step (the statistics' reductions by tensor size, the rest) and
stop() cost, and the CPU time of the step's files on the writer thread (:func:`breakdown`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

RESULT = "BENCH-RESULT "  # a child's last stdout line: this prefix, then its result as JSON


@dataclass(frozen=True)
class Config:
    task: str | None  # None: nothing dumped (the trend alone)
    level: str = "L1"
    self_check: bool = False
    trend: bool = False
    msprobe: str | None = (
        None  # msprobe's counterpart: statistics, md5 (its summary_mode) or tensor; None: none
    )


CONFIGS: dict[str, Config] = {
    "statistics_L1": Config("statistics", "L1", msprobe="statistics"),
    "statistics_L0": Config("statistics", "L0", msprobe="statistics"),
    "statistics_mix": Config("statistics", "mix", msprobe="statistics"),
    "md5_L1": Config("md5", "L1", msprobe="md5"),
    # recorded as for statistics; only the calls whose outputs hold inf/nan are written (none here)
    "overflow_check_L1": Config("overflow_check", "L1"),
    "tensor_L1": Config("tensor", "L1", msprobe="tensor"),
    "self_check_L1": Config("statistics", "L1", self_check=True),
    "trend": Config(None, trend=True),
}

# the goals, as dumped / undumped step of this loop (task tensor's goal is against the write time instead)
GOALS: dict[tuple[str, str], float] = {
    ("tiny", "statistics_L1"): 3.0,
    ("large", "statistics_L1"): 1.3,
    ("resnet50", "statistics_L1"): 1.2,
    ("large", "statistics_mix"): 1.5,
    ("large", "md5_L1"): 1.5,
}
TENSOR_GOAL = 1.5  # a tensor dump's step: at most plain + this x the time to torch.save the same tensors


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Shape:
    """The loop: ``steps`` steps, ``first``..``last`` dumped, the first ``warmup`` not measured."""

    steps: int = 14
    first: int = 6
    last: int = 10
    warmup: int = 3

    @property
    def window(self) -> list[int]:
        return list(range(self.first, self.last + 1))

    @property
    def undumped(self) -> list[int]:
        return [s for s in range(self.warmup, self.steps) if not self.first <= s <= self.last]

    def check(self) -> None:
        if not (0 <= self.warmup <= self.first <= self.last < self.steps) or not self.undumped:
            raise SystemExit(
                f"--steps {self.steps} --dump {self.first}-{self.last} --warmup {self.warmup}: the dumped "
                "window must lie inside the loop, after the warm-up, with undumped steps beside it"
            )


QUICK = Shape(steps=6, first=2, last=3, warmup=1)


def _make_dumps() -> Any:
    spec = importlib.util.spec_from_file_location(
        "make_dumps", ROOT / "tests" / "data" / "msprobe" / "make_dumps.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_specs() -> dict[str, ModelSpec]:
    md = _make_dumps()

    def tiny_batch(batch: int, size: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        return lambda step: md.make_batch(step % 4, batch, size)

    def resnet50() -> torch.nn.Module:
        import torchvision

        return torchvision.models.resnet50(weights=None, num_classes=10)

    def resnet_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step % 4)
        return torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, 10, (4,), generator=g)

    return {
        "tiny": ModelSpec("TinyResNet w8 8x3x16x16", lambda: md.TinyResNet(width=8), tiny_batch(8, 16)),
        "large": ModelSpec("TinyResNet w32 32x3x32x32", lambda: md.TinyResNet(width=32), tiny_batch(32, 32)),
        "resnet50": ModelSpec("resnet50 4x3x64x64", resnet50, resnet_batch),
    }


# ------------------------------------------------------------------------------------------------ the loop
@dataclass
class Loop:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: torch.nn.Module
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device


def make_loop(spec: ModelSpec, steps: int, device: torch.device) -> Loop:
    torch.manual_seed(1234)
    model = spec.build().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = [tuple(t.to(device) for t in spec.batch(step)) for step in range(steps)]
    return Loop(model, optimizer, torch.nn.CrossEntropyLoss(), batches, device)  # type: ignore[arg-type]


def train_step(loop: Loop, step: int, debugger: Any, trend: Any, sync: bool) -> None:
    """One step as a user's loop runs it; the msprobe calls are the same for both tools."""
    x, y = loop.batches[step]
    if debugger is not None:
        debugger.start(model=loop.model)
    if trend is not None:
        trend.begin(loop.model)
    loss = loop.loss_fn(loop.model(x), y)
    if trend is not None:
        trend.loss(loss)
    loop.optimizer.zero_grad()
    loss.backward()
    loop.optimizer.step()
    if debugger is not None:
        debugger.stop()
        debugger.step()
    if trend is not None:
        trend.end()
    if sync:
        torch.cuda.synchronize()


def make_debugger(engine: str, config: Config, window: list[int], dump_path: Path) -> Any:
    if config.task is None:
        return None
    if engine == "msprobe":
        return _msprobe_debugger(config, window, dump_path)
    from pytest_msprobe import PrecisionDebugger

    return PrecisionDebugger(
        dump_path=dump_path, task=config.task, level=config.level, step=window, self_check=config.self_check
    )


def _msprobe_debugger(config: Config, window: list[int], dump_path: Path) -> Any:
    """msprobe's own PrecisionDebugger, from a config.json as its users write one."""
    from msprobe.pytorch import PrecisionDebugger as MsprobeDebugger

    assert config.msprobe is not None
    task = "tensor" if config.msprobe == "tensor" else "statistics"
    doc: dict[str, Any] = {"task": task, "dump_path": str(dump_path), "rank": [], "step": window}
    doc["level"] = config.level
    doc[task] = {"scope": [], "list": [], "data_mode": ["all"]}
    if task == "statistics":
        doc[task]["summary_mode"] = config.msprobe
    path = dump_path.parent / "msprobe_config.json"
    path.write_text(json.dumps(doc, indent=1))
    return MsprobeDebugger(config_path=str(path))


def step_census(step_folder: Path) -> dict[str, Any]:
    """Files, tensor files, bytes and records of one dumped step's folder (``step{N}``, every rank in it)."""
    files = [p for p in step_folder.rglob("*") if p.is_file()]
    dumps = [p for p in files if p.name == "dump.json"]
    records = sum(len(json.loads(p.read_text()).get("data", {})) for p in dumps)
    tensors = [p for p in files if p.parent.name == "dump_tensor_data"]
    return {
        "files": len(files),
        "tensor_files": len(tensors),
        "bytes": sum(p.stat().st_size for p in files),
        "records": records,
    }


def write_costs(step_folder: Path, scratch: Path, repeats: int) -> dict[str, Any]:
    """Seconds to write a tensor step's bytes again on the same disk: raw as one file, and torch.save per tensor.

    The tensors are read back from the step's files first (not timed); each write goes to a fresh folder, removed
    after it (not timed). Medians of ``repeats``.
    """
    tensors = [
        torch.load(p, map_location="cpu", weights_only=True)
        for p in sorted(step_folder.rglob("*"))
        if p.parent.name == "dump_tensor_data"
    ]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    raw = [t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for t in tensors]
    one: list[float] = []
    saved: list[float] = []
    for _ in range(repeats):
        folder = scratch / "raw"
        folder.mkdir(parents=True)
        start = time.perf_counter()
        with open(folder / "all.bin", "wb") as f:
            for buf in raw:
                f.write(buf.data)
        one.append(time.perf_counter() - start)
        shutil.rmtree(folder)
        folder = scratch / "saved"
        folder.mkdir(parents=True)
        start = time.perf_counter()
        for i, t in enumerate(tensors):
            torch.save(t, folder / f"{i}.pt")
        saved.append(time.perf_counter() - start)
        shutil.rmtree(folder)
    return {
        "write_one_file_ms": statistics.median(one) * 1e3,
        "torch_save_files_ms": statistics.median(saved) * 1e3,
        "tensor_bytes": sum(b.nbytes for b in raw),
        "tensors": len(tensors),
    }


def finish(engine: str, debugger: Any) -> float:
    """Seconds until the last dumped step's files are on disk (msprobe writes them inside stop()/step())."""
    if debugger is None or engine == "msprobe":
        return 0.0
    start = time.perf_counter()
    debugger.close()
    return time.perf_counter() - start


def run_timed(job: dict[str, Any]) -> dict[str, Any]:
    """The child's work for one (tool, model, configuration): the loop, timed, and what its dump holds."""
    shape = Shape(**job["shape"])
    config = CONFIGS[job["config"]]
    device = torch.device(job["device"])
    sync = device.type == "cuda"
    workdir = Path(job["workdir"])
    dump_path = workdir / "dump"
    loop = make_loop(model_specs()[job["model"]], shape.steps, device)
    debugger = make_debugger(job["engine"], config, shape.window, dump_path)
    trend = None
    if config.trend:
        from pytest_msprobe.dump.trend_recorder import TrendRecorder

        trend = TrendRecorder(shape.steps)
    times = []
    for step in range(shape.steps):
        recording = trend if shape.first <= step <= shape.last else None
        start = time.perf_counter()
        train_step(loop, step, debugger, recording, sync)
        times.append(time.perf_counter() - start)
    wait = finish(job["engine"], debugger)
    plain = statistics.median(times[s] for s in shape.undumped)
    dumped = statistics.median(times[s] for s in shape.window)
    out: dict[str, Any] = {
        "plain_ms": plain * 1e3,
        "dumped_ms": dumped * 1e3,
        "ratio": dumped / plain,
        # the fastest of each kind: on a busy machine, closer to what the two cost without the others' load
        "ratio_of_minima": min(times[s] for s in shape.window) / min(times[s] for s in shape.undumped),
        "wait_ms": wait * 1e3,
        # the first undumped step after the window: the last dumped step's files are written during it
        "next_ms": times[shape.last + 1] * 1e3,
        "step_ms": [t * 1e3 for t in times],
        "threads": torch.get_num_threads(),
    }
    if config.task is not None:
        folder = dump_path / f"step{shape.last}"
        out.update(step_census(folder))
        if config.task == "tensor":
            out.update(write_costs(folder, workdir / "scratch", job["repeats"]))
            limit = plain * 1e3 + TENSOR_GOAL * out["torch_save_files_ms"]
            out["tensor_limit_ms"] = limit
            out["vs_tensor_goal"] = dumped * 1e3 / limit
    return out


def run_alternating(job: dict[str, Any]) -> dict[str, Any]:
    """The figure this script gave before: one thread, dumped and plain steps alternating, the files waited for
    outside the timed steps (ours only)."""
    from pytest_msprobe import PrecisionDebugger

    torch.set_num_threads(1)
    shape = Shape(**job["shape"])
    config = CONFIGS[job["config"]]
    pairs, warmup = len(shape.window), max(shape.warmup, 1)
    total = 2 * (pairs + warmup)
    device = torch.device(job["device"])
    loop = make_loop(model_specs()[job["model"]], total, device)
    debugger = PrecisionDebugger(
        dump_path=Path(job["workdir"]) / "dump",
        task=config.task,
        level=config.level,
        step=list(range(0, total, 2)),
        self_check=config.self_check,
    )
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(total):
        start = time.perf_counter()
        train_step(loop, step, debugger, None, device.type == "cuda")
        elapsed = time.perf_counter() - start
        debugger.wait()
        if step >= 2 * warmup:
            times[step % 2 == 0].append(elapsed)
    debugger.close()
    return {"alternating_ratio": statistics.median(times[True]) / statistics.median(times[False])}


# ------------------------------------------------------------------------------------ host synchronisations
class SyncCounter:
    """Host synchronisations per step and thread, on CUDA.

    Counted with CUDA's GPU trace (the hooks torch.cuda's sanitizer uses): torch calls them for every
    ``cudaStreamSynchronize`` (including the one inside each blocking device-to-host copy: ``.item()``,
    ``.cpu()``, ``.tolist()``, a non-pinned ``.to("cpu")``), ``cudaDeviceSynchronize`` and
    ``cudaEventSynchronize``, on the thread that waits. ``torch.cuda.set_sync_debug_mode("warn")`` is counted
    beside it as a cross-check: it flags the copies and stream synchronisations but not
    ``torch.cuda.synchronize()``. Each hit is charged to the step the training thread is in, to the thread (the
    training thread with torch's own threads, as autograd's device thread that runs the backward: the loop waits
    for them; or a background thread of the dump: its writer, the CRC pool) and to the Python line that made it.
    """

    def __init__(self) -> None:
        self.step = -1
        self.training = threading.get_ident()
        self.trace: Counter[tuple[int, str]] = Counter()  # (step, "training" | "background")
        self.warned: Counter[tuple[int, str]] = Counter()
        self.where: Counter[str] = Counter()
        self.available = False

    def install(self) -> None:
        if not torch.cuda.is_available():
            return
        from torch.cuda import _gpu_trace

        torch._C._activate_gpu_trace()
        _gpu_trace.register_callback_for_device_synchronization(lambda: self._hit(self.trace, "device"))
        _gpu_trace.register_callback_for_stream_synchronization(lambda _s: self._hit(self.trace, "stream"))
        _gpu_trace.register_callback_for_event_synchronization(lambda _e: self._hit(self.trace, "event"))
        torch.cuda.set_sync_debug_mode("warn")
        warnings.filterwarnings("always", message=".*synchroniz.*")
        shown = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, *args: Any, **kwargs: Any) -> None:
            if "synchroniz" in str(message):
                self._hit(self.warned, None)
            else:
                shown(message, category, filename, lineno, *args, **kwargs)

        warnings.showwarning = show
        self.available = True

    def _hit(self, counter: Counter[tuple[int, str]], kind: str | None) -> None:
        # torch's own threads (autograd's device threads run the backward and its hooks) hold up the training
        # thread, which waits for them; the Python threads started by the dump (its writer, the CRC pool) do not
        native = isinstance(threading.current_thread(), threading._DummyThread)
        thread = "training" if native or threading.get_ident() == self.training else "background"
        counter[(self.step, thread)] += 1
        if kind is not None:
            self.where[f"{thread} {kind}: {_caller()}"] += 1

    def per_step(self, steps: list[int], counter: Counter[tuple[int, str]], thread: str) -> float:
        return statistics.median(counter[(s, thread)] for s in steps)


def _caller() -> str:
    """The innermost Python frame outside torch and this file: who asked for the synchronisation."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename.replace(os.sep, "/")
        if "/torch/" in name or name.endswith("dump_overhead.py"):
            continue
        short = "/".join(name.split("/")[-3:])
        return f"{short}:{frame.lineno} ({frame.name})"
    return "(the loop itself)"


def run_syncs(job: dict[str, Any], dump: str = "dump") -> dict[str, Any]:
    """The loop once more, untimed, with the synchronisations counted (no synchronize() of the bench's own);
    ours runs it in the timed loop's process, after it (the counting slows every CUDA call down), msprobe in a
    process of its own (one PrecisionDebugger a process)."""
    shape = Shape(**job["shape"])
    config = CONFIGS[job["config"]]
    loop = make_loop(model_specs()[job["model"]], shape.steps, torch.device(job["device"]))
    counter = SyncCounter()
    counter.install()
    debugger = make_debugger(job["engine"], config, shape.window, Path(job["workdir"]) / dump)
    trend = None
    if config.trend:
        from pytest_msprobe.dump.trend_recorder import TrendRecorder

        trend = TrendRecorder(shape.steps)
    for step in range(shape.steps):
        counter.step = step
        train_step(loop, step, debugger, trend if shape.first <= step <= shape.last else None, False)
    counter.step = shape.steps  # the files of the last step, waited for at the end
    finish(job["engine"], debugger)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    window, undumped = shape.window, shape.undumped
    return {
        "sync_counted": counter.available,
        "syncs_dumped_training": counter.per_step(window, counter.trace, "training"),
        "syncs_dumped_background": counter.per_step(window, counter.trace, "background"),
        "syncs_undumped_training": counter.per_step(undumped, counter.trace, "training"),
        "syncs_at_close": counter.trace[(shape.steps, "training")]
        + counter.trace[(shape.steps, "background")],
        "sync_warnings_dumped_training": counter.per_step(window, counter.warned, "training"),
        "sync_where": dict(counter.where.most_common(8)),
    }


def child_main(job: dict[str, Any]) -> int:
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    run = {"time": run_timed, "alternating": run_alternating, "syncs": run_syncs}[job["measure"]]
    out = run(job)
    if job["measure"] == "time" and job.get("count_syncs"):
        out.update(run_syncs(job, "dump-syncs"))
    print(RESULT + json.dumps(out), flush=True)
    return 0


# ------------------------------------------------------------------------------------------- the parent side
def msprobe_version() -> str | None:
    """mindstudio-probe's version when it is importable in this interpreter, else None."""
    if importlib.util.find_spec("msprobe") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mindstudio-probe")
    except PackageNotFoundError:
        return "?"


def run_child(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One measurement in a process of its own; ``{"error": ...}`` when it failed."""
    workdir = Path(job["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=workdir,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return dict(json.loads(line[len(RESULT) :]))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median ratio (its other figures with it), every run's ratio kept."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    good.sort(key=lambda r: r["ratio"])
    chosen = dict(good[(len(good) - 1) // 2])
    if len(good) > 1:
        chosen["ratios"] = [r["ratio"] for r in good]
    return chosen


def measure(args: argparse.Namespace, shape: Shape, workdir: Path) -> list[dict[str, Any]]:
    specs = model_specs()
    msprobe = None if args.no_msprobe else msprobe_version()
    rows: list[dict[str, Any]] = []
    n = 0

    def job(engine: str, model: str, config: str, what: str) -> dict[str, Any]:
        nonlocal n
        n += 1
        return {
            "engine": engine,
            "model": model,
            "config": config,
            "measure": what,
            "shape": shape.__dict__,
            "device": args.device,
            "threads": args.threads,
            "repeats": args.write_repeats if args.write_repeats else 1 if args.quick else 3,
            "count_syncs": args.count_syncs and engine == "ours",
            "workdir": str(workdir / f"{n:03d}-{engine}-{model}-{config}"),
        }

    for model in args.models:
        for config in args.configs:
            row: dict[str, Any] = {"model": model, "model_name": specs[model].name, "config": config}
            row["goal"] = GOALS.get((model, config))
            engines = ["ours"] + (["msprobe"] if msprobe and CONFIGS[config].msprobe else [])
            for engine in engines:
                runs = [
                    run_child(job(engine, model, config, "time"), args.child_timeout)
                    for _ in range(args.repeat)
                ]
                row[engine] = _median_run(runs)
                if args.count_syncs and engine != "ours":
                    row[engine].update(run_child(job(engine, model, config, "syncs"), args.child_timeout))
            if args.alternating and CONFIGS[config].task is not None:
                row["ours"].update(run_child(job("ours", model, config, "alternating"), args.child_timeout))
            rows.append(row)
            print(progress_line(row), flush=True)
    return rows


def _ms(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def progress_line(row: dict[str, Any]) -> str:
    parts = [f"{row['model_name']:26} {row['config']:17}"]
    for engine in ("ours", "msprobe"):
        r = row.get(engine)
        if r is None:
            continue
        if "error" in r:
            parts.append(f"{engine}: FAILED {r['error']}")
            continue
        parts.append(
            f"{engine}: plain {r['plain_ms']:8.1f} ms dumped {r['dumped_ms']:8.1f} ms {r['ratio']:6.2f}x"
            f" next {r['next_ms']:7.1f} ms wait {r['wait_ms']:6.1f} ms"
        )
    return "  ".join(parts)


def tables(rows: list[dict[str, Any]], alternating: bool) -> str:
    """The results as markdown tables: every configuration, then task tensor against the write time, then syncs."""
    head = (
        "| model | configuration | plain ms | dumped ms | ratio | of minima | goal | next step ms | wait ms"
    )
    head += " | MB/step | files | msprobe dumped ms | msprobe ratio | of minima | ours / msprobe |"
    if alternating:
        head += " 1 thread, alternating |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        ours, ms = row.get("ours", {}), row.get("msprobe")
        cells = [row["model_name"], row["config"]]
        if "error" in ours:
            cells += ["failed: " + ours["error"]] + [""] * 9
        else:
            goal = row["goal"]
            met = "" if goal is None else f"{goal:g}x " + ("met" if ours["ratio"] <= goal else "NOT met")
            cells += [
                _ms(ours["plain_ms"]),
                _ms(ours["dumped_ms"]),
                _x(ours["ratio"]),
                _x(ours.get("ratio_of_minima")),
                met,
                _ms(ours["next_ms"]),
                _ms(ours["wait_ms"]),
                _ms(ours["bytes"] / 2**20, 2) if "bytes" in ours else "",
                str(ours.get("files", "")),
            ]
        if ms is None:
            cells += ["", "", "", ""]
        elif "error" in ms:
            cells += ["failed: " + ms["error"], "", "", ""]
        else:
            both = "error" not in ours
            cells += [_ms(ms["dumped_ms"]), _x(ms["ratio"]), _x(ms.get("ratio_of_minima"))]
            cells.append(_x(ours["ratio"] / ms["ratio"]) if both else "")
        if alternating:
            cells.append(_x(ours.get("alternating_ratio")))
        lines.append("| " + " | ".join(cells) + " |")
    out = ["\n".join(lines)]
    tensor_rows = [
        (row, engine)
        for row in rows
        for engine in ("ours", "msprobe")
        if "torch_save_files_ms" in row.get(engine, {})
    ]
    if tensor_rows:
        lines = [
            "| model | tool | plain ms | dumped ms | MB/step | tensor files | raw write, 1 file ms"
            " | torch.save, 1 file a tensor ms | plain + 1.5 x save ms | dumped / that |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row, engine in tensor_rows:
            r = row[engine]
            lines.append(
                f"| {row['model_name']} | {engine} | {_ms(r['plain_ms'])} | {_ms(r['dumped_ms'])} |"
                f" {r['bytes'] / 2**20:.1f} | {r['tensor_files']} | {_ms(r['write_one_file_ms'])} |"
                f" {_ms(r['torch_save_files_ms'])} | {_ms(r['tensor_limit_ms'])} | {_x(r['vs_tensor_goal'])} |"
            )
        out.append("\n".join(lines))
    sync_rows = [
        (row, engine)
        for row in rows
        for engine in ("ours", "msprobe")
        if "sync_counted" in row.get(engine, {})
    ]
    if sync_rows:
        lines = [
            "| model | configuration | tool | syncs a dumped step, training thread | background threads"
            " | an undumped step | at close | sync-debug warnings a dumped step | where (most) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row, engine in sync_rows:
            r = row[engine]
            if not r["sync_counted"]:
                lines.append(
                    f"| {row['model_name']} | {row['config']} | {engine} | no CUDA: not counted |||||||"
                )
                continue
            where = "; ".join(f"{w} x{n}" for w, n in list(r["sync_where"].items())[:3])
            lines.append(
                f"| {row['model_name']} | {row['config']} | {engine} | {r['syncs_dumped_training']:g} |"
                f" {r['syncs_dumped_background']:g} | {r['syncs_undumped_training']:g} | {r['syncs_at_close']} |"
                f" {r['sync_warnings_dumped_training']:g} | {where} |"
            )
        out.append("\n".join(lines))
    return "\n\n".join(out)


# ------------------------------------------------------------------------------------------------- profiling
def _in_process(
    args: argparse.Namespace, flag: str, configs: list[str]
) -> tuple[str, str, Config, torch.device]:
    """The configuration and model of ``--profile`` / ``--breakdown``, checked, and the device; torch's threads
    set as asked."""
    config_name, model = getattr(args, flag)
    if config_name not in configs or model not in model_specs():
        raise SystemExit(
            f"--{flag} {config_name} {model}: expected a configuration of {', '.join(configs)} "
            f"and a model of {', '.join(model_specs())}"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    return config_name, model, CONFIGS[config_name], torch.device(args.device)


def profile(args: argparse.Namespace, shape: Shape, workdir: Path) -> None:
    """Our loop in this process, the dumped steps under cProfile (every thread) or torch.profiler."""
    config_name, model, config, device = _in_process(args, "profile", list(CONFIGS))
    loop = make_loop(model_specs()[model], shape.steps, device)
    debugger = make_debugger("ours", config, shape.window, workdir / "dump")
    trend = None
    if config.trend:
        from pytest_msprobe.dump.trend_recorder import TrendRecorder

        trend = TrendRecorder(shape.steps)
    sync = device.type == "cuda"
    times = []
    with _profiler(args.profiler, device, args.top) as window:
        for step in range(shape.steps):
            dumped = shape.first <= step <= shape.last
            start = time.perf_counter()
            with window(dumped):
                train_step(loop, step, debugger, trend if dumped else None, sync)
            times.append(time.perf_counter() - start)
        wait = finish("ours", debugger)
    plain = statistics.median(times[s] for s in shape.undumped)
    dumped_ms = statistics.median(times[s] for s in shape.window)
    print(
        f"\n{model_specs()[model].name}, {config_name}: undumped step {plain * 1e3:.1f} ms, dumped step "
        f"{dumped_ms * 1e3:.1f} ms under the profiler ({dumped_ms / plain:.2f}x), files of the last step "
        f"{wait * 1e3:.1f} ms after the loop; torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    )


@contextlib.contextmanager
def _profiler(kind: str, device: torch.device, top: int) -> Iterator[Callable[[bool], Any]]:
    """Yields ``window(dumped)``: a context that profiles the step when ``dumped``; the tables print at the end."""
    import cProfile
    import pstats

    if kind == "torch":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        prof = torch_profile(activities=activities)
        state = {"on": False}

        @contextlib.contextmanager
        def torch_window(dumped: bool) -> Iterator[None]:
            if dumped and not state["on"]:
                prof.start()
                state["on"] = True
            if not dumped and state["on"]:
                prof.stop()
                state["on"] = False
            yield

        yield torch_window
        if state["on"]:
            prof.stop()
        averages = prof.key_averages()
        print("torch.profiler over the dumped steps, every thread, by self CPU time:")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=top))
        if device.type == "cuda":
            print("by device time:")
            print(averages.table(sort_by="self_device_time_total", row_limit=top))
        return

    main = cProfile.Profile()
    background: list[cProfile.Profile] = []

    def start_thread_profile(*_: Any) -> None:  # the first event of every thread started from here on
        prof = cProfile.Profile()
        background.append(prof)
        prof.enable()  # replaces this bootstrap function for the thread

    @contextlib.contextmanager
    def window(dumped: bool) -> Iterator[None]:
        if not dumped:
            yield
            return
        main.enable()
        try:
            yield
        finally:
            main.disable()

    threading.setprofile(start_thread_profile)
    try:
        yield window
    finally:
        threading.setprofile(None)
    stats = pstats.Stats(main, stream=sys.stdout).strip_dirs()
    print("training thread, the dumped steps, by cumulative time:")
    stats.sort_stats("cumulative").print_stats(top)
    print("training thread, the dumped steps, by own time:")
    stats.sort_stats("tottime").print_stats(top)
    if background:
        threaded = pstats.Stats(background[0], stream=sys.stdout)
        for other in background[1:]:
            threaded.add(other)
        print(f"background threads ({len(background)}: the step writers, the CRC pool), by own time:")
        threaded.strip_dirs().sort_stats("tottime").print_stats(top)


# ---------------------------------------------------------------------------------------------- breakdown
# tensor sizes (elements) the statistics' time is split by: reduced together at flush up to SMALL, then larger
_SIZE_BUCKETS = ((4096, "<= 4K (copied, reduced at flush)"), (1 << 16, "4K-64K"), (1 << 20, "64K-1M"))
_SIZE_TOP = "> 1M"


def _size_bucket(numel: int) -> str:
    for bound, name in _SIZE_BUCKETS:
        if numel <= bound:
            return name
    return _SIZE_TOP


class _Parts:
    """Wall time of a dump's parts on the training thread, and how many calls of each, by step."""

    def __init__(self) -> None:
        self.step = -1
        self.ms: dict[int, dict[str, float]] = {}
        self.counts: dict[int, Counter[str]] = {}

    def add(self, part: str, seconds: float) -> None:
        by_part = self.ms.setdefault(self.step, {})
        by_part[part] = by_part.get(part, 0.0) + seconds * 1e3
        self.counts.setdefault(self.step, Counter())[part] += 1

    def timed(
        self, owner: Any, name: str, part: str, key: Callable[..., str] | None = None
    ) -> Callable[[], None]:
        """Time every call of ``owner.name`` as ``part`` (``key(*args)`` names a sub-part); returns the undo."""
        original = getattr(owner, name)
        parts = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                parts.add(part if key is None else f"{part}: {key(*args)}", time.perf_counter() - start)

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


def breakdown(args: argparse.Namespace, shape: Shape, workdir: Path) -> dict[str, Any]:
    """Where our dumped steps' time goes, measured inside the loop, without a profiler: start() (the wrappers put
    in, the checklist's fingerprints), the step's body beyond an undumped step (of which the statistics'
    reductions, by tensor size, and the rest: Python per recorded call, stacks, backward hooks), stop() (the
    wrappers taken out, the step's files when written inline), and the CPU time of the writer's jobs
    that ran on its thread beside the next steps. Timers around the dump's own functions add ~1 us a tensor."""
    from pytest_msprobe.dump import checklist, debugger, intercept, writer
    from pytest_msprobe.dump.api_calls import ApiCalls
    from pytest_msprobe.dump.stats import StatEngine

    dumping = [name for name, c in CONFIGS.items() if c.task is not None]
    config_name, model, config, device = _in_process(args, "breakdown", dumping)
    parts = _Parts()
    jobs: list[tuple[int, bool, float]] = []  # (step, inline, CPU seconds) of each writer job
    submitted: list[int] = []  # the step of each job handed over, in order (jobs run one at a time, in order)
    original_submit, original_execute = writer.BackgroundJobs.submit, writer.BackgroundJobs._execute

    def submit(self: Any, job: Any, inline: bool = False) -> None:
        submitted.append(parts.step)
        original_submit(self, job, inline)

    def execute(self: Any, *job: Any) -> None:
        inline = threading.current_thread() is threading.main_thread()
        original_execute(self, *job)
        jobs.append((submitted[len(jobs)], inline, self.last_cpu or 0.0))

    undo = [
        parts.timed(debugger.PrecisionDebugger, "start", "start()"),
        parts.timed(debugger.PrecisionDebugger, "stop", "stop()"),
        parts.timed(intercept.ApiPatcher, "install", "wrappers in"),
        parts.timed(intercept.ApiPatcher, "uninstall", "wrappers out"),
        parts.timed(checklist.StepChecklist, "start", "checklist fingerprints"),
        parts.timed(StatEngine, "_compute", "statistics", key=lambda _, t, *rest: _size_bucket(t.numel())),
        parts.timed(StatEngine, "item", "tensor items"),
        parts.timed(ApiCalls, "api_call", "recorded calls"),
    ]
    writer.BackgroundJobs.submit = submit  # type: ignore[method-assign]
    writer.BackgroundJobs._execute = execute  # type: ignore[method-assign]
    undo.append(lambda: setattr(writer.BackgroundJobs, "submit", original_submit))
    undo.append(lambda: setattr(writer.BackgroundJobs, "_execute", original_execute))
    try:
        loop = make_loop(model_specs()[model], shape.steps, device)
        dbg = make_debugger("ours", config, shape.window, workdir / "dump")
        sync = device.type == "cuda"
        times = []
        for step in range(shape.steps):
            parts.step = step
            start = time.perf_counter()
            train_step(loop, step, dbg, None, sync)
            times.append(time.perf_counter() - start)
        parts.step = shape.steps
        finish("ours", dbg)
    finally:
        for restore in reversed(undo):
            restore()
    return _breakdown_table(model, config_name, shape, times, parts, jobs)


def _breakdown_table(
    model: str,
    config_name: str,
    shape: Shape,
    times: list[float],
    parts: _Parts,
    jobs: list[tuple[int, bool, float]],
) -> dict[str, Any]:
    window = shape.window
    plain = statistics.median(times[s] for s in shape.undumped) * 1e3
    dumped = statistics.median(times[s] for s in window) * 1e3

    def ms(part: str) -> float:
        return statistics.median(parts.ms.get(s, {}).get(part, 0.0) for s in window)

    def count(part: str) -> float:
        return statistics.median(parts.counts.get(s, Counter())[part] for s in window)

    sizes = [name for _, name in _SIZE_BUCKETS] + [_SIZE_TOP]
    stats_parts = {name: (ms(f"statistics: {name}"), count(f"statistics: {name}")) for name in sizes}
    stats_ms = sum(v for v, _ in stats_parts.values())
    inline = [cpu for step, on_caller, cpu in jobs if on_caller and step in window]
    threaded = [cpu for step, on_caller, cpu in jobs if not on_caller and step in window]
    start_ms, stop_ms = ms("start()"), ms("stop()")
    body_ms = dumped - start_ms - stop_ms
    rows: list[tuple[str, float | None, str]] = [
        ("undumped step", plain, ""),
        ("dumped step", dumped, f"{dumped / plain:.2f}x"),
        ("start()", start_ms, ""),
        ("  the wrappers put in", ms("wrappers in"), ""),
        ("  the checklist's fingerprints", ms("checklist fingerprints"), ""),
        ("the step's body (forward, backward, optimizer)", body_ms, f"{body_ms - plain:+.1f} ms on undumped"),
        ("  recorded calls", None, f"{count('recorded calls'):.0f} a step"),
        ("  tensor items", None, f"{count('tensor items'):.0f} a step"),
        ("  statistics' reductions", stats_ms, f"{sum(c for _, c in stats_parts.values()):.0f} tensors"),
    ]
    for name, (value, n) in stats_parts.items():
        rows.append((f"    {name}", value, f"{n:.0f} tensors"))
    rows.append(("  the rest (Python per call, stacks, backward hooks)", body_ms - plain - stats_ms, ""))
    rows.append(("stop()", stop_ms, ""))
    rows.append(("  the wrappers taken out", ms("wrappers out"), ""))
    if inline:
        note = f"CPU ({len(inline)} of {len(window)} steps)"
        rows.append(("  the step's files, written by stop()", statistics.median(inline) * 1e3, note))
    if threaded:
        note = f"CPU, beside the next step ({len(threaded)} of {len(window)} steps)"
        rows.append(("the step's files on the writer thread", statistics.median(threaded) * 1e3, note))
    rows.append(("undumped step + statistics alone", plain + stats_ms, f"{(plain + stats_ms) / plain:.2f}x"))
    lines = [
        f"{model_specs()[model].name}, {config_name}: medians of the dumped steps {window[0]}-{window[-1]}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)",
        "",
        "| part | ms a step | |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {'' if value is None else f'{value:.1f}'} | {note} |" for name, value, note in rows
    ]
    print("\n".join(lines))
    return {
        "model": model,
        "config": config_name,
        "plain_ms": plain,
        "dumped_ms": dumped,
        "parts": {name.strip(): {"ms": value, "note": note} for name, value, note in rows},
        "statistics": {name: {"ms": v, "tensors": n} for name, (v, n) in stats_parts.items()},
        "writer_jobs": [{"step": s, "inline": i, "cpu_ms": c * 1e3} for s, i, c in jobs],
    }


# ------------------------------------------------------------------------------------------------ per call
def _best_ns_per_call(fn: Callable[[], Any], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def time_calls(workdir: Path, calls: int = 20000, rounds: int = 15) -> dict[str, float]:
    """Nanoseconds per call: a wrapper's own cost when it records nothing, and a recorded ``torch.add``."""
    from pytest_msprobe import PrecisionDebugger
    from pytest_msprobe.dump import intercept, threads

    a, b = torch.ones(4), torch.ones(4)
    items = (1, 2, 3)
    wrapped_len = intercept._make_wrapper(len, "Torch.len")  # the wrapper of a function that costs nothing

    def bare() -> Any:
        return len(items)

    def through() -> Any:
        return wrapped_len(items)

    out: dict[str, float] = {}
    debugger = PrecisionDebugger(dump_path=workdir / "calls", task="statistics", level="L1")
    debugger.start()
    with threads.quiet():  # wrappers installed, this thread records nothing
        bare_ns = through_ns = float("inf")
        for _ in range(rounds):  # alternated, best of each: the machine's other load shows in neither
            bare_ns = min(bare_ns, _best_ns_per_call(bare, calls, 1))
            through_ns = min(through_ns, _best_ns_per_call(through, calls, 1))
    debugger.stop()
    debugger.step()
    out["wrapper, not recording (own cost)"] = through_ns - bare_ns
    add = torch.add
    out["plain torch.add"] = _best_ns_per_call(lambda: add(a, b), calls, rounds)
    best = float("inf")
    for _ in range(rounds):
        debugger.start()
        add = torch.add  # the wrapper
        start = time.perf_counter_ns()
        for _ in range(calls // 10):
            add(a, b)
        best = min(best, (time.perf_counter_ns() - start) / (calls // 10))
        debugger.stop()
        debugger.step()
        debugger.wait()
    out["recorded torch.add"] = best
    debugger.close()
    return out


# ------------------------------------------------------------------------------------------------------ main
def _window(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    try:
        return int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIRST-LAST, e.g. 6-10") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["tiny", "large", "resnet50"], choices=list(model_specs())
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=None, help="steps of each loop (default 14)")
    parser.add_argument(
        "--dump", type=_window, default=None, help="the dumped steps, FIRST-LAST (default 6-10)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="first steps not measured (default 3)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 6 steps, 2-3 dumped, 1 of warm-up")
    parser.add_argument(
        "--repeat", type=int, default=1, help="loops per measurement; the median ratio is kept"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--no-msprobe", action="store_true", help="ours only, even where msprobe is installed"
    )
    parser.add_argument("--alternating", action="store_true", help="add the one-thread alternating figure")
    parser.add_argument("--count-syncs", action="store_true", help="count host synchronisations (CUDA)")
    parser.add_argument(
        "--write-repeats", type=int, default=None, help="tensor writes timed per loop (default 3, --quick 1)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--workdir", type=Path, default=None, help="where dumps go (default: a temp dir)")
    parser.add_argument("--child-timeout", type=float, default=1800.0, help="seconds per measurement")
    parser.add_argument("--profile", nargs=2, metavar=("CONFIG", "MODEL"), help="profile our dumped steps")
    parser.add_argument("--profiler", choices=["cprofile", "torch"], default="cprofile")
    parser.add_argument("--top", type=int, default=25, help="rows of each profile table")
    parser.add_argument("--calls", action="store_true", help="time one API wrapper per call instead")
    parser.add_argument(
        "--breakdown", nargs=2, metavar=("CONFIG", "MODEL"), help="where our dumped steps' time goes"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))
    base = QUICK if args.quick else Shape()
    first, last = args.dump or (base.first, base.last)
    shape = Shape(
        steps=args.steps if args.steps is not None else base.steps,
        first=first,
        last=last,
        warmup=args.warmup if args.warmup is not None else base.warmup,
    )
    shape.check()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device here")
    own_workdir = args.workdir is None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="msprobe-bench-"))
    try:
        if args.calls:
            if args.threads:
                torch.set_num_threads(args.threads)
            timings = time_calls(workdir)
            print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
            for what, ns in timings.items():
                print(f"{what:36} {ns:9.0f} ns/call")
            if args.json:
                args.json.write_text(json.dumps({"torch": torch.__version__, "calls_ns": timings}, indent=1))
            return 0
        if args.profile:
            profile(args, shape, workdir)
            return 0
        if args.breakdown:
            found = breakdown(args, shape, workdir)
            if args.json:
                args.json.write_text(json.dumps({"torch": torch.__version__, "breakdown": found}, indent=1))
            return 0
        msprobe = None if args.no_msprobe else msprobe_version()
        print(
            f"torch {torch.__version__}, {args.threads or torch.get_num_threads()} thread(s), {os.cpu_count()} CPUs,"
            f" device {args.device}; msprobe: {msprobe or 'not installed (ours only)'}; {shape.steps} steps a loop,"
            f" steps {shape.first}-{shape.last} dumped, steps {shape.undumped} undumped; dumps under {workdir}",
            flush=True,
        )
        rows = measure(args, shape, workdir)
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(tables(rows, args.alternating))
    if args.json:
        doc = {
            "torch": torch.__version__,
            "msprobe": msprobe,
            "device": args.device,
            "cpus": os.cpu_count(),
            "threads": args.threads or torch.get_num_threads(),
            "shape": shape.__dict__,
            "rows": rows,
        }
        args.json.write_text(json.dumps(doc, indent=1))
    failed = sum(1 for row in rows for e in ("ours", "msprobe") if "error" in row.get(e, {}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
