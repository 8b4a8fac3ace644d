"""Reading a dump: its records (dump.json), tensor files, stacks, module tree (construct.json) and
optimizer updates, and the check of a dump without comparing it (:func:`validate`)."""

from __future__ import annotations

from pytest_msprobe.compare.dumps.modules import (
    OPTIMIZER_MODULE,
    OUTSIDE_MODULES,
    UNKNOWN_MODULE,
    Modules,
    place_calls,
)
from pytest_msprobe.compare.dumps.optimizer import PARAM_IN, plan_updates
from pytest_msprobe.compare.dumps.reader import (
    INPUT,
    NONE,
    OUTPUT,
    PARAMETER,
    TENSOR,
    VALUE,
    ApiEntry,
    Dump,
    Leaf,
    read_dump,
    read_stack,
    read_stack_file,
    tensor_path,
)
from pytest_msprobe.compare.dumps.tensors import open_tensor
from pytest_msprobe.compare.dumps.validate import DumpCheck, validate

__all__ = [
    "INPUT",
    "NONE",
    "OPTIMIZER_MODULE",
    "OUTPUT",
    "OUTSIDE_MODULES",
    "PARAMETER",
    "PARAM_IN",
    "TENSOR",
    "UNKNOWN_MODULE",
    "VALUE",
    "ApiEntry",
    "Dump",
    "DumpCheck",
    "Leaf",
    "Modules",
    "open_tensor",
    "place_calls",
    "plan_updates",
    "read_dump",
    "read_stack",
    "read_stack_file",
    "tensor_path",
    "validate",
]
