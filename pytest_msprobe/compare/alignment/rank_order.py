"""Execution order across ranks, and the ranks a collective joins.

The ranks of a distributed run execute at the same time: a call's index in its own dump says nothing about
whether it ran before or after a call of another rank. What does say something is a collective: every rank of
its group enters it, and none leaves before all have entered, so everything a rank did before
``Distributed.all_reduce.3.forward`` happened before anything any rank of the group does after it.

Which calls on other ranks are the same collective: the ranks of a process group call that group's collectives
in the same order (else the run hangs), so the n-th collective of a group on one rank is the n-th of that group
on every other member. The group is the ``torch.ProcessGroup`` record among the call's arguments
(``group_ranks``); a call without one uses the default group, every rank. msprobe's counter in the name
(``.3.``) counts the calls of an API on a rank whatever their group, so names alone would pair calls of
different groups as soon as the ranks make different numbers of them (tensor and data parallel groups, pipeline
stages); pairing by group and place in the group does not, and the API must agree as well.

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

from pytest_msprobe.format.names import parse_name

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
    group: tuple[int, ...] | None = None  # the ranks of the process group it names, None for the default one


def collective_op(name: str) -> str | None:
    """``all_reduce`` for ``Distributed.all_reduce.3.forward``; None for anything that is not a collective."""
    if not name.startswith(DISTRIBUTED):
        return None
    op = parse_name(name).base[len(DISTRIBUTED) :]
    return None if not op or op in POINT_TO_POINT else op


_Key = tuple[object, ...]


def collective_keys(places: Sequence[CallPlace]) -> dict[int, _Key]:
    """Each collective call's key, the same on every rank taking part in that collective: (step, group, n, API)
    where n counts the collectives of that group on the call's rank within the step."""
    ranks_of_step: dict[int | None, set[int]] = {}
    for place in places:
        if place.rank is not None:
            ranks_of_step.setdefault(place.step, set()).add(place.rank)
    seen: dict[tuple[int | None, int, tuple[int, ...] | None], int] = {}
    keys: dict[int, _Key] = {}
    for i in sorted(range(len(places)), key=lambda i: places[i].position):
        place = places[i]
        op = collective_op(place.name)
        if place.rank is None or op is None:
            continue
        group = place.group
        if group is not None and ranks_of_step[place.step] <= set(group):
            group = None  # every rank of the dumps: the default group, however the program named it
        counter = (place.step, place.rank, group)
        n = seen.get(counter, 0)
        seen[counter] = n + 1
        keys[i] = (place.step, group, n, op)
    return keys


def collective_peers(
    places: Sequence[CallPlace], keys: dict[int, _Key] | None = None
) -> dict[int, list[int]]:
    """For each collective call, the same collective on the other ranks of its group."""
    if keys is None:
        keys = collective_keys(places)
    groups: dict[_Key, list[int]] = {}
    for i, key in keys.items():
        groups.setdefault(key, []).append(i)
    peers: dict[int, list[int]] = {}
    for members in groups.values():
        if len({places[i].rank for i in members}) < 2:
            continue
        for i in members:
            peers[i] = [j for j in members if places[j].rank != places[i].rank]
    return peers


def execution_order(places: Sequence[CallPlace], keys: dict[int, _Key] | None = None) -> list[int]:
    """The indices of ``places`` in execution order: by step, then the logical clock, then rank."""
    if keys is None:
        keys = collective_keys(places)
    clock = [0] * len(places)
    by_step: dict[int | None, dict[int | None, list[int]]] = {}
    for i, place in enumerate(places):
        by_step.setdefault(place.step, {}).setdefault(place.rank, []).append(i)
    for ranks in by_step.values():
        calls = {rank: sorted(ids, key=lambda i: places[i].position) for rank, ids in ranks.items()}
        _tick(keys, calls, clock)

    def key(i: int) -> tuple[int, int, int, float]:
        p = places[i]
        return (-1 if p.step is None else p.step, clock[i], -1 if p.rank is None else p.rank, p.position)

    return sorted(range(len(places)), key=key)


def _tick(keys: dict[int, _Key], calls: dict[int | None, list[int]], clock: list[int]) -> None:
    """Give every call of one step its logical clock (in ``clock``)."""
    holders: dict[_Key, set[int | None]] = {}  # collective -> the ranks that make it
    for rank, ids in calls.items():
        for i in ids:
            if i in keys:
                holders.setdefault(keys[i], set()).add(rank)
    now = dict.fromkeys(calls, 0)
    at = dict.fromkeys(calls, 0)  # each rank's next call

    def run_to_collective(rank: int | None) -> None:
        ids = calls[rank]
        while at[rank] < len(ids):
            i = ids[at[rank]]
            key = keys.get(i)
            if key is not None and len(holders[key]) > 1:
                return  # waits for the other ranks
            clock[i] = now[rank]
            now[rank] += 1
            at[rank] += 1

    def waiting_at(rank: int | None) -> _Key | None:
        ids = calls[rank]
        return keys[ids[at[rank]]] if at[rank] < len(ids) else None

    def release(ranks: list[int | None]) -> None:
        t = max(now[r] for r in ranks)
        for r in ranks:
            clock[calls[r][at[r]]] = t
            now[r] = t + 1
            at[r] += 1

    for rank in calls:
        run_to_collective(rank)
    while True:
        waiting = {rank: key for rank in calls if (key := waiting_at(rank)) is not None}
        if not waiting:
            return
        ready = [
            key for key in dict.fromkeys(waiting.values()) if all(waiting.get(r) == key for r in holders[key])
        ]
        if ready:
            for key in ready:
                ranks = [r for r in calls if waiting.get(r) == key]
                release(ranks)
                for r in ranks:
                    run_to_collective(r)
            continue
        # the ranks disagree on the order of their collectives (a dump of a run that would hang, or dumps
        # cut at different points): let the earliest waiting call go on its own so that the order still ends
        rank = min(waiting, key=lambda r: (now[r], -1 if r is None else r))
        release([rank])
        run_to_collective(rank)
