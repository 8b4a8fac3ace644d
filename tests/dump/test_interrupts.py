"""Interruptions: Ctrl-C (or any BaseException a signal handler raises) landing anywhere in a dumped step.

After it, ``close()`` raises nothing caused by it, every wrapper and hook is gone, the dump's threads are joined,
and the dump folder holds only whole files: a step is written whole or not at all.
"""

from __future__ import annotations

import _thread
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_msprobe import PrecisionDebugger
from pytest_msprobe.dump import debugger as debugger_module
from pytest_msprobe.dump import intercept, threads
from pytest_msprobe.dump import signals as signals_module
from pytest_msprobe.dump.signals import deferred_signals

pytestmark = pytest.mark.usefixtures("no_leftover_debugger")

ORIGINALS = (F.relu, F.conv2d, torch.add, torch.Tensor.add_, torch.Tensor.mean)


def _assert_nothing_left(model: torch.nn.Module | None = None, grad: bool = True) -> None:
    """No wrapper, hook, started debugger or dump thread is left in the process (``grad``: gradients are on)."""
    assert (F.relu, F.conv2d, torch.add, torch.Tensor.add_, torch.Tensor.mean) == ORIGINALS
    assert "__add__" not in vars(torch.Tensor) and not intercept.wrappers_installed()
    assert not intercept._HOLDERS and debugger_module._STARTED == {} and threads.slot.active is None
    assert torch.is_grad_enabled() or not grad, "the dump switched gradients off and did not switch them back"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if model is not None:
        for module in model.modules():
            assert not module._forward_pre_hooks and not module._forward_hooks
        for param in model.parameters():
            assert not param._post_accumulate_grad_hooks
    from torch.optim import optimizer as optim_module

    assert not optim_module._global_optimizer_pre_hooks and not optim_module._global_optimizer_post_hooks
    alive = [t.name for t in threading.enumerate() if t.name.startswith("pytest-msprobe-writer")]
    assert not alive, alive


def _assert_whole(root: Path, task: str) -> int:
    """Every file of the dump is complete and no temporary name is left; returns the steps written."""
    assert not [p for p in root.rglob("*") if p.name.startswith(".") or ".tmp" in p.name]
    written = 0
    for rank in root.glob("step*/rank"):
        files = sorted(p.name for p in rank.iterdir())
        if not files:
            continue  # nothing was published for this step
        json_files = ["checklist.json", "construct.json", "dump.json", "optimizer.json", "stack.json"]
        assert [f for f in files if f != "dump_tensor_data"] == json_files, files
        docs = {name: json.loads((rank / name).read_text()) for name in json_files}
        data = docs["dump.json"]["data"]
        if task == "tensor":
            named = {
                item["data_name"]
                for item in _tensor_items([data, docs["optimizer.json"]["steps"]])
                if isinstance(item, dict) and "data_name" in item
            }
            folder = rank / "dump_tensor_data"
            saved = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
            # every file named is there; a file may be there unnamed (the input of a call the interrupt cut
            # short: its snapshot was saved, the call never recorded), whole all the same
            assert named <= saved, (sorted(named - saved)[:5], rank)
            for name in sorted(saved)[:3]:
                torch.load(folder / name, weights_only=True)
        written += 1
    return written


def _tensor_items(value: Any) -> Any:
    if isinstance(value, dict):
        if value.get("type") == "torch.Tensor":
            yield value
        else:
            for v in value.values():
                yield from _tensor_items(v)
    elif isinstance(value, list):
        for v in value:
            yield from _tensor_items(v)


