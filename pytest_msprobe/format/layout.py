"""Where msprobe puts a dump's files: the step and rank folders and the files in each.

    dump_path/step{N}/{rank | rank{R} | proc{PID}}/dump.json, stack.json, construct.json[, dump_tensor_data/]

``rank`` is a process outside torch.distributed, ``rank{R}`` rank R of a process group and ``proc{PID}`` the
folder some msprobe versions write instead (numbered in PID order when read).
"""

from __future__ import annotations

import re

DUMP_JSON = "dump.json"
STACK_JSON = "stack.json"
CONSTRUCT_JSON = "construct.json"
TENSOR_DIR = "dump_tensor_data"

STEP_DIR = re.compile(r"^step(\d+)$")
RANK_DIR = re.compile(r"^(?:rank(\d*)|proc(\d+))$")


def step_folder(step: int) -> str:
    """``step_folder(3)`` -> ``"step3"``."""
    return f"step{step}"


def rank_folder(rank: int | None) -> str:
    """``rank_folder(None)`` -> ``"rank"`` (no process group); ``rank_folder(1)`` -> ``"rank1"``."""
    return "rank" if rank is None else f"rank{rank}"
