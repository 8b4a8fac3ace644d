"""The advisor: where to look first, in msprobe's ``Line`` / ``Suspect Nodes`` / ``Expert Advice`` layout.

``Line`` counts as msprobe 8.3.3's does: the suspect row's index among the rows of the compare table, from 0 at
the first row under the header (its DataFrame index): Line 86 is spreadsheet row 88 of the compare_result sheet,
and ``pandas.read_csv(csv).iloc[86]`` of the CSV.
"""

from __future__ import annotations

import math
import re

from pytest_msprobe.compare.alignment import UNMATCHED_CAUSES, unmatched_share
from pytest_msprobe.compare.diagnosis import (
    BUFFER_SOURCE,
    DATA_SOURCE,
    INCONSISTENT,
    OUT_OF_LINE,
    OVERFLOW,
    PARAMETER_SOURCE,
    ROUNDING,
    SOURCE,
    UNRECORDED_SOURCE,
    Divergence,
)
from pytest_msprobe.compare.dumps import OUTPUT
from pytest_msprobe.compare.judging import ERROR, ApiResult, is_mask_fill, is_tensor, shape_differs
from pytest_msprobe.compare.result import CompareResult, collective
from pytest_msprobe.report.guide import CHECKLIST_NEXT, checklist_lines, next_steps, trend_advice
from pytest_msprobe.report.text import api_site, first_unmatched_text

# APIs whose kernels commonly use parallel reductions or atomics, so two runs may differ by design
_NONDETERMINISTIC = re.compile(
    r"conv|matmul|linear|\bmm\b|bmm|addmm|baddbmm|einsum|nll_loss|cross_entropy|layer_norm|group_norm|"
    r"batch_norm|lstm|gru|rnn|embedding_bag|scatter|index_add|index_put|softmax|attention|cumsum",
    re.IGNORECASE,
)


def _model_differs(result: CompareResult, fd: Divergence) -> bool:
    """Whether the first divergence is a call whose inputs have other shapes (no seed makes them agree)."""
    return fd.rule == "inherited" and any(
        shape_differs(r) for r in result.breaching_inputs(result.apis[fd.api_index])
    )


def _op_name(api: str) -> str:
    parts = api.split(".")
    return parts[1] if len(parts) > 2 else api


# the largest finite value of a dtype, for the overflow advice
_RANGES = {
    "float16": "float16 holds at most 65504",
    "bfloat16": "bfloat16 has float32's range (about 3.4e38) with 8 bits of mantissa",
    "float32": "float32 holds at most about 3.4e38",
    "float8_e4m3fn": "float8_e4m3fn holds at most 448",
    "float8_e5m2": "float8_e5m2 holds at most 57344",
}


def overflow_advice(result: CompareResult, fd: Divergence) -> str:
    """The guide's next steps for an overflow: which step to dump, at which level, what to check."""
    ov = result.overflow
    assert ov is not None
    step = fd.step
    dtype = (ov.dtype or "").rsplit(".", 1)[-1]
    dump_step = f"step {step}" if step is not None else "that step"
    text = [f"{fd.api} is the first call that overflows on the target and not on the baseline: {ov.reason}."]
    if ov.where == "parameter":
        if step:
            text.append(
                f"The weight was broken before {dump_step} began: dump step {step - 1}, its backward and "
                "optimizer step (level mix, or L1), and find the first gradient or update that holds inf/nan "
                f"(task='overflow_check', overflow_nums=-1, step=[{step - 1}] writes just those calls). Check "
                "the learning rate, gradient clipping (after unscaling) and the loss scale."
            )
        else:
            text.append(
                "The weight holds inf/nan at the first step dumped: check the weights the run starts from (a "
                "loaded checkpoint, the initialisation), or dump earlier steps (task='overflow_check' over every "
                "step finds the first overflowing one cheaply), then that step's backward and optimizer update."
            )
    elif ov.where == "input":
        text.append(
            f"A call that was not recorded made the inf/nan: dump {dump_step} again at level mix (modules and "
            "APIs) or with the missing API in the dump's list, to find the operation between the last recorded "
            "call and this one (an API outside the list, a fused or custom operator, an in-place write); check "
            "the input data for inf/nan too."
        )
    else:
        rng = _RANGES.get(dtype)
        text.append(
            f"This call is the suspect: dump {dump_step} with task='tensor' and list=['{_op_name(fd.api)}'] to "
            "see which elements overflow and what it received, and run it alone on those inputs on both devices."
        )
        text.append(
            (f"Check the dtype's range ({rng})" if rng else "Check the dtype's range")
            + ": compute this call in float32 (an autocast list, an upcast before exp, pow, sum or a large "
            "matmul), scale its inputs down, or use bfloat16, which has float32's range; in mixed precision "
            "check the loss scale (a static scale too large overflows the gradients; a dynamic scaler should "
            "skip the step and lower it)."
        )
    text.append(
        "To find the first step that overflows on the target only, cheaply, run both sides with "
        "task='overflow_check' (only the overflowing calls are written) over more steps, then dump that step "
        "with statistics on both sides."
    )
    site = api_site(result, fd.api)
    if site:
        text.append(f"Called from: {site}.")
    return " ".join(text)


