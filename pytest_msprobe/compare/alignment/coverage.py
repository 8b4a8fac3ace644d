"""How much of the baseline a compare paired with the target: per dump pair and over all, against the limit."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from pytest_msprobe.thresholds import format_share

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
class Counts:
    """How many calls and rows a baseline has, and how many of them found no partner in the target."""

    baseline_calls: int
    unmatched_calls: int  # baseline calls the target does not make
    baseline_rows: int
    # baseline rows without a partner (those of unmatched calls and extra items of paired ones)
    unmatched_rows: int

    @property
    def share(self) -> float:
        """The share of the baseline's rows that found no partner."""
        return self.unmatched_rows / self.baseline_rows if self.baseline_rows else 0.0


def added(counts: Iterable[Counts]) -> Counts:
    """The counts of several dump pairs, added up."""
    items = list(counts)
    return Counts(
        sum(c.baseline_calls for c in items),
        sum(c.unmatched_calls for c in items),
        sum(c.baseline_rows for c in items),
        sum(c.unmatched_rows for c in items),
    )


@dataclass(frozen=True)
class PairCoverage(Counts):
    """How much of one dump pair's baseline found a partner in the target."""

    step: int | None
    rank: int | None


@dataclass(frozen=True)
class Coverage(Counts):
    """How much of the baseline was compared, each dump pair held to ``Thresholds.max_unmatched``; its counts
    are those of every pair, added up (:meth:`of`).

    A pair above the limit fails the compare whatever its compared rows say: a run that skipped its backward
    pass, dumped another level or trained another model pairs few rows, and the few may well agree.
    """

    limit: float
    pairs: tuple[PairCoverage, ...]  # CompareResult.pairs order
    over: tuple[int, ...]  # indices into pairs: those above the limit
    # CompareResult.apis indices: the over pairs' first unmatched baseline calls
    first_unmatched: tuple[int, ...]

    @classmethod
    def of(
        cls,
        limit: float,
        pairs: tuple[PairCoverage, ...],
        over: tuple[int, ...],
        first_unmatched: tuple[int, ...],
    ) -> Coverage:
        return cls(
            **asdict(added(pairs)), limit=limit, pairs=pairs, over=over, first_unmatched=first_unmatched
        )

    @property
    def passed(self) -> bool:
        return not self.over

    @property
    def headline(self) -> str | None:
        """``too little compared: 18 of 26 baseline calls (40 of 52 rows, 77%) found no partner in the target;
        the limit is 5%``, counted over the pairs above the limit (named when not all are); None when none is."""
        if not self.over:
            return None
        counts = added(self.pairs[i] for i in self.over)
        calls, calls_of = counts.unmatched_calls, counts.baseline_calls
        rows, rows_of = counts.unmatched_rows, counts.baseline_rows
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
