"""Call stacks of forward records, captured cheaply and formatted once, at write time.

Capture keeps ``(filename, lineno, function)`` per frame, skipping the frames of this package; formatting
(reading source lines through ``linecache``) happens when stack.json is written, and is cached per code
location. stack.json groups the record names that share one stack, as msprobe does::

    {"0": [["Functional.conv2d.0.forward"], ["File /x/conv.py, line 549, in _conv_forward, \\n return F.conv2d(", ...]]}
"""

from __future__ import annotations

import linecache
import os
import sys
from typing import Any

Frame = tuple[str, int, str]
Stack = tuple[Frame, ...]

_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def capture_stack(skip: int = 1) -> Stack:
    """The caller's stack, innermost first, without this package's own frames.

    ``skip`` frames above this function are dropped first (1 = start at the caller).
    """
    frame: Any = sys._getframe(skip + 1)
    out: list[Frame] = []
    own = _OWN_DIR
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if not filename.startswith(own):
            out.append((filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(out)


class StackTable:
    """Collects (record name, stack) pairs for one step and renders stack.json."""

    def __init__(self) -> None:
        self._by_stack: dict[Stack, list[str]] = {}
        self._lines: dict[Frame, str] = {}

    def add(self, name: str, stack: Stack) -> None:
        names = self._by_stack.get(stack)
        if names is None:
            self._by_stack[stack] = [name]
        else:
            names.append(name)

    def _format(self, frame: Frame) -> str:
        line = self._lines.get(frame)
        if line is None:
            path, lineno, func = frame
            source = linecache.getline(path, lineno).strip()
            line = self._lines[frame] = (
                f"File {path}, line {lineno}, in {func}, \n {source}" if source else ""
            )
        return line

    def render(self) -> dict[str, list[list[str]]]:
        """stack.json's content: ``{"0": [[names...], [lines...]], ...}`` in first-seen order."""
        out: dict[str, list[list[str]]] = {}
        for index, (stack, names) in enumerate(self._by_stack.items()):
            # frames without source (built-in, generated code) are left out, as msprobe does
            lines = [text for text in (self._format(f) for f in stack) if text]
            out[str(index)] = [list(names), lines]
        return out
