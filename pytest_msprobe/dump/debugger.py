"""PrecisionDebugger: msprobe's dump calls, without its process-wide singleton.

    debugger = PrecisionDebugger(dump_path="./dump_data", task="statistics", step=[0, 1], level="L1")
    for images, target in loader:
        debugger.start()              # start(model=model) for L0 / mix
        ...forward, loss, zero_grad, backward, optimizer.step()...
        debugger.stop()               # step{N}/rank/{dump,stack,construct}.json are written in the background
        debugger.step()

Several debuggers can be used one after another in one process; only one can be started at a time. stop()
removes every wrapper and hook it installed; it also works as a context manager (``with PrecisionDebugger(...)
as debugger:``), which closes it on exit.

``max_dump_size`` (bytes, or a text such as ``"500MB"`` / ``"2GiB"``) bounds the tensor files of task ``tensor``:
the first tensor that would take the dump past it is not saved, nor any after it (the step's JSON files are still
written, without a ``data_name`` for them), and the stop() of that step raises :class:`DumpSizeError` naming the
row where it happened.

stop() saves the tensor files of task ``tensor`` (complete when it returns), then hands the step's records to a
background thread that resolves the statistics and writes the JSON files while training goes on. The files are complete
after :meth:`PrecisionDebugger.wait` or :meth:`PrecisionDebugger.close` (and at interpreter exit); each is
written through a temporary file and a rename, so a reader never sees a partial file.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from pytest_msprobe.dump import intercept
from pytest_msprobe.dump.capture import Recorder
from pytest_msprobe.dump.config import DumpConfig, build_config, format_size
from pytest_msprobe.dump.intercept import ApiPatcher
from pytest_msprobe.dump.stats import StatEngine
from pytest_msprobe.dump.writer import (
    TENSOR_DIR,
    BackgroundJobs,
    SizeBudget,
    TensorWriter,
    current_rank,
    step_dir,
    write_step_files,
)
from pytest_msprobe.errors import ConfigError, DumpError, DumpSizeError, PathLike

# the debugger currently started in this process (at most one: the API wrappers are process-wide)
_STARTED: PrecisionDebugger | None = None


class PrecisionDebugger:
    """Dump the APIs (L1), modules (L0) or both (mix) of chosen training steps in msprobe's format.

    Arguments mirror msprobe's (``config_path``, ``task``, ``dump_path``, ``level``, ``model``, ``step``) plus the
    filters of its config.json (``rank``, ``scope``, ``list``, ``data_mode``, ``summary_mode``); explicit
    arguments override the file. ``task`` is ``"statistics"``, ``"tensor"`` or ``"md5"`` (statistics plus a
    CRC32 of every tensor). ``max_dump_size`` (``500MB``, ``2GiB`` or bytes) stops saving tensor files before
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
        rank: Any = None,
        scope: list[str] | None = None,
        list: list[str] | None = None,
        data_mode: list[str] | None = None,
        summary_mode: str | None = None,
        max_dump_size: int | str | None = None,
    ) -> None:
        self.config: DumpConfig = build_config(
            config_path,
            task=task,
            dump_path=dump_path,
            level=level,
            step=step,
            rank=rank,
            scope=scope,
            api_list=list,
            data_mode=data_mode,
            summary_mode=summary_mode,
            max_dump_size=max_dump_size,
        )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model={type(model).__name__}: expected a torch.nn.Module")
        self.model = model
        self.current_step = 0
        self._patcher = ApiPatcher()
        self._recorder: Recorder | None = None
        self._engine: StatEngine | None = None
        self._writer: TensorWriter | None = None
        self._files = BackgroundJobs(on_thread_start=intercept.silence_this_thread)
        limit = self.config.max_dump_size
        self._budget = SizeBudget(limit) if limit is not None else None
        self._size_reported = False
        self._started = False
        self._closed = False

    # -- the msprobe calls ---------------------------------------------------------------------------------------

    def start(self, model: torch.nn.Module | None = None) -> None:
        """Begin (or resume) capturing the current step; a no-op for steps and ranks not selected."""
        global _STARTED
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
        if _STARTED is not None and _STARTED is not self:
            raise DumpError("another PrecisionDebugger is started in this process: stop it first")
        if self._recorder is None:
            self._files.check()
            self._new_step_recorder()
        else:
            self._files.wait()  # resuming the step: its records are being written, let that finish
        recorder = self._recorder
        assert recorder is not None
        recorder.closed = False
        if config.modules and self.model is not None:
            recorder.attach_model(self.model)
        if config.level == "mix":
            recorder.attach_optimizer_hooks()
        if config.apis:
            self._patcher.install()
        _STARTED = self
        self._started = True
        intercept.set_recorder(recorder)

    def stop(self) -> None:
        """Stop capturing, remove every wrapper and hook, and write the step's files (rewritten if resumed)."""
        global _STARTED
        if not self._started:
            return
        self._started = False
        recorder = self._recorder
        try:
            intercept.set_recorder(None)
            self._patcher.uninstall()
            if recorder is not None:
                recorder.detach()
                recorder.finish()
                recorder.closed = True
        finally:
            if _STARTED is self:
                _STARTED = None
        if recorder is not None:
            self._write(recorder)
        self._check_size()

    def step(self) -> None:
        """Advance to the next training step (stopping first if needed)."""
        self.stop()
        self._end_step()
        self.current_step += 1

    def close(self) -> None:
        """Stop, finish writing, and release everything; the debugger cannot be started again."""
        try:
            self.stop()
        finally:
            try:  # also after stop() raised (the size limit): the files so far are finished, nothing left open
                self._end_step()
                self._files.wait()
            finally:
                self._closed = True

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
        self.close()

    # -- where things go -----------------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._started

    def step_path(self, step: int | None = None) -> Path:
        """The folder of a step's files: ``dump_path/step{N}/rank`` (``rank{R}`` under torch.distributed)."""
        return step_dir(self.config.dump_path, self.current_step if step is None else step)

    # -- internals -----------------------------------------------------------------------------------------------

    def _check_size(self) -> None:
        """Raise, once, that the dump reached its size limit (its files written so far are complete)."""
        budget = self._budget
        if budget is None or budget.refused is None or self._size_reported:
            return
        self._size_reported = True
        row = budget.refused[: -len(".pt")] if budget.refused.endswith(".pt") else budget.refused
        raise DumpSizeError(self.config.dump_path, format_size(budget.limit), row)

    def _new_step_recorder(self) -> None:
        config = self.config
        sink = None
        if config.save_tensors:
            self._writer = TensorWriter(
                self.step_path() / TENSOR_DIR, quiet=intercept.quiet, budget=self._budget
            )
            sink = self._writer.submit
        self._engine = StatEngine(md5=config.md5, tensor_sink=sink, worker_init=intercept.silence_this_thread)
        self._recorder = Recorder(config, self._engine)

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
        if self._writer is not None:
            self._writer.join()
        _sync_devices()  # the copies and statistics launched on the training thread's streams are done

        def write_files() -> None:
            engine.flush()
            construct = recorder.construct if config.modules else {}
            write_step_files(folder, header, recorder.data, recorder.stacks.render(), construct)

        self._files.submit(write_files)

    def _end_step(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            finally:
                self._writer = None
        self._recorder = None
        self._engine = None


def _sync_devices() -> None:
    """Wait for the current stream of each accelerator in use (once per stop: the writer thread reads the
    statistics and copies from its own stream, which would not wait for a side stream of the training)."""
    if torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    npu = getattr(torch, "npu", None)
    if npu is not None and getattr(npu, "is_initialized", lambda: False)():
        npu.current_stream().synchronize()
