"""Execution order across ranks, and the ranks a collective joins.

The ranks of a distributed run execute at the same time: a call's index in its own dump says nothing about
whether it ran before or after a call of another rank. What does say something is a collective: every rank of
its group enters it, and none leaves before all have entered, so everything a rank did before
``Distributed.all_reduce.3.forward`` happened before anything any rank of the group does after it. ranks pair
their collectives by name: msprobe's counter (``.3.``) counts the calls of that API within the step, and the
ranks of a group call their collectives in the same order (else the run hangs), so the same name is the same
collective on every rank that has it.

:func:`execution_order` turns this into a logical clock: each rank's calls tick its clock one by one; a
collective waits until every rank holding it has reached it, and all leave at the largest clock among them.
Calls are then ordered by (step, clock, rank): an order every real execution agrees with wherever the dumps can
tell, and between two collectives the ranks interleave call by call.

:func:`collective_peers` gives each collective call the same collective on the other ranks: its effective
inputs are the inputs of all of them (an all_reduce's output on rank 0 is made of rank 1's input too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pytest_msprobe.compare.load import parse_name

DISTRIBUTED = "Distributed."
# point-to-point calls pair a send on one rank with a receive on another under different names: they are no
# collective of a group, and they synchronise only their two ranks
POINT_TO_POINT = frozenset(
    {"send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp", "send_object_list", "recv_object_list"}
)


class CallPlace(NamedTuple):
    """What the order needs of one compared call."""

    name: str  # the call's name on its rank (the target's, the baseline's for a baseline-only call)
    step: int | None
    rank: int | None
    position: float  # its place in its own dump pair


def collective_op(name: str) -> str | None:
    """``all_reduce`` for ``Distributed.all_reduce.3.forward``; None for anything that is not a collective."""
    if not name.startswith(DISTRIBUTED):
        return None
    op = parse_name(name).base[len(DISTRIBUTED) :]
    return None if not op or op in POINT_TO_POINT else op


def collective_peers(places: Sequence[CallPlace]) -> dict[int, list[int]]:
    """For each collective call, the same collective (same name, same step) on the other ranks."""
    groups: dict[tuple[int | None, str], list[int]] = {}
    for i, place in enumerate(places):
        if place.rank is not None and collective_op(place.name) is not None:
            groups.setdefault((place.step, place.name), []).append(i)
    peers: dict[int, list[int]] = {}
    for members in groups.values():
        if len({places[i].rank for i in members}) < 2:
            continue
        for i in members:
            peers[i] = [j for j in members if places[j].rank != places[i].rank]
    return peers


def execution_order(places: Sequence[CallPlace]) -> list[int]:
    """The indices of ``places`` in execution order: by step, then the logical clock, then rank."""
    clock = [0] * len(places)
    by_step: dict[int | None, dict[int | None, list[int]]] = {}
    for i, place in enumerate(places):
        by_step.setdefault(place.step, {}).setdefault(place.rank, []).append(i)
    for ranks in by_step.values():
        calls = {rank: sorted(ids, key=lambda i: places[i].position) for rank, ids in ranks.items()}
        _tick(places, calls, clock)

    def key(i: int) -> tuple[int, int, int, float]:
        p = places[i]
        return (-1 if p.step is None else p.step, clock[i], -1 if p.rank is None else p.rank, p.position)

    return sorted(range(len(places)), key=key)


def _tick(places: Sequence[CallPlace], calls: dict[int | None, list[int]], clock: list[int]) -> None:
    """Give every call of one step its logical clock (in ``clock``)."""
    holders: dict[str, set[int | None]] = {}  # collective name -> the ranks that make it
    for rank, ids in calls.items():
        for i in ids:
            if collective_op(places[i].name) is not None:
                holders.setdefault(places[i].name, set()).add(rank)
    now = dict.fromkeys(calls, 0)
    at = dict.fromkeys(calls, 0)  # each rank's next call

    def run_to_collective(rank: int | None) -> None:
        ids = calls[rank]
        while at[rank] < len(ids):
            i = ids[at[rank]]
            if len(holders.get(places[i].name, ())) > 1:
                return  # waits for the other ranks
            clock[i] = now[rank]
            now[rank] += 1
            at[rank] += 1

    def waiting_at(rank: int | None) -> str | None:
        ids = calls[rank]
        return places[ids[at[rank]]].name if at[rank] < len(ids) else None

    def release(name: str, ranks: list[int | None]) -> None:
        t = max(now[r] for r in ranks)
        for r in ranks:
            clock[calls[r][at[r]]] = t
            now[r] = t + 1
            at[r] += 1

    for rank in calls:
        run_to_collective(rank)
    while True:
        waiting = {rank: name for rank in calls if (name := waiting_at(rank)) is not None}
        if not waiting:
            return
        ready = [
            name
            for name in dict.fromkeys(waiting.values())
            if all(waiting.get(r) == name for r in holders[name])
        ]
        if ready:
            for name in ready:
                ranks = [r for r in calls if waiting.get(r) == name]
                release(name, ranks)
                for r in ranks:
                    run_to_collective(r)
            continue
        # the ranks disagree on the order of their collectives (a dump of a run that would hang, or dumps
        # cut at different points): let the earliest waiting call go on its own so that the order still ends
        rank = min(waiting, key=lambda r: (now[r], -1 if r is None else r))
        release(waiting[rank], [rank])
        run_to_collective(rank)
