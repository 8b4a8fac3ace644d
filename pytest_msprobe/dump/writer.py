"""Writing a step's dump: the folder layout, atomic files, tensor files off the training thread.

Layout, as msprobe writes it::

    dump_path/step{N}/{rank | rank{R}}/dump.json, stack.json, construct.json[, dump_tensor_data/<row>.pt]

and beside them our sidecars (checklist.json, optimizer.json, self_check.json), written before the dump.json.

``rank`` when torch.distributed is not initialized, ``rank{R}`` when it is. Each JSON file is written to a
temporary file in the same folder and renamed over the target; tensor files are saved into a hidden staging
folder that is renamed to ``dump_tensor_data`` when the step's files are written, right before its dump.json. A
crash never leaves a half-written file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from pytest_msprobe.dump.signals import deferred_signals
from pytest_msprobe.dump.torchsave import save_tensor
from pytest_msprobe.errors import DumpError, PathLike
from pytest_msprobe.format.checklistfile import CHECKLIST_JSON, write_checklist
from pytest_msprobe.format.files import write_text
from pytest_msprobe.format.layout import (
    CONSTRUCT_JSON,
    DUMP_JSON,
    STACK_JSON,
    rank_folder,
    step_folder,
)
from pytest_msprobe.format.optimizerfile import OPTIMIZER_JSON, OptimizerStep, write_optimizer
from pytest_msprobe.format.own_errors import CallOwn, own_errors_path, write_own_errors


def rank_dir_name() -> str:
    """``rank{R}`` under an initialized torch.distributed, else ``rank``."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed support
        return rank_folder(None)
    return rank_folder(dist.get_rank() if dist.is_available() and dist.is_initialized() else None)


def current_rank() -> int:
    """The process's rank (0 outside torch.distributed)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return 0
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def step_dir(dump_path: PathLike, step: int) -> Path:
    """``dump_path/step{N}/{rank dir}``."""
    return Path(dump_path) / step_folder(step) / rank_dir_name()


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically; a failure is a :class:`DumpError` naming the file."""
    try:
        write_text(path, text)
    except OSError as exc:
        raise DumpError(f"{path}: cannot write ({exc.strerror or exc})") from exc


# one encoder for every entry (json.dumps with options builds a new one per call); NaN/Infinity are written as
# msprobe's files have them
_dumps = json.JSONEncoder(ensure_ascii=False, check_circular=False).encode


def render_mapping(header: dict[str, Any], key: str | None, entries: dict[str, Any]) -> str:
    """JSON text with one entry of ``entries`` per line: readable, diffable, and fast (C encoder per entry).

    With ``key``, ``entries`` is nested under ``header[key]``; without, ``entries`` is the whole object.
    """
    parts = ["{\n"]
    items = [f" {_dumps(k)}: {_dumps(v)}" for k, v in header.items()]
    if key is not None:
        body = ",\n".join(f"  {_dumps(k)}: {_dumps(v)}" for k, v in entries.items())
        items.append(f" {_dumps(key)}: {{\n{body}\n }}" if body else f" {_dumps(key)}: {{}}")
    else:
        items.extend(f" {_dumps(k)}: {_dumps(v)}" for k, v in entries.items())
    parts.append(",\n".join(items))
    parts.append("\n}\n")
    return "".join(parts)


def write_checklist_file(folder: Path, doc: Mapping[str, Any]) -> None:
    """Write a step's checklist.json into ``folder`` (created if needed), before its dump.json."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_checklist(folder, doc)
    except OSError as exc:
        raise DumpError(f"{folder / CHECKLIST_JSON}: cannot write ({exc.strerror or exc})") from exc


def write_optimizer_file(folder: Path, steps: Sequence[OptimizerStep]) -> None:
    """Write a step's optimizer.json into ``folder`` (created if needed), before its dump.json."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_optimizer(folder, steps)
    except OSError as exc:
        raise DumpError(f"{folder / OPTIMIZER_JSON}: cannot write ({exc.strerror or exc})") from exc