# what to check for each kind of input from outside the recorded calls (rule source)
_SOURCE_ADVICE = {
    PARAMETER_SOURCE: (
        "A weight differs before any recorded call touched it: load the same checkpoint, or build the model on the "
        "CPU with the same seed before moving it (initialisers draw from the device's generator otherwise); at a "
        "later step, an update that no compared call shows (a step not dumped, a fused or foreach optimizer)."
    ),
    BUFFER_SOURCE: (
        "A running statistic differs before any recorded call touched it: the same checkpoint, the same momentum "
        "and the same number of earlier steps in training mode on both sides."
    ),
    DATA_SOURCE: (
        "The data differs: the same data set, order and preprocessing on both sides, random augmentation "
        "seeded, and data made on the CPU with its generator before it is moved."
    ),
    UNRECORDED_SOURCE: (
        "An operation that is not recorded made it (a recurrent layer's _VF call, a custom kernel or extension, "
        "code the dump's API list does not cover), or a parameter read directly: look at the code just before "
        "the line that calls it, and add that operation to the dump list or compare it alone."
    ),
}


def advice(result: CompareResult, fd: Divergence) -> str:
    """What the first divergence means and what to try, in a few sentences."""
    if fd.rule == OVERFLOW and result.overflow is not None:
        return overflow_advice(result, fd)
    api = result.apis[fd.api_index]
    row = result.rows[fd.row_index]
    backward = api.direction == "backward" or ".parameters_grad" in api.api
    text: list[str] = []
    if row.status == ERROR and row.error is None and row.stat is None and row.tensor is None:
        # no difference was measured: a record of one side cannot be compared (NaN or missing statistics)
        text.append(f"{row.row} cannot be compared: {row.reason}.")
        if row.reason.startswith("the baseline"):
            text.append(
                "A baseline is a reference only where its numbers are sound: regenerate it from a run that does "
                "not overflow (on the reference device, with the same code), or skip this API with a rule if "
                "its overflow is part of the model."
            )
        else:
            text.append("Dump the target again with statistics on (task statistics or md5).")
    elif fd.rule == OUT_OF_LINE:
        what = "its outgoing gradients" if backward else "its output"
        text.append(
            f"{api.api} computes {what} less precisely than its own inputs allow: against a float64 replay of "
            f"the very inputs it received, {result.own[fd.api_index].reason}. That holds whatever flowed into "
            "it, so this is the call to fix, even where errors already reach every call."
        )
        text.append(
            "Check this API on the target device: the dtype it computes in, a fused, replaced or patched "
            f"implementation{' of its backward' if backward else ''}. Each call's own error on both sides is "
            "in the xlsx's own-error columns."
        )
    elif fd.rule == ROUNDING:
        text.append(
            "No API is out of line: every replayed call computes its output as precisely as a float64 replay "
            f"of its own inputs says it should. The difference ({row.row}: {row.reason}) builds up from "
            "rounding over many calls, each within its own precision."
        )
        text.append(
            "If both devices are right, the target device may need a looser tolerance for this dtype (the "
            "rtol or dtype_rtol setting); if the difference grows from step to step, follow the loss over "
            "more steps before loosening anything."
        )
    elif fd.rule == "enters":
        if backward:
            text.append(
                f"{api.api} turns matching incoming gradients (and matching forward tensors) into different "
                f"outgoing gradients: its backward computes differently on the target. {row.row}: {row.reason}."
            )
            text.append(
                "Check the backward kernel of this API on the target device (its dtype, a fused or replaced "
                "implementation, a custom autograd Function) and compare it alone with the baseline's inputs."
            )
        else:
            text.append(
                f"{api.api} produces a different result from matching inputs: the error enters here. "
                f"{row.row}: {row.reason}."
            )
            text.append(
                "Check this API on the target device: its kernel, the dtype it computes in (a float16/bfloat16 "
                "path, TF32 on the baseline GPU), a fused or patched replacement. To confirm, dump with "
                "task='tensor' and run the API alone on the dumped inputs on both devices."
            )
    elif fd.rule == SOURCE:
        text.append(f"{api.api} is the first call that reads {row.row}, which differs: {fd.reason}.")
        text.append(_SOURCE_ADVICE.get(fd.source or "", _SOURCE_ADVICE[UNRECORDED_SOURCE]))
    elif fd.rule == "structural":
        text.append(f"{fd.reason}.")
        text.append(
            "The two runs do not make the same calls here: compare the model code and the library versions on "
            "both sides (an extra or missing operation, a fused kernel replacing several calls, a changed "
            "forward). Calls that only one side makes cannot be compared, so remove the difference or dump "
            "both sides from the same code."
        )
    elif fd.rule == INCONSISTENT:
        text.append(
            f"{api.api} is not what its own inputs make it: {fd.reason.rsplit(': the error enters', 1)[0]}. "
            "Errors that flowed in cannot explain a broken relation: this is the call to fix."
        )
        text.append(
            "Check this API on the target device: its kernel, the dtype it computes in, a fused, replaced or "
            "patched implementation. A dump with task='tensor' measures its own error against a float64 replay "
            "of its inputs."
        )
    elif fd.rule == "grows":
        text.append(f"Errors already flow into every call, but {api.api} amplifies them: {fd.reason}.")
        text.append(
            "This API is numerically sensitive (normalisation, softmax, division, exp/log, a large reduction) "
            "or computes differently on the target; compare it alone on the baseline's dumped inputs. If the "
            "growth is expected, loosen its threshold with an API rule."
        )
    else:
        inputs = result.breaching_inputs(api)
        which = f"{inputs[0].row}: {inputs[0].reason}" if inputs else "its inputs"
        beyond = bool(inputs) and all(r.error is not None and math.isinf(r.error) for r in inputs)
        reshaped = [r for r in inputs if shape_differs(r)]
        if reshaped:
            text.append(
                f"{api.api}, the first call that breaches, reads inputs of other shapes than the baseline's "
                f"({reshaped[0].row}: {reshaped[0].reason}): the two dumps may not come from the same model or data."
            )
            text.append(
                "Check that both runs use the same model code and configuration (architecture, layer sizes), the "
                "same batch size and input size; a model that changed on purpose needs a new baseline."
            )
        elif beyond:
            text.append(
                f"The inputs of {api.api} differ beyond measure ({which}): one run overflowed before this dump."
            )
            text.append(
                "Dump from an earlier step on both sides to find the first NaN/Inf, and seed both with "
                "seed_all(seed, mode=True)."
            )
        else:
            text.append(
                f"The inputs of {api.api} already differ ({which}), and it is the first call that breaches: "
                "the difference comes from before this dump."
            )
            text.append(
                "Compare an earlier step (dump from the first step on both sides), check that both runs load the "
                "same weights and optimizer state and read the same data, and seed both with "
                "seed_all(seed, mode=True)."
            )
    if result.mode == "md5":
        text.append(
            "In md5 mode any bit difference counts: expect differences between devices; use statistics."
        )
    if _NONDETERMINISTIC.search(_op_name(api.api)) and not _model_differs(result, fd):
        text.append(
            f"{_op_name(api.api)} can be nondeterministic by nature (parallel reductions): make sure both runs "
            "called seed_all(seed, mode=True) before concluding."
        )
    fill = fill_note(result, fd)
    if fill:
        text.append(fill)
    ranks = _other_ranks(result, fd)
    if ranks:
        text.append(ranks)
    site = api_site(result, api.api)
    if site:
        text.append(f"Called from: {site}.")
    return " ".join(text)


