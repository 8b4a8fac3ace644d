"""The optimizer's updates, paired by parameter whatever kernels made them.

torch's optimizers make other calls on other devices: one ``Tensor.*`` op per parameter on the CPU
(single-tensor), ``torch._foreach_*`` over lists on CUDA (msprobe records a list's elements as nested items,
``.input.0.3``), one fused kernel with ``fused=True`` (nothing decomposed recorded). Two dumps of the same step
made on two devices then pair the model's calls and leave the optimizer's without partners. :func:`plan_updates`
runs before the alignment of a dump pair and returns the entries to align:

- each side's optimizer calls are found: from its ``optimizer.json`` (:mod:`pytest_msprobe.format.optimizerfile`),
  else construct.json's parent ``optimizer`` (level mix), else the stacks (torch.optim's code on them, see
  :func:`pytest_msprobe.compare.dumps.modules.optimizer_step_call`);
- when both sides made the same calls (same names, same order) they pair call by call; where both sides have
  a sidecar, each parameter's update from it follows the step's calls too, so that a weight the step left wrong
  is named at its update even where no recorded call made the change (a fused kernel, a post-step hook);
- otherwise both sides' optimizer calls make way for one entry per parameter, ``Optimizer.{parameter}.{n}.forward``,
  at the place of the optimizer's step: from the sidecar (the weight and its gradient before, the weight and its
  optimizer state after), else derived from the side's own in-place calls (the weight before, the update it
  applied, the weight after: see :func:`derive_updates`). The entries pair by parameter, each pair keeping the
  rows both sides have, so that no row is left without a partner by the implementation; where no gradient nor
  update is kept, the update's inputs are unknown (``opaque``);
- a side whose optimizer recorded nothing decomposed and has no sidecar (a fused optimizer under plain msprobe)
  cannot give updates: the other side's optimizer calls are set aside (neither compared nor unmatched) and a line
  says so; the next step's calls read the weights it left.

Gradient clipping and ``zero_grad`` run over lists on CUDA too: their calls pair by name where both sides made the
same; those that differ are set aside the same way, with a line.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_msprobe.compare.dumps.modules import gradient_housekeeping, optimizer_step_call, read_construct
from pytest_msprobe.compare.dumps.reader import (
    INPUT,
    TENSOR,
    ApiEntry,
    Dump,
    Leaf,
    flatten_entry,
    read_stack,
)
from pytest_msprobe.errors import DumpFormatError, DumpReadError
from pytest_msprobe.format.checklistfile import read_checklist
from pytest_msprobe.format.layout import CONSTRUCT_JSON
from pytest_msprobe.format.names import BACKWARD, OPTIMIZER_NODE, parse_name
from pytest_msprobe.format.optimizerfile import (
    FOREACH,
    FUSED,
    SINGLE_TENSOR,
    UPDATE_PREFIX,
    optimizer_path,
    read_optimizer,
    update_name,
)

PARAM_IN, GRAD_IN, UPDATE_IN, PARAM_OUT = ".input.param", ".input.grad", ".input.update", ".output.param"


@dataclass(frozen=True)
class UpdatePlan:
    """The entries of a dump pair to align, once the optimizer's calls gave way to its updates."""

    target: tuple[ApiEntry, ...]
    baseline: tuple[ApiEntry, ...]
    opaque: frozenset[str] = frozenset()  # updates whose inputs are unknown (no gradient nor update kept)
    set_aside: tuple[str, ...] = ()  # one line per thing set aside, neither compared nor unmatched
    stacks: dict[str, tuple[str, ...]] = field(default_factory=dict)  # the target's updates -> their step's
    baseline_stacks: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class _Step:
    """One optimizer step of one side: where it began, its calls (entry indices), what made it."""

    position: int
    calls: list[int]
    implementation: str
    records: dict[str, Any] | None = None  # the sidecar's updates
    stack: tuple[str, ...] = ()


@dataclass
class Update:
    """One parameter's update on one side: its rows by suffix (``.input.param`` ...)."""

    parameter: str | None
    shape: tuple[int, ...] | None
    leaves: dict[str, Leaf]
    stack: tuple[str, ...] = ()


