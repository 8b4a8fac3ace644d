"""Short sections of the debugger's own bookkeeping that a signal must not cut in two.

Python runs signal handlers on the main thread between two bytecodes, so Ctrl-C (``KeyboardInterrupt``) or a
handler that raises (pytest-timeout's ``signal`` method raises a test failure from ``SIGALRM``) can land anywhere.
Most of the dump is written so that any cut leaves a state that ``stop()``, ``abort()`` or ``close()`` can
clean up; the few places where two changes must happen together (wrappers installed and the registry that says so,
a step's files handed to the writer thread and the debugger letting go of them) run inside
:class:`deferred_signals`. It swaps the Python-level handlers of the signals that have one for a handler that only
notes the signal, and on exit puts the handlers back and raises each noted signal again, so its handler runs at
the end of the section instead of inside it.

Only the main thread can swap handlers, and only it runs them: on any other thread the section is a no-op.
Signals whose handler is not a Python callable (``SIG_DFL``, ``SIG_IGN``, or one set from C) are left alone.
A section costs two ``signal.signal`` calls per deferred signal (about a microsecond each): it is for start,
stop, step and close, never for a captured call.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

try:  # the C functions: signal's wrappers are Python functions, where a pending handler would run mid-way
    import _signal as _sig
except ImportError:  # pragma: no cover - not CPython
    _sig = signal

_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGALRM", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
_get_ident = threading.get_ident
_MAIN_IDENT = threading.main_thread().ident
_OPEN: list[deferred_signals] = []  # the sections open on the main thread: only the outermost swaps handlers


class deferred_signals:
    """``with deferred_signals(): ...``: signals arriving inside are handled right after it.

    Sections nest: only the outermost one defers, an inner one costs a list append.
    """

    __slots__ = ("_active", "_hits", "_outer", "_saved")

    def __init__(self) -> None:
        self._saved: list[tuple[int, Callable[[int, FrameType | None], Any]]] = []
        self._hits: list[int] = []
        self._active = False
        self._outer = False

    def __enter__(self) -> deferred_signals:
        if _get_ident() != _MAIN_IDENT:
            return self
        try:
            _OPEN.append(self)
            if _OPEN[0] is not self:
                return self
            self._outer = self._active = True
            for sig in _SIGNALS:
                handler = _original(sig, _sig.getsignal(sig))
                if callable(handler):
                    # noted before the swap: if we are cut right after it, the except clause still undoes it
                    self._saved.append((sig, handler))
                    _sig.signal(sig, self._note)
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        if _get_ident() == _MAIN_IDENT:
            self._leave()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self._active:
            self._hits.append(signum)
            return
        # the section is over but this handler is still in place (we were cut while putting the handlers
        # back): put back all of them, and act as the original handler would
        self._put_back()
        handler = self._original_of(signum)
        if callable(handler):
            handler(signum, frame)

    def _original_of(self, signum: int) -> Any:
        for sig, handler in self._saved:
            if sig == signum:
                return handler
        return None

    def _put_back(self) -> None:
        for sig, handler in self._saved:
            if _sig.getsignal(sig) == self._note:
                _sig.signal(sig, handler)

    def _leave(self) -> None:
        if self in _OPEN:  # not when cut before it was added
            _OPEN.remove(self)
        if not self._outer:
            return
        self._outer = False
        # from here on, a signal reaching _note puts the handlers back and goes to its own handler at once; a
        # pending signal's handler may run (and raise) between any two calls below, or inside signal() itself:
        # the handlers are put back until done, and that exception goes on afterwards. Whatever is still left
        # (cut at the loop's back edge) forwards, and heal() or the next section puts it back.
        self._active = False
        error: BaseException | None = None
        for _ in range(3):
            try:
                self._put_back()
                break
            except BaseException as exc:
                error = error or exc
        hits, self._hits = self._hits, []
        for sig in dict.fromkeys(hits):
            _sig.raise_signal(sig)
        if error is not None:
            raise error


def _original(sig: int, handler: Any) -> Any:
    """``handler``, or the handler it stands for when it is the note of a section already over."""
    for _ in range(8):  # a chain of such notes, each standing for the one before
        owner = getattr(handler, "__self__", None)
        if not isinstance(owner, deferred_signals) or owner._active:
            return handler
        handler = owner._original_of(sig)
    return handler


def heal() -> None:
    """Put back the handlers that a section cut short left in place (they still work: they forward).

    Called by the debugger at the end of close() and abort(), outside any section.
    """
    if _get_ident() != _MAIN_IDENT or _OPEN:
        return
    for sig in _SIGNALS:
        current = _sig.getsignal(sig)
        original = _original(sig, current)
        if original is not current and original is not None:
            _sig.signal(sig, original)
