"""What the ranks of a multi-rank test tell the launcher: the rank to blame and the failure or skip message."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Sequence

from pytest_msprobe.options import RANK_TIMEOUT
from pytest_msprobe.run.launcher import RankExit
from pytest_msprobe.settings import RANK_STARTUP


def _tail(text: str, lines: int) -> list[str]:
    kept = text.rstrip().splitlines()[-lines:]
    return [f"  {line}" for line in kept] or ["  (nothing)"]


# frames of the machinery around the test body: pytest, pluggy, the rank's start-up
_MACHINERY = (f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}", f"{os.sep}rank_worker.py", '"<string>"')


def _stacks(text: str, frames: int = 12) -> list[str]:
    """faulthandler's stacks (most recent call first), each thread's first ``frames`` frames of its own code."""
    lines: list[str] = []
    kept = 0
    for line in text.rstrip().splitlines():
        if not line.startswith(" "):  # "Current thread 0x... (most recent call first):", "Thread 0x...:"
            lines.append(f"  {line}")
            kept = 0
        elif kept < frames and not any(part in line for part in _MACHINERY):
            lines.append(f"  {line}")
            kept += 1
    return lines


def _names(ranks: Sequence[RankExit]) -> str:
    numbers = ", ".join(str(e.rank) for e in ranks)
    return f"rank {numbers}" if len(ranks) == 1 else f"ranks {numbers}"


def _others(exits: Sequence[RankExit], shown: Sequence[RankExit]) -> str:
    """What became of the ranks a message is not about: '; rank 0 passed; ranks 2, 3 were stopped'."""
    groups: dict[str, list[RankExit]] = {}
    for e in exits:
        if e in shown:
            continue
        state = "stopped" if e.stopped else (e.outcome if e.status == 0 and e.outcome else "failed")
        groups.setdefault(state, []).append(e)
    parts = []
    for state, ranks in groups.items():
        verb = ("was" if len(ranks) == 1 else "were") if state == "stopped" else ""
        parts.append(f"{_names(ranks)} {verb + ' ' if verb else ''}{state}")
    return "".join(f"; {part}" for part in parts)


def _status(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"


def rank_failure(exits: Sequence[RankExit], nodeid: str, timeout: float) -> tuple[int, str] | None:
    """The rank to blame and the failure message, or None when every rank ran the test and none failed.

    The rank to blame is the first to end with a failure (the others are often its victims: stopped in a
    collective it never joined), or every rank still running when the time was up.
    """
    n = len(exits)
    late = [e for e in exits if e.timed_out]
    if late:
        # the clock starts once every rank has joined the process group; the start-up has its own limit
        limit = (
            f"finish within {timeout:g} s"
            if all(e.started for e in exits)
            else f"join the process group within {timeout + RANK_STARTUP:g} s"
        )
        lines = [
            f"{_names(late)} of {n} did not {limit} and "
            f"{'was' if len(late) == 1 else 'were'} stopped (raise {RANK_TIMEOUT.flag} or the marker's "
            f"{RANK_TIMEOUT.marker}=){_others(exits, late)}"
        ]
        for e in late:
            if e.stack.strip():
                lines += [f"rank {e.rank}'s Python stacks when stopped:", *_stacks(e.stack)]
            if e.output.strip():
                lines += [f"rank {e.rank}'s output (end):", *_tail(e.output, 10)]
        return late[0].rank, "\n".join(lines)
    ended = sorted((e for e in exits if not e.stopped), key=lambda e: e.order)
    bad = next((e for e in ended if e.status != 0 or e.outcome not in ("passed", "skipped")), None)
    if bad is None:
        return None
    head = f"rank {bad.rank} of {n}"
    others = _others(exits, [bad])
    if bad.outcome == "failed":
        at = "" if bad.phase == "call" else f" at {bad.phase}"
        return bad.rank, "\n".join(
            [f"{head} failed{at} ({_status(bad.status)}){others}", *_tail(bad.report, 30)]
        )
    if bad.status == 0 and bad.outcome == "passed":  # cannot be: kept so that every path has a message
        why = "passed"
    elif bad.outcome and bad.status != 0:
        why = f"{bad.outcome} its test but ended with {_status(bad.status)}"
    elif bad.status == 0 and not bad.found and bad.outcome == "":
        why = f"did not collect {nodeid} (exit status 0)"
    elif bad.status < 0:
        why = f"died: {_status(bad.status)}"
    elif not bad.found and bad.status in (2, 3, 4, 5):  # pytest's usage, internal, no-tests exits
        why = f"did not run {nodeid} ({_status(bad.status)})"
    else:
        why = f"ended with {_status(bad.status)} before reporting its test"
    return bad.rank, "\n".join(
        [f"{head} {why}{others}", f"rank {bad.rank}'s output (end):", *_tail(bad.output, 20)]
    )


def rank_skip(exits: Sequence[RankExit]) -> str | None:
    """The reason to skip the test when a rank skipped it (and none failed), else None."""
    skipped = [e for e in exits if e.outcome == "skipped"]
    if not skipped:
        return None
    reason = skipped[0].report.removeprefix("Skipped: ")
    return f"rank {skipped[0].rank}: {reason}"