class _Side:
    """One dump's optimizer steps, found once, and what its files say of the parameters."""

    def __init__(self, dump: Dump) -> None:
        self.dump = dump
        self.names = [e.name for e in dump.entries]
        self._stacks: dict[str, list[str]] | None = None
        self._checklist: tuple[bool, dict[str, Any] | None] | None = None
        self.sidecar = read_optimizer(dump.path)
        self.steps = self._find_steps()

    @property
    def stacks(self) -> dict[str, list[str]]:
        if self._stacks is None:
            self._stacks = read_stack(self.dump.path)
        return self._stacks

    def _find_steps(self) -> list[_Step]:
        if self.sidecar is not None:
            where = {name: i for i, name in enumerate(self.names)}
            return [
                _Step(
                    min(s.position, len(self.names)),
                    [where[c] for c in s.calls if c in where],
                    s.implementation,
                    dict(s.records),
                    s.stack,
                )
                for s in self.sidecar
            ]
        construct = read_construct(self.dump.path.parent / CONSTRUCT_JSON)
        if any(parent == OPTIMIZER_NODE for parent in construct.values()):
            flags = [construct.get(name) == OPTIMIZER_NODE for name in self.names]
        else:
            stacks = self.stacks
            flags = [bool(stacks.get(name)) and optimizer_step_call(stacks[name]) for name in self.names]
        steps = []
        for on, run in itertools.groupby(range(len(self.names)), key=lambda i: flags[i]):
            if on:
                calls = list(run)
                stack = tuple(self.stacks.get(self.names[calls[-1]], ()))
                steps.append(_Step(calls[0], calls, _implementation(self.dump.entries, calls), None, stack))
        return steps

    def updates(self, step: _Step) -> list[Update] | None:
        """The step's updates per parameter, None where they cannot be known."""
        if step.records is not None:
            out = []
            for name, record in step.records.items():
                try:
                    leaves = flatten_entry(name, record)
                except (TypeError, ValueError, KeyError, RecursionError) as exc:
                    raise DumpFormatError(optimizer_path(self.dump.path), str(exc)) from None
                by_suffix = {leaf.suffix: leaf for leaf in leaves}
                shape = by_suffix[PARAM_OUT].shape if PARAM_OUT in by_suffix else None
                out.append(
                    Update(parse_name(name).base[len(UPDATE_PREFIX) + 1 :], shape, by_suffix, step.stack)
                )
            return out
        found = derive_updates([self.dump.entries[i] for i in step.calls])
        for update in found or ():
            update.stack = step.stack
        return found or None

    def unrecorded(self) -> bool:
        """Whether this side's optimizer may have stepped without a call recorded: a dump without optimizer.json
        (ours write one, steps or none) whose backward ran, and whose checklist, if any, saw an optimizer step.
        A run that skipped its backward or its optimizer.step() is not such a side: its calls stay unmatched."""
        if self.sidecar is not None or not any(e.parts.direction == BACKWARD for e in self.dump.entries):
            return False
        readable, doc = self.checklist()
        return readable and bool(doc is None or doc.get("optimizers"))

    def checklist(self) -> tuple[bool, dict[str, Any] | None]:
        """(whether the side's checklist.json could be read, its document or None without one), read once."""
        try:
            self._checklist = self._checklist or (True, read_checklist(self.dump.path))
        except DumpReadError:
            raise
        except DumpFormatError:  # (the checklist compare reports it)
            self._checklist = (False, None)
        return self._checklist

    def checklist_parameters(self) -> list[tuple[str, tuple[int, ...]]] | None:
        """The model's parameters in model order with their shapes, from the side's checklist.json."""
        _, doc = self.checklist()
        params = ((doc or {}).get("structure") or {}).get("parameters")
        if not isinstance(params, dict):
            return None
        out = []
        for name, entry in params.items():
            if not isinstance(entry, list) or not entry or not isinstance(entry[0], list):
                return None
            out.append((str(name), tuple(int(s) for s in entry[0])))
        return out


def _implementation(entries: Sequence[ApiEntry], calls: Sequence[int]) -> str:
    apis = [entries[i].parts.base for i in calls]
    if any("_fused_" in api for api in apis):
        return FUSED
    if any("._foreach_" in api for api in apis):
        return FOREACH
    return SINGLE_TENSOR


def _in_place(api: str) -> bool:
    """``add_``, ``_foreach_mul_``, ``__iadd__``: an API that writes its first argument."""
    short = api.rsplit(".", 1)[-1]
    if short.startswith("__"):
        return short in ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__")
    return short.endswith("_")


