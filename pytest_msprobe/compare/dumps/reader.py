"""Read a dump.json into records: msprobe's format of any version (8.3.3, 26.x, ours).

:func:`read_dump` parses one dump.json (found by :func:`pytest_msprobe.format.layout.discover`) into API
entries whose inputs and outputs are flattened into rows named the way msprobe's compare names them
(``<api>.input.0``, ``<api>.input.3.0``, ``<api>.input.<kwarg>``, ``<api>.parameters.weight``,
``<api>.output.0``, ``<module>.parameters_grad.weight``); every record is checked on the way.
"""

from __future__ import annotations

import errno
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pytest_msprobe.errors import DumpFormatError, DumpReadError
from pytest_msprobe.format.files import read_json
from pytest_msprobe.format.layout import STACK_JSON, TENSOR_DIR, DumpLocation, missing_reason
from pytest_msprobe.format.names import NameParts, is_parameters_grad, parse_name

INPUT, OUTPUT, PARAMETER = "input", "output", "parameter"
OVERFLOW_CHECK = "overflow_check"  # msprobe's task that writes only the calls whose outputs hold inf/nan
TASKS = ("statistics", "tensor", OVERFLOW_CHECK)
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
class Dump:
    """A parsed dump.json."""

    location: DumpLocation
    task: str  # "statistics", "tensor" or "overflow_check"
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
        return self.location.path.parent / TENSOR_DIR


# ------------------------------------------------------------------------------------------------- parsing
# Past these limits a record describes no tensor a device could hold, or no call's arguments: it is refused
# rather than carried into the compare.
MAX_DIMS = 32  # CUDA kernels take at most 25 dimensions; real models' tensors have far fewer
MAX_TENSOR_BYTES = 1 << 40  # 1 TiB, more than the memory of any accelerator
MAX_DEPTH = 64  # nesting of one call's arguments (lists of lists of ...)

_JSON_KINDS = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}
# text that stands for "no value" where a statistic should be: read as a missing statistic, like null
_NO_VALUE = frozenset({"", "n/a", "na", "none", "null"})


def json_kind(value: Any) -> str:
    """``an object``, ``an array``, ... : how a JSON value is named in messages."""
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_document(path: Path, doc: Any) -> tuple[dict[str, Any], str, str | None]:
    """The ``data``, task and level of a parsed dump.json, or the error that makes it unusable."""
    if not isinstance(doc, dict):
        raise DumpFormatError(path, f"top level is {json_kind(doc)}, not an object: not a msprobe dump.json")
    if "data" not in doc:
        raise DumpFormatError(path, "no 'data' key: not a msprobe dump.json")
    data = doc["data"]
    if not isinstance(data, dict):
        raise DumpFormatError(path, f"'data' is {json_kind(data)}, expected an object of API calls")
    task = doc.get("task") or "statistics"
    if task not in TASKS:
        raise DumpFormatError(
            path, f"unsupported task {_short(task)} (expected 'statistics', 'tensor' or 'overflow_check')"
        )
    if not data and task != OVERFLOW_CHECK:
        # nothing to compare is not a pass: a dump that recorded no call cannot vouch for any (an overflow_check
        # dump holds the overflowing calls only: empty, it says none overflowed)
        raise DumpFormatError(path, "'data' is empty: no API call was recorded")
    level = doc.get("level")
    return data, task, level if isinstance(level, str) else None


def read_dump(location: DumpLocation) -> Dump:
    """Parse a dump.json into API entries with flattened rows."""
    path = location.path
    data, task, level = check_document(path, read_json(path))
    entries = []
    has_md5 = False
    for index, (name, body) in enumerate(data.items()):
        try:
            leaves = flatten_entry(name, body)
        except (TypeError, ValueError, KeyError, RecursionError) as exc:
            raise DumpFormatError(path, malformed(name, exc)) from None
        has_md5 = has_md5 or any(leaf.md5 is not None for leaf in leaves)
        entries.append(ApiEntry(name, index, tuple(leaves)))
    return Dump(location, task, level, has_md5, tuple(entries))


def malformed(name: str, exc: BaseException) -> str:
    """The problem of a malformed entry, for :class:`DumpFormatError`."""
    if isinstance(exc, RecursionError):
        return f"{name}: arguments nested too deeply"
    return str(exc) if isinstance(exc, ValueError) else f"{name}: malformed entry ({exc})"


