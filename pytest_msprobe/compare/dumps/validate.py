"""Check a dump without comparing it: :func:`validate`.

The pytest plugin runs it on a test's baseline before the test body, so that an unusable baseline is an ERROR
of the test's setup rather than a failure after minutes of training; it must therefore be cheap. It walks
every dump.json (and our sidecars beside it: checklist.json, optimizer.json) with the same record checks as
:func:`~pytest_msprobe.compare.dumps.reader.read_dump` but builds no rows (about half the cost), and opens every
referenced tensor file only as far as its header (the pickle of a
torch archive, the header of a .npy): never its values.

It raises exactly the :class:`~pytest_msprobe.errors.DumpFormatError` a compare of the dump would raise for
the same problem: on the first malformed entry it asks the compare's own parser for the message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pytest_msprobe.compare.dumps.reader import (
    MAX_DEPTH,
    Dump,
    check_document,
    flatten_entry,
    malformed,
    record,
    tensor_path,
)
from pytest_msprobe.compare.dumps.tensors import open_tensor
from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.checklistfile import read_checklist
from pytest_msprobe.format.files import read_json
from pytest_msprobe.format.layout import DumpLocation, discover
from pytest_msprobe.format.names import is_parameters_grad
from pytest_msprobe.format.optimizerfile import optimizer_path, read_optimizer

# the keys of an entry whose values are rows (as flatten_entry reads them)
_ROW_KEYS = ("input_args", "input_kwargs", "input", "parameters", "output")

_Tensor = tuple[str, str, tuple[int, ...]]  # data_name, dtype, shape


@dataclass(frozen=True)
class DumpHeader:
    """What one dump.json says it holds: its task and level, and whether its records carry md5 CRCs."""

    location: DumpLocation
    task: str
    level: str | None
    md5: bool


@dataclass(frozen=True)
class DumpCheck:
    """What :func:`validate` checked: every dump.json found, the API calls they hold, the tensor files opened."""

    locations: tuple[DumpLocation, ...]
    calls: int
    tensor_files: int
    headers: tuple[DumpHeader, ...] = ()


def validate(path: str | os.PathLike[str]) -> DumpCheck:
    """Check that ``path`` (a dump.json, rank folder, step folder or dump root) is a usable dump.

    Every dump.json must parse and be well formed; every tensor file it names must be a regular file inside
    the dump's ``dump_tensor_data``, open with the safe reader, and hold the dtype and shape dump.json says.
    Raises :class:`DumpFormatError` naming the file and the problem.

        >>> validate("baselines/test_model/test_train")        # doctest: +SKIP
        DumpCheck(locations=(...), calls=1778, tensor_files=0)
    """
    locations = discover(path)
    calls = files = 0
    headers = []
    for location in locations:
        data, task, level = check_document(location.path, read_json(location.path))
        calls += len(data)
        tensors: list[_Tensor] = []
        md5: list[bool] = []
        for name, body in data.items():
            try:
                _scan_entry(name, body, tensors, md5)
            except (TypeError, ValueError, KeyError, RecursionError) as exc:
                raise DumpFormatError(location.path, _problem(name, body, exc)) from None
        read_checklist(location.path.parent)  # our sidecars, when there: broken is unusable too
        for step in read_optimizer(location.path) or ():
            for name, body in step.records.items():  # the updates' records and their tensor files
                try:
                    _scan_entry(name, body, tensors, [])
                except (TypeError, ValueError, KeyError, RecursionError) as exc:
                    raise DumpFormatError(optimizer_path(location.path), _problem(name, body, exc)) from None
        headers.append(DumpHeader(location, task, level, bool(md5)))
        if tensors:
            dump = Dump(location, task, level, False, ())
            for data_name, dtype, shape in tensors:
                open_tensor(tensor_path(dump, data_name), dtype, shape)
            files += len(tensors)
    return DumpCheck(tuple(locations), calls, files, tuple(headers))


def _problem(name: str, body: Any, exc: BaseException) -> str:
    """The message the compare's parser gives for this entry (the same error, word for word)."""
    try:
        flatten_entry(name, body)
    except (TypeError, ValueError, KeyError, RecursionError) as canonical:
        return malformed(name, canonical)
    return malformed(name, exc)


def _scan_entry(name: str, body: Any, tensors: list[_Tensor], md5: list[bool]) -> None:
    """:func:`~pytest_msprobe.compare.dumps.reader.flatten_entry`'s walk, checking records and building no rows
    (``md5`` gets an item when a record carries a CRC)."""
    if type(body) is not dict:
        raise ValueError(f"{name}: entry is not an object")
    if is_parameters_grad(name):
        for value in body.values():
            for item in value if type(value) is list else [value]:
                _scan(item, 1, tensors, md5)
        return
    for key in _ROW_KEYS:
        if key in body:
            _scan(body[key], 0, tensors, md5)


def _scan(node: Any, depth: int, tensors: list[_Tensor], md5: list[bool]) -> None:
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    kind = type(node)
    if kind is dict:
        if type(node.get("type")) is str:
            dtype, shape, _, data_name = record(node)
            if shape is not None and data_name:
                assert dtype is not None
                tensors.append((data_name, dtype, shape))
            if not md5 and "md5" in node:
                md5.append(True)
            return
        for value in node.values():
            _scan(value, depth + 1, tensors, md5)
    elif kind is list:
        for value in node:
            _scan(value, depth + 1, tensors, md5)