def fill_note(result: CompareResult, fd: Divergence) -> str | None:
    """In statistics (and md5) mode: that an input of the first divergence has its range set by a mask fill
    (its Min or Max -1e4, -1e9, +-inf or the dtype's extreme, to 0.1%, on both sides, 64x the other), so its
    statistics cannot show a drift of its other values and the error may enter before; None otherwise."""
    if result.mode == "tensor":
        return None  # (tensor mode measures the values outside a fill)
    for i in result.apis[fd.api_index].rows:
        row = result.rows[i]
        t, b = row.target, row.baseline
        if row.role == OUTPUT or not is_tensor(t) or not is_tensor(b):
            continue
        for name, mine, theirs, other in (("Min", t.min, b.min, b.max), ("Max", t.max, b.max, b.min)):
            if mine is None or theirs is None or other is None or not is_mask_fill(mine, other, b.dtype):
                continue
            if not (mine == theirs or math.isclose(mine, theirs, rel_tol=1e-6)):
                continue
            return (
                f"{row.row} has {name} {mine:g} on both sides, a mask fill (a sentinel value) that sets its range: "
                "its statistics (Max, Min, Mean, Norm) cannot show a drift of its other values, so the error may "
                f"enter before {fd.api} (at the call that writes the fill, a masked_fill or an add of the mask); "
                "a dump with task='tensor' shows it."
            )
    return None


