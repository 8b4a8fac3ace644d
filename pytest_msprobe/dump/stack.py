"""Call stacks of forward records, captured cheaply and formatted once, at write time.

Capture keeps, per frame, the code object and the offset of the instruction running (``f_lasti``), skipping
the frames of this package: no line numbers are computed and no source is read while training runs. Line
numbers (from the code's line table) and source lines (through ``linecache``) are resolved when stack.json is
written, once per distinct frame. stack.json groups the record names that share one stack, as msprobe does::

    {"0": [["Functional.conv2d.0.forward"], ["File /x/conv.py, line 549, in _conv_forward, \\n return F.conv2d(", ...]]}

**Anchor.** Under pytest a call's stack is some 40 frames deep, 30 of them pytest's, and they do not move while
a step is captured. :class:`StackAnchor`, taken when the capture starts, notes the frames on the stack then; the
first capture finds the innermost of them still on the stack (the test function, the training loop) and keeps
the part of the stack above it, and later captures walk up to that frame only and reuse the rest: the same
stacks, at the cost of the frames below the training loop (about 0.33 us a frame).
"""

from __future__ import annotations

import bisect
import dis
import inspect
import linecache
import os
import sys
from types import CodeType
from typing import Any

# (id(code), offset, id(code), offset, ...) innermost first: a key that hashes fast
StackKey = tuple[int, ...]
# the code objects of a key, kept alive so that their ids stay theirs
StackCodes = tuple[CodeType, ...]
Stack = tuple[StackKey, StackCodes]

_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


# frames whose callers can change while they live (resumed from elsewhere): never part of a kept stack
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class StackAnchor:
    """The frames on the stack when a capture starts; the first capture settles on the innermost of them that is
    still on the stack and keeps the stack above it (see the module's docstring)."""

    __slots__ = ("_candidates", "codes", "frame", "key")

    def __init__(self, skip: int = 1) -> None:
        frame: Any = sys._getframe(skip + 1)
        candidates: dict[int, Any] = {}
        while frame is not None:
            candidates[id(frame)] = frame  # held: no other frame can take its id meanwhile
            frame = frame.f_back
        self._candidates: dict[int, Any] | None = candidates
        self.frame: Any = None
        self.key: StackKey = ()
        self.codes: StackCodes = ()

    def _settle(self, frame: Any, key: list[int], codes: list[CodeType], at: tuple[int, int]) -> None:
        """Keep ``frame`` and the stack above it (``key`` and ``codes`` from ``at`` on), unless a frame from it up
        can be resumed by another caller (the frames above would change); either way, let the other candidates
        go. Frames above a running frame that cannot be resumed never change while it runs."""
        self._candidates = None
        above = frame
        while above is not None:
            if above.f_code.co_flags & _RESUMABLE:
                return
            above = above.f_back
        self.frame = frame
        self.key, self.codes = tuple(key[at[0] :]), tuple(codes[at[1] :])


def capture_stack(skip: int = 1, anchor: StackAnchor | None = None) -> Stack:
    """The caller's stack, innermost first, without this package's own frames.

    ``skip`` frames above this function are dropped first (1 = start at the caller). With ``anchor``, the walk
    stops at the anchor's frame and takes the rest of the stack from it.
    """
    frame: Any = sys._getframe(skip + 1)
    key: list[int] = []
    codes: list[CodeType] = []
    own = _OWN_DIR
    stop: Any = None
    pending: dict[int, Any] | None = None
    above: tuple[StackKey, StackCodes] = ((), ())
    if anchor is not None:
        stop, above = anchor.frame, (anchor.key, anchor.codes)
        if stop is None:
            pending = anchor._candidates
    found: Any = None
    at = (0, 0)
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(own):
            key.append(id(code))
            key.append(frame.f_lasti)
            codes.append(code)
        if frame is stop:
            return tuple(key) + above[0], tuple(codes) + above[1]
        if pending is not None and pending.get(id(frame)) is frame:
            found, at, pending = frame, (len(key), len(codes)), None
        frame = frame.f_back
    if found is not None and anchor is not None:
        anchor._settle(found, key, codes, at)
    return tuple(key), tuple(codes)


_LINE_STARTS: dict[CodeType, tuple[list[int], list[int]]] = {}


def _line_of(code: CodeType, offset: int) -> int:
    """The source line of the instruction at ``offset`` (what ``frame.f_lineno`` would have said)."""
    starts = _LINE_STARTS.get(code)
    if starts is None:
        pairs = [(o, line) for o, line in dis.findlinestarts(code) if line is not None]
        starts = _LINE_STARTS[code] = ([o for o, _ in pairs], [line for _, line in pairs])
    index = bisect.bisect_right(starts[0], offset) - 1
    return starts[1][index] if index >= 0 else code.co_firstlineno


# formatted frames and stacks, kept from step to step (a training loop's stacks repeat). Keyed by the ids of the
# code objects, never by the objects: code objects of two files compare equal when their code is the same (the
# file name is not compared). Each entry keeps its code objects alive, so an id in a key stays theirs while the
# entry is there; emptied past a bound
_FRAMES: dict[tuple[int, int], tuple[CodeType, str]] = {}
_STACKS: dict[StackKey, tuple[StackCodes, tuple[str, ...]]] = {}
_BOUND = 50_000


class StackTable:
    """Collects (record name, stack) pairs for one step and renders stack.json; ``anchor``: the
    :class:`StackAnchor` of the capture running, if any."""

    def __init__(self) -> None:
        self._codes: dict[StackKey, StackCodes] = {}
        self._entries: list[tuple[str, StackKey]] = []
        self.anchor: StackAnchor | None = None

    def capture(self, skip: int = 1) -> Stack:
        """The caller's stack (``skip`` as :func:`capture_stack`'s), walked up to the anchor."""
        return capture_stack(skip + 1, self.anchor)

    def add(self, name: str, stack: Stack) -> None:
        key, codes = stack
        if key not in self._codes:
            self._codes[key] = codes
        self._entries.append((name, key))

    @staticmethod
    def _format(code: CodeType, offset: int) -> str:
        found = _FRAMES.get((id(code), offset))
        if found is not None:
            return found[1]
        path, lineno, func = code.co_filename, _line_of(code, offset), code.co_name
        source = linecache.getline(path, lineno).strip()
        line = f"File {path}, line {lineno}, in {func}, \n {source}" if source else ""
        if len(_FRAMES) >= _BOUND:
            _FRAMES.clear()
        _FRAMES[(id(code), offset)] = (code, line)
        return line

    def render(self) -> dict[str, list[list[str]]]:
        """stack.json's content: ``{"0": [[names...], [lines...]], ...}``, stacks in first-seen order."""
        lines_of: dict[StackKey, tuple[str, ...]] = {}
        stacks = _STACKS
        if len(stacks) >= _BOUND:
            stacks.clear()
        for key, codes in self._codes.items():
            found = stacks.get(key)
            if found is not None:
                lines = found[1]
            else:
                # frames without source (built-in, generated code) are left out, as msprobe does
                formatted = (self._format(c, o) for c, o in zip(codes, key[1::2]))
                lines = tuple(text for text in formatted if text)
                stacks[key] = (codes, lines)
            lines_of[key] = lines
        # calls made from different instructions of the same lines share one stack, as in msprobe's file
        merged: dict[tuple[str, ...], list[str]] = {}
        for name, key in self._entries:
            merged.setdefault(lines_of[key], []).append(name)
        return {str(i): [names, list(lines)] for i, (lines, names) in enumerate(merged.items())}
