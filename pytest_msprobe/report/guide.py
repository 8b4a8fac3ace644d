"""The next steps of msprobe's guide to training precision problems, as the advisor gives them: settle the
checklist first (data, weights, settings), follow the trend to the first step that parts, then dump that step
and the suspect's tensors."""

from __future__ import annotations

from pytest_msprobe.compare.diagnosis import Divergence
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.format.names import scope_key
from pytest_msprobe.options import ALLOW_TF32

# what to do next for a checklist difference, by kind (msprobe's guide: settle the checklist first)
CHECKLIST_NEXT = {
    "data": "Make both runs read the same batches: the same files and preprocessing, no shuffling (or the "
    "same seeded order), augmentation off or seeded on the CPU, random tensors made on the CPU and moved. "
    "Then compare again: the calls' differences will mostly go with it.",
    "parameter": "Start both runs from the same weights: build the model after seed_all on the CPU and move "
    "it, or save a state_dict on the reference device and load it on the other. A weight that differs at a "
    "later step changed in steps that were not dumped: dump the steps before it, or record a trend of every "
    "step (trend_steps) to find where the runs part.",
    "buffer": "Give both runs the same buffers (a mask, running statistics, a position table): they are part "
    "of the initial state as the weights are. One that differs at a later step changed in steps that were "
    "not dumped: dump the steps before it.",
    "hyperparameter": "Set the optimizer alike in both scripts (learning rate, momentum, betas, weight decay, "
    "and the lr scheduler's value at this step), then compare again.",
    "structure": "Run the same model code in both (the module tree, the names, shapes and dtypes of its "
    "parameters and buffers): a different version of the model code or of a library that builds it, or a "
    "dtype cast on one side only.",
    "setting": "Run both sides with the same setting. Under pytest the msprobe fixture's default computes "
    "float32 math in float32 on every device (TF32 and HF32 off) with deterministic algorithms, for the "
    f"baseline's run as for this one; {ALLOW_TF32.flag} (ini {ALLOW_TF32.ini}, marker {ALLOW_TF32.marker}=True) "
    "leaves TF32 and HF32 as the device has them instead, and then belongs on both runs (regenerate the "
    "baseline with it). Autocast and the reduced reductions of half-type matmuls are the test's own code: set "
    "them alike on both. Outside pytest, set the switch alike in both scripts. A looser tolerance is no fix: "
    "the setting's error would hide a real fault.",
}


def next_steps(result: CompareResult, fd: Divergence) -> str:
    """What to dump next, as msprobe's guide goes: the step where it diverges, at mix level, the suspect's
    tensors, then the suspect alone (its own error against a float64 replay)."""
    api = scope_key(fd.api)  # both directions of the call
    step = fd.step if fd.step is not None else 0
    if result.mode != "tensor":
        first = (
            f"dump step {step} again with task='tensor' and list=['{api}'] (only the suspect's tensors), "
            f"at level 'mix' to see the module it runs in"
        )
    else:
        first = f"the suspect's tensors are in this dump (step {step})"
    tail = (
        "then replay it alone in float64 (pytest-msprobe replay DUMP -o OUT, or --msprobe-self-check) to "
        "confirm that its own error, not its inputs', is out of line"
    )
    if step > 0:
        tail += (
            f"; a divergence first seen at step {step} may have entered in step {step - 1}'s backward or "
            "optimizer step: dump that step too if it was not"
        )
    return f"{first}; {tail}."


def checklist_lines(result: CompareResult) -> list[str]:
    """The checklist part of the advisor: its differences (failures first), the context, what was not
    checked."""
    checklist = result.checklist
    if checklist is None:
        return []
    several = result.several_ranks
    lines: list[str] = []
    if checklist.failures:
        lines.append("Checklist differences (what is checked before any operator is suspected):")
        lines.extend(f"  {d.headline(several)}" for d in checklist.failures[:12])
        if len(checklist.failures) > 12:
            lines.append(f"  ... and {len(checklist.failures) - 12} more")
    if checklist.drifts:
        lines.append(
            "Weights or buffers beyond their tolerance at a later step (no compared step shows how they got there; "
            "they fail nothing on their own):"
        )
        lines.extend(f"  {d.headline(several)}" for d in checklist.drifts[:6])
    if checklist.context:
        lines.append(
            "Context that differs (never a failure on its own; 'expected' between these two device types):"
        )
        lines.extend(f"  {d.context_text()}" for d in checklist.context[:20])
    if checklist.unchecked:
        lines.append("Not checked:")
        lines.extend(f"  {why}" for why in checklist.unchecked[:6])
    return lines


def trend_advice(result: CompareResult) -> str | None:
    """What the trend's first divergence says, following msprobe's guide for a loss that drifts over a long
    run: the first step K where the loss or the gradient norm differs or jumps, then the backward of step K-1
    and the forward of step K dumped (small models at level mix, large ones at L0 first)."""
    t = result.trend
    if t is None or t.first_step is None:
        return None
    k = t.first_step
    text = [f"Trend: {t.headline}."]
    if t.module is not None:
        text.append(f"The first module whose gradient norm differs there is {t.module}.")
    if t.nan_steps:
        text.append(
            f"NaN/Inf on one side only from step {t.nan_steps[0]}: look for the first overflow there."
        )
    where = f"the backward of step {k - 1} and the forward of step {k}" if k > 0 else "step 0"
    text.append(
        f"msprobe's guide for a loss that drifts: take the first step where the loss or the gradient norm "
        f"differs or jumps (step {k}) and dump {where}: a precision problem of the backward shows first in the "
        "next step's loss. Small models at level mix; large ones at L0 first, then L1 for the suspect module."
    )
    if t.rerun_steps:
        steps = ", ".join(map(str, t.rerun_steps))
        if result.failures:
            text.append(
                f"Steps {steps} were dumped again (the test body re-run with the same seed): see above."
            )
        else:
            text.append(
                f"Steps {steps} were dumped again (the test body re-run with the same seed) and agree within "
                "the API thresholds: the difference builds up from rounding, or from what the dump does not "
                "record; compare more steps before it, or a tensor dump of the suspect modules."
            )
    return " ".join(text)
