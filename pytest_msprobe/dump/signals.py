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
from types import FrameType, TracebackType
from typing import Any, Callable

_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGALRM", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
_get_ident = threading.get_ident
_MAIN_IDENT = threading.main_thread().ident


class deferred_signals:
    """``with deferred_signals(): ...``: signals arriving inside are handled right after it.

    Re-entrant: an inner section hands what it noted to the outer one.
    """

    __slots__ = ("_active", "_hits", "_saved")

    def __init__(self) -> None:
        self._saved: list[tuple[int, Callable[[int, FrameType | None], Any]]] = []
        self._hits: list[int] = []
        self._active = False

    def __enter__(self) -> deferred_signals:
        if _get_ident() != _MAIN_IDENT:
            return self
        self._active = True
        try:
            for sig in _SIGNALS:
                handler = signal.getsignal(sig)
                if callable(handler):
                    # noted before the swap: if we are cut right after it, the except clause still undoes it
                    self._saved.append((sig, handler))
                    signal.signal(sig, self._note)
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self._active:
            self._hits.append(signum)
            return
        # the section is over but this handler was not put back yet (we were cut while restoring): act as the
        # original handler would, and put it back
        for sig, handler in self._saved:
            if sig == signum:
                signal.signal(sig, handler)
                handler(signum, frame)
                return

    def _leave(self) -> None:
        self._active = False  # from here on, a signal reaching _note goes to its own handler at once
        saved = self._saved
        for sig, handler in reversed(saved):
            if signal.getsignal(sig) == self._note:
                signal.signal(sig, handler)
        hits, self._hits = self._hits, []
        for sig in dict.fromkeys(hits):
            signal.raise_signal(sig)