def _other_ranks(result: CompareResult, fd: Divergence) -> str | None:
    """Of a multi-rank compare: the rank where the error enters, and how it reaches the others."""
    ranks = {a.rank for a in result.apis if a.rank is not None}
    if fd.rank is None or len(ranks) < 2:
        return None
    later: dict[int, ApiResult] = {}
    for a in result.failures:
        if a.rank is not None and a.rank != fd.rank:
            later.setdefault(a.rank, a)
    if not later:
        return f"Only rank {fd.rank} breaches (of ranks {', '.join(map(str, sorted(ranks)))}): look at that rank."
    via = [a for a in later.values() if collective(a) is not None]
    text = (
        f"The error enters on rank {fd.rank}; rank(s) {', '.join(map(str, sorted(later)))} breach later "
        f"(first: {'; '.join(f'rank {r}: {a.api}' for r, a in sorted(later.items()))})"
    )
    if via:
        text += ", carried there by the collectives the ranks share: look at rank " + str(fd.rank) + " first"
    return text + "."


def coverage_advice(result: CompareResult) -> str | None:
    """What a compare that paired too little of the baseline means and what to try; None when it paired enough."""
    cov = result.coverage
    if cov.headline is None:
        return None
    headline = cov.headline[0].upper() + cov.headline[1:]
    return (
        f"{headline}: the compare cannot vouch for a run it could not pair. The usual causes: "
        f"{'; '.join(UNMATCHED_CAUSES)}. Dump both runs from the same script and level; if the two really "
        f"make different calls, raise "
        f"max_unmatched (unmatched now: {unmatched_share(cov)} of the baseline's rows)."
    )


def _checklist_advisor(result: CompareResult) -> str | None:
    """The advisor of a compare whose first divergence is a checklist difference."""
    first = result.verdict.checklist
    if first is None:
        return None
    fd = result.first_divergence
    lines = [
        "Line: N/A",
        f"Suspect Nodes: {first.headline(result.several_ranks).split(': ', 1)[0]}",
        f"Expert Advice: {first.detail}: {first.meaning}. {CHECKLIST_NEXT[first.kind]}",
        "",
        *checklist_lines(result),
    ]
    if fd is not None and result.overflow is not None and fd.rule == OVERFLOW:
        lines.append(
            f"It overflows at {fd.api} (step {fd.step}, rank {fd.rank}): {overflow_advice(result, fd)}"
        )
    if fd is not None:
        lines.append(
            f"The first breaching call after it: {fd.api} (step {fd.step}, rank {fd.rank}): {fd.reason}; "
            f"{len(result.failures)} API call(s) breach in total, most or all because of the difference above."
        )
    return "\n".join(lines) + "\n" + _missing_text(result)


def advisor_text(result: CompareResult) -> str:
    """The advisor file's content: led by a checklist difference when one comes first, else by the call
    where the error enters; the checklist's context and differences follow."""
    trend = trend_advice(result)
    aside = _set_aside_text(result)
    if result.across is not None:  # how the calls were judged leads what follows
        trend = "\n".join(
            t for t in (f"{result.across.line()[0].upper()}{result.across.line()[1:]}.", trend) if t
        )
    led = _checklist_advisor(result)
    if led is not None:
        return led + (f"\n{trend}\n" if trend else "") + aside
    text = _call_advisor(result)
    extra = checklist_lines(result)
    return text + ("\n".join(extra) + "\n" if extra else "") + (f"\n{trend}\n" if trend else "") + aside


