"""Call stacks of forward records, captured cheaply and formatted once, at write time.

Capture keeps, per frame, the code object and the offset of the instruction running (``f_lasti``), skipping
the frames of this package: no line numbers are computed and no source is read while training runs. Line
numbers (from the code's line table) and source lines (through ``linecache``) are resolved when stack.json is
written, once per distinct frame. stack.json groups the record names that share one stack, as msprobe does::

    {"0": [["Functional.conv2d.0.forward"], ["File /x/conv.py, line 549, in _conv_forward, \\n return F.conv2d(", ...]]}
"""

from __future__ import annotations

import bisect
import dis
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


def capture_stack(skip: int = 1) -> Stack:
    """The caller's stack, innermost first, without this package's own frames.

    ``skip`` frames above this function are dropped first (1 = start at the caller).
    """
    frame: Any = sys._getframe(skip + 1)
    key: list[int] = []
    codes: list[CodeType] = []
    own = _OWN_DIR
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(own):
            key.append(id(code))
            key.append(frame.f_lasti)
            codes.append(code)
        frame = frame.f_back
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
    """Collects (record name, stack) pairs for one step and renders stack.json."""

    def __init__(self) -> None:
        self._codes: dict[StackKey, StackCodes] = {}
        self._entries: list[tuple[str, StackKey]] = []

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
