"""Fault suite: does the compare detect injected faults, pass benign variants, and name the right call?

    python bench/fault_suite.py --out suite.json            # everything: 388 runs, 1316 compares
    python bench/fault_suite.py --models cnn transformer    # the first two models: 240 runs, 812 compares
    python bench/fault_suite.py --quick --out quick.json    # 9 faults x from0/at1, 3 benign: about 6 min
    python bench/fault_suite.py --new --activations at1     # lstm, vit and mlp: --models lstm vit mlp
    python bench/fault_suite.py --faults 'tr.*' --tasks tensor --activations at1
    python bench/fault_suite.py --quick --backend msprobe   # dumped by real msprobe (/tmp/msvenv: torch, mindstudio-probe)
    python bench/fault_suite.py --quick --plain             # our dumps without our own files (checklist.json, ...)

Each fault of ``bench/fault_cases.py`` (forward, backward, optimizer, in-place and masked ops of a small CNN,
a small transformer, an LSTM language model with tied weights, a tiny ViT with gradient clipping and AdamW,
an MLP under bfloat16 autocast with gradient accumulation; and source faults, which change a parameter, a
buffer, the data or an unrecorded module's output) is injected active from step 0 (``from0``), only at step 1
(``at1``) or only at step 2 (``at2``); each run is dumped with pytest-msprobe's own ``PrecisionDebugger``
(level L1) with task statistics and task tensor, three training steps, and compared with
``pytest_msprobe.compare`` against a clean run of the same model: every step folder alone and the whole run
(the dump roots). Benign variants (another summation order, matmul/linear/conv in float64 cast back, q/k/v
projected in another order, a rerun) are compared the same way and must pass. A source fault active at
several steps (``from0``) changes its parameter, buffer, data or module output afresh in each of them.

What each compare is held to:

- a step where the fault is active (``active``): the compare fails (detection) and the first divergence is
  the record the fault made in that step (``right``), e.g. ``Functional.relu.2.forward`` for a noisy third
  relu, ``Functional.relu.3.backward`` for its gradient off, ``Tensor.add_.11.forward`` for the SGD update
  of one parameter off; the record names are logged by the fault as it fires (the dump's call counter), and
  checked against the tensor dumps: the first record of that step whose tensors differ from the baseline's;
- a source fault (``Check.source``: parameter, data, buffer, unrecorded) makes no record: the record to name
  is the step's first record whose tensors differ from the baseline's, in the tensor dumps; at a later
  active step (``from0``), the first that differs from a run with the fault active only at the steps before
  (the step's own change, not the drift of the weights since the first); with task statistics alone, a
  tensor dump of the run is made for it, and these runs, none of them compared; a fault whose record the dump
  does not have (msprobe 26 records no ``torch.cat``) is held to the same truth (source ``unrecorded``).
  It is named right where the failure names it, or where the calls' first divergence does
  (``call_named``) while the failure names the checklist's difference first (``kind_named``: the summary's
  first divergence kind, ``api`` or ``parameter``, ``data``, ``buffer``, ...);
- the whole run: it fails and names that record at the first active step;
- a step before the fault is active (``before``), and every compare of a benign variant: the compare passes
  (otherwise a false alarm);
- a step after the fault's last active step (``after``, reported, not scored): fails when the dumps differ.

With task tensor the steps before and after are not compared unless ``--all-steps`` (the tensor compare
replays every call: it is most of the suite's time); the steps before are checked bitwise equal instead.

Prints a table (one line per run and dump task: its step compares and the whole run), the misses with the
rule and reason the compare gave, and the totals, split by task, model and source kind (``checklist first``:
how many failures name a checklist difference before any call; ``source named``: of those, a source fault's
own parameter, buffer or data, not scored); ``--out`` writes it all as JSON.
Dumps go to a temporary folder (``--work DIR`` keeps them). ``--backend msprobe`` dumps with msprobe's own
PrecisionDebugger instead, one process per dump (``--msprobe-python``; about 10 s a dump on 2 cores: --quick
takes about 9 min).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fault_cases as fc  # noqa: E402
import torch  # noqa: E402

from pytest_msprobe import compare  # noqa: E402
from pytest_msprobe.report.summary import first_divergence_dict  # noqa: E402

TASKS = ("statistics", "tensor")
QUICK_FAULTS = (
    "cnn.relu2.fwd",
    "cnn.sgd.optimizer",
    "cnn.add_6.inplace",
    "cnn.conv2.bwd",
    "tr.softmax0.fwd",
    "tr.masked_fill0.unmasked",
    "tr.masked_fill0.value",
    "tr.adam.optimizer",
    "tr.layer_norm1.bwd",
)
QUICK_BENIGN = ("cnn.conv2d.float64", "tr.qkv.order", "tr.linear.split_sum")
QUICK_ACTIVATIONS = ("from0", "at1")


@dataclass
class Check:
    """One compare: a step folder (``scope`` step0/1/2) or the whole run (``run``)."""

    model: str
    task: str
    case: str
    kind: str
    activation: str  # from0 / at1 / at2, "-" for a benign variant
    scope: str
    role: str  # active, before, after, benign
    expected: str  # "fail" or "pass" (after: what the dumps say)
    truth: str | None  # the record to name, "api@step"
    # a source fault's kind (parameter, data, buffer, unrecorded), or "unrecorded" for a fault whose call the
    # dump has no record of: the truth is then the step's first differing record in the tensor dumps
    source: str | None = None
    source_name: str | None = None  # the parameter or buffer a source fault changes ("inputs": the data)
    passed: bool | None = None
    named: str | None = None  # the first divergence, "api@step" (or the checklist's "kind name@step")
    kind_named: str | None = None  # the summary's first_divergence kind: "api" or the checklist's kind
    call_named: str | None = (
        None  # the calls' first divergence, "api@step" (also where the checklist's is named)
    )
    rule: str | None = None
    row: str | None = None
    reason: str | None = None
    right: bool | None = None  # scored roles only
    source_named: bool | None = None  # the failure names the changed parameter, buffer or data
    truth_call: str | None = None  # how the compare saw the call to name: status, errors in/out, own error
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        if self.error:
            return False
        if self.role in ("active", "run"):  # (the whole run of a fault: it must name the truth too)
            return bool(self.right)
        return self.passed == (self.expected == "pass")


@dataclass
class Run:
    """One dumped run of a fault (or benign variant) with one dump task."""

    case: str
    task: str
    activation: str
    fired: list[tuple[int, str]]
    dump_seconds: float
    validation: str = ""  # a mismatch between the fault's log and the dumps, if any
    differs: dict[int, str | None] = field(default_factory=dict)  # step -> first differing record (tensor)
    truth: dict[int, str] = field(default_factory=dict)  # active step -> the record to name, "api@step"
    # a source fault's (and an unrecorded call's), per active step: the first record its change there shows in,
    # against the baseline at the first active step, at a later one against the run active only before it
    entered: dict[int, str | None] = field(default_factory=dict)
    unrecorded: list[str] = field(default_factory=list)  # records the fault logs, the dump lacks: "api@step"


def _leaves(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        if "type" in value:
            yield value
        else:
            for v in value.values():
                yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)


def _dump_json(step: Path) -> Path:
    """The dump.json of a single-process step folder (rank/, or msprobe 26's proc<PID>/)."""
    found = sorted(step.glob("*/dump.json"))
    if len(found) != 1:
        raise SystemExit(f"{step}: expected one rank folder with a dump.json, found {len(found)}")
    return found[0]


# what pytest-msprobe writes beside msprobe's files: ``--plain`` removes them, as a plain msprobe dump has none
SIDECARS = (
    "checklist.json",
    "self_check.json",
    "optimizer.json",
    "replay.json",
    "trend.json",
    "trend_rank*.json",
)


def strip_sidecars(path: Path) -> int:
    """Remove pytest-msprobe's own files from a dump (and the tensor files only they name); how many."""
    removed = 0
    for pattern in SIDECARS:
        for f in path.rglob(pattern):
            f.unlink()
            removed += 1
    for f in path.rglob("dump_tensor_data/Optimizer.*"):  # the tensors of optimizer.json's records
        f.unlink()
    return removed


def dump(
    fault: fc.Fault, active: tuple[int, ...], task: str, path: Path, args: argparse.Namespace
) -> list[tuple[int, str]]:
    """Dump one run; the faults it fired. msprobe's runs are each a process of ``--msprobe-python``. With
    ``--plain``, the run's dump then loses pytest-msprobe's own files (see :data:`SIDECARS`)."""
    fired = _dump(fault, active, task, path, args)
    if args.plain:
        strip_sidecars(path)
    return fired


def _dump(
    fault: fc.Fault, active: tuple[int, ...], task: str, path: Path, args: argparse.Namespace
) -> list[tuple[int, str]]:
    if args.backend == "ours":
        return fc.train(fault, active, task, path)
    fired_json = path.parent / f"{path.name}.fired.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = ",".join(map(str, active)) or "-"
    cmd = [args.msprobe_python, str(Path(fc.__file__)), fault.name, steps, task, str(path), str(fired_json)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"msprobe dump failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    fired = [(int(s), str(n)) for s, n in json.loads(fired_json.read_text())]
    fired_json.unlink()
    return fired


def first_difference(target: Path, baseline: Path) -> str | None:
    """The first record (dump order: execution order) of two tensor-dump step folders whose tensors (or
    other values) are not identical; None when the two steps are the same."""
    t_json, b_json = _dump_json(target), _dump_json(baseline)
    t_data = json.loads(t_json.read_text())["data"]
    b_data = json.loads(b_json.read_text())["data"]
    for name, entry in t_data.items():
        other = b_data.get(name)
        if other is None:
            return name
        t_leaves, b_leaves = list(_leaves(entry)), list(_leaves(other))
        if len(t_leaves) != len(b_leaves):
            return name
        for t, b in zip(t_leaves, b_leaves):
            t_file, b_file = t.get("data_name"), b.get("data_name")
            if t_file and b_file:
                tt = torch.load(t_json.parent / "dump_tensor_data" / t_file, weights_only=True)
                bb = torch.load(b_json.parent / "dump_tensor_data" / b_file, weights_only=True)
                if tt.shape != bb.shape or tt.dtype != bb.dtype or not torch.equal(tt, bb):
                    return name
            elif {k: v for k, v in t.items() if k != "data_name"} != {
                k: v for k, v in b.items() if k != "data_name"
            }:
                return name
    return None if len(t_data) == len(b_data) else "(records only the baseline has)"


def _compare(check: Check, target: Path, baseline: Path, jobs: int) -> None:
    start = time.perf_counter()
    try:
        result = compare(target, baseline, jobs=jobs)
    except Exception as exc:  # a crash is a result of the suite too
        check.error = f"{type(exc).__name__}: {exc}"
        check.seconds = time.perf_counter() - start
        return
    check.seconds = time.perf_counter() - start
    check.passed = result.passed
    fd = result.first_divergence
    summary_first = first_divergence_dict(result)
    check.kind_named = summary_first["kind"] if summary_first is not None else None
    check.call_named = f"{fd.api}@{fd.step}" if fd is not None else None
    first = (
        result.verdict.checklist
    )  # what the test's failure names first (none of the suite's faults is one)
    if first is not None:
        check.named = f"{first.kind} {first.name}@{first.step}"
        check.rule, check.row, check.reason = "checklist", first.name, first.detail
    elif fd is not None:
        check.named = f"{fd.api}@{fd.step}"
        check.rule, check.row, check.reason = fd.rule, fd.row, fd.reason
    if check.source in ("parameter", "buffer", "data") and not result.passed:
        kind, name = (first.kind, first.name) if first is not None else (None, None)
        check.source_named = kind == check.source and (kind == "data" or name == check.source_name)
    if check.role == "active" or (check.scope == "run" and check.role != "benign"):
        # a source fault's truth is a call: right where the calls' first divergence names it, whether or not
        # the checklist names the parameter, buffer or data first
        named = check.named == check.truth or (check.source is not None and check.call_named == check.truth)
        check.right = (not result.passed) and named
        if not check.right and check.truth:
            check.truth_call = _seen(result, check.truth)


def _seen(result: Any, truth: str) -> str:
    """How the compare judged the call it should have named (for the misses)."""
    api, _, step = truth.rpartition("@")
    for i, a in enumerate(result.apis):
        if a.api == api and str(a.step) == step:
            own = result.own.get(i)
            own_text = ""
            if own is not None:
                own_text = (
                    f", own: {'OUT OF LINE' if own.out_of_line else 'in line'} {own.reason or own.skipped}"
                )
            return (
                f"{a.status}, input error {a.input_error}, output error {a.output_error}, "
                f"input breach {a.input_breach}, output breach {a.output_breach}{own_text}"
            )
    return "not among the compared calls"


def _checks_of(fault: fc.Fault, activation: str, task: str, run: Run) -> list[Check]:
    active = fc.ACTIVATIONS[activation] if not fault.benign else ()
    truth = run.truth
    source = fault.effect if fault.source else ("unrecorded" if run.unrecorded else None)
    checks = []
    for step in fc.STEPS:
        if fault.benign:
            role, expected = "benign", "pass"
        elif step in active:
            role, expected = "active", "fail"
        elif step < min(active):
            role, expected = "before", "pass"
        else:
            role = "after"
            expected = "fail" if run.differs.get(step, "?") is not None else "pass"
        checks.append(
            Check(
                fault.model, task, fault.name, fault.kind, activation if not fault.benign else "-",
                f"step{step}", role, expected, truth.get(step), source if role == "active" else None,
            )
        )  # fmt: skip
    first = min(active) if active else None
    checks.append(
        Check(
            fault.model, task, fault.name, fault.kind, activation if not fault.benign else "-", "run",
            "benign" if fault.benign else "run", "pass" if fault.benign else "fail",
            truth.get(first) if first is not None else None, source,
        )
    )  # fmt: skip
    for check in checks:
        if check.source and fault.source:
            check.source_name = fault.param
    return checks


def run_suite(args: argparse.Namespace, work: Path) -> tuple[list[Check], list[Run]]:
    faults = [f for f in fc.FAULTS if f.model in args.models and _selected(f.name, args)]
    benign = [f for f in fc.BENIGN if f.model in args.models and _selected(f.name, args, benign=True)]
    checks: list[Check] = []
    runs: list[Run] = []
    for model in [m for m in args.models if any(f.model == m for f in faults + benign)]:
        clean = _clean(model)
        for task in args.tasks:
            dump(clean, (), task, work / model / task / "baseline", args)
    for fault in faults + benign:
        activations = ["-"] if fault.benign else args.activations
        for activation in activations:
            active = () if fault.benign else fc.ACTIVATIONS[activation]
            tensor_run: Run | None = None
            # tensor first: its dumps check the fault's log (the ground truth) for both tasks
            for task in sorted(args.tasks, key=lambda t: t != "tensor"):
                path = work / fault.model / task / fault.name / activation
                start = time.perf_counter()
                fired = dump(fault, active, task, path, args)
                run = Run(fault.name, task, activation, fired, time.perf_counter() - start)
                baseline = work / fault.model / task / "baseline"
                if task == "tensor" and not fault.benign:
                    _validate(run, fault, active, path, baseline, _reference(fault, activation, work, args))
                    tensor_run = run
                elif not fault.benign:
                    if tensor_run is None and (fault.source or _unrecorded(fired, path)):
                        # the truth is a tensor dump's first differing record: dump one for it
                        tensor_run = _truth_run(fault, active, activation, work, args)
                    if tensor_run is not None:
                        run.differs, run.validation = tensor_run.differs, tensor_run.validation
                        run.unrecorded, run.entered = tensor_run.unrecorded, tensor_run.entered
                        if fired != tensor_run.fired:
                            run.validation += f"; fired {fired} vs the tensor run's {tensor_run.fired}"
                if not fault.benign:
                    run.truth = _truth(run, fault, active)
                runs.append(run)
                mine = _checks_of(fault, activation, task, run)
                if task == "tensor" and not args.all_steps:
                    # bitwise the baseline's (checked by _validate), or not scored: the statistics task compares them
                    mine = [c for c in mine if c.role not in ("before", "after")]
                for check in mine:
                    if check.scope == "run":
                        _compare(check, path, baseline, args.jobs)
                    else:
                        _compare(check, path / check.scope, baseline / check.scope, args.jobs)
                checks.extend(mine)
                print(_line(mine, run), flush=True)
                if not args.keep:
                    shutil.rmtree(path, ignore_errors=True)
            if not args.keep:
                shutil.rmtree(work / fault.model / "reference" / fault.name, ignore_errors=True)
    return checks, runs


def _clean(model: str) -> fc.Fault:
    return next(f for f in fc.BENIGN if f.model == model and f.effect == "rerun")


def _truth_run(
    fault: fc.Fault, active: tuple[int, ...], activation: str, work: Path, args: argparse.Namespace
) -> Run:
    """A tensor dump of the run (and of the model's clean run, once), not compared: its first differing
    records are the truth of a source fault (or of a call the dump does not record) for the other tasks."""
    baseline = work / fault.model / "tensor" / "baseline"
    if not baseline.exists():
        dump(_clean(fault.model), (), "tensor", baseline, args)
    path = work / fault.model / "truth" / fault.name / activation
    start = time.perf_counter()
    fired = dump(fault, active, "tensor", path, args)
    run = Run(fault.name, "tensor", activation, fired, time.perf_counter() - start)
    args.truth_seconds += run.dump_seconds
    _validate(run, fault, active, path, baseline, _reference(fault, activation, work, args))
    if not args.keep:
        shutil.rmtree(path, ignore_errors=True)
    return run


def _reference(
    fault: fc.Fault, activation: str, work: Path, args: argparse.Namespace
) -> Callable[[tuple[int, ...]], Path]:
    """A tensor dump of the run with the fault active at some of its steps only (made once, not compared): a
    later active step of a source fault is checked against the run active at the steps before it, where the
    step's own change shows first."""

    def made(steps: tuple[int, ...]) -> Path:
        path = work / fault.model / "reference" / fault.name / f"{activation}.{'-'.join(map(str, steps))}"
        if not path.exists():
            start = time.perf_counter()
            dump(fault, steps, "tensor", path, args)
            args.truth_seconds += time.perf_counter() - start
        return path

    return made


def _records(step: Path) -> set[str]:
    return set(json.loads(_dump_json(step).read_text())["data"])


def _unrecorded(fired: list[tuple[int, str]], dump: Path) -> list[str]:
    """The records a (non-source) fault logs that its dump does not have: a call the dumper does not record."""
    missing: list[str] = []
    seen: dict[int, set[str]] = {}
    for step, name in fired:
        if name not in seen.setdefault(step, _records(dump / f"step{step}")):
            missing.append(f"{name}@{step}")
    return missing


def _truth(run: Run, fault: fc.Fault, active: tuple[int, ...]) -> dict[int, str]:
    """Per active step, the record the compare must name: the one the fault logs it made, or for a source
    fault (and a fault whose record the dump lacks) the first record its change at the step shows in
    (``run.entered``, see :func:`_validate`)."""
    if fault.source or run.unrecorded:
        return {s: f"{run.entered[s]}@{s}" for s in active if run.entered.get(s) is not None}
    truth: dict[int, str] = {}
    for step, name in run.fired:
        truth.setdefault(step, f"{name}@{step}")
    return truth


def _validate(
    run: Run,
    fault: fc.Fault,
    active: tuple[int, ...],
    dump: Path,
    baseline: Path,
    reference: Callable[[tuple[int, ...]], Path],
) -> None:
    """Check the fault's log against the tensor dumps (``run.validation``: the mismatches, if any): it fired in
    its active steps; the steps before are bitwise the baseline's; at its first active step the first
    differing record is the one it says it made. Notes for the later inactive steps whether they differ at
    all (``run.differs``).

    A source fault (and a fault whose record the dump lacks, ``run.unrecorded``) makes no record: its change
    must show in some record at every active step, and the first such record is its truth (``run.entered``):
    at the first active step the first record that differs from the baseline's; at a later one (``from0``)
    the first that differs from a run with the fault active only at the steps before it (the weights have
    drifted since the first: every record of the step differs from the baseline's)."""
    problems = []
    first = min(active)
    fired_at = {s for s, _ in run.fired}
    if fired_at != set(active):
        problems.append(f"fired at steps {sorted(fired_at)}, active {list(active)}")
    if not fault.source:
        run.unrecorded = _unrecorded(run.fired, dump)
    sourced = fault.source or bool(run.unrecorded)
    for step in fc.STEPS:
        if step not in active or step == first:
            run.differs[step] = first_difference(dump / f"step{step}", baseline / f"step{step}")
    changed = [s for s in fc.STEPS if s < first and run.differs[s] is not None]
    if changed:
        problems.append(f"steps before the fault differ: {changed}")
    made = next((name for s, name in run.fired if s == first), None)
    if sourced:
        for step in active:
            if step == first:
                run.entered[step] = run.differs[step]
            else:
                before = reference(tuple(s for s in active if s < step))
                run.entered[step] = first_difference(dump / f"step{step}", before / f"step{step}")
        unchanged = [s for s in active if run.entered[s] is None]
        if unchanged:
            problems.append(f"{made} changed no record at steps {unchanged}")
    elif run.differs.get(first) != made:
        problems.append(
            f"step {first}: the fault logs {made}, the first differing record is {run.differs.get(first)}"
        )
    run.validation = "; ".join(problems)


def _check_names() -> None:
    known = {f.name for f in fc.FAULTS + fc.BENIGN}
    unknown = [n for n in QUICK_FAULTS + QUICK_BENIGN if n not in known]
    if unknown:
        raise SystemExit(f"--quick names unknown cases: {unknown}")


def _selected(name: str, args: argparse.Namespace, benign: bool = False) -> bool:
    if args.faults:
        return any(fnmatch.fnmatchcase(name, p) for p in args.faults)
    if args.quick:
        return name in (QUICK_BENIGN if benign else QUICK_FAULTS)
    return True


def _cell(c: Check) -> str:
    if c.error:
        return "CRASH"
    if c.role in ("active", "run"):
        if c.passed:
            return "UNDETECTED"
        return "ok" if c.right else f"WRONG {c.named} [{c.rule}]"
    if c.role in ("before", "benign"):
        return "pass" if c.passed else f"FALSE ALARM {c.named} [{c.rule}]"
    # after: not scored
    if c.expected == "pass":
        return "pass (same)" if c.passed else f"fails, dumps same: {c.named}"
    return f"({c.named})" if not c.passed else "passes, dumps differ"


def _line(checks: list[Check], run: Run) -> str:
    head = f"{run.case:<26} {run.task:<10} {run.activation:<5}"
    cells = "  ".join(f"{c.scope}: {_cell(c)}" for c in checks)
    truth = next((c.truth for c in checks if c.scope == "run" and c.truth), "")
    source = next((c.source for c in checks if c.source), None)
    kind = f" [{source}]" if source else ""
    note = f"  !! {run.validation}" if run.validation else ""
    return f"{head} {cells}   truth {truth}{kind}{note}"


def _ratio(good: int, total: int) -> str:
    return f"{good}/{total} ({100 * good / total:.1f}%)" if total else "-"


def totals(checks: list[Check]) -> dict[str, dict[str, str]]:
    groups: dict[str, list[Check]] = {"all": checks}
    for task in TASKS:
        groups[f"task {task}"] = [c for c in checks if c.task == task]
    for model in sorted({c.model for c in checks}):
        groups[f"model {model}"] = [c for c in checks if c.model == model]
        for task in TASKS:
            groups[f"{model} {task}"] = [c for c in checks if c.model == model and c.task == task]
    sources = sorted({c.source for c in checks if c.source})
    if sources:
        groups["source faults"] = [c for c in checks if c.source]
        for source in sources:
            groups[f"source {source}"] = [c for c in checks if c.source == source]
    out: dict[str, dict[str, str]] = {}
    for name, cs in groups.items():
        if not cs:
            continue
        active = [c for c in cs if c.role == "active"]
        runs = [c for c in cs if c.role == "run"]
        clean = [c for c in cs if c.role in ("before", "benign")]
        after = [c for c in cs if c.role == "after" and c.expected == "fail"]
        out[name] = {
            "detected per step": _ratio(sum(c.passed is False for c in active), len(active)),
            "detected per run": _ratio(sum(c.passed is False for c in runs), len(runs)),
            "false alarms (benign, before)": _ratio(sum(c.passed is not True for c in clean), len(clean)),
            "right per step": _ratio(sum(bool(c.right) for c in active), len(active)),
            "right per run": _ratio(sum(bool(c.right) for c in runs), len(runs)),
            "after steps detected": _ratio(sum(c.passed is False for c in after), len(after)),
            # the right call, explained as rounding (its own error in line): a right name with a wrong reason
            "right as 'rounding'": str(sum(bool(c.right) and c.rule == "rounding" for c in active + runs)),
            # the failure names a checklist difference (data, parameter, buffer, ...) first, not a call
            "checklist first": str(sum(c.kind_named not in (None, "api") for c in active + runs)),
            # of those, a source fault's own parameter, buffer or data (not scored: the truth is a call)
            "source named": str(sum(bool(c.source_named) for c in active + runs)),
        }
    return out


def _width(column: str) -> int:
    return max(len(column), 16) + 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the cases and totals as JSON here")
    parser.add_argument(
        "--quick", action="store_true", help="a subset of the faults, benign variants and activations"
    )
    parser.add_argument("--models", nargs="+", default=list(fc.MODELS), choices=list(fc.MODELS))
    parser.add_argument(
        "--new", action="store_true", help="the models lstm, vit and mlp (--models lstm vit mlp)"
    )
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument(
        "--faults", nargs="+", help="fnmatch patterns of fault / benign names (see fault_cases.py)"
    )
    parser.add_argument("--activations", nargs="+", choices=list(fc.ACTIVATIONS))
    parser.add_argument(
        "--backend",
        default="ours",
        choices=["ours", "msprobe"],
        help="who dumps: pytest-msprobe's PrecisionDebugger (in this process) or msprobe's",
    )
    parser.add_argument(
        "--msprobe-python",
        default="/tmp/msvenv/bin/python",
        help="a Python with torch and mindstudio-probe, for --backend msprobe",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="remove pytest-msprobe's own files (checklist.json, self_check.json, optimizer.json, ...) from every "
        "dump before it is compared: the path of a plain msprobe dump",
    )
    parser.add_argument("--jobs", type=int, default=1, help="compare processes (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training runs")
    parser.add_argument(
        "--all-steps",
        action="store_true",
        help="task tensor: compare the steps before and after the fault too (the statistics task always does)",
    )
    parser.add_argument(
        "--work", type=Path, help="dump here and keep the dumps (default: a temporary folder)"
    )
    parser.add_argument("--list", action="store_true", help="list the faults and benign variants and exit")
    args = parser.parse_args()
    if args.list:
        for f in fc.FAULTS + fc.BENIGN:
            print(f"{f.name:<28} {f.model:<12} {f.kind:<10} {f.effect:<15} {f.api if f.owner else f.param}")
        return
    _check_names()
    args.activations = args.activations or (list(QUICK_ACTIVATIONS) if args.quick else list(fc.ACTIVATIONS))
    args.keep = args.work is not None
    args.truth_seconds = 0.0
    if args.new:
        args.models = ["lstm", "vit", "mlp"]
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fault_suite_") as tmp:
        work = args.work or Path(tmp)
        if args.work is not None and work.exists():
            shutil.rmtree(work)
        checks, runs = run_suite(args, work)
    elapsed = time.perf_counter() - start
    misses = [c for c in checks if not c.ok and c.role != "after"]
    print(f"\nmisses ({len(misses)}):")
    for c in misses:
        source = f" [{c.source}]" if c.source else ""
        calls = f" (calls: {c.call_named})" if c.kind_named not in (None, "api") else ""
        print(f"- {c.case} {c.task} {c.activation} {c.scope}: expected {c.truth or 'a pass'}{source}, got "
              f"{_cell(c)}{calls}; {c.error or c.reason}" + (f"\n    the call to name: {c.truth_call}" if c.truth_call else ""))  # fmt: skip
    table = totals(checks)
    cols = list(next(iter(table.values())))
    print(f"\n{'':<22}" + "".join(f"{c:>{_width(c)}}" for c in cols))
    for name, row in table.items():
        print(f"{name:<22}" + "".join(f"{row[c]:>{_width(c)}}" for c in cols))
    dump_s = sum(r.dump_seconds for r in runs)
    compare_s = sum(c.seconds for c in checks)
    truth_s = f" (and tensor dumps for the truth in {args.truth_seconds:.0f} s)" if args.truth_seconds else ""
    print(
        f"\n{len(runs)} runs dumped in {dump_s:.0f} s{truth_s}, {len(checks)} compares in {compare_s:.0f} s, total {elapsed:.0f} s"
    )
    if args.out:
        doc = {
            "backend": args.backend,
            "plain": args.plain,
            "totals": table,
            "seconds": {
                "total": elapsed,
                "dumps": dump_s,
                "truth dumps": args.truth_seconds,
                "compares": compare_s,
            },
            "runs": [asdict(r) for r in runs],
            "checks": [asdict(c) for c in checks],
        }
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