def _small_model() -> torch.nn.Module:
    """Convolution, batch norm, an in-place ReLU, pooling and a linear layer: the kinds of the TinyResNet, fewer."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(inplace=True),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 5),
    )


class _Run:
    """One dumped training run of two steps of a small TinyResNet; ``where`` tells the phase it is in."""

    PHASES = ("start", "forward", "backward", "optimizer", "stop", "step")

    def __init__(self, root: Path, task: str, level: str) -> None:
        torch.manual_seed(0)
        self.model = _small_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        self.batches = [(torch.randn(2, 3, 6, 6, generator=g), torch.tensor([1, 3])) for _ in range(2)]
        self.debugger = PrecisionDebugger(dump_path=root, task=task, level=level)
        self.where = "before"
        self.marks: list[tuple[str, float]] = []  # (phase, when it began, from the run's start)
        self._t0 = 0.0

    def _enter(self, phase: str) -> None:
        self.where = phase
        self.marks.append((phase, time.perf_counter() - self._t0))

    def __call__(self) -> None:
        debugger, model, opt = self.debugger, self.model, self.opt
        self._t0 = time.perf_counter()
        for x, y in self.batches:
            self._enter("start")
            debugger.start(model=model)
            self._enter("forward")
            loss = F.cross_entropy(model(x), y)
            self._enter("backward")
            opt.zero_grad()
            loss.backward()
            self._enter("optimizer")
            opt.step()
            self._enter("stop")
            debugger.stop()
            self._enter("step")
            debugger.step()
        self._enter("close")
        debugger.close()
        self._enter("after")


def _windows(runs: list[_Run]) -> list[tuple[str, float, float]]:
    """(phase, begin, end) of each phase of a run, medians over calibration runs."""
    begins = [statistics.median(run.marks[i][1] for run in runs) for i in range(len(runs[0].marks))]
    phases = [phase for phase, _ in runs[0].marks]
    return [(phases[i], begins[i], begins[i + 1]) for i in range(len(phases) - 1)]


def _interrupter(delay: float, how: int) -> threading.Thread | None:
    """Interrupt the main thread after ``delay`` s: ``interrupt_main()`` or a SIGINT sent to the main thread (both
    from a timer thread), or a SIGALRM from the kernel whose handler raises (as pytest-timeout's does), the one
    that lands where a GIL hand-over would not."""
    if how == 2:
        signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-6))
        return None
    main = threading.main_thread().ident
    assert main is not None

    def fire() -> None:
        time.sleep(delay)
        if how == 1:
            signal.pthread_kill(main, signal.SIGINT)
        else:
            _thread.interrupt_main()

    thread = threading.Thread(target=fire, name="interrupter", daemon=True)
    thread.start()
    return thread


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


CASES = [(task, level) for task in ("statistics", "md5", "tensor") for level in ("L1", "mix")]


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals reach main only"
)
def test_random_interrupts_leave_the_debugger_clean(tmp_path: Path) -> None:
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the timer thread gets the GIL soon after its delay
    previous_alarm = signal.signal(signal.SIGALRM, _raise_interrupt)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _note_swallowed
    try:
        _interrupt_runs(tmp_path)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_alarm)
        sys.unraisablehook = previous_hook
        sys.setswitchinterval(interval)


_SWALLOWED: list[str] = []


def _note_swallowed(unraisable: Any) -> None:
    # Python itself drops an exception raised where nothing can catch it (a gc callback, a __del__, a weakref
    # callback): an interrupt landing there never reaches any caller, with or without a dump
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _SWALLOWED.append(repr(unraisable.object))
    else:
        sys.__unraisablehook__(unraisable)


def _interrupt_runs(tmp_path: Path) -> None:
    # when each phase of a run begins, per case: every run is interrupted in a phase chosen at random (each as
    # likely, however short), at a random moment of it
    windows = {}
    for task, level in CASES:
        runs = []
        for i in range(4):
            run = _Run(tmp_path / f"calibrate_{task}_{level}_{i}", task, level)
            run()
            runs.append(run)
        windows[task, level] = _windows(runs[1:])  # the first warms up
    rng = random.Random(int(os.environ.get("MSPROBE_INTERRUPT_SEED", "20240611")))
    landed: Counter[str] = Counter()
    aimed = {*_Run.PHASES, "close"}
    whole: dict[tuple[str, str], list[_Run]] = {case: [] for case in CASES}  # recent runs timed to the end
    n_runs, most = 90, 300  # each phase is chosen about 13 times in the first 90
    written = 0
    i = 0
    while i < n_runs or (len(set(landed) & aimed) < 5 and i < most):
        task, level = CASES[i % len(CASES)]
        choices = windows[task, level]
        if i >= n_runs:
            # a loaded machine stretches or shifts the phases: aim at those no interrupt has reached yet, timed
            # by the latest runs of this case that went to the end
            if len(whole[task, level]) >= 3:
                choices = _windows(whole[task, level][-3:])
            choices = [w for w in choices if w[0] not in landed] or choices
        _, begin, end = rng.choice(choices)
        delay = rng.uniform(begin, end)
        root = tmp_path / f"run{i}"
        run = _Run(root, task, level)
        interrupted = False
        timer = None
        _SWALLOWED.clear()
        try:
            timer = _interrupter(delay, how=i % 3)
            run()
            deadline = time.monotonic() + delay + 10
            while time.monotonic() < deadline:  # the interrupt comes after the run: it lands here
                time.sleep(0.0005)
        except KeyboardInterrupt:
            interrupted = True
        if timer is not None:
            timer.join()
        if run.where == "after":
            whole[task, level].append(run)
        if interrupted:
            landed[run.where] += 1
        else:
            assert _SWALLOWED, f"run {i}: the KeyboardInterrupt never reached the caller"
            landed["swallowed by Python"] += 1
        context = f"run {i} ({task}, {level}), interrupted in {run.where} after {delay * 1e3:.1f} ms"
        try:
            if rng.random() < 0.4:  # as the plugin does: abort the step, then close at teardown
                run.debugger.abort()
                run.debugger.abort()
            run.debugger.close()
            run.debugger.close()
        except BaseException as exc:  # pragma: no cover - the failure message
            pytest.fail(f"{context}: close() raised {type(exc).__name__}: {exc}")
        try:
            # optimizer.step() itself switches gradients off and back in a finally clause that calls a Python
            # function first: cut there, PyTorch leaves them off, with or without a dump
            _assert_nothing_left(run.model, grad=run.where != "optimizer")
            written += _assert_whole(root, task) if root.exists() else 0
        except AssertionError as exc:  # pragma: no cover - the failure message
            raise AssertionError(f"{context}: {exc}") from exc
        finally:
            torch.set_grad_enabled(True)
        i += 1
    print(f"{i} interrupts landed in: {dict(landed)}; {written} steps written whole")
    # the interrupts reached most parts of the step (step() itself lasts about 0.1 ms: it is seldom hit)
    assert landed["forward"] and landed["backward"] and landed["stop"], landed
    assert len(set(landed) & aimed) >= 5, landed


_PACKAGE = str(Path(intercept.__file__).resolve().parents[1])


class _InterruptAtEntry:
    """A trace function that raises KeyboardInterrupt as the ``at``-th Python function is entered, counting the
    dump's own functions and those it calls, outside sections with deferred signals: where CPython runs a
    signal's handler (on entering a Python function, such as a context manager's ``__exit__``). ``at`` None
    counts only. Python unsets a trace function that raised, so a run is interrupted once."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.seen = 0
        self.inside: list[str] = []  # the dump's function entered at each position counted

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or signals_module._OPEN:
            return None
        caller = frame.f_back
        code = frame.f_code
        if not code.co_filename.startswith(_PACKAGE) and (
            caller is None or not caller.f_code.co_filename.startswith(_PACKAGE)
        ):
            return None
        self.seen += 1
        if self.at is None:
            owner = code if code.co_filename.startswith(_PACKAGE) else caller.f_code
            self.inside.append(f"{Path(owner.co_filename).name}:{owner.co_name}")
        elif self.seen == self.at:
            raise KeyboardInterrupt
        return None


