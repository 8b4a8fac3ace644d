"""Operators the dump launches per recorded tensor: on a GPU each is a kernel launch, the fixed cost that makes a
dumped step of many small tensors slow there; on the CPU they are counted the same way, with a dispatch counter.

One process, one model and task at a time: a training loop (the loop of ``bench/dump_overhead.py``) dumps step 3
at level L1; a ``TorchDispatchMode`` counts the aten operators of step 3 and of the undumped step 4 on the
training thread, and those of the statistics' flush wherever it runs (the writer thread, or ``stop()``). Operators
that launch nothing (views, ``detach``, ``empty``) are left out; ``item`` and the like are counted apart, as host
synchronisations. The dump's launches are the dumped step's less the undumped step's, plus the flush's; the
recorded tensors are the tensor items of the step's dump.json.

    python bench/launch_count.py                         # TinyResNet w8 and w32, resnet50; statistics and md5
    python bench/launch_count.py --models tiny --tasks statistics --top 15

The goal is at most one launch per recorded tensor on average.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dump_overhead import make_loop, model_specs, train_step

# operators that launch no kernel: they make a view or an empty tensor, or only read metadata
NO_LAUNCH = frozenset(
    [
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "detach",
        "alias",
        "as_strided",
        "slice",
        "select",
        "narrow",
        "t",
        "transpose",
        "permute",
        "expand",
        "unsqueeze",
        "squeeze",
        "split",
        "split_with_sizes",
        "unbind",
        "view_as_real",
        "view_as_complex",
        "lift_fresh",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "is_nonzero",
        "sym_size",
        "sym_stride",
        "sym_numel",
    ]
)
SYNCS = frozenset({"_local_scalar_dense"})  # .item() and the conversions that call it


class Counting(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active on a thread."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def launches(ops: Counter[str]) -> int:
    return sum(n for name, n in ops.items() if name not in NO_LAUNCH and name not in SYNCS)


def _count_flushes(into: Counting) -> Callable[[], None]:
    """Count the statistics' flush wherever it runs; returns the undo."""
    from pytest_msprobe.dump.stats import StatEngine

    original = StatEngine.flush
    inside = threading.local()

    def flush(self: StatEngine) -> None:
        if getattr(inside, "on", False):
            return original(self)
        mode = Counting()
        inside.on = True
        try:
            with mode:
                original(self)
        finally:
            inside.on = False
            into.ops.update(mode.ops)

    StatEngine.flush = flush  # type: ignore[method-assign]
    return lambda: setattr(StatEngine, "flush", original)


def tensor_items(value: Any) -> int:
    if isinstance(value, dict):
        if value.get("type") == "torch.Tensor":
            return 1
        return sum(tensor_items(v) for v in value.values())
    if isinstance(value, list):
        return sum(tensor_items(v) for v in value)
    return 0


def measure(model: str, task: str, device: str = "cpu") -> dict[str, Any]:
    from pytest_msprobe import PrecisionDebugger

    loop = make_loop(model_specs()[model], 6, torch.device(device))
    with tempfile.TemporaryDirectory() as scratch:
        debugger = PrecisionDebugger(dump_path=scratch, task=task, level="L1", step=[3])
        for step in range(3):
            train_step(loop, step, debugger, None, False)
        flushed = Counting()
        undo = _count_flushes(flushed)
        try:
            dumped, plain = Counting(), Counting()
            with dumped:
                train_step(loop, 3, debugger, None, False)
            debugger.wait()
            with plain:
                train_step(loop, 4, debugger, None, False)
        finally:
            undo()
        debugger.close()
        (dump_json,) = Path(scratch).rglob("step3/**/dump.json")
        tensors = tensor_items(json.loads(dump_json.read_text())["data"])
    own = dumped.ops.copy()
    own.subtract(plain.ops)
    own.update(flushed.ops)
    total = launches(+own)
    return {
        "model": model_specs()[model].name,
        "task": task,
        "tensors": tensors,
        "launches": total,
        "per_tensor": round(total / tensors, 2),
        "syncs": sum(own[name] for name in SYNCS),
        "top": {k: v for k, v in (+own).most_common() if k not in NO_LAUNCH},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["tiny", "large", "resnet50"], choices=list(model_specs())
    )
    parser.add_argument("--tasks", nargs="+", default=["statistics", "md5"], choices=["statistics", "md5"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--top", type=int, default=6, help="operators listed per row")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    results = [measure(m, t, args.device) for m in args.models for t in args.tasks]
    print("| model | task | recorded tensors | launches | per tensor | item() | most launched |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        top = ", ".join(f"{k} {v}" for k, v in list(r["top"].items())[: args.top])
        print(
            f"| {r['model']} | {r['task']} L1 | {r['tensors']} | {r['launches']} | {r['per_tensor']} | {r['syncs']} | {top} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
