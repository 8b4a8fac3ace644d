"""The records of one step and their bookkeeping: the base every part of the recorder writes through.

``data`` (dump.json's entries), ``construct`` (each record's parent node), ``stacks`` (stack.json), the call
counter that numbers the records, the filters, the module stack (the module calls running, which give a record
made now its parent), and the recorder's state: the thread that owns it, ``closed`` (every hook and wrapper
reaching it returns without touching it) and ``broken`` (an interruption cut through a record: the step is
dropped, see :mod:`.recorder`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pytest_msprobe.dump.config import DumpConfig
from pytest_msprobe.dump.entries import Values
from pytest_msprobe.dump.selection import Selector
from pytest_msprobe.dump.stack import StackTable
from pytest_msprobe.dump.stats import StatEngine
from pytest_msprobe.dump.threads import is_foreign_thread, owns_backward
from pytest_msprobe.format.names import OPTIMIZER_NODE, CallCounter, backward_of

_T = TypeVar("_T")

if TYPE_CHECKING:  # pragma: no cover
    from pytest_msprobe.dump.online_self_check import SelfCheck

_get_ident = threading.get_ident


class ModuleCall:
    """Forward state of one module call, kept on the module stack until its forward hook."""

    __slots__ = ("entry", "fwd", "input_keys", "parent", "seq", "stack", "wanted_bwd", "wanted_fwd")

    def __init__(self) -> None:
        self.fwd = ""
        self.parent: str | None = None
        self.entry: dict[str, Any] | None = None
        self.seq = 0
        # per tensor input that requires grad: (its grad_fn, or the leaf tensor itself; output_nr; position)
        self.input_keys: list[tuple[Any, int, int]] = []
        self.stack: Any = None
        self.wanted_fwd = False
        self.wanted_bwd = False


class StepRecords(Values):
    """What one step captured so far, and the state every hook and wrapper checks first."""

    def __init__(self, config: DumpConfig, engine: StatEngine) -> None:
        super().__init__(config, engine)
        self.config = config
        self.data: dict[str, Any] = {}
        self.construct: dict[str, str | None] = {}
        self.stacks = StackTable()
        self.counter = CallCounter()
        self.select = Selector(config)
        self.filtered = bool(config.scope or config.api_list)
        self.with_construct = config.modules
        self.with_api_parents = config.level == "mix"
        # the parent node of a record made now: the innermost module running, else the optimizer's step
        self.module_stack: list[ModuleCall] = []
        self.in_optimizer = False
        self.closed = False
        # an interruption cut through the capture: the records may be half-built, the step is not written
        self.broken = False
        self.owner = _get_ident()  # the thread whose step this is (set again by the debugger's start)
        self._handles: list[Any] = []  # of every hook registered, removed by detach()
        self.self_check: SelfCheck | None = None  # replays the API calls (config.self_check)

    def interrupted(self, exc: BaseException) -> None:
        """An exception passed through the recorder's code: if it was an interruption, the records are not whole."""
        if not isinstance(exc, Exception):
            self.broken = True

    def guarded(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` where an exception passing through it goes on after :meth:`interrupted` saw it (for the
        recorder's work outside the wrappers: hooks, callbacks, finishing a step)."""
        try:
            return fn(*args)
        except BaseException as exc:
            self.interrupted(exc)
            raise

    def foreign_mine(self) -> bool:
        """Whether the calling thread, not the owner, is a device thread running a backward pass of this step."""
        return is_foreign_thread() and owns_backward(self)

    def _parent(self) -> str | None:
        if self.module_stack:
            return self.module_stack[-1].fwd
        if self.in_optimizer:
            return OPTIMIZER_NODE
        return None

    def _write_backward(
        self, name: str, parent: str | None, grads_in: list[Any], grads_out: list[Any]
    ) -> None:
        """The backward record ``name`` of an API or module call: gradients flowing in, then out."""
        select = self.select
        entry: dict[str, Any] = {}
        names = self.names
        if select.bwd_in:
            entry["input"] = [
                self.analyze(g, f"{name}.input.{i}" if names else None, True) for i, g in enumerate(grads_in)
            ]
        if select.bwd_out:
            entry["output"] = [
                self.analyze(g, f"{name}.output.{i}" if names else None, True)
                for i, g in enumerate(grads_out)
            ]
        self.data[name] = entry
        if self.with_construct and (self.with_api_parents or name.startswith("Module.")):
            self.construct[name] = parent


def backward_parent(parent: str) -> str | None:
    """The parent node of a backward record, from its forward record's (the optimizer has no backward)."""
    if parent == OPTIMIZER_NODE:
        return None
    return backward_of(parent)