def _writes(calls: Sequence[ApiEntry]) -> list[tuple[int, int, Leaf, Leaf | None, Leaf]]:
    """Every tensor an in-place call of the step writes, with its record before and after: a foreach call's
    element ``k`` of its first list (``.input.0.k`` -> ``.output.0.k``), a tensor method's ``self``. A fused
    kernel's record is no such write: its outputs are not its inputs after the update."""
    out = []
    for order, entry in enumerate(calls):
        base = entry.parts.base
        if not _in_place(base) or "_fused_" in base:
            continue
        by = {leaf.suffix: leaf for leaf in entry.leaves}
        if "._foreach_" in base:
            for k in itertools.count():
                before = by.get(f".input.0.{k}")
                if before is None:
                    break
                after, other = by.get(f".output.0.{k}"), by.get(f".input.1.{k}")
                if before.kind == TENSOR and after is not None and after.kind == TENSOR:
                    out.append(
                        (
                            order,
                            k,
                            before,
                            other if other is not None and other.kind == TENSOR else None,
                            after,
                        )
                    )
        else:
            before, after, other = by.get(".input.0"), by.get(".output.0"), by.get(".input.1")
            if before is not None and before.kind == TENSOR and after is not None and after.kind == TENSOR:
                out.append(
                    (order, -1, before, other if other is not None and other.kind == TENSOR else None, after)
                )
    return out


def _key(leaf: Leaf) -> tuple[Any, ...]:
    return (leaf.shape, leaf.dtype, leaf.stats)


def derive_updates(calls: Sequence[ApiEntry]) -> list[Update]:
    """Each parameter's update, from an optimizer step's own calls (in param-group order).

    The weights are the tensors that require grad among those the step's in-place calls write. A weight written
    several times in the step (AdamW's decay, then its update) is followed from one write to the next by its record:
    a write's input is the tensor an earlier write gave out (same shape, dtype and statistics; the same element of
    a foreach list first). The update is the last write of the weight: the weight before the step (its first
    write's input), the tensor that last write applied (its second argument: SGD's momentum buffer, Adam's first
    moment), and the weight after. Dumps that do not say which tensors require grad: a foreach step's last in-place
    call writes the weights, element by element; a single-tensor step's cannot be told from its buffers' (none).
    """
    writes = _writes(calls)
    weights = [w for w in writes if w[2].requires_grad]
    if not weights and all(w[2].requires_grad is None for w in writes):
        foreach = [w for w in writes if w[1] >= 0]
        last_call = max((w[0] for w in foreach), default=None)
        weights = [w for w in foreach if w[0] == last_call]
    chains: list[list[tuple[int, int, Leaf, Leaf | None, Leaf]]] = []
    open_ends: dict[tuple[Any, ...], list[int]] = {}  # a chain's latest output -> the chains ending so
    for w in weights:
        order, k, before, _, after = w
        candidates = [c for c in open_ends.get(_key(before), ()) if chains[c][-1][0] < order]
        chosen = next(
            (c for c in candidates if chains[c][-1][1] == k), candidates[-1] if candidates else None
        )
        if chosen is None:
            chains.append([w])
            chosen = len(chains) - 1
        else:
            open_ends[_key(before)].remove(chosen)
            chains[chosen].append(w)
        open_ends.setdefault(_key(after), []).append(chosen)
    updates = []
    for chain in chains:
        first, last = chain[0], chain[-1]
        leaves = {PARAM_IN: first[2]}
        if last[3] is not None:
            leaves[UPDATE_IN] = last[3]
        leaves[PARAM_OUT] = last[4]
        updates.append(Update(None, last[4].shape, leaves))
    return updates


def _named(updates: list[Update], names: Sequence[tuple[str, tuple[int, ...] | None]] | None) -> bool:
    """Name the updates by ``names`` (in order) when they have the same shapes in order."""
    if names is None or len(names) != len(updates):
        return False
    if any(
        shape is not None and u.shape is not None and tuple(shape) != tuple(u.shape)
        for (_, shape), u in zip(names, updates)
    ):
        return False
    for (name, _), u in zip(names, updates):
        u.parameter = name
    return True


def _entries(
    updates: list[Update], counts: dict[str, int], keep: dict[str, set[str]] | None
) -> tuple[list[ApiEntry], dict[str, tuple[str, ...]]]:
    entries, stacks = [], {}
    for u in updates:
        assert u.parameter is not None
        n = counts.get(u.parameter, 0)
        counts[u.parameter] = n + 1
        name = update_name(u.parameter, n)
        wanted = keep.get(name) if keep is not None else None
        leaves = [
            leaf._replace(name=name + suffix, suffix=suffix)
            for suffix, leaf in _ordered(u.leaves)
            if wanted is None or suffix in wanted
        ]
        entries.append(ApiEntry(name, -1, tuple(leaves)))
        stacks[name] = u.stack
    return entries, stacks


