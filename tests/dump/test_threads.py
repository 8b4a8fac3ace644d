"""Threads: a debugger records the calls of the thread that started it, and only those.

A background thread using torch during a dumped step (a metrics thread, a second training loop) must leave the
dump exactly as it is without it; two debuggers on two threads each get their own model's dump.
"""

from __future__ import annotations

import _thread
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_msprobe import PrecisionDebugger
from pytest_msprobe.dump import intercept

pytestmark = pytest.mark.usefixtures("no_leftover_debugger")


def _read(root: Path, step: int, name: str) -> Any:
    return json.loads((root / f"step{step}" / "rank" / name).read_text())


def _dump_of(root: Path, steps: int) -> list[tuple[Any, Any, list[str]]]:
    """Per step: dump.json's data, construct.json and the names of the tensor files."""
    out = []
    for step in range(steps):
        tensors = root / f"step{step}" / "rank" / "dump_tensor_data"
        names = sorted(p.name for p in tensors.iterdir()) if tensors.is_dir() else []
        out.append((_read(root, step, "dump.json")["data"], _read(root, step, "construct.json"), names))
    return out


class _Hammer:
    """A background thread running torch ops without pause: elementwise, matmul, a small model's training step."""

    def __init__(self) -> None:
        self.calls = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hammer")

    def _run(self) -> None:
        try:
            # never the default generator: the main thread's stays untouched
            g = torch.Generator().manual_seed(7)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            a = torch.randn(16, 16, generator=g)
            while not self._stop.is_set():
                b = torch.relu(a * 2 + 1).sin()
                c = a @ b
                _ = torch.matmul(c, a).sum().item()
                out = model(torch.randn(8, 16, generator=g))
                loss = F.cross_entropy(out, torch.randint(0, 4, (8,), generator=g))
                opt.zero_grad()
                loss.backward()
                opt.step()
                self.calls += 1
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.errors.append(exc)

    def wait_for(self, more: int) -> None:
        """Block until the thread has done ``more`` further iterations (it runs inside the dumped step)."""
        target = self.calls + more
        while self.calls < target and self._thread.is_alive():
            self._stop.wait(0.001)

    def __enter__(self) -> _Hammer:
        self._thread.start()
        self.wait_for(1)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _train(
    make_dumps: Any,
    debugger: PrecisionDebugger,
    steps: int = 2,
    pause: Callable[[], None] = lambda: None,
    width: int = 8,
    net: torch.nn.Module | None = None,
) -> None:
    """The TinyResNet loop of make_dumps.py, with ``pause()`` between its phases (there the other thread runs)."""
    if net is None:
        net = _model(make_dumps, width)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = make_dumps.make_batch(step, 8, 16)
        debugger.start(model=net)
        pause()
        out = net(x)
        pause()
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        pause()
        opt.step()
        pause()
        debugger.stop()
        debugger.step()
    debugger.close()


def _model(make_dumps: Any, width: int) -> torch.nn.Module:
    torch.manual_seed(1234)  # the default generator: threads build their models before they start
    return make_dumps.TinyResNet(width=width)


@pytest.mark.parametrize("task", ["statistics", "md5", "tensor"])
@pytest.mark.parametrize("level", ["L1", "mix"])
def test_a_busy_background_thread_leaves_the_dump_unchanged(
    tmp_path: Path, make_dumps: Any, task: str, level: str
) -> None:
    alone = tmp_path / "alone"
    _train(make_dumps, PrecisionDebugger(dump_path=alone, task=task, level=level))
    busy = tmp_path / "busy"
    with _Hammer() as hammer:
        _train(
            make_dumps,
            PrecisionDebugger(dump_path=busy, task=task, level=level),
            pause=lambda: hammer.wait_for(3),
        )
    assert not hammer.errors, hammer.errors
    assert hammer.calls >= 2 * 4 * 3
    expected, got = _dump_of(alone, 2), _dump_of(busy, 2)
    for step in range(2):
        assert list(got[step][0]) == list(expected[step][0]), f"step {step}: the records' names"
        assert got[step] == expected[step], f"step {step}: the records' contents"


