"""Build the rows and calls of a compare from aligned dump entries.

A :class:`Builder` takes the aligned entries of one dump pair (step, rank) after another: every pair of records
becomes a row, judged at once (:mod:`pytest_msprobe.compare.judging.judge`) or, in tensor mode, once its tensor files
are compared; every pair of entries becomes a call, linked to the calls whose tensors it also reads (a
backward call to its forward call, a ``parameters_grad`` to its module's backward). :meth:`Builder.finish`
turns them into the rows and calls of the result, each call with its verdict from its rows and its place in
the execution order across ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pytest_msprobe.compare import judging
from pytest_msprobe.compare.alignment import (
    DISTRIBUTED,
    Alignment,
    CallPlace,
    collective_keys,
    collective_peers,
    execution_order,
)
from pytest_msprobe.compare.dumps import INPUT, OUTPUT, PARAMETER, ApiEntry, Dump, Leaf, tensor_path
from pytest_msprobe.compare.judging import (
    ERROR,
    SKIPPED,
    UNMATCHED,
    WARNING,
    ApiResult,
    DumpPair,
    RowResult,
    TensorMetrics,
    worst,
)
from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.names import BACKWARD, FORWARD, is_parameters_grad, params_grad_module, parse_name
from pytest_msprobe.thresholds import Thresholds, Tolerance


class TensorRef(NamedTuple):
    """A tensor file to read, with the dtype and shape its dump.json record gives it."""

    path: str
    dtype: str | None
    shape: tuple[int, ...] | None


@dataclass
class Draft:
    """A row under construction (tensor rows wait for their metrics)."""

    row: str
    bench_row: str | None
    api_index: int
    role: str
    target: Leaf | None
    baseline: Leaf | None
    check: judging.Check | None = None
    task: tuple[TensorRef, TensorRef] | None = None  # tensor files to compare
    skip: bool = False
    api: str = ""


@dataclass
class CallDraft:
    """A call under construction: its identity and where its rows are."""

    api: str
    bench_api: str | None
    step: int | None
    rank: int | None
    pair: int
    position: float  # execution position within its dump pair
    direction: str | None
    row_start: int
    row_stop: int
    one_side: bool
    base: str = ""
    module: tuple[str, ...] = ()  # where in the model it was made (pytest_msprobe.compare.dumps.modules)


@dataclass
class Builder:
    """The rows and calls of the dump pairs added so far."""

    thresholds: Thresholds
    requested_mode: str
    mode: str | None = None
    drafts: list[Draft] = field(default_factory=list)
    apis: list[CallDraft] = field(default_factory=list)
    pairs: list[DumpPair] = field(default_factory=list)
    feeds: dict[int, list[int]] = field(default_factory=dict)
    tasks: list[int] = field(default_factory=list)  # draft indices waiting for tensor metrics
    opaque: set[int] = field(default_factory=set)  # calls whose inputs are unknown
    structural: dict[int, int] = field(default_factory=dict)  # call -> the one-side call that fed it
    # pair -> the records (target, baseline) of weights an update left moved by rounding noise -> the update
    noise: dict[int, dict[tuple[Any, Any], str]] = field(default_factory=dict)
    # what each module path of the calls is, and which files told where the calls were made
    modules: dict[tuple[str, ...], str] = field(default_factory=dict)
    module_sources: list[str] = field(default_factory=list)
    # what was set aside, neither compared nor unmatched (an optimizer that records no update per parameter)
    set_aside: list[str] = field(default_factory=list)
    # pair -> the stacks of calls that stack.json does not hold (a parameter's update: its optimizer.step())
    extra_stacks: dict[int, dict[str, tuple[str, ...]]] = field(default_factory=dict)

    def merge(self, part: Builder) -> None:
        """Append the pairs of ``part`` (a builder of later dump pairs) to this one."""
        if part.mode is not None:
            if self.mode is not None and part.mode != self.mode:
                raise DumpFormatError(
                    part.pairs[0].target,
                    f"is a {part.mode} dump while earlier steps/ranks were compared as {self.mode}",
                )
            self.mode = part.mode
        rows, calls, pairs = len(self.drafts), len(self.apis), len(self.pairs)
        for d in part.drafts:
            d.api_index += calls
        for a in part.apis:
            a.row_start += rows
            a.row_stop += rows
            a.pair += pairs
        self.drafts.extend(part.drafts)
        self.apis.extend(part.apis)
        self.pairs.extend(part.pairs)
        self.feeds.update({i + calls: [j + calls for j in fed] for i, fed in part.feeds.items()})
        self.opaque.update(i + calls for i in part.opaque)
        self.structural.update({i + calls: j + calls for i, j in part.structural.items()})
        self.noise.update({p + pairs: weights for p, weights in part.noise.items()})
        for path, about in part.modules.items():
            self.modules.setdefault(path, about)
        self.module_sources.extend(s for s in part.module_sources if s not in self.module_sources)
        self.set_aside.extend(part.set_aside)
        self.extra_stacks.update({p + pairs: stacks for p, stacks in part.extra_stacks.items()})

    def _resolve_mode(self, t: Dump, b: Dump) -> str:
        if self.requested_mode == "auto":
            if t.task == "tensor" and b.task == "tensor":
                mode = "tensor"
            elif t.has_md5 and b.has_md5:
                mode = "md5"
            else:
                mode = "statistics"
        else:
            mode = self.requested_mode
            for dump in (t, b):
                if mode == "tensor" and dump.task != "tensor":
                    raise DumpFormatError(
                        dump.path, "has no tensor files (task 'statistics'): use statistics mode"
                    )
                if mode == "md5" and not dump.has_md5:
                    raise DumpFormatError(dump.path, "has no md5 (CRC32) values: use statistics mode")
        if self.mode is not None and mode != self.mode:
            raise DumpFormatError(
                t.path, f"is a {mode} dump while earlier steps/ranks were compared as {self.mode}"
            )
        self.mode = mode
        return mode

    def add(self, t: Dump, b: Dump, alignment: Alignment) -> None:
        mode = self._resolve_mode(t, b)
        pair = len(self.pairs)
        step = t.location.step if t.location.step is not None else b.location.step
        rank = t.location.rank if t.location.rank is not None else b.location.rank
        self.pairs.append(
            DumpPair(
                step,
                rank,
                str(t.path),
                str(b.path),
                alignment.method,
                alignment.matched,
                alignment.target_only,
                alignment.baseline_only,
            )
        )
        first_api = len(self.apis)
        for position, (ti, bj) in enumerate(alignment.pairs):
            te = t.entries[ti] if ti is not None else None
            be = b.entries[bj] if bj is not None else None
            self._add_api(te, be, t, b, mode, step, rank, pair, float(position))
        self._link(first_api)

    def _add_api(
        self,
        te: ApiEntry | None,
        be: ApiEntry | None,
        t: Dump,
        b: Dump,
        mode: str,
        step: int | None,
        rank: int | None,
        pair: int,
        position: float,
    ) -> None:
        main = te or be
        assert main is not None
        api_index = len(self.apis)
        parts = main.parts
        start = len(self.drafts)
        if te is None or be is None:
            for leaf in main.leaves:
                tl, bl = (leaf, None) if te is not None else (None, leaf)
                draft = Draft(leaf.name, None if bl is None else leaf.name, api_index, leaf.role, tl, bl)
                draft.check = judging.check_unmatched(tl, bl)
                draft.api = main.name
                self.drafts.append(draft)
        else:
            b_rows = {leaf.suffix: leaf for leaf in be.leaves}
            seen = set()
            for leaf in te.leaves:
                other = b_rows.get(leaf.suffix)
                seen.add(leaf.suffix)
                self._add_row(leaf, other, te.name, be.name, api_index, t, b, mode)
            for leaf in be.leaves:
                if leaf.suffix not in seen:
                    self._add_row(None, leaf, te.name, be.name, api_index, t, b, mode)
        self.apis.append(
            CallDraft(
                api=main.name,
                bench_api=be.name if be is not None else None,
                step=step,
                rank=rank,
                pair=pair,
                position=position,
                direction=parts.direction,
                row_start=start,
                row_stop=len(self.drafts),
                one_side=te is None or be is None,
                base=parts.base,
            )
        )

    def _add_row(
        self,
        tl: Leaf | None,
        bl: Leaf | None,
        t_api: str,
        b_api: str,
        api_index: int,
        t: Dump,
        b: Dump,
        mode: str,
    ) -> None:
        main = tl or bl
        assert main is not None
        draft = Draft(
            row=tl.name if tl is not None else b_api + main.suffix,
            bench_row=bl.name if bl is not None else None,
            api_index=api_index,
            role=main.role,
            target=tl,
            baseline=bl,
            api=t_api,
        )
        self.drafts.append(draft)
        if tl is None or bl is None:
            draft.check = judging.check_unmatched(tl, bl)
            return
        kinds = judging.check_kinds(tl, bl)
        if kinds is not None:
            draft.check = kinds
            return
        tol, draft.skip = self._tolerance(tl, bl, t_api, draft.row, statistics=True)
        if mode == "md5":
            draft.check = judging.finish(judging.check_md5(tl, bl, tol), draft.skip, t_api)
        elif mode == "tensor" and tl.data_name and bl.data_name and tl.shape == bl.shape:
            draft.task = (
                TensorRef(str(tensor_path(t, tl.data_name)), tl.dtype, tl.shape),
                TensorRef(str(tensor_path(b, bl.data_name)), bl.dtype, bl.shape),
            )
            self.tasks.append(len(self.drafts) - 1)
        else:
            check = judging.check_statistics(tl, bl, tol)
            if mode == "tensor" and tl.shape == bl.shape:
                check = judging.amend(check, "no tensor file on one side: statistics compared")
            draft.check = judging.finish(check, draft.skip, t_api)

    def _link(self, first_api: int) -> None:
        """Backward calls read their forward call's tensors; parameters_grad runs with its module's backward."""
        by_name: dict[str, int] = {}
        backward_of: dict[str, list[int]] = {}
        for i in range(first_api, len(self.apis)):
            api = self.apis[i]
            by_name.setdefault(api.api, i)
            if api.direction == BACKWARD and not is_parameters_grad(api.api):
                backward_of.setdefault(api.base, []).append(i)
        backward_end = max(
            (
                a.position
                for a in self.apis[first_api:]
                if a.direction == BACKWARD and not is_parameters_grad(a.api)
            ),
            default=0.0,
        )
        for i in range(first_api, len(self.apis)):
            api = self.apis[i]
            if is_parameters_grad(api.api):
                module = params_grad_module(api.base)
                calls = backward_of.get(module, [])
                self.feeds[i] = list(calls)
                if calls:  # the gradient is complete once the module's last backward call ran
                    api.position = self.apis[calls[-1]].position + 0.5
                else:
                    # no backward record of the module (msprobe loses it behind an in-place ReLU): the gradient
                    # arrives during backward from calls we cannot see
                    api.position = backward_end + 0.5
                    self.opaque.add(i)
            elif api.direction == BACKWARD:
                forward = parse_name(api.api).with_direction(FORWARD)
                if forward in by_name:
                    self.feeds[i] = [by_name[forward]]

    def tensor_files(self) -> list[tuple[TensorRef, TensorRef]]:
        """The tensor file pairs that rows wait for, in row order."""
        files = [self.drafts[i].task for i in self.tasks]
        return [f for f in files if f is not None]

    def _tolerance(
        self, target: Leaf, baseline: Leaf, api: str, row: str, statistics: bool = False
    ) -> tuple[Tolerance, bool]:
        """A row's tolerance, and whether it is skipped. The baseline's dtype sets it: the target must reproduce
        the baseline to its precision; a float32 tensor whose values a half type made, to the looser of the two."""
        tol, skip = self.thresholds.tolerance(baseline.dtype, api, row, statistics=statistics)
        carried = judging.carried_dtype(target, baseline)
        if carried is not None:
            tol = tol.looser(self.thresholds.tolerance(carried, api, row, statistics=statistics)[0])
        return tol, skip

    def add_tensor_metrics(self, results: Sequence[TensorMetrics]) -> None:
        """Judge the rows waiting for tensor files by their metrics (:meth:`tensor_files` order); the file
        names are dropped (the builder may travel back from a worker)."""
        for i, outcome in zip(self.tasks, results):
            draft = self.drafts[i]
            assert draft.target is not None and draft.baseline is not None
            tol, _ = self._tolerance(draft.target, draft.baseline, draft.api, draft.row)
            check = judging.check_tensors(
                draft.target, draft.baseline, outcome, tol, self.thresholds.msprobe_rule
            )
            draft.check = judging.finish(check, draft.skip, draft.api)
            draft.task = None
        self.tasks.clear()

    def finish(
        self,
    ) -> tuple[list[RowResult], list[ApiResult], dict[int, list[int]], dict[int, list[int]]]:
        """Rows and calls as results, with the calls each call reads (``feeds``) and each collective's
        counterparts on the other ranks (``peers``)."""
        rows = [_row_result(d) for d in self.drafts]
        places = [
            CallPlace(
                a.api,
                a.step,
                a.rank,
                a.position,
                # only a collective's group orders anything: the other calls' rows are not searched
                _process_group(self.drafts[a.row_start : a.row_stop])
                if a.api.startswith(DISTRIBUTED)
                else None,
            )
            for a in self.apis
        ]
        keys = collective_keys(places)
        order = {i: n for n, i in enumerate(execution_order(places, keys))}
        apis = [_call_result(a, order[i], rows) for i, a in enumerate(self.apis)]
        return rows, apis, self.feeds, collective_peers(places, keys)


def _process_group(drafts: list[Draft]) -> tuple[int, ...] | None:
    """The ranks of the process group a call names among its inputs (msprobe's ``torch.ProcessGroup`` record)."""
    for d in drafts:
        leaf = d.target or d.baseline
        if leaf is None or leaf.role != INPUT or leaf.type != "torch.ProcessGroup":
            continue
        ranks = leaf.value.get("group_ranks") if isinstance(leaf.value, dict) else None
        if isinstance(ranks, list) and ranks and all(type(r) is int for r in ranks):
            return tuple(sorted(ranks))
    return None


def _row_result(d: Draft) -> RowResult:
    assert d.check is not None
    return RowResult(d.row, d.bench_row, d.api_index, d.role, d.target, d.baseline, *d.check)


_IDENTITY = ("api", "bench_api", "step", "rank", "direction", "row_start", "row_stop", "pair", "module")


def _call_result(a: CallDraft, order: int, rows: Sequence[RowResult]) -> ApiResult:
    """A call with its verdict from its rows: the worst of them (a row only one side has, of a call both
    make, is a warning about the call), its reason that of its worst row (outputs first: they are what the
    call produced), its input and output errors the largest measured."""
    own = rows[a.row_start : a.row_stop]
    input_error = output_error = worst_row = None
    input_breach = output_breach = False
    if a.one_side:
        side = "baseline" if own and own[0].target is None else "target"
        status, reason = UNMATCHED, f"only in the {side}: not compared"
    else:
        counted = [r for r in own if r.status not in (SKIPPED, UNMATCHED) and r.error is not None]
        input_error = max(
            (r.error for r in counted if r.role in (INPUT, PARAMETER) and r.error is not None), default=None
        )
        output_error = max(
            (r.error for r in counted if r.role == OUTPUT and r.error is not None), default=None
        )
        input_breach = any(r.status == ERROR for r in own if r.role in (INPUT, PARAMETER))
        output_breach = any(r.status == ERROR for r in own if r.role == OUTPUT)
        statuses = [WARNING if r.status == UNMATCHED else r.status for r in own]
        status = worst(statuses)
        reason = ""
        if status in (ERROR, WARNING):
            flagged = [(i, r) for i, r in enumerate(own) if statuses[i] == status]
            flagged.sort(key=lambda t: (t[1].role != OUTPUT, -(t[1].error or 0.0)))
            i, r = flagged[0]
            worst_row = a.row_start + i
            reason = f"{r.row}: {r.reason}"
    fields: dict[str, Any] = {name: getattr(a, name) for name in _IDENTITY}  # the call, as drafted
    fields.update(input_error=input_error, output_error=output_error)
    fields.update(input_breach=input_breach, output_breach=output_breach)
    return ApiResult(order=order, status=status, reason=reason, worst_row=worst_row, **fields)