def _ordered(leaves: dict[str, Leaf]) -> list[tuple[str, Leaf]]:
    """Inputs before outputs, as every record's rows (msprobe's order)."""
    return sorted(leaves.items(), key=lambda item: 0 if item[1].role == INPUT else 1)


def _where(dump: Dump) -> str:
    loc = dump.location
    parts = [
        f"step {loc.step}" if loc.step is not None else "",
        f"rank {loc.rank}" if loc.rank is not None else "",
    ]
    return ", ".join(p for p in parts if p) or "dump"


def plan_updates(target: Dump, baseline: Dump) -> UpdatePlan:
    """The entries of a dump pair to align (see the module's docstring)."""
    t, b = _Side(target), _Side(baseline)
    t_calls = [t.names[i] for s in t.steps for i in s.calls]
    b_calls = [b.names[i] for s in b.steps for i in s.calls]
    removed: tuple[set[int], set[int]] = (set(), set())
    inserts: tuple[dict[int, list[ApiEntry]], dict[int, list[ApiEntry]]] = ({}, {})
    notes: list[str] = []
    opaque: set[str] = set()
    stacks: tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]] = ({}, {})
    where = _where(target)
    if t_calls != b_calls and bool(t.steps) != bool(b.steps) and (t if not t.steps else b).unrecorded():
        _nothing_recorded(t, b, removed, notes, where)
    elif t_calls != b_calls:
        counts: tuple[dict[str, int], dict[str, int]] = ({}, {})
        for ts, bs in zip(t.steps, b.steps):
            removed[0].update(ts.calls)
            removed[1].update(bs.calls)
            tu, bu = t.updates(ts), b.updates(bs)
            if tu is None or bu is None:
                lacking, other, other_side = (
                    ("target", ts, "baseline") if tu is None else ("baseline", bs, "target")
                )
                known = bu if tu is None else tu
                count = f"its {len(known)} parameters'" if known else "the parameters'"
                notes.append(
                    f"{where}: the {lacking}'s optimizer ({other.implementation}) records no update per parameter: "
                    f"{count} updates are judged where the next step reads them (the {other_side}'s "
                    f"{len(bs.calls if tu is None else ts.calls)} optimizer calls set aside, not compared)"
                )
                continue
            _name_both(tu, bu, t, b)
            t_keep, b_keep = _kept_rows(tu, bu, counts)
            t_entries, t_stacks = _entries(tu, counts[0], t_keep)
            b_entries, b_stacks = _entries(bu, counts[1], b_keep)
            for e in t_entries:
                if e.name in b_keep and not ({GRAD_IN, UPDATE_IN} & t_keep.get(e.name, set())):
                    opaque.add(e.name)
            inserts[0].setdefault(ts.position, []).extend(t_entries)
            inserts[1].setdefault(bs.position, []).extend(b_entries)
            stacks[0].update(t_stacks)
            stacks[1].update(b_stacks)
    else:  # the same calls: they pair one by one; both sidecars' updates follow them (the step's last word)
        counts = ({}, {})
        for ts, bs in zip(t.steps, b.steps):
            if ts.records is None or bs.records is None:
                continue
            tu, bu = t.updates(ts), b.updates(bs)
            assert tu is not None and bu is not None  # (a sidecar's updates are always known)
            t_keep, b_keep = _kept_rows(tu, bu, counts)
            t_entries, t_stacks = _entries(tu, counts[0], t_keep)
            b_entries, b_stacks = _entries(bu, counts[1], b_keep)
            inserts[0].setdefault(_after(ts), []).extend(t_entries)
            inserts[1].setdefault(_after(bs), []).extend(b_entries)
            stacks[0].update(t_stacks)
            stacks[1].update(b_stacks)
    _housekeeping(t, b, removed, notes, where)
    if not any(removed) and not any(inserts):
        return UpdatePlan(target.entries, baseline.entries, set_aside=tuple(notes))
    return UpdatePlan(
        _rebuilt(target.entries, removed[0], inserts[0]),
        _rebuilt(baseline.entries, removed[1], inserts[1]),
        frozenset(opaque),
        tuple(notes),
        stacks[0],
        stacks[1],
    )


def _nothing_recorded(
    t: _Side, b: _Side, removed: tuple[set[int], set[int]], notes: list[str], where: str
) -> None:
    """One side's optimizer made calls and the other's made none that were recorded: plain msprobe records
    neither torch._foreach_* nor fused kernels (26.x), and a dump without optimizer.json has nothing else to
    tell its updates by. The calls are set aside, with a line; the weights they left are read by the next
    dumped step's calls."""
    made, lacking = (b, "target") if not t.steps else (t, "baseline")
    calls = sorted(i for step in made.steps for i in step.calls)
    removed[0 if made is t else 1].update(calls)
    other = "baseline" if lacking == "target" else "target"
    notes.append(
        f"{where}: the {lacking}'s optimizer records no call (msprobe records neither torch._foreach_* nor fused "
        f"kernels, and the dump has no optimizer.json): the {other}'s {len(calls)} optimizer calls set aside, not "
        "compared; the weights they left are judged where a later dumped step reads them (none after the last)"
    )