def _set_aside_text(result: CompareResult) -> str:
    """What the compare set aside on purpose (neither compared nor unmatched), one line per dump pair and cause."""
    if not result.set_aside:
        return ""
    lines = [
        "Set aside (not compared, not unmatched: the two sides' implementations record it differently):",
        *(f"  {note}" for note in result.set_aside),
    ]
    return "\n" + "\n".join(lines) + "\n"


def _call_advisor(result: CompareResult) -> str:
    fd = result.first_divergence
    counts = result.counts()
    uncovered = coverage_advice(result)
    if fd is None:
        compared = counts["rows"] - counts["unmatched"] - counts["skipped"]
        note = (
            f"No API breaches the thresholds: {compared} rows compared, {counts['warning']} warning(s), "
            f"{counts['unmatched']} row(s) present on one side only (not compared)."
        )
        if counts["warning"]:
            note += " Warnings are rows close to their threshold or with a dtype/requires_grad difference."
        if uncovered is not None:
            firsts = result.coverage.first_unmatched
            line, node = "N/A", "N/A"
            if (
                firsts
            ):  # the first baseline call the target does not make, as the row where the sheet shows it
                line, node = str(result.apis[firsts[0]].row_start), result.apis[firsts[0]].api
            return (
                f"Line: {line}\nSuspect Nodes: {node}\nExpert Advice: {uncovered}\n\n{_unmatched_calls(result)}"
                f"Of the rows paired: {note[0].lower()}{note[1:]}\n{_missing_text(result)}"
            )
        own = "\n".join(_out_of_line_calls(result))
        return f"Line: N/A\nSuspect Nodes: N/A\nExpert Advice: {note}\n{own + chr(10) if own else ''}{_missing_text(result)}"
    lines = [
        f"Line: {fd.row_index}",
        f"Suspect Nodes: {fd.row}",
        f"Expert Advice: {advice(result, fd)}",
        "",
        f"Why this API: {fd.reason}.",
        f"Step {fd.step if fd.step is not None else 'n/a'}, rank {fd.rank if fd.rank is not None else 'n/a'}; "
        f"{len(result.failures)} API call(s) breach in total, "
        f"{counts['apis_warning']} with warnings, {counts['apis_unmatched']} call(s) not matched "
        f"({counts['unmatched']} unmatched row(s): inputs and outputs present on one side only).",
    ]
    lines.append(f"Next steps: {next_steps(result, fd)}")
    breached = result.apis[fd.api_index]
    later = [a for a in result.failures if a is not breached][:10]
    if later:
        lines.append("Other breaching calls (execution order; most follow from the first):")
        lines.extend(f"  {a.api} (step {a.step}, rank {a.rank}): {a.reason}" for a in later)
    lines.extend(_out_of_line_calls(result))
    if uncovered is not None:
        lines.extend(["", uncovered, _unmatched_calls(result).rstrip("\n")])
    return "\n".join(lines) + "\n" + _missing_text(result)


def _out_of_line_calls(result: CompareResult) -> list[str]:
    """Lines naming the calls whose own error is out of line (execution order, at most 10)."""
    calls = result.out_of_line
    if not calls:
        return []
    index = {id(a): i for i, a in enumerate(result.apis)}
    lines = [
        f"Calls out of line ({len(calls)}; each call's output against the float64 replay of its own inputs):"
    ]
    lines.extend(
        f"  {a.api} (step {a.step}, rank {a.rank}): {result.own[index[id(a)]].reason}" for a in calls[:10]
    )
    return lines


def _unmatched_calls(result: CompareResult) -> str:
    """A line naming the first baseline calls without a partner (of a compare that paired too little)."""
    if not result.coverage.first_unmatched:
        return ""
    return f"First baseline calls without a partner (execution order): {first_unmatched_text(result)}.\n"


def _missing_text(result: CompareResult) -> str:
    """The steps and ranks of the baseline that the target lacks (each fails the compare)."""
    if not result.missing:
        return ""
    lines = [
        "Missing in the target (the run stopped early, a rank failed, or the dumped steps changed: "
        "this fails the compare):",
        *(f"  {note}" for note in result.missing),
    ]
    return "\n".join(lines) + "\n"