_SECTIONS = (("input_args", INPUT), ("input_kwargs", INPUT), ("input", INPUT), ("parameters", PARAMETER))


def flatten_entry(name: str, body: Any) -> list[Leaf]:
    """The rows of one entry, in msprobe's order: inputs, kwargs, parameters, then outputs.

    A malformed entry raises ValueError whose message starts with the entry's or the row's name.
    """
    if not isinstance(body, dict):
        raise ValueError(f"{name}: entry is {json_kind(body)}, not an object")
    out: list[Leaf] = []
    if is_parameters_grad(name):
        # {"weight": [tensor], ...}: the list index is not part of the row name (msprobe's naming)
        for key, value in body.items():
            items = value if isinstance(value, list) else [value]
            for item in items:
                _walk(item, f".{key}", OUTPUT, name, out, False, 1)
        return out
    for key, role in _SECTIONS:
        if key in body:
            _walk(body[key], ".input" if role == INPUT else ".parameters", role, name, out)
    if "output" in body:
        _walk(body["output"], ".output", OUTPUT, name, out)
    return out


def _walk(
    node: Any, suffix: str, role: str, api: str, out: list[Leaf], index_lists: bool = True, depth: int = 0
) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"{api}{suffix}: arguments nested more than {MAX_DEPTH} levels deep")
    if node is None:
        out.append(Leaf(api + suffix, suffix, role, NONE, type="None"))
    elif isinstance(node, dict) and isinstance(node.get("type"), str):
        out.append(_leaf(node, api, suffix, role))
    elif isinstance(node, dict):
        for key, value in node.items():
            _walk(value, f"{suffix}.{key}", role, api, out, index_lists, depth + 1)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _walk(value, f"{suffix}.{i}" if index_lists else suffix, role, api, out, index_lists, depth + 1)
    elif isinstance(node, (str, int, float, bool)):
        # a bare value (e.g. the "op" or "peer" of a distributed P2POp record): a plain-value row
        out.append(Leaf(api + suffix, suffix, role, VALUE, type(node).__name__, value=node))
    else:
        raise ValueError(f"{api}{suffix}: unexpected {type(node).__name__}")


