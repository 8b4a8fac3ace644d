"""The checklist compare: what differs between two runs before any operator is suspected.

msprobe's guide starts every investigation here: most precision problems are not an operator's. Each dump pair's
``checklist.json`` files (see :mod:`pytest_msprobe.format.checklistfile`) are compared, and every difference is one
:class:`Difference` of a kind:

- failures, named for what they are, and the first divergence when they come no later than the first breaching
  call: ``structure`` (module tree, parameter and buffer names, shapes, dtypes), ``hyperparameter`` (an
  optimizer's class or a param group's scalar, at the first step it differs), ``parameter`` and ``buffer``
  (its values at the start of a step), ``data`` (the step's input batch), ``setting`` (a numerics setting the
  two runs compute under differently: TF32, HF32, a reduced reduction, autocast, deterministic algorithms; at
  the first call it changes, see :mod:`pytest_msprobe.compare.checklist.setting_causes`);
- context, never a failure on its own: ``environment`` (a variable that changes numerics), ``version``,
  ``switch`` (torch's numeric switches, the seed, an optimizer's implementation flags, a setting that changes
  no recorded call); a difference expected between two device types (CUDA's versions and switches against an
  NPU's, TF32 against HF32) is marked ``expected``.

How values are held: the batch exactly (it is read, not computed: the same data gives the same bytes on every
device); parameters and buffers exactly at step 0 (the initial weights: same seed, same init, same bytes), and at
a later step within their dtype's tolerance on each statistic (training on two devices moves them by rounding).
A parameter at the start of step N is checked only when step N - 1 was not compared: when it was, every change
made to the parameter during it was compared call by call (and an update from a gradient that is rounding noise
moves a weight far while no call is wrong). Buffers are checked at every step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pytest_msprobe.format.checklistfile import decode_number
from pytest_msprobe.format.numerics import ASPECT_OF_SWITCH, CONV, MATMUL, Policy

STRUCTURE, HYPERPARAMETER, PARAMETER, BUFFER, DATA, SETTING = (
    "structure",
    "hyperparameter",
    "parameter",
    "buffer",
    "data",
    "setting",
)
ENVIRONMENT, VERSION, SWITCH = "environment", "version", "switch"
# in the order they are named at a step (a setting at its first changed call, after the step's start)
FAILING_KINDS = (STRUCTURE, HYPERPARAMETER, PARAMETER, BUFFER, DATA, SETTING)
CONTEXT_KINDS = (ENVIRONMENT, VERSION, SWITCH)


@dataclass(frozen=True)
class Difference:
    """One thing that differs between the two runs' checklists."""

    kind: str  # one of FAILING_KINDS or CONTEXT_KINDS
    name: str  # "c2.weight", "lr", "NVIDIA_TF32_OVERRIDE", "torch", "args.0"
    step: int | None
    rank: int | None
    target: str  # the target's value, as text ("unset" for an unset variable)
    baseline: str
    detail: str  # what differs, in a few words
    where: str = ""  # "before step 0", "param group 0", "the model's forward"
    expected: bool = False  # context that two device types are expected to differ in
    # a weight or buffer held to its tolerance at a later step: it may have drifted there by the calls of the
    # steps before, so a call wrong by its own evidence at this step comes first
    drift: bool = False
    # a setting: the first call it changes (target name) and its index in the compare's calls, where known
    call: str = ""
    call_index: int | None = None
    no_call: bool = False  # context: a setting whose calls do not occur in the dumps

    @property
    def mark(self) -> str:
        """What a context difference is: `` (expected)`` between two device types, `` (changes no recorded
        call)`` for a setting without calls to change; empty otherwise."""
        if self.expected:
            return " (expected)"
        return " (changes no recorded call)" if self.no_call else ""

    def context_text(self) -> str:
        """``switch cudnn.allow_tf32: True vs False (expected)``."""
        return f"{self.kind} {self.name}: {self.target} vs {self.baseline}{self.mark}"

    @property
    def failing(self) -> bool:
        return self.kind in FAILING_KINDS

    def headline(self, with_rank: bool = False) -> str:
        """``parameter c2.weight (before step 0): its values differ ...``; ``data (step 0, rank 1): ...``;
        ``setting torch.backends.cudnn.allow_tf32 (target True; the baseline's cpu has none):
        Functional.conv2d.0.forward (step 0) is the first call it changes``."""
        if self.kind == SETTING and self.call and with_rank and self.rank is not None:
            detail = f"{self.call} (step {self.step}, rank {self.rank}) is the first call it changes"
            return f"{self.kind} {self.name} ({self.where}): {detail}"
        where = self.where
        if with_rank and self.rank is not None:
            where = f"{where}, rank {self.rank}" if where else f"rank {self.rank}"
        name = f" {self.name}" if self.name and self.kind != DATA else ""
        return f"{self.kind}{name}" + (f" ({where})" if where else "") + f": {self.detail}"

    @property
    def meaning(self) -> str:
        """What a failing difference means for the run, and where to look (under the first divergence)."""
        if self.kind == DATA:
            return (
                "the step's input batch is not the baseline's: the runs do not train on the same data (another "
                "data set or preprocessing, shuffling, random augmentation, or data made on the device with its "
                "own random generator: make it on the CPU and move it); every call after it reads other numbers"
            )
        if self.kind in (PARAMETER, BUFFER):
            what = "weights" if self.kind == PARAMETER else "buffers"
            if self.step == 0:
                return (
                    f"the initial {what} are not the baseline's: the same seed and the model built on the CPU "
                    "before it is moved (or the same checkpoint) give the same bytes on every device; every call "
                    "that reads it differs from here on"
                )
            return (
                f"the {what} changed before this step in a way no compared call shows (steps that were not "
                "dumped, or a change made outside the dumped calls): dump the steps before it, or a trend of "
                "every step"
            )
        if self.kind == SETTING:
            aspect = ASPECT_OF_SWITCH.get(self.name)
            what = f"{self.name}: {aspect.what}" if aspect is not None else f"{self.name} changes the numbers"
            changed = (
                f"{self.call} and the calls of its kind after it differ by that much"
                if self.call
                else "the calls it governs differ by that much"
            )
            return (
                f"{what}. The two runs do not compute under the same setting, so {changed}, and every call after "
                "them reads the difference: no call is at fault"
            )
        if self.kind == HYPERPARAMETER:
            return (
                "the optimizer is not set as the baseline's: the runs do not train the same way (an lr "
                "scheduler's value of this step included); set them alike before looking at any operator"
            )
        return (
            "the two runs do not train the same model (module tree, parameter or buffer names, shapes or "
            "dtypes): the calls cannot be held to each other until they do"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "step": self.step,
            "rank": self.rank,
            "where": self.where,
            "target": self.target,
            "baseline": self.baseline,
            "detail": self.detail,
            "failing": self.failing,
            "expected": self.expected,
            **(
                {"call": self.call or None, "no_call": self.no_call} if self.kind in (SETTING, SWITCH) else {}
            ),
        }


