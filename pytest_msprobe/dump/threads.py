"""Whose calls are recorded: each thread's slot, naming the recorder its API calls go to.

Every thread has its own slot, ``slot.active``: the recorder its calls go to, or None. A wrapper (:mod:`.intercept`)
reads that slot and nothing else, so a call costs one thread-local read when it is not recorded. A debugger sets
the slot of the thread that started it (:func:`activate`); the recorder empties it while it works on a call (calls
nested in a captured call, and the dump's own torch calls, are not recorded) and puts it back after. Every other
thread's calls go straight through, unrecorded and uncounted: a data loader, a metrics thread or a second
debugger's training loop on another thread never shows in this dump.

A recorder belongs to the thread that started it (its ``owner``). Its module hooks, optimizer hooks and
parameter-gradient hooks return at once on any other thread, except on a thread Python did not create while it
runs a backward pass this recorder claimed. The hooks it put on autograd nodes are its own whatever thread the
engine runs them on; the first of them to run on another thread claims that backward pass (:func:`claim_backward`).

Threads that Python did not create: the autograd engine runs the backward of CUDA (and other device) tensors on
its own device threads; Python code called there for the owner's backward (a custom ``autograd.Function``'s
backward, activation checkpointing's recomputation, a user's tensor hook) belongs to the owner's step. Such a
thread's slot holds :data:`FOREIGN`, which records a call for a recorder only while the thread runs an autograd
node (``torch._C._current_autograd_node()``) of a backward pass that recorder owns: one in which a hook the
recorder registered has already run. Not seen, then: calls made on a device thread before the first of the
recorder's hooks ran in that pass, and calls a device thread makes outside autograd nodes. On CPU the engine runs
a thread's backward on that thread, so none of this applies.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch

_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch._C.is_grad_enabled
_current_autograd_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)
_current_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_get_ident = threading.get_ident
_T = TypeVar("_T")


class CallTarget(Protocol):
    """What a slot names: a recorder, or :data:`FOREIGN` (which hands the call to one)."""

    # asynchronous collectives waiting for their work objects, by id of the work (read by Work.wait's wrapper)
    dist_pending: dict[int, Any]

    def api_call(
        self, api: str, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any: ...

    def dist_call(
        self, api: str, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any: ...

    def work_waited(self, work: Any) -> None: ...


# the backward passes (autograd graph task ids) in which a recorder's own hooks ran, for FOREIGN threads: the
# recorder, a CallTarget (its hooks, which claim, know it by the part of it they belong to)
_BACKWARD_OWNERS: dict[int, Any] = {}


def _created_by_python() -> bool:
    """Whether the calling thread was started by Python (threading), rather than by C++ (autograd, a library)."""
    active = getattr(threading, "_active", None)
    # current_thread() would register a dummy for a foreign thread: look it up instead (CPython has _active)
    thread = threading.current_thread() if active is None else active.get(_get_ident())
    dummy = getattr(threading, "_DummyThread", ())
    return thread is not None and not isinstance(thread, dummy)


class _ForeignThread:
    """The slot of a thread Python did not create: records for the recorder owning the backward pass it runs."""

    # never holds collectives waiting for their work (read by the wrapper of Work.wait)
    dist_pending: dict[int, Any] = {}  # noqa: RUF012 - an always empty, shared constant

    @staticmethod
    def owner() -> CallTarget | None:
        """The recorder whose backward pass this thread is running a node of, if any."""
        if not _BACKWARD_OWNERS or _current_autograd_node() is None:
            return None
        return _BACKWARD_OWNERS.get(_current_graph_task_id())

    def api_call(
        self, api: str, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        recorder = self.owner()
        return orig(*args, **kwargs) if recorder is None else recorder.api_call(api, orig, args, kwargs)

    def dist_call(
        self, api: str, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        recorder = self.owner()
        return orig(*args, **kwargs) if recorder is None else recorder.dist_call(api, orig, args, kwargs)

    def work_waited(self, work: Any) -> None:  # pragma: no cover - dist_pending is always empty
        pass


FOREIGN = _ForeignThread()


class ThreadSlot(threading.local):
    """Per thread: where its API calls go (``active``), set up on the thread's first use."""

    active: CallTarget | None = None  # a Recorder, FOREIGN, or None (straight through)
    foreign = False

    def __init__(self) -> None:
        if not _created_by_python():
            self.active = FOREIGN
            self.foreign = True


slot = ThreadSlot()


def activate(recorder: CallTarget) -> None:
    """Record the calling thread's API calls into ``recorder``."""
    slot.active = recorder


def deactivate(recorder: CallTarget | None = None) -> None:
    """Stop recording the calling thread's calls (into ``recorder`` only, when given)."""
    tls = slot
    if recorder is None or tls.active is recorder:
        tls.active = FOREIGN if tls.foreign else None


def is_foreign_thread() -> bool:
    """Whether the calling thread was not started by Python (an autograd device thread, say)."""
    return bool(slot.foreign)


def claim_backward(recorder: object) -> int | None:
    """Note that the backward pass the calling thread runs belongs to ``recorder`` (called from its hooks).

    Returns the pass's id (None outside a backward pass); :meth:`release_backward` forgets it.
    """
    task = _current_graph_task_id()
    if task < 0:
        return None
    if _BACKWARD_OWNERS.get(task) is not recorder:
        _BACKWARD_OWNERS[task] = recorder
    return task


def owns_backward(recorder: object) -> bool:
    """Whether the calling thread runs a node of a backward pass ``recorder`` claimed."""
    return bool(_BACKWARD_OWNERS) and _BACKWARD_OWNERS.get(_current_graph_task_id()) is recorder


def release_backward(recorder: object) -> None:
    """Forget every backward pass claimed by ``recorder``."""
    for task in [t for t, r in list(_BACKWARD_OWNERS.items()) if r is recorder]:
        _BACKWARD_OWNERS.pop(task, None)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """A context in which the calling thread's torch calls are not recorded."""
    tls = slot
    prev = tls.active
    try:
        tls.active = None
        yield
    finally:
        tls.active = prev


def untracked(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with the calling thread's calls not recorded and autograd off, both put back after it.

    For the dump's own work on the training thread inside a step (a hook's fingerprints, a collective's output).
    A ``with`` block cannot promise the putting back: a context manager's ``__exit__`` is a Python function, and a
    signal handler (Ctrl-C, pytest-timeout) can raise as it is entered, before it restores anything, leaving
    gradients off for the rest of the program. Here the restore is a ``finally`` clause whose only call, the last,
    is to C (Python runs handlers on entering Python functions, at loops and after calls).
    """
    tls = slot
    prev = tls.active
    grad = _is_grad_enabled()
    try:
        tls.active = None
        if grad:
            _set_grad_enabled(False)
        return fn(*args)
    finally:
        tls.active = prev
        if grad:
            _set_grad_enabled(True)


def silence_this_thread() -> None:
    """Set up one of the dump's own threads: its API calls are never recorded, and build no autograd graph."""
    slot.active = None
    slot.foreign = False
    _set_grad_enabled(False)