def _num(value: Any, key: str) -> float | None:
    """A statistic as a float: JSON numbers, booleans, and the strings msprobe writes for NaN/Inf."""
    kind = type(value)
    if kind is float:
        return value
    if value is None:
        return None
    try:
        if kind is int or kind is bool:
            return float(value)
        if kind is str:
            try:
                return float(value)
            except ValueError:
                if value.strip().lower() in _NO_VALUE:
                    return None
    except OverflowError:
        raise ValueError(f"{key} {_short(value)} is out of range") from None
    raise ValueError(f"{key} is {_short(value)}, not a number")


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named like ``torch.float32`` (1 when the name does not say)."""
    bits = re.search(r"\d+", dtype.rsplit(".", 1)[-1])
    return max(1, int(bits.group()) // 8) if bits else 1


def record(
    node: dict[str, Any],
) -> tuple[str | None, tuple[int, ...] | None, tuple[float | None, ...], str | None]:
    """Check one record of a dump.json (a dict with a ``type``): its dtype and shape (None for a record that
    is not a tensor), its Max, Min, Mean and Norm, and its data_name. A malformed record raises ValueError."""
    get = node.get
    stats = (
        _num(get("Max"), "Max"),
        _num(get("Min"), "Min"),
        _num(get("Mean"), "Mean"),
        _num(get("Norm"), "Norm"),
    )
    data_name = get("data_name")
    if data_name is not None and type(data_name) is not str:
        raise ValueError(f"data_name {_short(data_name)} is not a file name")
    has_dtype, has_shape = "dtype" in node, "shape" in node
    if not (has_dtype and has_shape):
        if has_dtype or has_shape or get("type") == "torch.Tensor":
            raise ValueError(f"tensor record has no '{'shape' if has_dtype else 'dtype'}'")
        return None, None, stats, data_name
    dtype, shape = node["dtype"], node["shape"]
    if type(dtype) is not str:
        raise ValueError(f"dtype {_short(dtype)} is not a string")
    if type(shape) is not list:
        raise ValueError(f"shape {_short(shape)} is not a list of sizes")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"shape has {len(shape)} dimensions (at most {MAX_DIMS})")
    numel = 1
    for size in shape:
        if type(size) is not int:
            raise ValueError(f"shape {_short(shape)} has a size that is not a whole number: {_short(size)}")
        if size < 0:
            raise ValueError(f"shape {_short(shape)} has a negative size")
        numel *= size
    if numel * _itemsize(dtype) > MAX_TENSOR_BYTES:
        raise ValueError(
            f"shape {_short(shape)} of {dtype} holds {numel:.3g} elements, more than 1 TiB: no device holds it"
        )
    return dtype, tuple(shape), stats, data_name


def _leaf(node: dict[str, Any], api: str, suffix: str, role: str) -> Leaf:
    try:
        dtype, shape, stats, data_name = record(node)
    except ValueError as exc:
        raise ValueError(f"{api}{suffix}: {exc}") from None
    get = node.get
    md5 = get("md5")
    if shape is None:
        value = node["value"] if "value" in node else {k: v for k, v in node.items() if k != "type"}
        return Leaf(
            api + suffix,
            suffix,
            role,
            VALUE,
            get("type"),
            max=stats[0],
            min=stats[1],
            mean=stats[2],
            norm=stats[3],
            md5=None if md5 is None else str(md5),
            value=value,
        )
    grad = get("requires_grad")
    return Leaf(
        api + suffix,
        suffix,
        role,
        TENSOR,
        get("type"),
        dtype,
        shape,
        stats[0],
        stats[1],
        stats[2],
        stats[3],
        grad if type(grad) is bool else None,
        None if md5 is None else str(md5),
        data_name or None,
    )


# --------------------------------------------------------------------------------------------- tensor files
def tensor_path(dump: Dump, data_name: str) -> Path:
    """The file of a tensor row, refusing names that leave the dump's tensor folder (``..``, absolute, links).

    The file must be a regular file inside ``dump_tensor_data`` of the folder holding the dump.json, once every
    link is resolved: a link (of the file, or of ``dump_tensor_data`` itself) to anywhere else is refused, so
    a hostile dump cannot have the compare read ``/dev/zero``, a FIFO or a file outside the dump.
    """
    if not data_name or "\0" in data_name or os.path.isabs(data_name) or data_name.startswith(("/", "\\")):
        raise DumpFormatError(dump.path, f"data_name {data_name!r} is not a file name inside {TENSOR_DIR}")
    parts = re.split(r"[\\/]", data_name)
    if any(part in ("..", "") for part in parts):
        raise DumpFormatError(dump.path, f"data_name {data_name!r} leaves the dump folder")
    candidate = dump.tensor_dir / data_name
    if not os.path.lexists(candidate):
        raise DumpFormatError(candidate, "tensor file named in dump.json is missing")
    try:
        os.stat(candidate)  # follows every link: a loop or a dangling link fails here
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DumpFormatError(candidate, "symbolic link loop") from None
        if exc.errno == errno.ENOENT:
            raise DumpFormatError(candidate, missing_reason(candidate)) from None
        raise DumpFormatError(candidate, f"cannot read ({exc.strerror or exc})") from None
    real = os.path.realpath(candidate)
    allowed = os.path.join(os.path.realpath(dump.path.parent), TENSOR_DIR)
    if os.path.commonpath([allowed, real]) != allowed:
        raise DumpFormatError(dump.path, f"data_name {data_name!r} leaves the dump folder (through a link)")
    if os.path.isdir(real):
        raise DumpFormatError(candidate, "is a folder, not a tensor file")
    if not os.path.isfile(real):
        raise DumpFormatError(candidate, "not a regular file")
    return Path(real)


# ------------------------------------------------------------------------------------------------- stacks
def read_stack(dump_json: Path) -> dict[str, list[str]]:
    """API name -> call stack frames, from the stack.json beside a dump.json ({} if absent or unreadable)."""
    return read_stack_file(dump_json.parent / STACK_JSON)


def read_helper_json(path: Path) -> Any:
    """A JSON file that only helps a compare (stack.json, construct.json): its document, None where it is absent
    or unusable (a compare does not fail for it). A file the system could not read this time
    (:class:`DumpReadError`) is neither: it raises, since the compare would read it another time."""
    if not path.is_file():
        return None
    try:
        return read_json(path)
    except DumpReadError:
        raise
    except DumpFormatError:
        return None


def read_stack_file(path: Path) -> dict[str, list[str]]:
    """API name -> call stack frames of a stack.json ({} if absent or unreadable).

    Both layouts are read: ``{"0": [[names...], [frames...]]}`` (8.x, 26.x) and ``{name: [frames]}`` (older).
    """
    doc = read_helper_json(path)
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
