"""How often the checklist names a run's data, weight, buffer or setting difference as the first divergence.

The two models of ``bench/fault_cases.py`` (a ResNet-like CNN with SGD, a transformer block with Adam) train three
steps under ``seed_all(1234, mode=True)``, dumped at L1 by pytest-msprobe's debugger started the way msprobe's is,
``debugger.start()`` without the model (the checklist finds it), or ``debugger.start(model)`` with ``--given``;
each case changes one thing of the target run, and the compare against the clean run must name it:

- ``data.s{N}``: one input element of step N (a pixel; a token id);
- ``parameter.init``: one weight re-initialised with another seed; ``parameter.nudge``: one element of it
  scaled by 1.001; ``parameter.between``: it scaled by 1.01 between steps 0 and 1, outside the dumped calls;
- ``buffer.init``: the CNN's first batch_norm's running_var doubled;
- ``hyperparameter.lr``: the learning rate 10% higher.

Every benign variant of the fault suite (a rerun, float64 and split-sum kernels, another q/k/v order) must show no
checklist failure. Run: ``python bench/checklist_suite.py [--task statistics|tensor] [--given]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import fault_cases as fc

from pytest_msprobe import PrecisionDebugger, seed_all
from pytest_msprobe.compare import compare

WEIGHT = {"cnn": "block1.conv1.weight", "transformer": "layers.0.attn.q.weight"}
Case = tuple[str, str, str | None, int | None]  # (case, kind, name, step) of the truth


def _cases(model: str) -> list[Case]:
    w = WEIGHT[model]
    data_name = "args.0"
    cases: list[Case] = [
        ("data.s0", "data", data_name, 0),
        ("data.s2", "data", data_name, 2),
        ("parameter.init", "parameter", w, 0),
        ("parameter.nudge", "parameter", w, 0),
        ("parameter.between", "parameter", w, 1),
        ("hyperparameter.lr", "hyperparameter", "lr", 0),
    ]
    if model == "cnn":
        cases.append(("buffer.init", "buffer", "bn.running_var", 0))
    return cases


def _run(model: str, case: str, task: str, path: Path, given: bool) -> None:
    seed_all(seed=1234, mode=True)
    setup = fc.build(model)
    m = setup.model
    params = dict(m.named_parameters())
    with torch.no_grad():
        if case == "parameter.init":
            w = params[WEIGHT[model]]
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(99)) * w.std())
        elif case == "parameter.nudge":
            params[WEIGHT[model]].view(-1)[3] *= 1.001
        elif case == "buffer.init":
            dict(m.named_buffers())["bn.running_var"].mul_(2)
        elif case.startswith("data.s"):
            step = int(case.removeprefix("data.s"))
            first = setup.batches[step][0]
            if first.dtype.is_floating_point:
                first[1, 2, 3, 4] += 0.5
            else:
                first[0, 1] = (first[0, 1] + 1) % 32
    if case == "hyperparameter.lr":
        for group in setup.optimizer.param_groups:
            group["lr"] *= 1.1
    debugger = PrecisionDebugger(task=task, dump_path=str(path), level="L1", step=list(fc.STEPS))
    try:
        for step, batch in zip(fc.STEPS, setup.batches):
            if case == "parameter.between" and step == 1:
                with torch.no_grad():
                    params[WEIGHT[model]].mul_(1.01)
            debugger.start(m) if given else debugger.start()
            loss = setup.loss(setup.model, batch)
            setup.optimizer.zero_grad()
            loss.backward()
            setup.optimizer.step()
            debugger.stop()
            debugger.step()
    finally:
        debugger.close()


def _named(result: object) -> tuple[str | None, str | None, int | None]:
    first = result.verdict.checklist  # type: ignore[attr-defined]
    if first is not None:
        return first.kind, first.name, first.step
    fd = result.first_divergence  # type: ignore[attr-defined]
    return ("api", fd.api, fd.step) if fd is not None else (None, None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="statistics", choices=["statistics", "tensor"])
    parser.add_argument("--given", action="store_true", help="debugger.start(model) instead of start()")
    args = parser.parse_args()
    torch.set_num_threads(1)
    right = total = false_alarms = benign = 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in ("cnn", "transformer"):
            clean = work / f"{model}.clean"
            _run(model, "clean", args.task, clean, args.given)
            for case, kind, name, step in _cases(model):
                target = work / f"{model}.{case}"
                _run(model, case, args.task, target, args.given)
                result = compare(target, clean, jobs=1)
                got = _named(result)
                ok = not result.passed and got == (kind, name, step)
                right += ok
                total += 1
                print(
                    f"{model:<12} {case:<20} {'right' if ok else 'WRONG':<6} named {got[0]} {got[1]} (step {got[2]})"
                )
            benign_faults: list[fc.Fault] = [f for f in fc.BENIGN if f.model == model]
            for fault in benign_faults:
                target = work / f"{model}.{fault.name}"
                train: Callable[..., object] = fc.train
                train(fault, (), args.task, target)
                result = compare(target, clean, jobs=1)
                alarm = result.checklist is not None and not result.checklist.passed
                false_alarms += alarm
                benign += 1
                first = result.checklist.first if result.checklist is not None else None
                print(
                    f"{model:<12} {fault.name:<20} {'ALARM' if alarm else 'quiet':<6} "
                    + (first.headline() if first is not None else "no checklist failure")
                )
    print(
        f"named right: {right}/{total}; checklist false alarms on benign variants: {false_alarms}/{benign} "
        f"({args.task}, {'start(model)' if args.given else 'start()'}; {time.perf_counter() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
