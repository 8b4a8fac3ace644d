"""Cost of the online self-check: a training loop's step, plain, dumped (task statistics) and dumped with the
self-check (every API call replayed on the CPU in float64 and judged), as a user runs it.

    python bench/self_check_cost.py                      # TinyResNet width 32, 32x3x32x32, default threads
    python bench/self_check_cost.py --model tiny --steps 6 --rounds 5 --json out.json

Each round runs three training loops of ``--steps`` consecutive steps on one model, one per configuration, in
turn: ``plain`` (no debugger), ``statistics`` (every step dumped, level L1) and ``self-check`` (the same dump
with ``self_check=True``). A loop is timed whole, from its first step to ``debugger.close()`` (the JSON files
and sidecars written in the background included), after a warm-up loop of each; the per-step time of a
configuration is the median over the rounds of loop time / steps. Ratios are against ``plain``.

Also reported, from the last self-checked loop: the calls replayed (forward and backward records judged), those
skipped and those out of line (a clean CPU run: none), and where the self-check's time goes (``--profile``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dump_overhead import ROOT, ModelSpec, model_specs

sys.path.insert(0, str(ROOT))
from pytest_msprobe import PrecisionDebugger, seed_all
from pytest_msprobe.format.layout import discover
from pytest_msprobe.format.own_errors import read_own_errors

CONFIGS = ("plain", "statistics", "self-check")


def run_loop(spec: ModelSpec, config: str, steps: int, dump_path: Path) -> float:
    """Seconds for ``steps`` training steps of ``spec`` under ``config``, the dump's files included."""
    seed_all(1234, mode=False)
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = [spec.batch(step) for step in range(steps)]
    debugger = None
    if config != "plain":
        shutil.rmtree(dump_path, ignore_errors=True)
        debugger = PrecisionDebugger(
            dump_path=dump_path, task="statistics", level="L1", self_check=config == "self-check"
        )
    start = time.perf_counter()
    for x, y in batches:
        if debugger is not None:
            debugger.start()
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if debugger is not None:
            debugger.stop()
            debugger.step()
    if debugger is not None:
        debugger.close()
    return time.perf_counter() - start


def census(dump_path: Path) -> dict[str, int]:
    """Calls judged, skipped and out of line over the sidecars of a dump."""
    judged = skipped = out_of_line = 0
    for location in discover(dump_path):
        calls = read_own_errors(location.path) or {}
        skipped += sum(1 for c in calls.values() if c.skipped)
        judged += sum(1 for c in calls.values() if not c.skipped)
        out_of_line += sum(1 for c in calls.values() if c.out_of_line)
    return {"judged": judged, "skipped": skipped, "out_of_line": out_of_line}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="large", choices=sorted(model_specs()))
    parser.add_argument("--steps", type=int, default=4, help="consecutive steps per timed loop")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--profile", action="store_true", help="cProfile one self-checked loop")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = model_specs()[args.model]
    workdir = Path(tempfile.mkdtemp(prefix="msprobe-selfcheck-bench-"))
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    try:
        for config in CONFIGS:  # warm-up
            run_loop(spec, config, 2, workdir / config)
        for _ in range(args.rounds):
            for config in CONFIGS:
                times[config].append(run_loop(spec, config, args.steps, workdir / config) / args.steps)
        counts = census(workdir / "self-check")
        if args.profile:
            import cProfile
            import pstats

            profile = cProfile.Profile()
            profile.enable()
            run_loop(spec, "self-check", args.steps, workdir / "self-check")
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    medians = {c: statistics.median(t) for c, t in times.items()}
    plain = medians["plain"]
    print(
        f"{spec.name}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.steps} steps a loop"
    )
    for config in CONFIGS:
        print(f"{config:12} {medians[config] * 1e3:9.1f} ms/step  {medians[config] / plain:6.2f}x")
    print(
        f"self-check: {counts['judged']} records judged, {counts['skipped']} skipped, "
        f"{counts['out_of_line']} out of line"
    )
    if args.json:
        doc: dict[str, Any] = {
            "model": spec.name,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "steps": args.steps,
            "ms_per_step": {c: m * 1e3 for c, m in medians.items()},
            "ratio": {c: m / plain for c, m in medians.items()},
            "census": counts,
        }
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
