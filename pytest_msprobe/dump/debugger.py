"""PrecisionDebugger: msprobe's dump calls, without its process-wide singleton.

    debugger = PrecisionDebugger(dump_path="./dump_data", task="statistics", step=[0, 1], level="L1")
    for images, target in loader:
        debugger.start()              # start(model=model) for L0 / mix
        ...forward, loss, zero_grad, backward, optimizer.step()...
        debugger.stop()               # step{N}/rank/{dump,stack,construct}.json are written in the background
        debugger.step()

A debugger records the calls of the thread that started it, and only those: other threads' torch calls, forward
passes and optimizer steps go on unrecorded. Several debuggers can be used one after another in one process, or
at the same time on different threads (one started debugger per thread). stop() removes every wrapper and hook it
installed (the API wrappers go when the last started debugger stops); it also works as a context manager (``with
PrecisionDebugger(...) as debugger:``), which closes it on exit.

``max_dump_size`` (bytes, or a text such as ``"500MB"`` / ``"2GiB"``) bounds the tensor files of task ``tensor``:
the first tensor that would take the dump past it is not saved, nor any after it (the step's JSON files are still
written, without a ``data_name`` for them), and the stop() of that step raises :class:`DumpSizeError` naming the
row where it happened.

stop() saves the tensor files of task ``tensor`` into a hidden staging folder, then hands the step to a background
thread that resolves the statistics, publishes the tensor folder (one rename) and writes the JSON files while
training goes on. The files are complete after :meth:`PrecisionDebugger.wait` or :meth:`PrecisionDebugger.close`
(and at interpreter exit); each is written through a temporary file and a rename, so a reader never sees a
partial file.

**Interruptions.** Ctrl-C, a test timeout or ``SystemExit`` may land anywhere in a dumped step. :meth:`abort`
drops the step being captured (records and unpublished tensor files), removes every wrapper and hook and joins
the dump's threads; it never raises because of the interruption, in any state, and the plugin calls it when a
step's body raised. Without it, ``stop()`` / ``step()`` / ``close()`` after an interruption clean up the same way:
a step whose records an interruption cut through is dropped, any other is written whole. The few changes of state
that must go together run with signals deferred (:mod:`.signals`), and every other cut leaves a state that the
next call completes.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from pytest_msprobe.dump import switches, threads
from pytest_msprobe.dump.checklist import StepChecklist, caller_model
from pytest_msprobe.dump.config import DumpArgs, DumpConfig, build_config
from pytest_msprobe.dump.intercept import ApiPatcher
from pytest_msprobe.dump.overflow_filter import keep_overflows, keep_stacks
from pytest_msprobe.dump.recorder import Recorder
from pytest_msprobe.dump.signals import deferred_signals
from pytest_msprobe.dump.signals import heal as heal_signal_handlers
from pytest_msprobe.dump.stack import StackAnchor
from pytest_msprobe.dump.stats import StatEngine
from pytest_msprobe.dump.writer import (
    BackgroundJobs,
    SizeBudget,
    TensorWriter,
    current_rank,
    step_dir,
    write_checklist_file,
    write_optimizer_file,
    write_step_files,
)
from pytest_msprobe.errors import ConfigError, DumpError, DumpSizeError, PathLike
from pytest_msprobe.format.layout import TENSOR_DIR, TENSOR_SUFFIX
from pytest_msprobe.settings import format_size

if TYPE_CHECKING:  # pragma: no cover (typing.Unpack is Python 3.11's)
    from typing_extensions import Unpack

# the debugger started on each thread (by thread ident): at most one per thread
_STARTED: dict[int, PrecisionDebugger] = {}


class PrecisionDebugger:
    """Dump the APIs (L1), modules (L0) or both (mix) of chosen training steps in msprobe's format.

    Arguments mirror msprobe's (``config_path``, ``task``, ``dump_path``, ``level``, ``model``, ``step``) plus the
    filters of its config.json (``rank``, ``scope``, ``list``, ``data_mode``, ``summary_mode``); explicit
    arguments override the file. ``task`` is ``"statistics"``, ``"tensor"``, ``"md5"`` (statistics plus a
    CRC32 of every tensor) or ``"overflow_check"`` (only the calls whose outputs hold inf/nan, with their inputs;
    ``overflow_nums``, msprobe's setting, is how many of them the dump keeps, -1 for all, default 1). ``max_dump_size`` (``500MB``, ``2GiB`` or bytes) stops saving tensor files before
    they take more than that: ``stop()`` raises :class:`~pytest_msprobe.errors.DumpSizeError`.
    """

    def __init__(
        self,
        config_path: PathLike | None = None,
        task: str | None = None,
        dump_path: PathLike | None = None,
        level: str | None = None,
        model: torch.nn.Module | None = None,
        step: Any = None,
        *,
        list: list[str] | None = None,
        checklist_env: Sequence[str] = (),
        **given: Unpack[DumpArgs],  # rank, scope, data_mode, summary_mode, max_dump_size, self_check...
    ) -> None:
        self.config: DumpConfig = build_config(
            config_path, task=task, dump_path=dump_path, level=level, step=step, api_list=list, **given
        )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model={type(model).__name__}: expected a torch.nn.Module")
        self.model = model
        self.current_step = 0
        self.checklist_env = tuple(
            checklist_env
        )  # environment variables the checklist records beyond its own
        self._checklist: StepChecklist | None = None
        self._checklist_model: torch.nn.Module | None = None  # the model the checklist found, when not given
        self._patcher = ApiPatcher()
        self._recorder: Recorder | None = None
        self._engine: StatEngine | None = None
        self._writer: TensorWriter | None = None
        self._files = BackgroundJobs(on_thread_start=threads.silence_this_thread)
        self._capture_s = 0.0  # how long the current step's captures have lasted (start() to stop())
        self._capture_began = 0.0
        limit = self.config.max_dump_size
        self._budget = SizeBudget(limit) if limit is not None else None
        self._size_reported = False
        self._started = False
        self._closed = False
        self._owner: int | None = None  # the thread that started the capture
        # task overflow_check: the overflowing calls each step's files kept (a step stopped twice is rewritten
        # whole, so it is counted once); read and written by the writer thread only, one step at a time
        self._overflows: dict[int, int] = {}

    # -- the msprobe calls ---------------------------------------------------------------------------------------

    def start(self, model: torch.nn.Module | None = None) -> None:
        """Begin (or resume) capturing the current step; a no-op for steps and ranks not selected."""
        if self._closed:
            raise DumpError("this PrecisionDebugger is closed: create a new one")
        if self._started:
            return
        if model is not None:
            if not isinstance(model, torch.nn.Module):
                raise ConfigError(f"model={type(model).__name__}: expected a torch.nn.Module")
            self.model = model
        config = self.config
        if not (config.wants_step(self.current_step) and config.wants_rank(current_rank())):
            return
        if config.modules and self.model is None:
            raise ConfigError(f"level={config.level!r} needs the model: call start(model=model)")
        ident = threading.get_ident()
        other = _STARTED.get(ident)
        if other is not None and other is not self:
            raise DumpError("another PrecisionDebugger is started in this thread: stop it first")
        if self._recorder is None or self._recorder.broken:
            self._files.check()
        else:
            self._files.wait()  # resuming the step: its records are being written, let that finish
        with deferred_signals():
            if self._recorder is not None and self._recorder.broken:
                self._drop_step()  # what an interruption left of this step: it starts afresh
            if self._recorder is None:
                self._new_step_recorder()
                self._capture_s = 0.0
            elif config.save_tensors and self._writer is None:
                self._resume_writer()
            recorder = self._recorder
            assert recorder is not None
            # first: from here on, stop() and abort() undo whatever of the rest was done
            self._started = True
            self._capture_began = time.perf_counter()
            self._owner = ident
            _STARTED[ident] = self
            recorder.owner = ident
            recorder.closed = False
            if self._checklist is None:  # the step's first start
                device = switches.training_device(self.model)
                self._checklist = StepChecklist(self.current_step, current_rank(), device, self.checklist_env)
                if recorder.self_check is not None:  # judged by what the device declares as the step starts
                    recorder.self_check.policy = switches.current_policy(device)
            if self.model is None and self._checklist_model is None:
                self._checklist_model = caller_model()
            self._checklist.start(self.model if self.model is not None else self._checklist_model)
            if self._checklist.wants_first_call():
                recorder.on_first_call = self._checklist.first_call
            if config.modules and self.model is not None:
                recorder.attach_model(self.model)
            if config.level == "mix" or recorder.record_updates:
                recorder.model_lookup = self._updated_model
                recorder.attach_optimizer_hooks()
            # the frames above this call stay while the step is captured: stacks stop walking at them
            recorder.stacks.anchor = StackAnchor(skip=1)
            if config.apis:
                self._patcher.install()
                threads.activate(recorder)

    def stop(self) -> None:
        """Stop capturing, remove every wrapper and hook, and write the step's files (rewritten if resumed)."""
        if not self._started:
            return
        self._capture_s += time.perf_counter() - self._capture_began
        recorder = self._recorder
        with deferred_signals():
            self._detach()
        if recorder is None:
            return
        try:
            if not recorder.broken:
                recorder.finish()
            if recorder.broken:  # an interruption cut through the capture: the step is not written
                self._drop_step()
                return
            self._write(recorder)
        except BaseException as exc:
            recorder.interrupted(exc)  # the step's files are not handed over: step()/close() drop it
            raise
        self._check_size()

    def step(self) -> None:
        """Advance to the next training step (stopping first if needed)."""
        self.stop()
        with deferred_signals():
            self._drop_step()  # what was not handed to the writer thread is dropped
            self.current_step += 1

    def abort(self) -> None:
        """Give up the step being captured, after its body raised (Ctrl-C, a test timeout, any exception).

        Stops capturing, removes every wrapper and hook, drops the step's records and its tensor files not yet
        published, and waits for the dump's threads (the files of the steps already stopped are finished whole).
        Safe in any state and idempotent; it never raises because of the interruption (an error of an earlier
        step's writing is kept for :meth:`wait` / :meth:`close`). The step counter does not move, and the debugger
        stays usable: call :meth:`step` to go on, :meth:`close` to finish.
        """
        with deferred_signals():
            self._detach()
            self._drop_step()
        self._files.join()
        heal_signal_handlers()

    def close(self) -> None:
        """Stop, finish writing, and release everything; the debugger cannot be started again."""
        try:
            self.stop()
        finally:
            try:  # also after stop() raised (the size limit, an interruption): nothing is left open
                with deferred_signals():
                    self._detach()
                    self._drop_step()  # what was not handed to the writer thread is dropped
                self._files.wait()
            finally:
                self._closed = True
                heal_signal_handlers()

    def wait(self) -> None:
        """Block until every file of the steps stopped so far is written; raises DumpError if one failed."""
        self._files.wait()

    def forward_backward_dump_end(self) -> None:
        """msprobe's name for stopping the capture before the end of the step."""
        self.stop()

    def __enter__(self) -> PrecisionDebugger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        # the body raised: its step is dropped, and nothing here may hide the exception on its way out
        self.abort()
        try:
            self.close()
        except Exception as error:
            warnings.warn(
                f"closing the dump after {exc_type.__name__ if exc_type else 'an error'}: {error}",
                stacklevel=2,
            )

    # -- where things go -----------------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._started

    def step_path(self, step: int | None = None) -> Path:
        """The folder of a step's files: ``dump_path/step{N}/rank`` (``rank{R}`` under torch.distributed)."""
        return step_dir(self.config.dump_path, self.current_step if step is None else step)

    # -- internals -----------------------------------------------------------------------------------------------

    def _updated_model(self) -> torch.nn.Module | None:
        """The model whose parameters' updates are recorded: the one given, else the one the checklist found (at
        the start, or at the optimizer's step: its hook runs before the recorder's)."""
        if self.model is not None:
            return self.model
        checklist = self._checklist
        return (
            checklist.model
            if checklist is not None and checklist.model is not None
            else self._checklist_model
        )

    def _detach(self) -> None:
        """Stop capturing: the recorder closed, this thread's slot emptied, wrappers let go, hooks removed.

        Idempotent, and ordered so that a cut anywhere leaves nothing that records: the recorder is closed first
        (every wrapper and hook that still reaches it returns at once), and the flag that makes stop() do this
        again is cleared last.
        """
        recorder = self._recorder
        if self._checklist is not None:
            self._checklist.detach()
        if recorder is not None:
            recorder.closed = True
            recorder.stacks.anchor = None  # its frames are let go
            if self._owner == threading.get_ident():
                threads.deactivate(recorder)
        self._patcher.uninstall()
        if recorder is not None:
            recorder.detach(sweep=recorder.broken)
        owner = self._owner
        if owner is not None and _STARTED.get(owner) is self:
            del _STARTED[owner]
        self._started = False

    def _drop_step(self) -> None:
        """Forget the step's records and delete its staged tensor files (the ones not handed to the writer)."""
        writer = self._writer
        if writer is not None:
            writer.discard()
        self._writer = None
        self._recorder = None
        self._engine = None
        self._checklist = None

    def _check_size(self) -> None:
        """Raise, once, that the dump reached its size limit (its files written so far are complete)."""
        budget = self._budget
        if budget is None or budget.refused is None or self._size_reported:
            return
        self._size_reported = True
        row = budget.refused.removesuffix(TENSOR_SUFFIX)
        raise DumpSizeError(self.config.dump_path, format_size(budget.limit), row)

    def _new_step_recorder(self) -> None:
        config = self.config
        sink = None
        writer = None
        if config.save_tensors:
            writer = self._tensor_writer()
            sink = writer.submit
        engine = StatEngine(md5=config.md5, tensor_sink=sink, worker_init=threads.silence_this_thread)
        recorder = Recorder(config, engine)
        self._writer, self._engine, self._recorder = writer, engine, recorder

    def _tensor_writer(self) -> TensorWriter:
        return TensorWriter(self.step_path() / TENSOR_DIR, quiet=threads.quiet, budget=self._budget)

    def _resume_writer(self) -> None:
        """A new writer for a step captured again after its stop() (the first one's files were handed over)."""
        writer = self._tensor_writer()
        engine = self._engine
        # a sink of None: the dump is full, nothing more to save
        if engine is not None and engine.tensor_sink is not None:
            engine.tensor_sink = writer.submit
        self._writer = writer

    def _write(self, recorder: Recorder) -> None:
        config = self.config
        engine = self._engine
        assert engine is not None
        folder = self.step_path()
        header = {
            "task": config.task,
            "level": config.level,
            "framework": "pytorch",
            "dump_data_dir": os.fspath(folder / TENSOR_DIR) if config.save_tensors else None,
        }
        checklist = self._checklist.document() if self._checklist is not None else None
        if self._checklist is not None and self.model is None and self._checklist.model is not None:
            self._checklist_model = (
                self._checklist.model
            )  # found at its optimizer step: at the start from now on
        writer = self._writer
        if writer is not None:
            writer.save()  # the snapshots, into the staging folder (long: it may be interrupted, then dropped)
        _sync_devices()  # the copies and statistics launched on the training thread's streams are done

        step = self.current_step

        def write_files() -> None:
            with torch.no_grad():
                engine.flush()
                if writer is not None:
                    writer.publish()  # the tensor folder appears before the dump.json that names its files
                construct = recorder.construct if config.modules else {}
                check = recorder.self_check
                own = None
                if check is not None:
                    policy = check.precision
                    declared = policy.to_dict() if policy is not None else None
                    own = (check.own_errors(recorder.data), check.device, declared)
                data, stacks = recorder.data, recorder.stacks.render()
                if config.overflow_check:
                    data, stacks = self._overflowing(step, data, stacks)
                if checklist is not None:
                    write_checklist_file(folder, checklist)
                if recorder.record_updates:
                    write_optimizer_file(folder, recorder.optimizer_document(data))
                write_step_files(folder, header, data, stacks, construct, own)

        self._files.wait()  # one step at a time; an earlier step's failure is reported before this one goes
        with deferred_signals():
            # together: once the thread has the step, its staged files are the thread's to publish (a resumed
            # capture of the step stages its new files with a new writer)
            self._files.submit(write_files, inline=self._files.wants_inline(self._capture_s))
            self._writer = None

    def _overflowing(
        self, step: int, data: dict[str, Any], stacks: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The records (and stacks) of the step's calls that overflow, within what ``overflow_nums`` leaves."""
        limit = self.config.overflow_nums
        if limit != -1:
            limit = max(0, limit - sum(n for s, n in self._overflows.items() if s != step))
        kept = keep_overflows(data, limit)
        self._overflows[step] = len(kept)
        return kept, keep_stacks(stacks, kept)


def _sync_devices() -> None:
    """Wait for the current stream of each accelerator in use (once per stop: the writer thread reads the
    statistics and copies from its own stream, which would not wait for a side stream of the training)."""
    if torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    npu = getattr(torch, "npu", None)
    if npu is not None and getattr(npu, "is_initialized", lambda: False)():
        npu.current_stream().synchronize()
