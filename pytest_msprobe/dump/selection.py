"""Which records a step keeps: the ``list``, ``scope`` and ``data_mode`` filters of msprobe's config.

``data_mode`` picks the directions (forward, backward) and sides (input, output) recorded; ``list`` keeps the
records whose name matches one of its items; ``scope`` keeps the forward records from the first of its names to
the last, as they are made (and the backward records of the calls made in that range).
"""

from __future__ import annotations

from pytest_msprobe.dump.config import DumpConfig
from pytest_msprobe.format.names import scope_key, selected_by_list


class Selector:
    """``list``, ``scope`` and ``data_mode`` filters, applied to record names as they are made."""

    def __init__(self, config: DumpConfig) -> None:
        self.items = config.api_list
        modes = config.data_mode
        self.fwd_in = "forward" in modes and "input" in modes
        self.fwd_out = "forward" in modes and "output" in modes
        self.bwd_in = "backward" in modes and "input" in modes
        self.bwd_out = "backward" in modes and "output" in modes
        self.forward = self.fwd_in or self.fwd_out
        self.backward = self.bwd_in or self.bwd_out
        self.scope_start: str | None = None
        self.scope_end: str | None = None
        if config.scope:
            self.scope_start = scope_key(config.scope[0])
            self.scope_end = scope_key(config.scope[-1])
        # before, inside or after the scope range
        self._inside = not config.scope
        self._done = False

    def enter(self, forward_name: str) -> bool:
        """Called when a forward record begins: whether it lies in the scope range."""
        if self._inside:
            return True
        if not self._done and scope_key(forward_name) == self.scope_start:
            self._inside = True
            return True
        return False

    def leave(self, forward_name: str) -> None:
        """Called when a forward record ends: the range closes after its last record."""
        if self.scope_end is not None and self._inside and scope_key(forward_name) == self.scope_end:
            self._inside = False
            self._done = True

    def listed(self, name: str) -> bool:
        return not self.items or selected_by_list(name, self.items)