def write_step_files(
    folder: Path,
    header: dict[str, Any],
    data: dict[str, Any],
    stack: dict[str, Any],
    construct: dict[str, Any],
    own_errors: tuple[Mapping[str, CallOwn], str, Mapping[str, Any] | None] | None = None,
) -> None:
    """Write dump.json, stack.json and construct.json of one step into ``folder`` (created if needed), and the
    self-check's sidecar before them when ``own_errors`` (every call's own error, the device, the policy they
    were judged by) is given: a dump.json of a self-checked step is never without its sidecar."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DumpError(f"{folder}: cannot create the dump folder ({exc.strerror or exc})") from exc
    if own_errors is not None:
        try:
            calls, device, policy = own_errors
            write_own_errors(folder / DUMP_JSON, calls, device=device, precision=policy)
        except OSError as exc:
            raise DumpError(
                f"{own_errors_path(folder / DUMP_JSON)}: cannot write ({exc.strerror or exc})"
            ) from exc
    atomic_write_text(folder / DUMP_JSON, render_mapping(header, "data", data))
    atomic_write_text(folder / STACK_JSON, render_mapping({}, None, stack))
    atomic_write_text(folder / CONSTRUCT_JSON, render_mapping({}, None, construct))


def file_size_estimate(name: str, nbytes: int) -> int:
    """The size torch.save gives a tensor of ``nbytes`` saved as ``name``, from above: the zip records repeat the
    name, and headers and alignment take about 1.3 kB (measured with torch 2.x)."""
    return nbytes + 1536 + 16 * len(name)


class SizeBudget:
    """The bytes of tensor files a dump may still take, shared by its steps; counted as tensors are queued."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.refused: str | None = None  # the first file that did not fit

    def take(self, name: str, nbytes: int) -> bool:
        """Reserve room for file ``name``; False (and every later call False) once the dump is full."""
        if self.refused is not None:
            return False
        size = file_size_estimate(name, nbytes)
        if self.used + size > self.limit:
            self.refused = name
            return False
        self.used += size
        return True


class TensorWriter:
    """Saves tensor snapshots as ``folder/<name>`` files, all at once when the step stops.

    The training thread hands over snapshots (copies taken when the record was built) while it captures; they
    are saved by :meth:`join`, on the calling thread, once capture is over: saving beside a capturing thread
    would make the two fight over the GIL. Past ``max_pending_bytes`` of waiting snapshots, the snapshots are
    saved right away, which bounds the memory a large dump takes. Files go to a hidden staging folder beside
    ``folder``, published as ``folder`` with one rename (or moved in, when ``folder`` exists from an earlier stop
    in the same step): a crash never leaves a half-written file in ``folder``, and the dump pays one rename per
    step rather than one per file. ``quiet`` returns a context in which torch calls are not recorded (saving
    while capture is on must not show up in the dump). ``budget`` bounds the size of the dump: a snapshot that
    would take it past its limit is refused as it is handed over, before anything is written.
    """

    def __init__(
        self,
        folder: Path,
        max_pending_bytes: int = 256 * 2**20,
        quiet: Callable[[], AbstractContextManager[Any]] | None = None,
        budget: SizeBudget | None = None,
    ) -> None:
        self.folder = folder
        self.staging = folder.with_name(f".{folder.name}.{os.getpid()}.{id(self):x}.tmp")
        self._pending: list[tuple[str, Any]] = []
        self._pending_bytes = 0
        self._max_pending = max_pending_bytes
        self._quiet = quiet or contextlib.nullcontext
        self._staged = False  # whether the staging folder exists and holds unpublished files
        self._made: list[Path] = []  # folders created for the staging folder
        self._budget = budget
        self.files_written = 0

    def submit(self, name: str, tensor: Any) -> bool:
        """Keep ``tensor`` (already a private copy) to be saved as ``folder/name``; False when the dump is full."""
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        if self._budget is not None and not self._budget.take(name, nbytes):
            return False
        self._pending.append((name, tensor))
        self._pending_bytes += nbytes
        if self._pending_bytes > self._max_pending:
            with self._quiet():
                self._save_pending()
        return True

    def _save_pending(self) -> None:
        if not self._pending:
            return
        if not self._staged:
            # the folders made here (the step's rank folder and the step folder, say) go again if it is discarded
            self._made = [p for p in self.staging.parents if not p.exists()]
            try:
                self.staging.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DumpError(
                    f"{self.folder}: cannot create the tensor folder ({exc.strerror or exc})"
                ) from exc
            self._staged = True
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        for name, tensor in pending:
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            try:
                # torch.save calls back into Python from C and can lose the exception a signal handler raises
                # there (a Ctrl-C would vanish): signals wait until the file is saved
                with deferred_signals():
                    save_tensor(tensor, self.staging / name)
            except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
                # the staged files are not published: drop them all, a failed dump must not keep filling the disk
                self.discard()
                raise DumpError(f"{self.folder / name}: cannot write ({_why(exc, self.folder)})") from exc
            self.files_written += 1

    def discard(self) -> None:
        """Drop what is pending and staged (after a failure or an interruption): nothing of it is published.

        Idempotent: cut while deleting, the next call deletes the rest.
        """
        self._pending, self._pending_bytes = [], 0
        if self._staged or self.staging.exists():
            shutil.rmtree(self.staging, ignore_errors=True)
            self._staged = False
            for folder in self._made:  # innermost first, while nothing else is in them
                try:
                    folder.rmdir()
                except OSError:
                    break
            self._made = []

    def save(self) -> None:
        """Save every pending snapshot into the staging folder (not published yet)."""
        with self._quiet():
            self._save_pending()

    def publish(self) -> None:
        """Make the staged files appear in ``folder`` (one rename, or moves into an existing folder)."""
        if not self._staged:
            return
        try:
            if not self.folder.exists():
                os.rename(self.staging, self.folder)
            else:  # a later stop() in the same step: add the new files to the published ones
                for path in self.staging.iterdir():
                    os.replace(path, self.folder / path.name)
                self.staging.rmdir()
        except OSError as exc:
            raise DumpError(
                f"{self.folder}: cannot publish the tensor files ({exc.strerror or exc})"
            ) from exc
        self._staged = False

    def join(self) -> None:
        """Save every pending snapshot and publish the files; raise DumpError if one could not be written."""
        self.save()
        self.publish()


