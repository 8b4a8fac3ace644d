"""Across devices: a call fails by its own error, or where its error provably enters, never for drift.

Two steps of training a model on two devices (or under two numerics settings) amplify each device's rounding
beyond any value threshold, and that is no fault: a random-weight ResNet50's two steps differ in most calls
between two CPUs' thread counts. So when the two runs' checklists say they ran on different device types or
under a different numerics policy (:meth:`pytest_msprobe.compare.checklist.differences.ChecklistResult.cross_device`), a breaching call is judged by what can tell a fault from rounding:

- where the call has its own error on the target (the self-check's ``self_check.json``, or a replay of a tensor
  dump): it fails when its own error is out of line (against its device's declared precision and, where the
  baseline has its own error for the same call, beyond the baseline's by the ratios of msprobe's precision
  standard), whether or not its values breach; it does not fail when its own error is in line;
- where it has none: it fails when the error provably enters there: its outputs breach while its inputs match
  the baseline (within a tenth of their tolerance), or its statistics break a relation that holds whatever its
  inputs (:mod:`pytest_msprobe.compare.judging.stat_relations`);
- always: an overflow on the target only, a row whose two sides cannot be compared as numbers (another shape,
  NaN/Inf on one side only, statistics that are unusable), and every failing checklist difference (data, weights,
  hyperparameters, structure, a numerics setting) fail as on one device.

Every other breaching call *drifts*: it stays in the reports (a warning, its rows with their errors, ``drift
across devices`` in its reason) and fails nothing. Value differences still decide where an error is said to
enter, and what is shown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from pytest_msprobe.compare.diagnosis.calls import Calls
from pytest_msprobe.compare.judging import ERROR, WARNING, ApiResult, Overflow, OwnErrorVerdict, RowResult

DRIFT = "drift across devices"


@dataclass(frozen=True)
class AcrossDevices:
    """How a compare across devices judged its calls: ``why`` the runs count as on different devices (``the
    baseline ran on cuda, the target on cpu``), whether the target's calls had own errors to judge by, and how
    many breaching calls drift (reported, not failing) or fail by evidence."""

    why: str
    own_errors: bool
    drift_calls: int
    evidence_calls: int

    @property
    def rule(self) -> str:
        """The rule that judged the calls, in words (for the reports)."""
        if self.own_errors:
            return (
                "each call is judged by its own error against the float64 replay of its inputs (out of line "
                "fails; values that drift from the baseline's do not)"
            )
        return (
            "values alone cannot tell rounding amplified by training from a fault: a call fails only where its "
            "error provably enters (its outputs breach while its inputs match the baseline), where its "
            "statistics break a relation that holds whatever its inputs, or where it overflows; run both sides "
            "with --msprobe-self-check to judge every call by its own error"
        )

    def line(self) -> str:
        """``across devices (the baseline ran on cuda, the target on cpu): 700 calls drift beyond the value
        thresholds and do not fail; <rule>``."""
        drift = (
            f"{self.drift_calls} call{'s' if self.drift_calls != 1 else ''} drift beyond the value thresholds "
            "and do not fail"
            if self.drift_calls
            else "no call drifts beyond the value thresholds"
        )
        return f"across devices ({self.why}): {drift}; {self.rule}"

    def to_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "rule": self.rule}


def judge_across(
    why: str,
    apis: list[ApiResult],
    rows: list[RowResult],
    feeds: Mapping[int, Sequence[int]],
    peers: Mapping[int, Sequence[int]],
    opaque: Collection[int],
    noise: Collection[int],
    own: Mapping[int, OwnErrorVerdict],
    relations: Mapping[int, str],
    overflow: Overflow | None,
) -> AcrossDevices:
    """Judge the calls of a compare across devices (see the module docstring), in place: a drifting call and its
    error rows become warnings, a call out of line by its own error an error."""
    has_own = any(v.target is not None for v in own.values())
    overflowing = overflow.api_index if overflow is not None else None
    # decided on the compare as it stands, then applied: a call's evidence reads its feeds' breaches
    out_of_line: list[int] = []
    drifting: list[tuple[int, str]] = []
    evidence = 0
    # the calls and the inputs from outside them, read once for every call asked about
    calls = Calls.of(apis, rows, feeds, opaque, peers, frozenset(noise))
    for i, api in enumerate(apis):
        verdict = own.get(i)
        judged = verdict is not None and not verdict.skipped
        if judged and verdict is not None and verdict.out_of_line:
            out_of_line.append(i)
            evidence += 1
        elif api.status != ERROR:
            continue
        elif (
            i == overflowing
            or any(rows[j].status == ERROR and rows[j].problem for j in api.rows)
            or (not judged and (i in relations or (api.output_breach and calls.inputs_match(i))))
        ):
            evidence += 1
        else:
            drifting.append((i, "its own error is in line" if judged else "its inputs already differ"))
    for i in out_of_line:
        if apis[i].status != ERROR:
            apis[i] = dataclasses.replace(apis[i], status=ERROR, reason=f"out of line: {own[i].reason}")
    for i, because in drifting:
        _drift(apis, rows, i, because)
    return AcrossDevices(why, has_own, len(drifting), evidence)


def _drift(apis: list[ApiResult], rows: list[RowResult], i: int, because: str) -> None:
    api = apis[i]
    for j in api.rows:
        row = rows[j]
        if row.status == ERROR:
            rows[j] = dataclasses.replace(row, status=WARNING, reason=f"{DRIFT} ({because}): {row.reason}")
    apis[i] = dataclasses.replace(
        api, status=WARNING, output_breach=False, reason=f"{DRIFT} ({because}): {api.reason}"
    )