def test_another_thread_running_the_dumped_model_is_not_recorded(tmp_path: Path) -> None:
    """Module hooks (L0/mix) see the forward passes of the thread that started the debugger only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    stop = threading.Event()
    passes = [0]

    def infer() -> None:  # the same model, read only: it changes nothing the main thread computes
        with torch.no_grad():
            while not stop.is_set():
                model(x)
                passes[0] += 1

    def run(root: Path, pause: Callable[[], None]) -> None:
        debugger = PrecisionDebugger(dump_path=root, level="mix")
        debugger.start(model=model)
        pause()
        model(x).sum().backward()
        pause()
        debugger.close()
        model.zero_grad()

    run(tmp_path / "alone", lambda: None)
    worker = threading.Thread(target=infer)
    worker.start()

    def pause() -> None:
        target = passes[0] + 5
        while passes[0] < target:
            stop.wait(0.001)

    try:
        run(tmp_path / "busy", pause)
    finally:
        stop.set()
        worker.join()
    assert _dump_of(tmp_path / "busy", 1) == _dump_of(tmp_path / "alone", 1)
    assert "Module.0.Linear.forward.1" not in _read(tmp_path / "busy", 0, "dump.json")["data"]


@pytest.mark.parametrize(("task", "level"), [("statistics", "L1"), ("md5", "mix"), ("tensor", "L1")])
def test_two_debuggers_on_two_threads_each_dump_their_own_model(
    tmp_path: Path, make_dumps: Any, task: str, level: str
) -> None:
    widths = {"a": 8, "b": 4}
    for name, width in widths.items():
        _train(
            make_dumps,
            PrecisionDebugger(dump_path=tmp_path / f"solo_{name}", task=task, level=level),
            width=width,
        )

    barrier = threading.Barrier(len(widths))
    errors: list[BaseException] = []
    nets = {name: _model(make_dumps, width) for name, width in widths.items()}

    def run(name: str) -> None:
        try:
            debugger = PrecisionDebugger(dump_path=tmp_path / f"together_{name}", task=task, level=level)
            barrier.wait()  # both start their first step at the same time
            _train(make_dumps, debugger, net=nets[name], pause=lambda: barrier.wait())
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(name,)) for name in widths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name in widths:
        assert _dump_of(tmp_path / f"together_{name}", 2) == _dump_of(tmp_path / f"solo_{name}", 2), name


def test_one_started_debugger_per_thread(tmp_path: Path) -> None:
    first = PrecisionDebugger(dump_path=tmp_path / "a", level="L1")
    second = PrecisionDebugger(dump_path=tmp_path / "b", level="L1")
    first.start()
    try:
        with pytest.raises(Exception, match="another PrecisionDebugger is started in this thread"):
            second.start()
    finally:
        first.close()


def test_wrappers_stay_until_the_last_debugger_stops(tmp_path: Path) -> None:
    relu = F.relu
    started = threading.Event()
    release = threading.Event()

    def other() -> None:
        debugger = PrecisionDebugger(dump_path=tmp_path / "other", level="L1")
        debugger.start()
        started.set()
        release.wait()
        torch.ones(1).neg()
        debugger.close()

    worker = threading.Thread(target=other)
    worker.start()
    started.wait()
    mine = PrecisionDebugger(dump_path=tmp_path / "mine", level="L1")
    mine.start()
    F.relu(torch.ones(1))
    mine.close()
    assert F.relu is not relu, "the other thread's debugger still records"
    release.set()
    worker.join()
    assert F.relu is relu and not intercept.wrappers_installed()
    assert list(_read(tmp_path / "mine", 0, "dump.json")["data"]) == [
        "Torch.ones.0.forward",
        "Functional.relu.0.forward",
    ]
    assert list(_read(tmp_path / "other", 0, "dump.json")["data"]) == [
        "Torch.ones.0.forward",
        "Tensor.neg.0.forward",
    ]


class _Scale(torch.autograd.Function):
    """A custom autograd function whose backward runs Python torch calls (as checkpointing's recompute does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.mul(grad, 3)


def _raw_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a thread started outside ``threading`` (as the autograd engine's device threads are)."""
    done = threading.Event()
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    _thread.start_new_thread(body, ())
    done.wait()
    assert not errors, errors


def test_a_backward_pass_on_an_engine_thread_counts_for_the_owner(tmp_path: Path) -> None:
    """On CUDA the engine runs the owner's backward on its device threads: their calls belong to the step.

    Simulated on the CPU by running the backward on a thread that Python did not start; a backward pass of
    another graph on such a thread meanwhile is not recorded.
    """

    def run(root: Path, on_engine_thread: bool) -> Any:
        x = torch.ones(4, requires_grad=True)
        unrelated = torch.ones(3, requires_grad=True)
        debugger = PrecisionDebugger(dump_path=root, level="L1")
        debugger.start()
        loss = _Scale.apply(torch.sin(x)).sum()
        seed = torch.ones_like(loss)  # made by the owner, as backward() makes it on the calling thread
        if on_engine_thread:
            _raw_thread(lambda: _Scale.apply(unrelated * 1).sum().backward())  # not this step's graph
            _raw_thread(lambda: loss.backward(seed))
        else:
            loss.backward(seed)
        debugger.close()
        return _read(root, 0, "dump.json")["data"]

    expected = run(tmp_path / "here", on_engine_thread=False)
    assert "Torch.mul.0.forward" in expected, "the custom backward's call, made in the owner's backward pass"
    assert run(tmp_path / "engine", on_engine_thread=True) == expected


def test_threads_that_python_did_not_start_pass_through_outside_a_backward(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(dump_path=tmp_path, level="L1")
    debugger.start()
    _raw_thread(lambda: torch.ones(2).neg())
    torch.zeros(1)
    debugger.close()
    assert list(_read(tmp_path, 0, "dump.json")["data"]) == ["Torch.zeros.0.forward"]


@pytest.fixture(autouse=True)
def _no_thread_left() -> Iterator[None]:
    yield
    # the replay's judge pool lives as long as the process (an earlier test of this worker may have started it)
    left = [t.name for t in threading.enumerate() if t.name.startswith("pytest-msprobe")]
    assert not [name for name in left if not name.startswith("pytest-msprobe-judge")], left
