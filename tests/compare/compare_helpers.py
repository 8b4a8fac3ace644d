"""Helpers of the compare tests: where msprobe's real dumps are, and builders of synthetic dumps.

Real dumps (``tests/data/msprobe``): ``bench`` is a clean run, ``npu`` the same run with 1e-3 * N(0, 1) added
to the output of the third ``F.relu`` call (``Functional.relu.2.forward``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data" / "msprobe"
VERSIONS = ("8.3.3", "26.2.0")


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """``seed_all(seed, mode=True)`` for the block, its process-wide switches put back after it for the tests
    that follow (deterministic algorithms, PYTHONHASHSEED)."""
    import torch

    from pytest_msprobe import seed_all

    deterministic, hashseed = torch.are_deterministic_algorithms_enabled(), os.environ.get("PYTHONHASHSEED")
    try:
        seed_all(seed, mode=True)
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        if hashseed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = hashseed


def dump_dir(version: str, side: str, kind: str, step: int | None = None) -> Path:
    """``.../msprobe-<version>/dumps/<side>/<kind>[/step<N>]``."""
    root = DATA / f"msprobe-{version}" / "dumps" / side / kind
    return root if step is None else root / f"step{step}"


def rank_dir(version: str, side: str, kind: str, step: int) -> Path:
    (only,) = [d for d in dump_dir(version, side, kind, step).iterdir() if d.is_dir()]
    return only


# ------------------------------------------------------------------------------------------- synthetic dumps
def tensor(
    shape: list[int],
    lo: float,
    hi: float,
    mean: float,
    norm: float,
    dtype: str = "torch.float32",
    **extra: Any,
) -> dict[str, Any]:
    """A tensor item of a dump.json."""
    return {
        "type": "torch.Tensor",
        "dtype": dtype,
        "shape": shape,
        "Max": hi,
        "Min": lo,
        "Mean": mean,
        "Norm": norm,
        "requires_grad": extra.pop("requires_grad", False),
        **extra,
    }


def write_dump(folder: Path, data: dict[str, Any], task: str = "statistics", level: str = "L1") -> Path:
    """Write ``folder/dump.json`` (and an empty stack.json / construct.json) and return the dump.json path."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"task": task, "level": level, "framework": "pytorch", "dump_data_dir": None, "data": data}
    (folder / "dump.json").write_text(json.dumps(doc, indent=1))
    (folder / "stack.json").write_text("{}")
    (folder / "construct.json").write_text("{}")
    return folder / "dump.json"


def load_data(dump_json: Path) -> dict[str, Any]:
    return json.loads(dump_json.read_text())


def copy_dump(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _walk_tensors(node: Any, fn: Callable[[dict[str, Any]], None]) -> None:
    if isinstance(node, dict) and node.get("type") == "torch.Tensor":
        fn(node)
    elif isinstance(node, dict):
        for value in node.values():
            _walk_tensors(value, fn)
    elif isinstance(node, list):
        for value in node:
            _walk_tensors(value, fn)


def perturb_statistics(dump_json: Path, rel: float = 1e-6, seed: int = 0) -> int:
    """Multiply every float statistic by (1 + rel * N(0, 1)); move near-zero means by a similar relative
    amount of the tensor's range (and flip their sign): the noise of a clean rerun on another device.
    Returns how many near-zero means were moved."""
    rng = random.Random(seed)
    doc = load_data(dump_json)
    moved = 0

    def perturb(item: dict[str, Any]) -> None:
        nonlocal moved
        if not str(item.get("dtype", "")).startswith(("torch.float", "torch.bfloat")):
            return
        span = max(abs(item["Max"]), abs(item["Min"]))
        for key in ("Max", "Min", "Mean", "Norm"):
            value = item[key]
            if isinstance(value, float) and math.isfinite(value):
                item[key] = value * (1 + rel * rng.gauss(0, 1))
        if span and abs(item["Mean"]) < 1e-6 * span:
            item["Mean"] = -item["Mean"] + rel * span * rng.gauss(0, 1)
            moved += 1

    _walk_tensors(doc["data"], perturb)
    dump_json.write_text(json.dumps(doc, indent=1))
    return moved


def _renumber(name: str, base: str, shift_from: int, by: int) -> str:
    """``Functional.relu.3.forward`` -> ``Functional.relu.4.forward`` when its counter is >= shift_from."""
    prefix = base + "."
    if not name.startswith(prefix):
        return name
    counter, _, rest = name[len(prefix) :].partition(".")
    if counter.isdigit() and int(counter) >= shift_from and rest in ("forward", "backward"):
        return f"{base}.{int(counter) + by}.{rest}"
    return name


def insert_call(dump_json: Path, base: str, after: int, before: bool = False) -> tuple[str, str]:
    """Insert one extra call of ``base`` next to call ``after`` (forward and backward), renumbering every
    later call of ``base``, as an extra ``x = F.relu(x)`` in the model would. The extra call takes the output
    of call ``after`` and returns it unchanged (relu is idempotent). It goes right after that call, or with
    ``before`` right before it (then it is the one numbered ``after``). Returns the inserted names."""
    doc = load_data(dump_json)
    data = doc["data"]
    number = after if before else after + 1
    new_fwd, new_bwd = f"{base}.{number}.forward", f"{base}.{number}.backward"
    src_fwd, src_bwd = data[f"{base}.{after}.forward"], data.get(f"{base}.{after}.backward")
    extra_fwd = {
        "input_args": copy.deepcopy(src_fwd["output"]),
        "input_kwargs": {},
        "output": copy.deepcopy(src_fwd["output"]),
    }
    extra_bwd = None
    if src_bwd is not None:
        extra_bwd = {"input": copy.deepcopy(src_bwd["input"]), "output": copy.deepcopy(src_bwd["input"])}
    out: dict[str, Any] = {}
    for name, entry in data.items():
        renamed = _renumber(name, base, number, 1)
        # backward runs in reverse order: an extra call after this one has its backward before this one's
        if name == f"{base}.{after}.forward" and before:
            out[new_fwd] = extra_fwd
        if name == f"{base}.{after}.backward" and extra_bwd is not None and not before:
            out[new_bwd] = extra_bwd
        out[renamed] = entry
        if name == f"{base}.{after}.forward" and not before:
            out[new_fwd] = extra_fwd
        if name == f"{base}.{after}.backward" and extra_bwd is not None and before:
            out[new_bwd] = extra_bwd
    doc["data"] = out
    dump_json.write_text(json.dumps(doc, indent=1))
    return new_fwd, new_bwd
