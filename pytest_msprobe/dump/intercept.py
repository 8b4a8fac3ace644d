"""API interception for level L1: thin wrappers installed on start and the exact originals put back on stop.

The functions of ``torch.nn.functional``, ``torch``, ``torch.Tensor`` (methods and operators, dunder and in-place
included), ``torch._VF`` and ``torch_npu`` (when imported) named in :mod:`.api_lists` are replaced by wrappers;
restoring puts the originals back (a ``Tensor`` dunder inherited from ``torch._C.TensorBase`` is deleted again
rather than re-set). A wrapper costs one global read when no step is being recorded, and a thread-local depth
counter keeps calls made inside a captured call (or inside the dump's own code and threads) from being recorded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import threading
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import torch

from pytest_msprobe.dump import api_lists
from pytest_msprobe.dump.naming import PREFIXES

if TYPE_CHECKING:  # pragma: no cover
    from pytest_msprobe.dump.capture import Recorder

_set_grad_enabled = torch._C._set_grad_enabled


class _Depth(threading.local):
    """Per-thread nesting depth: > 0 inside a captured call or inside the dump's own code."""

    depth = 0


_tls = _Depth()
# the Recorder of the step being captured, read by every wrapper (None: wrappers call straight through)
_RECORDER: Recorder | None = None


def set_recorder(recorder: Recorder | None) -> None:
    """Make ``recorder`` the one every wrapper reports to (None: wrappers call straight through)."""
    global _RECORDER
    _RECORDER = recorder


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """A context in which the calling thread's torch calls are not recorded."""
    _tls.depth += 1
    try:
        yield
    finally:
        _tls.depth -= 1


def silence_this_thread() -> None:
    """Set up one of the dump's own threads: its API calls are never recorded, and build no autograd graph."""
    _tls.depth = 1
    _set_grad_enabled(False)


def _make_wrapper(orig: Callable[..., Any], api: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        recorder = _RECORDER
        if recorder is None or _tls.depth:
            return orig(*args, **kwargs)
        return recorder.api_call(api, orig, args, kwargs)

    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(wrapper, attr, getattr(orig, attr))
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


class _Batch:
    """The functions to wrap that live on one object (a module, ``torch.Tensor``, ``torch._VF``).

    Wrappers are built once per original function and reused; install and restore touch a module's dict in one
    ``update`` and a class's attributes in a tight loop, so a start/stop pair costs well under a millisecond.
    """

    def __init__(self, owner: Any, names: list[str], apis: list[str]) -> None:
        self.owner = owner
        self.names = names
        self.apis = dict(zip(names, apis))
        # a plain module: its dict can be updated directly; a class or torch._VF needs setattr/delattr
        plain_module = isinstance(owner, types.ModuleType) and all(n in owner.__dict__ for n in names)
        self.module_dict: dict[str, Any] | None = owner.__dict__ if plain_module else None
        # a Tensor dunder inherited from TensorBase is not in torch.Tensor's own dict: it is deleted on restore
        self.owned = {n for n in names if n in vars(owner)}
        self.originals: dict[str, Any] = {}
        self.wrappers: dict[str, Any] = {}

    def _refresh(self, current: dict[str, Any]) -> None:
        """Rebuild the wrappers of the functions replaced (or first seen) since the last install."""
        originals, wrappers, apis = self.originals, self.wrappers, self.apis
        for name, value in current.items():
            if originals.get(name) is not value:
                originals[name] = value
                wrappers[name] = _make_wrapper(value, apis[name])
        for name in [n for n in wrappers if n not in current]:
            del wrappers[name], originals[name]

    def install(self) -> None:
        owner, names = self.owner, self.names
        d = self.module_dict
        if d is not None:
            current = {n: d[n] for n in names if n in d}
        else:
            current = {n: v for n in names if (v := getattr(owner, n, None)) is not None}
        if current != self.originals:  # functions compare by identity: one C-level comparison
            self._refresh(current)
        if d is not None:
            d.update(self.wrappers)
        else:
            for name, wrapper in self.wrappers.items():
                setattr(owner, name, wrapper)

    def restore(self) -> None:
        owner, wrappers, originals = self.owner, self.wrappers, self.originals
        d = self.module_dict
        if d is not None:
            # a function replaced by someone else meanwhile keeps their value
            d.update({n: originals[n] for n, w in wrappers.items() if d.get(n) is w})
            return
        own = vars(owner) if isinstance(owner, type) else owner.__dict__
        owned = self.owned
        for name, wrapper in wrappers.items():
            if own.get(name) is not wrapper:
                continue
            if name in owned:
                setattr(owner, name, originals[name])
            else:
                delattr(owner, name)


# the batches per namespace, resolved once per process (inspect is slow)
_BATCHES: dict[tuple[str, int], list[_Batch]] = {}


def _namespaces() -> list[tuple[str, Any, tuple[str, ...]]]:
    spaces: list[tuple[str, Any, tuple[str, ...]]] = [
        ("functional", torch.nn.functional, api_lists.FUNCTIONAL),
        ("torch", torch, api_lists.TORCH),
        ("tensor", torch.Tensor, api_lists.TENSOR),
        ("vf", torch._VF, api_lists.VF),
    ]
    npu = sys.modules.get("torch_npu")
    if npu is not None and importlib.util.find_spec("torch_npu") is not None:
        spaces.append(("npu", npu, api_lists.NPU))
    return spaces


def _wrappable(owner: Any, attr: str) -> bool:
    """Whether ``owner.attr`` exists and is a plain callable (not a class, property, static/class method)."""
    try:
        static = inspect.getattr_static(owner, attr)
    except AttributeError:
        if type(owner).__name__ != "VFModule":  # torch._VF resolves its names dynamically
            return False
        static = getattr(owner, attr, None)
    if static is None or isinstance(static, (staticmethod, classmethod, property, type)):
        return False
    return callable(getattr(owner, attr, None))


def _batches(key: str, space: Any, names: tuple[str, ...]) -> list[_Batch]:
    cache_key = (key, id(space))
    found = _BATCHES.get(cache_key)
    if found is None:
        prefix = PREFIXES[key]
        by_owner: dict[int, tuple[Any, list[str], list[str]]] = {}
        for dotted in names:
            owner = space
            *parents, attr = dotted.split(".")
            for part in parents:
                owner = getattr(owner, part, None)
                if owner is None:
                    break
            if owner is not None and _wrappable(owner, attr):
                slot = by_owner.setdefault(id(owner), (owner, [], []))
                slot[1].append(attr)
                slot[2].append(f"{prefix}.{dotted}")
        found = _BATCHES[cache_key] = [_Batch(o, n, a) for o, n, a in by_owner.values()]
    return found


class ApiPatcher:
    """Installs the API wrappers and puts the originals back."""

    def __init__(self) -> None:
        self._installed: list[_Batch] = []

    @property
    def installed(self) -> bool:
        return bool(self._installed)

    def install(self) -> None:
        if self._installed:
            return
        for key, space, names in _namespaces():
            for batch in _batches(key, space, names):
                batch.install()
                self._installed.append(batch)

    def uninstall(self) -> None:
        for batch in reversed(self._installed):
            batch.restore()
        self._installed.clear()
