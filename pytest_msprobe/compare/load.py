"""Find and read msprobe-format dumps: any layout, any version (8.3.3, 26.x, ours).

A dump is addressed by a ``dump.json``, a rank folder (``rank``, ``rank{R}``, ``proc{PID}``), a step folder
(holding rank folders) or a dump root (holding ``step{N}/``). :func:`discover` turns any of these into the
list of ``dump.json`` files with their step and rank; :func:`read_dump` parses one into API entries whose
inputs and outputs are flattened into rows named the way msprobe's compare names them
(``<api>.input.0``, ``<api>.input.3.0``, ``<api>.input.<kwarg>``, ``<api>.parameters.weight``,
``<api>.output.0``, ``<module>.parameters_grad.weight``).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pytest_msprobe.errors import DumpFormatError

STEP_DIR = re.compile(r"^step(\d+)$")
RANK_DIR = re.compile(r"^(?:rank(\d*)|proc(\d+))$")

INPUT, OUTPUT, PARAMETER = "input", "output", "parameter"
TENSOR, NONE, VALUE = "tensor", "none", "value"


class Leaf(NamedTuple):
    """One flattened item of an API entry: a tensor, a None, or a plain value (int, float, str...).

    A named tuple rather than a dataclass: a large dump has millions of them, and tuples build ~5x faster.
    """

    name: str  # full row name, e.g. "Functional.relu.2.forward.output.0"
    suffix: str  # the part after the API name, e.g. ".output.0"
    role: str  # INPUT, OUTPUT or PARAMETER
    kind: str  # TENSOR, NONE or VALUE
    type: str | None = None  # the dump's "type" field ("torch.Tensor", "int", ...)
    dtype: str | None = None  # "torch.float32" for tensors
    shape: tuple[int, ...] | None = None
    max: float | None = None
    min: float | None = None
    mean: float | None = None
    norm: float | None = None
    requires_grad: bool | None = None
    md5: str | None = None
    data_name: str | None = None
    value: Any = None  # plain values only

    @property
    def stats(self) -> tuple[float | None, float | None, float | None, float | None]:
        return (self.max, self.min, self.mean, self.norm)


@dataclass(frozen=True)
class ApiEntry:
    """One API or module call of a dump, in dump.json order (which is execution order)."""

    name: str
    index: int
    leaves: tuple[Leaf, ...]

    @property
    def parts(self) -> NameParts:
        return parse_name(self.name)


@dataclass(frozen=True)
class DumpLocation:
    """A dump.json found on disk, with the step and rank it belongs to (None where the path does not say)."""

    path: Path
    step: int | None
    rank: int | None
    rank_dir: str | None


@dataclass(frozen=True)
class Dump:
    """A parsed dump.json."""

    location: DumpLocation
    task: str  # "statistics" or "tensor"
    level: str | None
    has_md5: bool
    entries: tuple[ApiEntry, ...]

    @property
    def path(self) -> Path:
        return self.location.path

    @property
    def tensor_dir(self) -> Path:
        # msprobe's dump_data_dir holds the absolute path where the dump was made; the copy we read may
        # live elsewhere, so tensors are always looked up next to the dump.json being read
        return self.location.path.parent / "dump_tensor_data"


# ---------------------------------------------------------------------------------------------------- names
_API_NAME = re.compile(r"^(?P<base>.+)\.(?P<n>\d+)\.(?P<dir>forward|backward)$")
_MODULE_NAME = re.compile(r"^(?P<base>.+)\.(?P<dir>forward|backward)\.(?P<n>\d+)$")


@dataclass(frozen=True)
class NameParts:
    """An entry name split into the call's identity, its per-step call counter and its direction."""

    base: str  # "Functional.relu", "Module.layer1.BasicBlock", "Module.fc.Linear.parameters_grad"
    counter: int | None
    direction: str | None  # "forward", "backward", or None for names of another shape
    module_style: bool = False  # counter after the direction (modules) rather than before it (APIs)

    def with_direction(self, direction: str) -> str:
        """The name of the same call in the other direction (forward <-> backward)."""
        if self.counter is None:
            return f"{self.base}.{direction}"
        if self.module_style:
            return f"{self.base}.{direction}.{self.counter}"
        return f"{self.base}.{self.counter}.{direction}"


def parse_name(name: str) -> NameParts:
    """Split ``Functional.relu.2.forward`` / ``Module.fc.Linear.backward.0`` / ``...parameters_grad``."""
    if is_parameters_grad(name):
        head, _, tail = name.rpartition(".")
        if tail.isdigit():
            return NameParts(head, int(tail), "backward", module_style=True)
        return NameParts(name, None, "backward")
    if name.startswith(("Module.", "Cell.")):
        m = _MODULE_NAME.match(name)
        if m:
            return NameParts(m.group("base"), int(m.group("n")), m.group("dir"), module_style=True)
    m = _API_NAME.match(name)
    if m:
        return NameParts(m.group("base"), int(m.group("n")), m.group("dir"))
    m = _MODULE_NAME.match(name)
    if m:
        return NameParts(m.group("base"), int(m.group("n")), m.group("dir"), module_style=True)
    return NameParts(name, None, None)


