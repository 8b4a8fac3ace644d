"""Where msprobe puts a dump's files: the step and rank folders, the files in each, and finding them.

    dump_path/step{N}/{rank | rank{R} | proc{PID}}/dump.json, stack.json, construct.json[, dump_tensor_data/]

``rank`` is a process outside torch.distributed, ``rank{R}`` rank R of a process group and ``proc{PID}`` the
folder some msprobe versions write instead (numbered in PID order when read). :func:`discover` turns a
dump.json, a rank folder, a step folder or a dump root into the dump.json files it holds, with their step and
rank.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pytest_msprobe.errors import DumpFormatError

DUMP_JSON = "dump.json"
STACK_JSON = "stack.json"
CONSTRUCT_JSON = "construct.json"
TENSOR_DIR = "dump_tensor_data"
TENSOR_SUFFIX = ".pt"  # a tensor file is its row name plus this, in TENSOR_DIR

STEP_DIR = re.compile(r"^step(\d+)$")
RANK_DIR = re.compile(r"^(?:rank(\d*)|proc(\d+))$")


def step_folder(step: int) -> str:
    """``step_folder(3)`` -> ``"step3"``."""
    return f"step{step}"


def rank_folder(rank: int | None) -> str:
    """``rank_folder(None)`` -> ``"rank"`` (no process group); ``rank_folder(1)`` -> ``"rank1"``."""
    return "rank" if rank is None else f"rank{rank}"


@dataclass(frozen=True)
class DumpLocation:
    """A dump.json found on disk, with the step and rank it belongs to (None where the path does not say)."""

    path: Path
    step: int | None
    rank: int | None
    rank_dir: str | None


def discover(path: str | os.PathLike[str]) -> list[DumpLocation]:
    """Every dump.json under ``path`` (a dump.json, rank folder, step folder or dump root), sorted by step, rank.

    A folder that looks like part of a dump but is not complete is unusable input, not something to skip: a
    step folder of a dump root without any rank folder, or a rank folder without its dump.json, is what an
    interrupted dump leaves behind, and comparing around it would silently check less than was asked.
    """
    p = Path(path)
    try:
        return _discover(p)
    except OSError as exc:  # a permission error while looking around (stat, listing)
        where = exc.filename if isinstance(exc.filename, str) else p
        raise DumpFormatError(where, f"cannot read ({exc.strerror or exc})") from None


def _discover(p: Path) -> list[DumpLocation]:
    if not p.exists():
        raise DumpFormatError(p, missing_reason(p))
    if p.is_file():
        if p.suffix != ".json":
            raise DumpFormatError(p, "expected a dump.json or a dump folder")
        return [_locate(p)]
    if not p.is_dir():
        raise DumpFormatError(p, "not a regular file or folder")
    if _has_dump_json(p):
        return [_locate(p / DUMP_JSON)]
    found = _rank_dirs(p)
    if found:
        return _number_ranks([(_step_of(p), d) for d in found])
    steps = sorted(
        ((int(m.group(1)), child) for child in _subdirs(p) if (m := STEP_DIR.match(child.name))),
        key=lambda t: t[0],
    )
    located: list[tuple[int | None, Path]] = []
    for step, step_dir in steps:
        ranks = _rank_dirs(step_dir)
        if not ranks:
            raise DumpFormatError(
                step_dir, "step folder holds no rank folder with a dump.json (rank, rank{R}, proc{PID})"
            )
        located.extend((step, d) for d in ranks)
    if not located:
        raise DumpFormatError(
            p,
            "no dump.json found: expected a dump.json, a rank folder (rank, rank{R}, proc{PID}), "
            "a step folder holding rank folders, or a dump root holding step{N} folders",
        )
    return _number_ranks(located)


def missing_reason(p: Path) -> str:
    """Why a path that does not exist does not: absent, a dangling link, or a loop of links."""
    if not os.path.islink(p):
        return "no such file or directory"
    try:
        os.stat(p)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symbolic link loop"
    return f"symbolic link to {os.readlink(p)!r}, which does not exist"


def _has_dump_json(folder: Path) -> bool:
    """Whether ``folder`` holds a dump.json file (a dump.json that is not a file is an error, not absent)."""
    candidate = folder / DUMP_JSON
    if candidate.is_file():
        return True
    if os.path.lexists(candidate):
        if candidate.is_dir():
            raise DumpFormatError(candidate, "is a folder, not a file")
        if not candidate.exists():
            raise DumpFormatError(candidate, missing_reason(candidate))
        raise DumpFormatError(candidate, "not a regular file")
    return False


def _subdirs(p: Path) -> list[Path]:
    try:
        return sorted(child for child in p.iterdir() if child.is_dir())
    except OSError as exc:
        raise DumpFormatError(p, f"cannot list folder ({exc.strerror or exc})") from None


def _rank_dirs(p: Path) -> list[Path]:
    found = []
    for d in _subdirs(p):
        if not RANK_DIR.match(d.name):
            continue
        if not _has_dump_json(d):
            raise DumpFormatError(d, "rank folder holds no dump.json (an interrupted dump?)")
        found.append(d)
    return found


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
            out.append(DumpLocation(d / DUMP_JSON, step, rank, d.name))
    out.sort(key=lambda loc: (loc.step if loc.step is not None else -1, loc.rank or 0))
    return out
