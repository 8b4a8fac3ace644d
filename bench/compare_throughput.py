"""Throughput of ``pytest-msprobe compare``: the whole command, as a user runs it.

Builds once (cached) an msprobe-format dump pair with torch: 64 APIs x (input, output) x 4 MiB float32 per
side (1.07 GB of tensor files in all), as a tensor dump and as a statistics dump; then runs the CLI on each
in a child process, several times, interleaved, and reports medians of the wall time and the child's peak
RSS (from wait4), the tensor throughput in GB/s, and 1 vs 2 ``--jobs``. The target side differs from the
baseline by 1e-6 relative noise everywhere and 1e-3 on one API, so every row is really computed.

    python bench/compare_throughput.py                  # table
    python bench/compare_throughput.py --json           # the same as JSON
    python bench/compare_throughput.py --repeat 5 --cache /tmp/msprobe-bench

Reference, measured on the same kind of machine with msprobe's own compare on the 1.07 GB pair: 8.3.3
7.6 s, 26.2.0 14.5 s (~390 MB peak); a statistics compare ~3.5 s. Goals: <= 1.5 s at <= 400 MB, and a
statistics compare <= 1 s. Timings on a shared machine are noisy: compare the runs of one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
APIS = 64
ELEMENTS = 1 << 20  # 4 MiB of float32 per tensor
MSPROBE_SECONDS = {"msprobe 8.3.3": 7.6, "msprobe 26.2.0": 14.5}


def build(root: Path) -> dict[str, Path]:
    """Write the dump pairs under ``root`` (once: a marker file says the build finished)."""
    cases = {
        "tensor": (root / "tensor" / "target", root / "tensor" / "baseline"),
        "statistics": (root / "statistics" / "target", root / "statistics" / "baseline"),
    }
    done = root / "BUILT"
    if done.exists():
        return {name: pair[0].parent for name, pair in cases.items()}
    import torch

    g = torch.Generator().manual_seed(0)
    stats: dict[str, dict[str, Any]] = {"target": {}, "baseline": {}}  # API -> statistics entry
    tensor_dirs = {}
    for side in ("target", "baseline"):
        folder = cases["tensor"][0 if side == "target" else 1] / "step0" / "rank"
        (folder / "dump_tensor_data").mkdir(parents=True, exist_ok=True)
        tensor_dirs[side] = folder
    for i in range(APIS):
        name = f"Functional.linear.{i}.forward"
        for side in stats:
            stats[side][name] = {"input_args": [], "input_kwargs": {}, "output": []}
        for role, key in (("input", "input_args"), ("output", "output")):
            base = torch.randn(ELEMENTS, generator=g).reshape(1024, 1024)
            noise = 1e-3 if (i == APIS // 2 and role == "output") else 1e-6
            values = {"baseline": base, "target": base * (1 + noise * torch.randn(base.shape, generator=g))}
            for side, t in values.items():
                torch.save(t.contiguous(), tensor_dirs[side] / "dump_tensor_data" / f"{name}.{role}.0.pt")
                stats[side][name][key].append(
                    {
                        "type": "torch.Tensor",
                        "dtype": "torch.float32",
                        "shape": list(t.shape),
                        "Max": t.max().item(),
                        "Min": t.min().item(),
                        "Mean": t.mean().item(),
                        "Norm": t.norm().item(),
                        "requires_grad": False,
                    }
                )
    for side in ("target", "baseline"):
        with_files = {
            name: {
                "input_args": [{**entry["input_args"][0], "data_name": f"{name}.input.0.pt"}],
                "input_kwargs": {},
                "output": [{**entry["output"][0], "data_name": f"{name}.output.0.pt"}],
            }
            for name, entry in stats[side].items()
        }
        stat_dir = cases["statistics"][0 if side == "target" else 1] / "step0" / "rank"
        for task, folder, data in (
            ("tensor", tensor_dirs[side], with_files),
            ("statistics", stat_dir, stats[side]),
        ):
            folder.mkdir(parents=True, exist_ok=True)
            doc = {"task": task, "level": "L1", "framework": "pytorch", "dump_data_dir": None, "data": data}
            (folder / "dump.json").write_text(json.dumps(doc, indent=1))
            (folder / "stack.json").write_text("{}")
            (folder / "construct.json").write_text("{}")
    done.write_text("ok\n")
    return {name: pair[0].parent for name, pair in cases.items()}


def run_once(case_dir: Path, out: Path, extra: list[str]) -> tuple[float, float, int]:
    """Wall seconds and peak RSS (MB) of one ``python -m pytest_msprobe compare`` child, and its exit code."""
    cmd = [
        sys.executable,
        "-m",
        "pytest_msprobe",
        "compare",
        str(case_dir / "target"),
        str(case_dir / "baseline"),
        "-o",
        str(out),
        "-q",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    err = child.stderr.read().decode() if child.stderr else ""
    if child.returncode not in (0, 1):
        raise SystemExit(f"compare failed ({child.returncode}): {err}")
    # ru_maxrss: KiB on Linux, bytes on macOS
    peak = usage.ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024)
    return wall, peak, child.returncode


def tensor_bytes(case_dir: Path) -> int:
    return sum(p.stat().st_size for p in case_dir.rglob("*.pt"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "pytest-msprobe-bench"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    root = Path(args.cache)
    root.mkdir(parents=True, exist_ok=True)
    if args.build_only:
        build(root)
        return 0
    if not (root / "BUILT").exists():
        print(f"building the dump pairs under {root} (once) ...", file=sys.stderr)
        # in a child: a child's peak RSS (from wait4) counts its parent's memory at fork, and torch is large
        subprocess.run([sys.executable, __file__, "--build-only", "--cache", str(root)], check=True)
    cases = build(root)
    runs = {
        "tensor, --jobs 1": (cases["tensor"], []),
        "tensor, --jobs 2": (cases["tensor"], ["--jobs", "2"]),
        "statistics": (cases["statistics"], []),
    }
    size = tensor_bytes(cases["tensor"])
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as out:
        for case, extra in runs.values():  # warm the page cache and the imports
            run_once(case, Path(out), extra)
        for _ in range(args.repeat):  # interleaved, so that load from elsewhere hits every case alike
            for name, (case, extra) in runs.items():
                samples[name].append(run_once(case, Path(out), extra))

    results: list[dict[str, Any]] = []
    for name, got in samples.items():
        wall = statistics.median(s[0] for s in got)
        peak = statistics.median(s[1] for s in got)
        row: dict[str, Any] = {
            "case": name,
            "median_s": round(wall, 3),
            "min_s": round(min(s[0] for s in got), 3),
            "peak_mb": round(peak, 1),
            "exit_code": got[0][2],
        }
        if name.startswith("tensor"):
            row["gb_per_s"] = round(size / wall / 1e9, 3)
            row["speedup_vs"] = {k: round(v / wall, 1) for k, v in MSPROBE_SECONDS.items()}
        results.append(row)
    report = {"tensor_bytes": size, "repeat": args.repeat, "cpus": os.cpu_count(), "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"tensor pair: {size / 1e9:.2f} GB ({APIS} APIs x input/output x 4 MiB per side); {args.repeat} runs each"
    )
    print(f"{'case':<20} {'median s':>9} {'min s':>7} {'GB/s':>6} {'peak MB':>8}  vs msprobe 8.3.3 / 26.2.0")
    for row in results:
        gbs = f"{row['gb_per_s']:.2f}" if "gb_per_s" in row else "-"
        vs = row.get("speedup_vs")
        versus = f"{vs['msprobe 8.3.3']}x / {vs['msprobe 26.2.0']}x faster" if vs else ""
        print(
            f"{row['case']:<20} {row['median_s']:>9.3f} {row['min_s']:>7.3f} {gbs:>6} {row['peak_mb']:>8.1f}  {versus}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