# ------------------------------------------------------------------------------------------------ discovery
def discover(path: str | os.PathLike[str]) -> list[DumpLocation]:
    """Every dump.json under ``path`` (a dump.json, rank folder, step folder or dump root), sorted by step, rank."""
    p = Path(path)
    if not p.exists():
        raise DumpFormatError(p, "no such file or directory")
    if p.is_file():
        if p.suffix != ".json":
            raise DumpFormatError(p, "expected a dump.json or a dump folder")
        return [_locate(p)]
    if (p / "dump.json").is_file():
        return [_locate(p / "dump.json")]
    found = _rank_dirs(p)
    if found:
        return _number_ranks([(_step_of(p), d) for d in found])
    steps = sorted(
        ((int(m.group(1)), child) for child in _subdirs(p) if (m := STEP_DIR.match(child.name))),
        key=lambda t: t[0],
    )
    located: list[tuple[int | None, Path]] = []
    for step, step_dir in steps:
        located.extend((step, d) for d in _rank_dirs(step_dir))
    if not located:
        raise DumpFormatError(
            p,
            "no dump.json found: expected a dump.json, a rank folder (rank, rank{R}, proc{PID}), "
            "a step folder holding rank folders, or a dump root holding step{N} folders",
        )
    return _number_ranks(located)


def _subdirs(p: Path) -> list[Path]:
    try:
        return sorted(child for child in p.iterdir() if child.is_dir())
    except OSError as exc:
        raise DumpFormatError(p, f"cannot list folder ({exc.strerror or exc})") from None


def _rank_dirs(p: Path) -> list[Path]:
    return [d for d in _subdirs(p) if RANK_DIR.match(d.name) and (d / "dump.json").is_file()]


def _step_of(p: Path) -> int | None:
    m = STEP_DIR.match(p.name)
    return int(m.group(1)) if m else None


def _locate(dump_json: Path) -> DumpLocation:
    rank_dir = dump_json.parent
    if not RANK_DIR.match(rank_dir.name):
        return DumpLocation(dump_json, None, None, None)
    return _number_ranks([(_step_of(rank_dir.parent), rank_dir)])[0]


def _number_ranks(found: list[tuple[int | None, Path]]) -> list[DumpLocation]:
    """Rank numbers: R for ``rank{R}``; 0 for ``rank``; ``proc{PID}`` folders of a step numbered in PID order."""
    out: list[DumpLocation] = []
    by_step: dict[int | None, list[Path]] = {}
    for step, d in found:
        by_step.setdefault(step, []).append(d)
    for step, dirs in by_step.items():
        procs = sorted((int(m.group(2)), d) for d in dirs if (m := RANK_DIR.match(d.name)) and m.group(2))
        proc_rank = {d: i for i, (_, d) in enumerate(procs)}
        for d in dirs:
            m = RANK_DIR.match(d.name)
            assert m is not None
            rank = proc_rank[d] if m.group(2) else int(m.group(1) or 0)
            out.append(DumpLocation(d / "dump.json", step, rank, d.name))
    out.sort(key=lambda loc: (loc.step if loc.step is not None else -1, loc.rank or 0))
    return out


