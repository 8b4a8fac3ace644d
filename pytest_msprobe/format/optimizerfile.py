"""The optimizer's updates of a dumped step, recorded beside msprobe's files: ``optimizer.json`` in the folder of
its dump.json.

torch's optimizers make other calls on other devices (one ``Tensor.*`` op per parameter on the CPU,
``torch._foreach_*`` over lists on CUDA, one fused kernel with ``fused=True``), so a compare across devices cannot
pair their calls. This sidecar holds what every implementation does alike: for each ``optimizer.step()`` run in
the step, each parameter's update as a record in msprobe's shape, named after the parameter::

    {"format": "pytest-msprobe optimizer", "version": 1,
     "steps": [{"class": "SGD", "implementation": "foreach", "position": 406,
                "calls": ["Torch._foreach_add.0.forward", "Torch._foreach_add_.0.forward"],
                "stack": ["File .../train.py, line 40, in train, \\n optimizer.step()", ...],
                "records": {"Optimizer.conv1.weight.0.forward": {
                    "input_kwargs": {"param": {...the weight before...}, "grad": {...}},
                    "output": {"param": {...the weight after...}, "momentum_buffer": {...}}}, ...}}]}

``position`` is the number of dump.json records made before the step began, ``calls`` the dump.json records made
inside it, ``implementation`` one of :data:`IMPLEMENTATIONS` (as torch resolved it), ``stack`` the frames of the
``optimizer.step()`` call (innermost first, as stack.json has them). Tensor items are msprobe's (statistics,
``md5``, ``data_name`` of a file in ``dump_tensor_data``). This module reads and writes the file and checks its
shape; it knows nothing of torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.files import read_sidecar, write_text

OPTIMIZER_JSON = "optimizer.json"
FORMAT = "pytest-msprobe optimizer"
VERSION = 1
UPDATE_PREFIX = "Optimizer"  # the records' names: Optimizer.{parameter}.{n}.forward
SINGLE_TENSOR, FOREACH, FUSED = "single-tensor", "foreach", "fused"
IMPLEMENTATIONS = (SINGLE_TENSOR, FOREACH, FUSED)


def update_name(parameter: str, count: int) -> str:
    """``update_name("conv1.weight", 0)`` -> ``"Optimizer.conv1.weight.0.forward"``."""
    return f"{UPDATE_PREFIX}.{parameter}.{count}.forward"


def is_update(name: str) -> bool:
    """Whether a record name is a parameter's update (``Optimizer.{parameter}.{n}.forward``)."""
    return name.startswith(UPDATE_PREFIX + ".")


@dataclass(frozen=True)
class OptimizerStep:
    """One ``optimizer.step()`` of a dumped step, as the sidecar holds it."""

    cls: str
    implementation: str
    position: int
    calls: tuple[str, ...]
    stack: tuple[str, ...]
    records: Mapping[str, Any]  # update name -> record in msprobe's shape

    def to_dict(self) -> dict[str, Any]:
        return {
            "class": self.cls,
            "implementation": self.implementation,
            "position": self.position,
            "calls": list(self.calls),
            "stack": list(self.stack),
            "records": dict(self.records),
        }


def optimizer_path(dump_json: Path) -> Path:
    """The sidecar beside a dump.json (or in a rank folder)."""
    folder = dump_json if dump_json.is_dir() else dump_json.parent
    return folder / OPTIMIZER_JSON


# one encoder for every record; NaN and the infinities as msprobe's dump.json has them
_encode = json.JSONEncoder(ensure_ascii=False, check_circular=False).encode


def write_optimizer(folder: Path, steps: Sequence[OptimizerStep]) -> Path:
    """Write ``folder/optimizer.json`` atomically, one record per line."""
    path = folder / OPTIMIZER_JSON
    parts = []
    for step in steps:
        doc = step.to_dict()
        records = doc.pop("records")
        head = ", ".join(f"{_encode(k)}: {_encode(v)}" for k, v in doc.items())
        body = ",\n".join(f"    {_encode(k)}: {_encode(v)}" for k, v in records.items())
        parts.append(
            f'  {{{head},\n   "records": {{\n{body}\n   }}}}' if body else f'  {{{head}, "records": {{}}}}'
        )
    steps_text = "[\n" + ",\n".join(parts) + "\n ]" if parts else "[]"
    write_text(
        path, f'{{\n "format": {_encode(FORMAT)},\n "version": {VERSION},\n "steps": {steps_text}\n}}\n'
    )
    return path


def read_optimizer(dump_json: Path) -> tuple[OptimizerStep, ...] | None:
    """The optimizer steps recorded beside a dump.json, None when it has no sidecar (a plain msprobe dump, or one
    of ours from before it was written). A file that is there but broken raises DumpFormatError naming it."""
    path = optimizer_path(dump_json)
    doc = read_sidecar(path, FORMAT, "optimizer record", VERSION)
    if doc is None:
        return None
    steps = doc.get("steps")
    if not isinstance(steps, list):
        raise DumpFormatError(path, "'steps' must be a list")
    return tuple(_step(path, i, item) for i, item in enumerate(steps))


def _step(path: Path, index: int, item: Any) -> OptimizerStep:
    where = f"steps[{index}]"
    if not isinstance(item, dict):
        raise DumpFormatError(path, f"{where} must be an object")
    cls, implementation, position = item.get("class"), item.get("implementation"), item.get("position")
    calls, stack, records = item.get("calls", []), item.get("stack", []), item.get("records", {})
    if not isinstance(cls, str):
        raise DumpFormatError(path, f"{where}: 'class' must be a string")
    if implementation not in IMPLEMENTATIONS:
        raise DumpFormatError(
            path, f"{where}: 'implementation' {implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}"
        )
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise DumpFormatError(path, f"{where}: 'position' must be a whole number >= 0, got {position!r}")
    if not isinstance(calls, list) or not all(isinstance(c, str) for c in calls):
        raise DumpFormatError(path, f"{where}: 'calls' must be a list of record names")
    if not isinstance(stack, list) or not all(isinstance(f, str) for f in stack):
        raise DumpFormatError(path, f"{where}: 'stack' must be a list of frames")
    if not isinstance(records, dict):
        raise DumpFormatError(path, f"{where}: 'records' must be an object of records")
    for name, record in records.items():
        if not is_update(name) or not isinstance(record, dict):
            raise DumpFormatError(
                path, f"{where}: {name!r} is not an update record ({UPDATE_PREFIX}.<parameter>...)"
            )
    return OptimizerStep(cls, implementation, position, tuple(calls), tuple(stack), records)
