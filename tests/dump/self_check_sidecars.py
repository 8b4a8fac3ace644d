"""The self-check's sidecars of a dump, read back for the tests."""

from __future__ import annotations

from pathlib import Path

from pytest_msprobe.format.layout import discover
from pytest_msprobe.format.own_errors import CallOwn, read_own_errors


def sidecar_calls(root: Path) -> dict[tuple[int | None, str], CallOwn]:
    """(step, record name) -> the call's own error, from every self_check.json of the dump (each must be there)."""
    calls = {}
    for location in discover(root):
        own = read_own_errors(location.path)
        assert own is not None, f"no sidecar beside {location.path}"
        calls.update({(location.step, name): call for name, call in own.items()})
    return calls
