"""How much of the baseline a compare paired with the target: per dump pair and over all, against the limit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pytest_msprobe.compare.thresholds import format_share

# why a baseline's calls find no partner in the target, most common first
UNMATCHED_CAUSES = (
    "an optimizer step made on one side only, or whose calls no optimizer.json, construct.json or stack.json "
    "tells apart",
    "a skipped backward() or optimizer.step()",
    "another dump level (L0, L1, mix)",
    "another model or other data",
    "an API list that differs between msprobe versions",
)


@dataclass(frozen=True)
class PairCoverage:
    """How much of one dump pair's baseline found a partner in the target."""

    step: int | None
    rank: int | None
    baseline_calls: int
    unmatched_calls: int  # baseline calls the target does not make
    baseline_rows: int
    # baseline rows without a partner (those of unmatched calls and extra items of paired ones)
    unmatched_rows: int

    @property
    def share(self) -> float:
        return self.unmatched_rows / self.baseline_rows if self.baseline_rows else 0.0


@dataclass(frozen=True)
class Coverage:
    """How much of the baseline was compared, each dump pair held to ``Thresholds.max_unmatched``.

    A pair above the limit fails the compare whatever its compared rows say: a run that skipped its backward
    pass, dumped another level or trained another model pairs few rows, and the few may well agree.
    """

    limit: float
    pairs: tuple[PairCoverage, ...]  # CompareResult.pairs order
    over: tuple[int, ...]  # indices into pairs: those above the limit
    # CompareResult.apis indices: the over pairs' first unmatched baseline calls
    first_unmatched: tuple[int, ...]

    @property
    def passed(self) -> bool:
        return not self.over

    def _total(self, name: str, pairs: Sequence[int] | None = None) -> int:
        chosen = range(len(self.pairs)) if pairs is None else pairs
        return sum(getattr(self.pairs[i], name) for i in chosen)

    @property
    def baseline_calls(self) -> int:
        return self._total("baseline_calls")

    @property
    def unmatched_calls(self) -> int:
        return self._total("unmatched_calls")

    @property
    def baseline_rows(self) -> int:
        return self._total("baseline_rows")

    @property
    def unmatched_rows(self) -> int:
        return self._total("unmatched_rows")

    @property
    def share(self) -> float:
        """The share of all the baseline's rows that found no partner."""
        rows = self.baseline_rows
        return self.unmatched_rows / rows if rows else 0.0

    @property
    def headline(self) -> str | None:
        """``too little compared: 18 of 26 baseline calls (40 of 52 rows, 77%) found no partner in the target;
        the limit is 5%``, counted over the pairs above the limit (named when not all are); None when none is."""
        if not self.over:
            return None
        calls, calls_of = self._total("unmatched_calls", self.over), self._total("baseline_calls", self.over)
        rows, rows_of = self._total("unmatched_rows", self.over), self._total("baseline_rows", self.over)
        where = ""
        if len(self.over) < len(self.pairs):
            named = "; ".join(_place(self.pairs[i].step, self.pairs[i].rank) for i in self.over[:3])
            more = f" and {len(self.over) - 3} more" if len(self.over) > 3 else ""
            where = f"in {named}{more} ({len(self.over)} of {len(self.pairs)} dump pairs), "
        return (
            f"too little compared: {where}{calls} of {calls_of} baseline calls ({rows} of {rows_of} rows, "
            f"{format_share(rows / rows_of)}) found no partner in the target; the limit is "
            f"{format_share(self.limit)}" + (" per dump pair" if where else "")
        )


def _place(step: int | None, rank: int | None) -> str:
    parts = [f"step {step}" if step is not None else "", f"rank {rank}" if rank is not None else ""]
    return ", ".join(p for p in parts if p) or "the dump"


def unmatched_share(coverage: Coverage) -> str:
    """The share of the baseline's rows that found no partner, as messages print it (``77%``)."""
    return format_share(coverage.share)
