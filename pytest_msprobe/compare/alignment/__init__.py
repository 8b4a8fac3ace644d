"""Pairing the two dumps' calls: by name, then in execution order (an edit script that survives inserted,
removed and reordered calls), by content where kernels differ, ranks ordered by their collectives; and how much
of the baseline found a partner (:class:`Coverage`)."""

from __future__ import annotations

from pytest_msprobe.compare.alignment.align import Alignment, align
from pytest_msprobe.compare.alignment.coverage import (
    UNMATCHED_CAUSES,
    Coverage,
    PairCoverage,
    unmatched_share,
)
from pytest_msprobe.compare.alignment.rank_order import (
    DISTRIBUTED,
    CallPlace,
    collective_keys,
    collective_op,
    collective_peers,
    execution_order,
)

__all__ = [
    "DISTRIBUTED",
    "UNMATCHED_CAUSES",
    "Alignment",
    "CallPlace",
    "Coverage",
    "PairCoverage",
    "align",
    "collective_keys",
    "collective_op",
    "collective_peers",
    "execution_order",
    "unmatched_share",
]