# ------------------------------------------------------------------------------------------------- parsing
def read_json(path: Path) -> Any:
    try:
        with open(path, "rb") as fh:
            return json.load(fh)
    except OSError as exc:
        raise DumpFormatError(path, f"cannot read ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DumpFormatError(path, f"invalid JSON ({exc})") from None


def read_dump(location: DumpLocation) -> Dump:
    """Parse a dump.json into API entries with flattened rows."""
    path = location.path
    doc = read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise DumpFormatError(path, "not a msprobe dump.json (no 'data' object)")
    task = doc.get("task") or "statistics"
    if task not in ("statistics", "tensor"):
        raise DumpFormatError(path, f"unsupported task {task!r} (expected 'statistics' or 'tensor')")
    entries = []
    has_md5 = False
    for index, (name, body) in enumerate(doc["data"].items()):
        try:
            leaves = flatten_entry(name, body)
        except (TypeError, ValueError, KeyError) as exc:
            raise DumpFormatError(path, f"malformed entry {name!r} ({exc})") from None
        has_md5 = has_md5 or any(leaf.md5 is not None for leaf in leaves)
        entries.append(ApiEntry(name, index, tuple(leaves)))
    level = doc.get("level")
    return Dump(location, task, level if isinstance(level, str) else None, has_md5, tuple(entries))


_SECTIONS = (("input_args", INPUT), ("input_kwargs", INPUT), ("input", INPUT), ("parameters", PARAMETER))


def is_parameters_grad(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] == "parameters_grad" or (len(parts) >= 2 and parts[-2] == "parameters_grad")


def flatten_entry(name: str, body: Any) -> list[Leaf]:
    """The rows of one entry, in msprobe's order: inputs, kwargs, parameters, then outputs."""
    if not isinstance(body, dict):
        raise TypeError("entry is not an object")
    out: list[Leaf] = []
    if is_parameters_grad(name):
        # {"weight": [tensor], ...}: the list index is not part of the row name (msprobe's naming)
        for key, value in body.items():
            items = value if isinstance(value, list) else [value]
            for item in items:
                _walk(item, f".{key}", OUTPUT, name, out, index_lists=False)
        return out
    for key, role in _SECTIONS:
        if key in body:
            _walk(body[key], ".input" if role == INPUT else ".parameters", role, name, out)
    if "output" in body:
        _walk(body["output"], ".output", OUTPUT, name, out)
    return out


def _walk(node: Any, suffix: str, role: str, api: str, out: list[Leaf], index_lists: bool = True) -> None:
    if node is None:
        out.append(Leaf(api + suffix, suffix, role, NONE, type="None"))
    elif isinstance(node, dict) and isinstance(node.get("type"), str):
        out.append(_leaf(node, api, suffix, role))
    elif isinstance(node, dict):
        for key, value in node.items():
            _walk(value, f"{suffix}.{key}", role, api, out, index_lists)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _walk(value, f"{suffix}.{i}" if index_lists else suffix, role, api, out, index_lists)
    elif isinstance(node, (str, int, float, bool)):
        # a bare value (e.g. the "op" or "peer" of a distributed P2POp record): a plain-value row
        out.append(Leaf(api + suffix, suffix, role, VALUE, type(node).__name__, value=node))
    else:
        raise TypeError(f"unexpected {type(node).__name__} at {api}{suffix}")


def _num(value: Any) -> float | None:
    """A statistic as a float: JSON numbers, booleans, and the strings msprobe writes for NaN/Inf."""
    kind = type(value)
    if kind is float:
        return value
    if value is None:
        return None
    if kind is int or kind is bool:
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _leaf(node: dict[str, Any], api: str, suffix: str, role: str) -> Leaf:
    get = node.get
    md5 = get("md5")
    data_name = get("data_name")
    grad = get("requires_grad")
    if "dtype" not in node or "shape" not in node:
        value = node["value"] if "value" in node else {k: v for k, v in node.items() if k != "type"}
        return Leaf(
            api + suffix,
            suffix,
            role,
            VALUE,
            get("type"),
            max=_num(get("Max")),
            min=_num(get("Min")),
            mean=_num(get("Mean")),
            norm=_num(get("Norm")),
            md5=None if md5 is None else str(md5),
            value=value,
        )
    raw_shape = node["shape"]
    if type(raw_shape) is not list or not all(type(s) is int and s >= 0 for s in raw_shape):
        raise ValueError(f"bad shape {raw_shape!r} at {api}{suffix}")
    return Leaf(
        api + suffix,
        suffix,
        role,
        TENSOR,
        get("type"),
        str(node["dtype"]),
        tuple(raw_shape),
        _num(get("Max")),
        _num(get("Min")),
        _num(get("Mean")),
        _num(get("Norm")),
        grad if type(grad) is bool else None,
        None if md5 is None else str(md5),
        data_name if type(data_name) is str and data_name else None,
    )


# --------------------------------------------------------------------------------------------- tensor files
def tensor_path(dump: Dump, data_name: str) -> Path:
    """The file of a tensor row, refusing names that leave the dump's tensor folder (``..``, absolute, symlinks)."""
    if not data_name or os.path.isabs(data_name) or data_name.startswith(("/", "\\")):
        raise DumpFormatError(
            dump.path, f"data_name {data_name!r} is not a file name inside dump_tensor_data"
        )
    parts = re.split(r"[\\/]", data_name)
    if any(part in ("..", "") for part in parts):
        raise DumpFormatError(dump.path, f"data_name {data_name!r} leaves the dump folder")
    base = dump.tensor_dir
    candidate = base / data_name
    real_base = os.path.realpath(base)
    real = os.path.realpath(candidate)
    if os.path.commonpath([real_base, real]) != real_base:
        raise DumpFormatError(dump.path, f"data_name {data_name!r} leaves the dump folder (through a link)")
    if not os.path.isfile(real):
        raise DumpFormatError(candidate, "tensor file named in dump.json is missing")
    return Path(real)


# ------------------------------------------------------------------------------------------------- stacks
def read_stack(dump_json: Path) -> dict[str, list[str]]:
    """API name -> call stack frames, from the stack.json beside a dump.json ({} if absent or unreadable)."""
    return read_stack_file(dump_json.parent / "stack.json")


def read_stack_file(path: Path) -> dict[str, list[str]]:
    """API name -> call stack frames of a stack.json ({} if absent or unreadable).

    Both layouts are read: ``{"0": [[names...], [frames...]]}`` (8.x, 26.x) and ``{name: [frames]}`` (older).
    """
    if not path.is_file():
        return {}
    try:
        doc = read_json(path)
    except DumpFormatError:
        return {}
    stacks: dict[str, list[str]] = {}
    if not isinstance(doc, dict):
        return stacks
    for key, value in doc.items():
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, list) for v in value):
            names, frames = value
            for name in names:
                if isinstance(name, str):
                    stacks[name] = [str(f) for f in frames]
        elif isinstance(value, list):
            stacks[key] = [str(f) for f in value]
    return stacks


def is_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
