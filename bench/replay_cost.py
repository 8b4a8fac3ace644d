"""Cost of the offline replay: ``pytest-msprobe replay`` of a tensor dump, the whole command as a user runs it.

Dumps consecutive training steps of a model with task tensor (level L1) until the dump holds at least
``--gigabytes`` of files, then times ``python -m pytest_msprobe replay`` on it (median of ``--repeat`` runs,
peak RSS of the command) and reports how many calls it replayed and how many it found out of line (a clean
CPU run: none should be).

    python bench/replay_cost.py --model large --gigabytes 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dump_overhead import ROOT, model_specs


def _size(path: Path) -> int:
    """Bytes under ``path``; a step's files being written (renamed) meanwhile are counted when they land."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


def make_dump(model: str, root: Path, gigabytes: float) -> tuple[int, int]:
    """Dump steps of ``model`` into ``root`` until it holds ``gigabytes``; (steps dumped, bytes)."""
    from pytest_msprobe import PrecisionDebugger, seed_all

    spec = model_specs()[model]
    seed_all(1234)
    net = spec.build()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    debugger = PrecisionDebugger(task="tensor", dump_path=str(root), level="L1")  # every step, as they come
    steps = 0
    while steps < 64 and (steps == 0 or _size(root) * (steps + 1) / steps < gigabytes * 1e9):
        x, y = spec.batch(steps)
        debugger.start()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        debugger.stop()
        debugger.step()
        steps += 1
    debugger.close()
    return steps, _size(root)


def run_once(dump: Path, out: Path) -> tuple[float, float, dict[str, object]]:
    cmd = [sys.executable, "-m", "pytest_msprobe", "replay", str(dump), "-o", str(out), "-q"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):
        raise SystemExit(f"replay failed ({code}): {child.stderr.read().decode() if child.stderr else ''}")
    doc = json.loads((out / "replay.json").read_text())
    return wall, usage.ru_maxrss / 1024, doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large", choices=sorted(model_specs()))
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "dump"
        steps, size = make_dump(args.model, dump, args.gigabytes)
        runs = [run_once(dump, Path(tmp) / f"out{i}") for i in range(args.repeat)]
        doc = runs[-1][2]
        print(
            f"{model_specs()[args.model].name}: {steps} steps, {size / 1e9:.2f} GB of tensor dump; "
            f"replay median {statistics.median(r[0] for r in runs):.1f} s (min {min(r[0] for r in runs):.1f} s), "
            f"peak {max(r[1] for r in runs):.0f} MB; {doc['replayed']} calls replayed, {doc['skipped']} not, "
            f"{len(doc['out_of_line'])} out of line"  # type: ignore[arg-type]
        )
        for call in doc["calls"]:  # type: ignore[attr-defined]
            reasons = [o["reason"] for o in call["outputs"] if o and o["out_of_line"]]
            if reasons:
                print(f"  out of line: {call['name']} (step {call['step']}): {'; '.join(reasons)}")


if __name__ == "__main__":
    main()