def _why(exc: BaseException, folder: Path) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    try:
        free = shutil.disk_usage(folder.parent).free
    except OSError:
        return f"torch.save failed: {text}"
    return f"torch.save failed: {text}; {free} bytes free on that disk"


class BackgroundJobs:
    """Runs jobs one at a time on a background thread (a step's JSON files), surfacing errors later.

    The thread is not a daemon: the interpreter waits for the files before it exits. :meth:`wait` blocks until
    the current job is done and raises :class:`DumpError` if a job failed; :meth:`check` raises without waiting,
    :meth:`join` waits without raising.

    ``submit(job, inline=True)`` runs the job on the calling thread instead, with the same error reporting.
    :attr:`last_cpu` is the CPU time of the last job that ended (``time.thread_time``: its own work, not its
    waits for the GIL), which :meth:`wants_inline` weighs against the step's capture.
    """

    def __init__(self, on_thread_start: Callable[[], None] | None = None) -> None:
        self._thread: threading.Thread | None = None
        self._done: threading.Event | None = None  # set by the job's thread when the job is over
        self._error: BaseException | None = None
        self._on_thread_start = on_thread_start
        self.last_cpu: float | None = None

    def wants_inline(self, capture_s: float) -> bool:
        """Whether the next job should run on the calling thread, given how long the step's capture took.

        A job is mostly Python (a step's statistics brought to the host, its JSON rendered). On a thread of its
        own it takes the GIL at each of the training thread's operators and keeps it for up to the interpreter's
        switch interval: beside a step of many short operators that costs the step more than the job itself
        (width-8 TinyResNet, consecutive dumped steps: 27 ms a step with the thread, 19.5 ms inline), beside one
        of long operators the two run in parallel (width 32: 62 ms with the thread, 73 ms inline). A job whose
        CPU time is more than a quarter of the capture's runs inline; the first runs on the thread.
        """
        return self.last_cpu is not None and self.last_cpu * 4 > capture_s

    def submit(self, job: Any, inline: bool = False) -> None:
        self.wait()  # one at a time, in order: a later step's files never overtake an earlier one's
        if inline:
            self._execute(job)
            return
        done = threading.Event()
        thread = threading.Thread(target=self._run, args=(job, done), name="pytest-msprobe-writer")
        thread.start()
        # kept once started: a thread that never started is never waited for
        self._thread, self._done = thread, done

    def _run(self, job: Any, done: threading.Event) -> None:
        try:
            self._execute(self._on_thread_start, job)
        finally:
            done.set()

    def _execute(self, *calls: Callable[[], Any] | None) -> None:
        """Run ``calls`` in order, keeping an error for :meth:`wait` and the CPU time in :attr:`last_cpu`."""
        began = time.thread_time()
        try:
            for call in calls:
                if call is not None:
                    call()
        except BaseException as exc:  # kept for wait(): a failed write must not go unnoticed
            self._error = exc
        finally:
            self.last_cpu = time.thread_time() - began

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise the error of a finished job, if any (does not wait)."""
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, DumpError):
                raise error
            raise DumpError(f"writing the dump failed: {error}") from error

    def join(self) -> None:
        """Wait for the current job, keeping its error (if any) for :meth:`wait` / :meth:`check`.

        Waits on the job's own event first: an interrupted ``Thread.join`` of CPython 3.11 marks a thread that is
        still running as stopped, after which join() returns at once. Once the event is set, the thread has only
        to return.
        """
        thread, done = self._thread, self._done
        if thread is None:
            return
        if done is not None:
            done.wait()
        thread.join()
        self._thread = self._done = None  # after the wait: cut during it, the next call waits again

    def wait(self) -> None:
        """Wait for the current job; raise DumpError if a job failed."""
        self.join()
        self.check()
