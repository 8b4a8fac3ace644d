"""Dump overhead: median dumped training step / median plain step, measured side by side in one process.

    python bench/dump_overhead.py                     # all models, all configurations
    python bench/dump_overhead.py --models tiny --configs statistics_L1 --json out.json

Each configuration runs one training loop in which dumped and plain steps alternate (the debugger's ``step``
list holds the even steps), after a warm-up of both kinds. A step is timed from ``debugger.start()`` to
``debugger.step()`` inclusive (as msprobe's own measurements were). The step's JSON files are written by a
background thread: after each dumped step the loop waits for them (``debugger.wait()``) outside the timed
steps, so plain steps never share the machine with it, and that wait is reported too:

- ``ratio``: median(dumped step) / median(plain step), what the training loop sees;
- ``+files``: (median(dumped step) + median(wait for the files)) / median(plain step), the whole cost as if
  the files were written on the training thread.

For task ``tensor`` (whose tensor files are on disk when stop() returns) the script also times ``torch.save``
of the very tensors the dump wrote, one file each, and reports (dumped + files) / (plain + save). Dumps go to a
temporary folder, removed after each configuration.

Models: TinyResNet of ``tests/data/msprobe/make_dumps.py`` at width 8 (batch 8x3x16x16, the model of msprobe's
reference dumps) and width 32 (32x3x32x32), and torchvision's ``resnet50(weights=None)`` (4x3x64x64).
``--threads`` sets ``torch.set_num_threads`` (default 1: the runs share the machine with other work, and one
thread keeps the plain and dumped steps comparable).

``--calls`` times one API wrapper instead, in nanoseconds per call (best of several rounds): the wrapper's own
cost where nothing is recorded (a debugger started, the call made inside ``threads.quiet()``: a wrapper of
``len`` against ``len``), a plain ``torch.add`` of two 4-element tensors, and the same call recorded (task
statistics, L1, the statistics of its three tensors included).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pytest_msprobe import PrecisionDebugger, seed_all  # noqa: E402

# configuration name -> (task, level)
CONFIGS: dict[str, tuple[str, str]] = {
    "statistics_L1": ("statistics", "L1"),
    "statistics_L0": ("statistics", "L0"),
    "statistics_mix": ("statistics", "mix"),
    "md5_L1": ("md5", "L1"),
    # the step recorded as for statistics; only the calls whose outputs hold inf/nan written (none here)
    "overflow_check_L1": ("overflow_check", "L1"),
    "tensor_L1": ("tensor", "L1"),
}


@dataclass
class ModelSpec:
    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    pairs: int  # dumped/plain step pairs measured
    warmup: int  # pairs run first, not measured


@dataclass
class Row:
    model: str
    config: str
    plain_ms: float
    dumped_ms: float
    ratio: float
    files_ms: float = 0.0
    ratio_with_files: float = 0.0
    save_ms: float | None = None
    ratio_vs_plain_plus_save: float | None = None
    records: int = 0
    tensor_files: int = 0
    mbytes: float = 0.0


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

    def tiny_batch(width: int, batch: int, size: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        return lambda step: md.make_batch(step % 4, batch, size)

    def resnet50() -> torch.nn.Module:
        import torchvision

        return torchvision.models.resnet50(weights=None, num_classes=10)

    def resnet_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step % 4)
        return torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, 10, (4,), generator=g)

    return {
        "tiny": ModelSpec(
            "TinyResNet w8 8x3x16x16", lambda: md.TinyResNet(width=8), tiny_batch(8, 8, 16), 15, 4
        ),
        "large": ModelSpec(
            "TinyResNet w32 32x3x32x32", lambda: md.TinyResNet(width=32), tiny_batch(32, 32, 32), 8, 2
        ),
        "resnet50": ModelSpec("resnet50 4x3x64x64", resnet50, resnet_batch, 5, 2),
    }


def _dir_size(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _time_saving(step_folder: Path) -> float:
    """Seconds to torch.save, one file each under the same names, the tensors a dumped step wrote.

    The tensors are loaded and the step's folder deleted first (not timed), so the plain saves meet the disk
    in the state the dump's own saves met it.
    """
    folder = step_folder / "dump_tensor_data"
    tensors = {p.name: torch.load(p, weights_only=True) for p in sorted(folder.glob("*.pt"))}
    shutil.rmtree(step_folder)
    folder.mkdir(parents=True)
    start = time.perf_counter()
    for name, t in tensors.items():
        torch.save(t, folder / name)
    elapsed = time.perf_counter() - start
    shutil.rmtree(step_folder)
    return elapsed


def run_config(spec: ModelSpec, config_name: str, workdir: Path) -> Row:
    seed_all(seed=1234, mode=False)
    torch.manual_seed(1234)
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    total_pairs = spec.warmup + spec.pairs
    dump_path = workdir / config_name
    dumped_steps = [2 * i for i in range(total_pairs)]
    task, level = CONFIGS[config_name]
    debugger = PrecisionDebugger(dump_path=dump_path, task=task, level=level, step=dumped_steps)
    times: dict[bool, list[float]] = {True: [], False: []}
    waits: list[float] = []
    saves: list[float] = []
    saving = task == "tensor"
    for step in range(2 * total_pairs):
        x, y = spec.batch(step)
        start = time.perf_counter()
        debugger.start(model=model)
        out = model(x)
        loss = loss_fn(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        debugger.stop()
        debugger.step()
        elapsed = time.perf_counter() - start
        start = time.perf_counter()
        debugger.wait()
        waited = time.perf_counter() - start
        if step >= 2 * spec.warmup:
            times[step % 2 == 0].append(elapsed)
            if step % 2 == 0:
                waits.append(waited)
                if saving:
                    saves.append(_time_saving(debugger.step_path(step)))
    debugger.close()
    plain = statistics.median(times[False])
    dumped = statistics.median(times[True])
    last = debugger.step_path(
        dumped_steps[1]
    )  # a warm-up step (the measured ones may be gone), not the first
    records = len(json.loads((last / "dump.json").read_text())["data"])
    files = statistics.median(waits)
    row = Row(spec.name, config_name, plain * 1e3, dumped * 1e3, dumped / plain, records=records)
    row.files_ms = files * 1e3
    row.ratio_with_files = (dumped + files) / plain
    n_files, size = _dir_size(last)
    row.tensor_files = n_files - 3
    row.mbytes = size / 2**20
    if saves:
        save = statistics.median(saves)
        row.save_ms = save * 1e3
        row.ratio_vs_plain_plus_save = (dumped + files) / (plain + save)
    shutil.rmtree(dump_path, ignore_errors=True)
    return row


def _best_ns_per_call(fn: Callable[[], None], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def time_calls(workdir: Path, calls: int = 20000, rounds: int = 15) -> dict[str, float]:
    """Nanoseconds per call: a wrapper's own cost when it records nothing, and a recorded ``torch.add``."""
    from pytest_msprobe.dump import intercept, threads

    a, b = torch.ones(4), torch.ones(4)
    items = (1, 2, 3)
    wrapped_len = intercept._make_wrapper(len, "Torch.len")  # the wrapper of a function that costs nothing

    def bare() -> None:
        len(items)

    def through() -> None:
        wrapped_len(items)

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "large", "resnet50"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where dumps are written (default: a temp dir)"
    )
    parser.add_argument("--calls", action="store_true", help="time one API wrapper per call instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.calls:
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="msprobe-bench-"))
        try:
            timings = time_calls(workdir)
        finally:
            if args.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
        for what, ns in timings.items():
            print(f"{what:36} {ns:9.0f} ns/call")
        if args.json:
            args.json.write_text(json.dumps({"torch": torch.__version__, "calls_ns": timings}, indent=1))
        return 0
    specs = model_specs()
    rows: list[Row] = []
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="msprobe-bench-"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), dumps under {workdir}")
    header = (
        f"{'model':26} {'config':15} {'plain ms':>9} {'dumped ms':>10} {'files ms':>9} {'ratio':>6} {'+files':>7}"
        f" {'save ms':>8} {'vs p+s':>7} {'records':>7} {'MB':>7}"
    )
    print(header)
    print("-" * len(header))
    try:
        for key in args.models:
            spec = specs[key]
            for config in args.configs:
                row = run_config(spec, config, workdir)
                rows.append(row)
                save = f"{row.save_ms:8.1f}" if row.save_ms is not None else " " * 8
                vs = (
                    f"{row.ratio_vs_plain_plus_save:6.2f}x"
                    if row.ratio_vs_plain_plus_save is not None
                    else " " * 7
                )
                print(
                    f"{row.model:26} {row.config:15} {row.plain_ms:9.2f} {row.dumped_ms:10.2f} {row.files_ms:9.2f}"
                    f" {row.ratio:5.2f}x {row.ratio_with_files:6.2f}x {save} {vs} {row.records:7d} {row.mbytes:7.2f}",
                    flush=True,
                )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"threads": args.threads, "torch": torch.__version__, "rows": [asdict(r) for r in rows]},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
