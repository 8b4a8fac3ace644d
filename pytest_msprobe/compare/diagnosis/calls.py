"""The compared calls as the first divergence's rules read them: each call's inputs (its own, the tensors
its forward call saw, a collective's peers' inputs), which of them came from outside the recorded calls
(:mod:`pytest_msprobe.compare.diagnosis.sources`), and where a divergence points (see
:mod:`pytest_msprobe.compare.diagnosis.divergence`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from pytest_msprobe.compare.diagnosis.rules import Divergence
from pytest_msprobe.compare.diagnosis.sources import NO_SOURCES, Sources, find_sources
from pytest_msprobe.compare.dumps import OUTPUT
from pytest_msprobe.compare.judging import ERROR, UNMATCHED, ApiResult, RowResult, shape_differs

# an input whose error exceeds this fraction of its tolerance does not count as matching the baseline (the
# warning level of the default dtype table): an output can only be where the error enters if its inputs are clean
NEAR_FRACTION = 0.1


def inputs_of_other_shapes(api: ApiResult, rows: Sequence[RowResult]) -> list[int]:
    """The breaching input rows of a call whose two tensors have other shapes (indices into ``rows``)."""
    return [
        j for j in api.rows if rows[j].role != OUTPUT and rows[j].status == ERROR and shape_differs(rows[j])
    ]


@dataclass(frozen=True)
class Calls:
    """The compared calls with what their inputs are made of."""

    apis: Sequence[ApiResult]
    rows: Sequence[RowResult]
    feeds: Mapping[int, Sequence[int]]
    opaque: Collection[int]
    peers: Mapping[int, Sequence[int]]
    noise: frozenset[int] = frozenset()
    sources: Sources = NO_SOURCES

    @classmethod
    def of(
        cls,
        apis: Sequence[ApiResult],
        rows: Sequence[RowResult],
        feeds: Mapping[int, Sequence[int]],
        opaque: Collection[int],
        peers: Mapping[int, Sequence[int]],
        noise: frozenset[int],
    ) -> Calls:
        """The calls, with the inputs that came from outside the recorded calls."""
        # (a tensor of another shape is another model's or data's, not an input that came in from outside)
        differs = frozenset(
            j
            for j, r in enumerate(rows)
            if (r.status == ERROR or (j not in noise and close_to_line(r))) and not shape_differs(r)
        )
        return cls(apis, rows, feeds, opaque, peers, noise, find_sources(apis, rows, differs))

    def near(self, j: int) -> bool:
        # within a tenth of its tolerance: a row this close to the line does not "match" the baseline; nor
        # does one whose difference is too small to measure, nor a weight that drifts
        return j in self.noise or j in self.sources.drifting or close_to_line(self.rows[j])

    def inputs_match(self, i: int) -> bool:
        """Whether every input of call ``i`` matches the baseline (within a tenth of its tolerance; see rule 1):
        then an output that breaches shows the error entering at this call."""
        return not self.effective_inputs(i)[2]

    def effective_inputs(self, i: int) -> tuple[float | None, bool, bool]:
        """(largest input error, whether an input breaches, whether an input is near or over its tolerance)."""
        apis, rows, near = self.apis, self.rows, self.near
        api = apis[i]
        errors = [api.input_error] if api.input_error is not None else []
        breach = api.input_breach or i in self.opaque
        # (an output held to a tighter tolerance than an input, a float32 loss of a bfloat16 logit, is off by
        # that input's error: the input matches only within a tenth of the output's tolerance)
        tight = min((a for j in api.rows if rows[j].role == OUTPUT and (a := rows[j].allowed)), default=None)
        tainted = breach or any(
            near(j) or (tight is not None and (rows[j].error or 0.0) > tight * NEAR_FRACTION)
            for j in api.rows
            if rows[j].role != OUTPUT
        )
        for j in self.feeds.get(i, ()):
            other = apis[j]
            if other.status == UNMATCHED:
                continue
            errors.extend(e for e in (other.input_error, other.output_error) if e is not None)
            breach = breach or other.input_breach or other.output_breach
            tainted = tainted or breach or any(near(k) for k in other.rows)
        for j in self.peers.get(i, ()):
            other = apis[j]
            if other.status == UNMATCHED:
                continue
            if other.input_error is not None:
                errors.append(other.input_error)
            breach = breach or other.input_breach
            tainted = tainted or breach or any(near(k) for k in other.rows if rows[k].role != OUTPUT)
        return (max(errors) if errors else None), breach, tainted

    def at(self, i: int, rule: str, why: str, row: int | None = None) -> Divergence:
        """The divergence at call ``i``, pointing at ``row`` (by default its worst output row)."""
        api = self.apis[i]
        if row is None:
            row = worst_output_row(api, self.rows)
        return Divergence(api.api, self.rows[row].row, api.step, api.rank, why, rule, i, row)


def close_to_line(r: RowResult) -> bool:
    """Whether a row's measured difference is over a tenth of its tolerance."""
    return r.error is not None and r.allowed is not None and r.error > r.allowed * NEAR_FRACTION


def worst_output_row(api: ApiResult, rows: Sequence[RowResult]) -> int:
    candidates = [i for i in api.rows if rows[i].role == OUTPUT and rows[i].status == ERROR]
    if not candidates:
        candidates = [i for i in api.rows if rows[i].status == ERROR] or list(api.rows)
    return max(candidates, key=lambda i: (rows[i].error or 0.0, -i))


def suffix(api: ApiResult, rows: Sequence[RowResult], i: int) -> str:
    return rows[i].row[len(api.api) :] if rows[i].row.startswith(api.api) else rows[i].row
