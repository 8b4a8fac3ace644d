"""API interception for level L1: thin wrappers installed while a debugger is started, the exact originals put
back when the last one stops.

The functions of ``torch.nn.functional``, ``torch``, ``torch.Tensor`` (methods and operators, dunder and in-place
included), ``torch._VF``, ``torch_npu`` (when imported) and ``torch.distributed`` named in :mod:`.api_lists` are
replaced by wrappers; restoring puts the originals back (a ``Tensor`` dunder inherited from ``torch._C.TensorBase``
is deleted again rather than re-set).

A wrapper reads the calling thread's slot (:mod:`.threads`) and nothing else: None sends the call straight
through, anything else (a recorder, or the slot of a device thread) gets it through ``api_call``.

Wrappers are installed while at least one debugger holds them (:meth:`ApiPatcher.install`) and removed when the
last lets go; both happen under a lock, with signals deferred (:mod:`.signals`), and removal restores every
wrapper ever installed whatever was recorded about it, so no cut in between leaves one behind.

The collectives of ``torch.distributed`` go to the recorder's ``dist_call`` (:mod:`.collectives`); while they
are wrapped, ``torch.distributed.Work.wait`` is wrapped too, so that an asynchronous collective
(``async_op=True``, ``isend``, ``irecv``, ``batch_isend_irecv``) is recorded when the program waits for it, the
moment its tensors are final.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from pytest_msprobe.dump import api_lists
from pytest_msprobe.dump.signals import deferred_signals
from pytest_msprobe.dump.threads import slot
from pytest_msprobe.format.names import PREFIXES
from pytest_msprobe.replay.pristine import ORIGINAL


def _dressed_as(
    wrapper: Callable[..., Any],
    orig: Callable[..., Any],
    attrs: tuple[str, ...] = ("__name__", "__qualname__", "__doc__", "__module__"),
) -> Callable[..., Any]:
    """``wrapper`` with the name and docs of ``orig`` (where they can be set), and ``orig`` as its ``__wrapped__``
    and its :data:`~pytest_msprobe.replay.pristine.ORIGINAL` (what a replay takes in its place)."""
    for attr in attrs:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(wrapper, attr, getattr(orig, attr))
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    setattr(wrapper, ORIGINAL, orig)
    return wrapper


def _make_wrapper(orig: Callable[..., Any], api: str, collective: bool = False) -> Callable[..., Any]:
    """The wrapper of one API: straight through unless the calling thread records, else to ``Recorder.api_call``
    (a torch.distributed collective's to ``dist_call``, recorded after the call: :mod:`.collectives`). One
    closure, and the choice made only once the thread records: a call that is not recorded pays nothing more."""
    if collective and api in _P2P_APIS:
        return _P2PWrapper(orig, api)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # pytest shows the user's call, not the wrapper, when the call raises
        recorder = slot.active
        if recorder is None:
            return orig(*args, **kwargs)
        if collective:
            return recorder.dist_call(api, orig, args, kwargs)
        return recorder.api_call(api, orig, args, kwargs)

    return _dressed_as(wrapper, orig)


def _make_dist_wrapper(orig: Callable[..., Any], api: str) -> Callable[..., Any]:
    """The wrapper of a torch.distributed collective (:func:`_make_wrapper`)."""
    return _make_wrapper(orig, api, collective=True)


_P2P_APIS = frozenset({"Distributed.isend", "Distributed.irecv"})


class _P2PWrapper:
    """The wrapper of ``isend`` / ``irecv``, which torch.distributed also uses as the tag of a ``P2POp``.

    ``P2POp(dist.isend, ...)`` checks its function with ``op in [isend, irecv]``, so the wrapper compares and
    hashes equal to the function it wraps; it is installed in ``torch.distributed`` only, so the names inside
    ``distributed_c10d`` stay the originals. ``batch_isend_irecv`` tells sends from receives with ``op.op is isend``
    and passes a send it takes for a receive ``group_src=`` instead of ``group_dst=``: the wrapper of ``isend``
    hands that peer on as ``group_dst``, which is what the original send needs (``isend`` has no ``group_src``,
    so no correct call is changed). P2POp objects built while a step is captured then work during and after it.
    """

    def __init__(self, orig: Callable[..., Any], api: str) -> None:
        self.__wrapped__ = orig
        self._api = api
        self._send = api == "Distributed.isend"
        self.__name__: str = getattr(orig, "__name__", api.rpartition(".")[2])
        self.__qualname__: str = getattr(orig, "__qualname__", self.__name__)
        self.__doc__ = getattr(orig, "__doc__", None)
        self.__module__ = getattr(orig, "__module__", "torch.distributed")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # (as in the other wrappers)
        if self._send and "group_src" in kwargs and "group_dst" not in kwargs:
            kwargs["group_dst"] = kwargs.pop("group_src")
        orig = self.__wrapped__
        recorder = slot.active
        if recorder is None:
            return orig(*args, **kwargs)
        return recorder.dist_call(self._api, orig, args, kwargs)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.__wrapped__

    def __hash__(self) -> int:
        return hash(self.__wrapped__)

    def __repr__(self) -> str:
        return repr(self.__wrapped__)


def _make_wait_wrapper(orig: Callable[..., Any], api: str) -> Callable[..., Any]:
    """``Work.wait``: once the work is done, the recorder completes the record of the collective that made it.

    The collectives waited for inside torch.distributed itself (the synchronous ones) run inside a captured call,
    where the thread's slot is empty, and are not looked up.
    """

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # (as in the other wrappers)
        result = orig(self, *args, **kwargs)
        recorder = slot.active
        if recorder is not None and recorder.dist_pending:
            recorder.work_waited(self)
        return result

    return _dressed_as(wait, orig, ("__name__", "__qualname__", "__doc__"))


_Factory = Callable[[Callable[..., Any], str], Callable[..., Any]]


class _Batch:
    """The functions to wrap that live on one object (a module, ``torch.Tensor``, ``torch._VF``).

    Wrappers are built once per original function and reused; install and restore touch a module's dict in one
    ``update`` and a class's attributes in a tight loop, so a start/stop pair costs well under a millisecond.
    """

    def __init__(
        self, owner: Any, names: list[str], apis: list[str], factory: _Factory = _make_wrapper
    ) -> None:
        self.owner = owner
        self.names = names
        self.apis = dict(zip(names, apis))
        self.factory = factory
        # a plain module: its dict can be updated directly; a class or torch._VF needs setattr/delattr
        plain_module = isinstance(owner, types.ModuleType) and all(n in owner.__dict__ for n in names)
        self.module_dict: dict[str, Any] | None = owner.__dict__ if plain_module else None
        # a Tensor dunder inherited from TensorBase is not in torch.Tensor's own dict: it is deleted on restore
        self.owned = {n for n in names if n in vars(owner)}
        self.originals: dict[str, Any] = {}
        self.wrappers: dict[str, Any] = {}

    def _refresh(self, current: dict[str, Any]) -> None:
        """Rebuild the wrappers of the functions replaced (or first seen) since the last install.

        The wrapper is stored before its original: cut in between, the next install sees the original differ and
        rebuilds it, so a wrapper never stands for another function than the one it calls.
        """
        originals, wrappers, apis = self.originals, self.wrappers, self.apis
        for name, value in current.items():
            # a wrapper of ours found in place (another holder installed it) stands for its original
            if originals.get(name) is not value and wrappers.get(name) is not value:
                wrappers[name] = self.factory(value, apis[name])
                originals[name] = value
        for name in [n for n in originals if n not in current]:
            originals.pop(name, None)
            wrappers.pop(name, None)

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


def _namespaces() -> list[tuple[str, Any, tuple[str, ...], _Factory]]:
    spaces: list[tuple[str, Any, tuple[str, ...], _Factory]] = [
        ("functional", torch.nn.functional, api_lists.FUNCTIONAL, _make_wrapper),
        ("torch", torch, api_lists.TORCH, _make_wrapper),
        ("tensor", torch.Tensor, api_lists.TENSOR, _make_wrapper),
        ("vf", torch._VF, api_lists.VF, _make_wrapper),
    ]
    npu = sys.modules.get("torch_npu")
    if npu is not None and importlib.util.find_spec("torch_npu") is not None:
        spaces.append(("npu", npu, api_lists.NPU, _make_wrapper))
    dist = _distributed()
    if dist is not None:
        spaces.append(("distributed", dist, api_lists.DISTRIBUTED, _make_dist_wrapper))
        # isend / irecv stay the originals inside distributed_c10d (see _P2PWrapper)
        in_c10d = tuple(n for n in api_lists.DISTRIBUTED if f"Distributed.{n}" not in _P2P_APIS)
        spaces.append(("distributed_c10d", dist.distributed_c10d, in_c10d, _make_dist_wrapper))
        functional = sys.modules.get("torch.distributed.nn.functional")
        if functional is not None:  # imported by the program: its collectives with autograd
            spaces.append(("distributed_nn", functional, api_lists.DISTRIBUTED_NN, _make_wrapper))
    return spaces


def _distributed() -> Any:
    """``torch.distributed`` when this torch build has it, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed support
        return None
    return dist if dist.is_available() else None


_WAIT_BATCH: list[_Batch] = []


def _wait_batch() -> list[_Batch]:
    """The batch wrapping ``torch.distributed.Work.wait`` (empty without torch.distributed)."""
    if not _WAIT_BATCH:
        dist = _distributed()
        work = getattr(dist, "Work", None) if dist is not None else None
        if work is not None and _wrappable(work, "wait"):
            _WAIT_BATCH.append(_Batch(work, ["wait"], ["Work.wait"], _make_wait_wrapper))
    return _WAIT_BATCH


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


def _batches(key: str, space: Any, names: tuple[str, ...], factory: _Factory) -> list[_Batch]:
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
        found = _BATCHES[cache_key] = [_Batch(o, n, a, factory) for o, n, a in by_owner.values()]
    return found


# the holders of the wrappers (one per started debugger): installed while there is one
_HOLDERS: set[object] = set()
_LOCK = threading.RLock()


def _all_batches() -> list[_Batch]:
    return [batch for batches in _BATCHES.values() for batch in batches] + _WAIT_BATCH


def wrappers_installed() -> bool:
    """Whether any API wrapper is in place (a check for tests and for clean-up)."""
    for batch in _all_batches():
        owner = batch.owner
        d = batch.module_dict
        for name, wrapper in batch.wrappers.items():
            current = d.get(name) if d is not None else getattr(owner, name, None)
            if current is wrapper:
                return True
    return False


class ApiPatcher:
    """One debugger's hold on the API wrappers: they are installed while any debugger holds them."""

    def __init__(self) -> None:
        self._token = object()

    @property
    def installed(self) -> bool:
        return self._token in _HOLDERS

    def install(self) -> None:
        """Hold the wrappers (installing them if this is the first holder); idempotent."""
        with _LOCK, deferred_signals():
            # noted first: cut after it, uninstall() still removes whatever was installed
            _HOLDERS.add(self._token)
            # every holder installs: cheap when the wrappers are in place, and right after a cut uninstall
            for key, space, names, factory in _namespaces():
                for batch in _batches(key, space, names, factory):
                    batch.install()
                if key == "distributed":
                    for batch in _wait_batch():
                        batch.install()

    def uninstall(self) -> None:
        """Let go of the wrappers; the last holder puts every original back. Idempotent."""
        with _LOCK, deferred_signals():
            if self._token not in _HOLDERS:
                return
            if {self._token} == _HOLDERS:
                # every batch ever built, not only those this holder installed: nothing is left behind
                for batch in reversed(_all_batches()):
                    batch.restore()
            _HOLDERS.discard(self._token)  # last: cut before it, the next uninstall() restores again