@dataclass(frozen=True)
class ChecklistResult:
    """Every checklist difference of a compare: failures in the order they happen, then context."""

    differences: tuple[Difference, ...]
    checked: int  # dump pairs whose two checklists were compared
    unchecked: tuple[str, ...] = ()  # why a dump pair's checklists were not (a side without one)
    # each compared dump pair's numerics policies (target, baseline): device type, formats, autocast
    policies: tuple[tuple[Policy, Policy], ...] = ()

    @property
    def failures(self) -> list[Difference]:
        """The differences that fail the compare: all but the context and the drifts."""
        return [d for d in self.differences if d.failing and not d.drift]

    @property
    def drifts(self) -> list[Difference]:
        """Weights or buffers beyond their tolerance at a later step, when no compared step shows how they got
        there: the divergence may have begun before the compared steps; they are reported, but fail nothing and
        are never the first divergence (two devices' training moves weights apart, Adam's update from a
        gradient that is rounding noise moves one far, and a call wrong from step 0 moves them too)."""
        return [d for d in self.differences if d.failing and d.drift]

    @property
    def context(self) -> list[Difference]:
        return [d for d in self.differences if not d.failing]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def first(self) -> Difference | None:
        """The first failing difference: the model's structure, else the earliest step's hyperparameter,
        parameter, buffer or data difference (in that order within a step), lowest rank first."""
        return self.failures[0] if self.failures else None

    def context_line(self, limit: int = 4) -> str | None:
        """``environment NVIDIA_TF32_OVERRIDE: unset vs 0; version torch: 2.4.0 vs 2.1.0 (expected)``."""
        shown = self.context
        if not shown:
            return None
        parts = [d.context_text() for d in shown[:limit]]
        more = f"; and {len(shown) - limit} more" if len(shown) > limit else ""
        return "; ".join(parts) + more

    def cross_device(self) -> str | None:
        """Whether the two runs ran on different device types or under a different numerics policy, and why, in
        words (``the baseline ran on cuda, the target on cpu``); None when neither is known to differ (dump
        pairs without both checklists say nothing)."""
        return cross_device(self.policies)

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked_dump_pairs": self.checked,
            "unchecked": list(self.unchecked),
            "passed": self.passed,
            "failures": [d.to_dict() for d in self.failures],
            "drifts": [d.to_dict() for d in self.drifts],
            "context": [d.to_dict() for d in self.context],
            "cross_device": self.cross_device(),
        }


_CALLS_OF = {CONV: "convolutions", MATMUL: "matmuls"}


def cross_device(policies: Iterable[tuple[Policy, Policy]]) -> str | None:
    """``the baseline ran on cuda, the target on cpu; the target computes float32 convolutions in float32, the
    baseline in tf32 (torch.backends.cudnn.allow_tf32 True)`` for the (target, baseline) policies of the dump
    pairs; None when none differ (or there are none)."""
    reasons: dict[str, None] = {}
    for t, b in policies:
        if t.device != b.device:
            reasons[f"the baseline ran on {b.device}, the target on {t.device}"] = None
        for kind, calls in _CALLS_OF.items():
            tf, bf = t.format_of(kind), b.format_of(kind)
            if tf != bf:
                reasons[
                    f"the target computes float32 {calls} in {_format_text(t, kind)}, the baseline in "
                    f"{_format_text(b, kind)}"
                ] = None
        if t.autocast != b.autocast:
            reasons[
                f"the target runs under autocast {t.autocast or 'off'}, the baseline {b.autocast or 'off'}"
            ] = None
    return "; ".join(reasons) or None


def _format_text(policy: Policy, kind: str) -> str:
    setting = policy.setting_of(kind)
    fmt = policy.format_of(kind)
    return f"{fmt} ({setting[0]} {setting[1]})" if setting is not None else fmt


def order_key(d: Difference) -> tuple[int, int, int]:
    step = -1 if d.kind == STRUCTURE else (d.step if d.step is not None else -1)
    return (step, FAILING_KINDS.index(d.kind), d.rank or 0)


def value_text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def same_value(a: Any, b: Any) -> bool:
    """Whether two recorded values are the same (NaN is NaN)."""
    if a == b:
        return True
    x, y = decode_number(a), decode_number(b)
    return x is not None and y is not None and math.isnan(x) and math.isnan(y)
