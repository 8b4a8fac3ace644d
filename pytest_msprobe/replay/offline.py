"""Offline replay of a tensor dump: every recorded call rebuilt from its dumped inputs, run on the CPU in
float64, and its dumped output (forward) or outgoing gradients (backward, :mod:`.backward`) judged against that
replay (:func:`replay_dump`).

A call that cannot be replayed (no tensor files, a random op, a collective, an unknown API or argument) is
listed with the reason, never guessed.

The replay emulates the precision the dump's device declares (:mod:`.emulate`), as the self-check did while the
steps ran: the policy of its ``checklist.json`` (its ``"precision"``, else the one its recorded switches give on
its device), and autocast where a call's dtypes show it (float32 inputs, a half-type output). A dump without a
checklist (msprobe's own) is replayed as float32.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.checklistfile import read_checklist
from pytest_msprobe.format.files import read_json, write_text
from pytest_msprobe.format.layout import TENSOR_DIR, discover
from pytest_msprobe.format.names import BACKWARD, FORWARD, parse_name
from pytest_msprobe.format.numerics import Policy, checklist_policy
from pytest_msprobe.replay.apis import resolve
from pytest_msprobe.replay.arguments import (
    flat,
    is_tensor_node,
    load_tensor,
    rebuild_inputs,
)
from pytest_msprobe.replay.backward import read_records, replay_backward, run_replayed
from pytest_msprobe.replay.standard import OwnError, judge_output
from pytest_msprobe.replay.state import steady

REPLAY_JSON = "replay.json"


@dataclass(frozen=True)
class CallReplay:
    """One recorded call: its own error per output tensor, or why it was not replayed."""

    name: str
    step: int | None
    rank: int | None
    outputs: tuple[OwnError | None, ...] = ()  # per output tensor (None: not a floating tensor)
    skipped: str = ""  # why it was not replayed
    emulated: str = ""  # the format its device's declared precision was emulated in ("tf32"), "" for none

    @property
    def out_of_line(self) -> bool:
        return any(o is not None and o.out_of_line for o in self.outputs)


@dataclass(frozen=True)
class Declared:
    """The precision one dump.json's device declares (its checklist's), which its calls were replayed by."""

    step: int | None
    rank: int | None
    policy: Policy | None


@dataclass(frozen=True)
class ReplayResult:
    dump: str
    calls: tuple[CallReplay, ...] = field(default_factory=tuple)
    precision: tuple[Declared, ...] = ()

    @property
    def out_of_line(self) -> list[CallReplay]:
        return [c for c in self.calls if c.out_of_line]

    def to_dict(self) -> dict[str, Any]:
        return {
            "dump": self.dump,
            "replayed": sum(1 for c in self.calls if not c.skipped),
            "skipped": sum(1 for c in self.calls if c.skipped),
            "out_of_line": [{"name": c.name, "step": c.step, "rank": c.rank} for c in self.out_of_line],
            "precision": [
                {"step": d.step, "rank": d.rank, "policy": d.policy.to_dict() if d.policy else None}
                for d in self.precision
            ],
            "calls": [
                {
                    "name": c.name,
                    "step": c.step,
                    "rank": c.rank,
                    "skipped": c.skipped or None,
                    "emulated": c.emulated or None,
                    "outputs": [o.to_dict() if o is not None else None for o in c.outputs],
                }
                for c in self.calls
            ],
        }


def replay_call(
    name: str, entry: dict[str, Any], tensor_dir: Path, policy: Policy | None = None
) -> tuple[tuple[OwnError | None, ...], str, str]:
    """The own errors of one forward call's outputs, or ``((), reason)`` when it cannot be replayed, and the
    format its device's declared ``policy`` was emulated in (``""`` for none; see :mod:`.emulate`). Runs in the
    replay's own torch state (:mod:`.state`)."""
    with steady():
        return _replay_call(name, entry, tensor_dir, policy)


def _replay_call(
    name: str, entry: dict[str, Any], tensor_dir: Path, policy: Policy | None
) -> tuple[tuple[OwnError | None, ...], str, str]:
    target = resolve(name)
    if target.fn is None:
        return (), target.reason, ""

    def read() -> tuple[list[Any], dict[str, Any], list[Any], list[Any]]:
        load = lambda node: load_tensor(node, tensor_dir)  # noqa: E731
        args, kwargs = rebuild_inputs(entry, load)
        recorded = flat(entry.get("output", []))
        return args, kwargs, recorded, [load(node) if is_tensor_node(node) else None for node in recorded]

    records, why = read_records(read)
    if records is None:
        return (), why, ""
    args, kwargs, recorded, expected = records
    out, why, emulating = run_replayed(target, args, kwargs, entry, policy, grad=False)
    if why:
        return (), why, ""
    outputs, why = judge_forward(out, recorded, expected)
    return outputs, why, emulating.label if emulating is not None and not why else ""


def judge_forward(
    out: Any, recorded: list[Any], expected: list[Any]
) -> tuple[tuple[OwnError | None, ...], str]:
    """The own errors of a call's outputs: its replayed ``out`` against the ``expected`` tensors as dumped
    (``recorded``: their nodes, for the dtypes); ``((), reason)`` when they do not line up."""
    produced = flat(out)
    if len(produced) != len(recorded):
        return (), f"the replay gave {len(produced)} output(s), the dump {len(recorded)}"
    return tuple(judge_output(n, want, got) for n, want, got in zip(recorded, expected, produced)), ""


def replay_dump(path: str | os.PathLike[str], only: Collection[str] | None = None) -> ReplayResult:
    """Replay every API call of a dump, forward and backward (a dump root, step or rank folder, or a dump.json);
    with ``only``, the calls of those record names alone."""
    calls: list[CallReplay] = []
    declared: list[Declared] = []
    for location in discover(Path(path)):
        doc = read_json(location.path)
        data = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(data, dict):
            raise DumpFormatError(location.path, "no 'data' object: not a msprobe dump.json")
        tensor_dir = location.path.parent / TENSOR_DIR
        checklist = read_checklist(location.path.parent)  # (msprobe's own dumps have none: float32)
        policy = checklist_policy(checklist) if checklist is not None else None
        declared.append(Declared(location.step, location.rank, policy))
        for name, entry in data.items():
            if only is not None and name not in only:
                continue
            parts = parse_name(name)
            if parts.direction not in (FORWARD, BACKWARD) or name.startswith("Module."):
                continue
            forward = data.get(parts.with_direction(FORWARD)) if parts.direction == BACKWARD else entry
            if not isinstance(entry, dict) or not isinstance(forward, dict):
                why = "a malformed entry" if not isinstance(entry, dict) else "its forward record is missing"
                calls.append(CallReplay(name, location.step, location.rank, skipped=why))
                continue
            if parts.direction == FORWARD:
                outputs, why, emulated = replay_call(name, entry, tensor_dir, policy)
            else:
                outputs, why, emulated = replay_backward(name, forward, entry, tensor_dir, policy)
            calls.append(CallReplay(name, location.step, location.rank, outputs, why, emulated))
    return ReplayResult(os.fspath(path), tuple(calls), tuple(declared))


def write_replay(result: ReplayResult, out_dir: str | os.PathLike[str]) -> Path:
    """Write ``replay.json`` (every call's own errors) into ``out_dir``, atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / REPLAY_JSON, json.dumps(result.to_dict(), indent=1, allow_nan=True))
    return out / REPLAY_JSON
