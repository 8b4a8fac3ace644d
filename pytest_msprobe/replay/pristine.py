"""torch's own functions, captured once before anything replaces them: what a replay runs.

A replay must run torch's function, not whatever stands in its namespace by the time it runs: a test injects a
fault by replacing ``torch.nn.functional.relu`` with a faulty one, a library patches an API, and the dump's own
wrappers stand in every captured namespace while a step is recorded. :func:`capture` takes a snapshot of
``torch.nn.functional``, ``torch``, ``torch.Tensor`` and ``torch._VF``; a dump wrapper found there (one that
carries :data:`ORIGINAL`) is taken as the function it wraps.

The pytest plugin calls :func:`capture_when_torch_loads` when it is imported (before any conftest or test
module): the snapshot is taken right after torch's own import, without importing torch for runs that never do.
Without the plugin the snapshot is taken on first use (the dump takes it when a self-checking debugger is made).
A function that something else had replaced by then (:func:`replaced_by`: a function not defined in torch's
modules) is noted, and its calls are not replayed (:func:`pytest_msprobe.replay.apis.resolve` says why): a replay
never runs what the process happened to hold.

Imports torch only when capturing; never pytest.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

# set by each dump wrapper on itself (dump/intercept.py): the function it stands for
ORIGINAL = "__msprobe_original__"

_CAPTURED: dict[str, dict[str, Any]] = {}
# (space, name) -> what stood in place of torch's own function when the snapshot was taken (replaced_by)
_REPLACED: dict[tuple[str, str], str] = {}


def capture() -> None:
    """Take the snapshot, once (importing torch if it is not yet)."""
    if _CAPTURED:
        return
    import torch

    vf = torch._C._VariableFunctions
    spaces = {
        "Functional": dict(vars(torch.nn.functional)),
        "Torch": dict(vars(torch)),
        "Tensor": {name: getattr(torch.Tensor, name, None) for name in dir(torch.Tensor)},
        # torch._VF looks its names up in the C table: what is set on it (a wrapper, a patch) comes first
        "VF": {name: getattr(torch._VF, name, None) for name in dir(vf)},
    }
    _CAPTURED.update(
        {space: {name: _unwrapped(fn) for name, fn in fns.items()} for space, fns in spaces.items()}
    )
    _REPLACED.update(
        {
            (space, name): by
            for space, fns in _CAPTURED.items()
            for name, fn in fns.items()
            if (by := replaced_by(fn))
        }
    )


def lookup(space: str, name: str) -> Any:
    """torch's own ``name`` in ``space`` (``Functional``, ``Torch``, ``Tensor``, ``VF``), or None."""
    capture()
    return _CAPTURED.get(space, {}).get(name)


def replaced(space: str, name: str) -> str:
    """What stood in place of torch's own ``name`` of ``space`` when the snapshot was taken (``""``: torch's)."""
    capture()
    return _REPLACED.get((space, name), "")


def replaced_by(fn: Any) -> str:
    """What stands in a torch namespace in place of torch's own function (``"test_faults.noisy"``), ``""`` for
    torch's own. Seen where the snapshot was taken after something replaced it (without the plugin the snapshot
    is taken on first use): a replay of it would run that, and its verdict would depend on the process's history,
    not on the dump. Only functions and the methods of objects tell: torch's are defined in torch's modules."""
    if isinstance(fn, type):
        return ""
    if isinstance(fn, types.MethodType):
        owner = fn.__self__
        parts: list[Any] = [fn.__func__, owner if isinstance(owner, type) else type(owner)]
    elif isinstance(fn, types.FunctionType):
        parts = [fn]
    else:  # a C function or descriptor (their module is torch's or none), a callable object, a partial
        parts = [fn if isinstance(getattr(fn, "__module__", None), str) else type(fn)]
    for part in parts:
        module = getattr(part, "__module__", None) or ""
        if module.split(".")[0] not in ("torch", "builtins"):
            return f"{module}.{getattr(part, '__qualname__', getattr(type(part), '__qualname__', '?'))}"
    return ""


def _unwrapped(value: Any) -> Any:
    # only our wrappers (plain functions) carry the mark: other objects are not asked (torch.ops makes up
    # a namespace for any attribute looked up on it)
    while isinstance(value, types.FunctionType) and ORIGINAL in value.__dict__:
        value = value.__dict__[ORIGINAL]
    return value


def capture_when_torch_loads() -> None:
    """Capture now if torch is imported, else right after its import finishes (a finder on ``sys.meta_path``
    wraps the loader of ``torch``, and takes itself off on its first use)."""
    module = sys.modules.get("torch")
    if module is not None:
        spec = getattr(module, "__spec__", None)
        if not getattr(spec, "_initializing", False):
            capture()
        return
    if not any(isinstance(finder, _AfterTorch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds ``torch`` as the other finders do, and has its loader capture once torch's module has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        run = getattr(loader, "exec_module", None)
        if loader is None or run is None:
            return spec

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            try:
                capture()
            except Exception:  # never break torch's import: the snapshot is then taken on first use
                _CAPTURED.clear()
                _REPLACED.clear()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