def _after(step: _Step) -> int:
    """Where a step's updates go when its calls stay: after its last call (at its start when it made none)."""
    return max(step.calls) + 1 if step.calls else step.position


def _name_both(tu: list[Update], bu: list[Update], t: _Side, b: _Side) -> None:
    """Name each side's updates: the sidecar's names, else the side's checklist (same shapes in order), else the
    other side's (same shapes in order), else ``param{k}``."""
    for updates, side in ((tu, t), (bu, b)):
        if any(u.parameter is None for u in updates) and not _named(updates, side.checklist_parameters()):
            for u in updates:
                u.parameter = None
    for updates, other in ((tu, bu), (bu, tu)):
        if any(u.parameter is None for u in updates) and all(u.parameter is not None for u in other):
            _named(updates, [(u.parameter or "", u.shape) for u in other])
    for updates in (tu, bu):
        if any(u.parameter is None for u in updates):
            for k, u in enumerate(updates):
                u.parameter = f"param{k}"


def _kept_rows(
    tu: list[Update], bu: list[Update], counts: tuple[dict[str, int], dict[str, int]]
) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Per update name, the rows both sides have (a sidecar has the gradient and the state, a derived update the
    tensor it applied): no row is left without a partner by the implementation."""

    def names(updates: list[Update], count: dict[str, int]) -> dict[str, set[str]]:
        seen = dict(count)
        out = {}
        for u in updates:
            assert u.parameter is not None
            n = seen.get(u.parameter, 0)
            seen[u.parameter] = n + 1
            out[update_name(u.parameter, n)] = set(u.leaves)
        return out

    t_rows, b_rows = names(tu, counts[0]), names(bu, counts[1])
    t_keep = {n: rows & b_rows[n] if n in b_rows else rows for n, rows in t_rows.items()}
    b_keep = {n: rows & t_rows[n] if n in t_rows else rows for n, rows in b_rows.items()}
    return t_keep, b_keep


def _housekeeping(
    t: _Side, b: _Side, removed: tuple[set[int], set[int]], notes: list[str], where: str
) -> None:
    """Set aside gradient clipping's and zero_grad's calls where the two sides made other ones."""
    blocks = []
    for side in (t, b):
        stacks = side.stacks
        found: list[tuple[str, list[int]]] = []
        for i, name in enumerate(side.names):
            stack = stacks.get(name)
            kind = gradient_housekeeping(stack) if stack else None
            if kind is None:
                continue
            if found and found[-1][0] == kind and found[-1][1][-1] == i - 1:
                found[-1][1].append(i)
            else:
                found.append((kind, [i]))
        blocks.append(found)
    t_blocks, b_blocks = blocks
    for k in range(max(len(t_blocks), len(b_blocks))):
        tb = t_blocks[k] if k < len(t_blocks) else None
        bb = b_blocks[k] if k < len(b_blocks) else None
        t_apis = [parse_name(t.names[i]).base for i in tb[1]] if tb else []
        b_apis = [parse_name(b.names[i]).base for i in bb[1]] if bb else []
        if t_apis == b_apis:
            continue
        if tb:
            removed[0].update(tb[1])
        if bb:
            removed[1].update(bb[1])
        kind = (tb or bb or ("", []))[0]
        what = "gradient clipping" if kind == "clip_grad" else "zero_grad"
        notes.append(
            f"{where}: {what} makes other calls on each side (target {len(t_apis)}, baseline {len(b_apis)}: "
            "another implementation): set aside, not compared; the optimizer's updates read the gradients it left"
        )


def _rebuilt(
    entries: Sequence[ApiEntry], removed: set[int], inserts: dict[int, list[ApiEntry]]
) -> tuple[ApiEntry, ...]:
    out: list[ApiEntry] = []
    for i, entry in enumerate(entries):
        for e in inserts.get(i, ()):
            out.append(ApiEntry(e.name, i, e.leaves))
        if i not in removed:
            out.append(entry)
    for position in sorted(p for p in inserts if p >= len(entries)):
        out.extend(ApiEntry(e.name, len(entries), e.leaves) for e in inserts[position])
    return tuple(out)