def test_an_interrupt_entering_any_function_of_the_dump_leaves_gradients_on(tmp_path: Path) -> None:
    """An interrupt raised as a function is entered while the dump works on the training thread (a hook's
    fingerprints, a recorded call's statistics, a module's backward record) leaves ``close()`` with gradients on
    and nothing installed: every place where the dump switches gradients off puts them back in a ``finally``
    clause, never through a context manager's ``__exit__``, which an interrupt can cut before it runs. Every
    position inside the checklist's and the module hooks' work is tried, and a spread of the others."""
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _note_swallowed  # an interrupt raised in a generator's finalizer: Python drops it
    try:
        _interrupt_at_entries(tmp_path)
    finally:
        sys.unraisablehook = previous_hook


def _interrupt_at_entries(tmp_path: Path) -> None:
    counter = _InterruptAtEntry(None)
    run = _Run(tmp_path / "count", "statistics", "mix")
    sys.settrace(counter)
    try:
        run()
    finally:
        sys.settrace(None)
    hooks = [
        i + 1 for i, where in enumerate(counter.inside) if where.startswith(("checklist.", "module_hooks."))
    ]
    assert hooks and counter.seen > 500, (len(hooks), counter.seen)
    positions = sorted(set(hooks) | set(range(1, counter.seen + 1, counter.seen // 60)))
    landed = 0
    for at in positions:
        run = _Run(tmp_path / f"at{at}", "statistics", "mix")
        injector = _InterruptAtEntry(at)
        sys.settrace(injector)
        try:
            run()
        except BaseException:  # the interrupt, or what a backward hook's interrupt became inside autograd
            landed += 1
        finally:
            sys.settrace(None)
        where = f"interrupted entering position {at} ({counter.inside[at - 1]}), in {run.where}"
        try:
            run.debugger.close()
        except BaseException as exc:  # pragma: no cover - the failure message
            pytest.fail(f"{where}: close() raised {type(exc).__name__}: {exc}")
        try:
            _assert_nothing_left(run.model)
        except AssertionError as exc:
            pytest.fail(f"{where}: {exc}")
    assert landed >= len(positions) // 2, (landed, len(positions))


def test_abort_drops_the_step_and_leaves_a_usable_debugger(tmp_path: Path, make_dumps: Any) -> None:
    model = make_dumps.TinyResNet(width=4)
    x, y = make_dumps.make_batch(0, 2, 8)
    debugger = PrecisionDebugger(dump_path=tmp_path, task="tensor", level="mix")
    debugger.abort()  # nothing started: nothing to do
    debugger.start(model=model)
    F.cross_entropy(model(x), y).backward()
    debugger.abort()
    debugger.abort()
    _assert_nothing_left(model)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "the aborted step wrote nothing"
    # the same step again, whole this time
    debugger.start(model=model)
    F.cross_entropy(model(x), y).backward()
    debugger.stop()
    debugger.abort()  # after stop(): the step was handed over, it is written
    debugger.step()
    debugger.close()
    _assert_nothing_left(model)
    assert _assert_whole(tmp_path, "tensor") == 1


def test_an_exception_in_a_with_block_drops_the_step(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), PrecisionDebugger(dump_path=tmp_path, level="L1") as debugger:
        debugger.start()
        F.relu(torch.ones(2))
        raise KeyboardInterrupt
    _assert_nothing_left()
    assert not (tmp_path / "step0").exists()


def test_an_interruption_inside_a_recorded_call_drops_the_step(tmp_path: Path) -> None:
    """A BaseException cutting through the recorder's bookkeeping: stop() drops the step and raises nothing."""

    class Stop(BaseException):
        pass

    def interrupting(*args: Any, **kwargs: Any) -> Any:
        raise Stop

    debugger = PrecisionDebugger(dump_path=tmp_path, level="L1")
    debugger.start()
    F.relu(torch.ones(2))
    recorder = debugger._recorder
    assert recorder is not None
    real = recorder.engine.item
    recorder.engine.item = interrupting  # type: ignore[method-assign]
    with pytest.raises(Stop):
        torch.ones(2).neg()
    recorder.engine.item = real  # type: ignore[method-assign]
    assert recorder.broken
    debugger.stop()
    debugger.step()
    debugger.start()
    torch.zeros(1)
    debugger.close()
    _assert_nothing_left()
    assert not (tmp_path / "step0").exists()
    assert list(json.loads((tmp_path / "step1" / "rank" / "dump.json").read_text())["data"]) == [
        "Torch.zeros.0.forward"
    ]


def test_an_ordinary_exception_of_a_wrapped_call_keeps_the_step(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(dump_path=tmp_path, level="L1")
    debugger.start()
    with pytest.raises(RuntimeError):
        torch.ones(2, 3) @ torch.ones(2, 3)  # a shape error the program catches
    F.relu(torch.ones(2))
    debugger.close()
    data = json.loads((tmp_path / "step0" / "rank" / "dump.json").read_text())["data"]
    assert "Functional.relu.0.forward" in data


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals reach main only"
)
def test_deferred_signals_hold_an_interrupt_until_the_section_ends() -> None:
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_signals():
            _thread.interrupt_main()
            for _ in range(1000):  # many chances for the handler to run: it only notes the signal
                reached.append(1)
        reached.append(2)  # pragma: no cover - the interrupt is raised as the section ends
    assert reached == [1] * 1000
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with deferred_signals(), deferred_signals():  # nested, nothing arrives: nothing raised
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
