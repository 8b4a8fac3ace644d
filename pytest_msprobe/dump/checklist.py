"""The training checklist of a dumped step: what msprobe's guide checks before it suspects any operator.

Recorded at the start of every dumped step by the debugger (:class:`StepChecklist`), written beside the step's
msprobe files (:mod:`pytest_msprobe.format.checklistfile`):

- the environment variables that change numerics (:data:`NUMERIC_ENV`, plus the names a user adds), library
  versions, torch's numeric switches and the seed;
- the model's structure (module tree; parameter and buffer names, shapes, dtypes) and a fingerprint (CRC32 of
  the bytes plus statistics) of every parameter and buffer, as the step starts;
- the step's input batch: the tensors given to the model's forward (its first call in the step), or, without a
  model, to the first recorded API call;
- every optimizer that holds the model's parameters, with each param group's scalars, as its first
  ``step()`` of the step saw them (an lr scheduler's value of that step);
- the run's numerics policy (``precision``, see :mod:`pytest_msprobe.format.numerics`): the format its device
  computes float32 convolutions and matmuls in, by the switches above, and the autocast dtype in force where
  the step's batch is taken (the model's forward, or the first recorded call).

The costs are a CRC32 and four statistics of each parameter and buffer per dumped step (and a host copy on an
accelerator; ``bench/checklist_cost.py``), nothing per API call.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from pytest_msprobe.dump import determinism, switches
from pytest_msprobe.dump.checksums import crc32_hex as tensor_crc32
from pytest_msprobe.dump.threads import untracked
from pytest_msprobe.format.checklistfile import TAKEN_AT_OPTIMIZER, TAKEN_AT_START, encode_number
from pytest_msprobe.format.numerics import Policy, policy_from_switches

# the environment variables that change the numbers of a run (documented in the README); a user adds more with
# the ini key msprobe_checklist_env
NUMERIC_ENV: tuple[str, ...] = (
    # CUDA and cuBLAS / cuDNN
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "CUDA_LAUNCH_BLOCKING",
    "CUBLASLT_WORKSPACE_SIZE",
    "TORCH_CUDNN_V8_API_DISABLED",
    "NCCL_ALGO",
    "NCCL_PROTO",
    # Ascend NPU and its collectives
    "HCCL_DETERMINISTIC",
    "LCCL_DETERMINISTIC",
    "ASCEND_LAUNCH_BLOCKING",
    "CLOSE_MATMUL_K_SHIFT",
    "ATB_LLM_LCOC_ENABLE",
    "INF_NAN_MODE_ENABLE",
    "HCCL_ALGO",
    # CPU threading and Python
    "PYTHONHASHSEED",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MKL_CBWR",
)


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": _module_version("numpy"),
        "cuda": torch.version.cuda,
        "cudnn": None,
        "torch_npu": None,
        "cann": None,
    }
    if torch.cuda.is_available():
        try:
            cudnn = torch.backends.cudnn.version()
        except Exception:  # a broken cuDNN install: the version is unknown, not an error of the dump
            cudnn = None
        found["cudnn"] = str(cudnn) if cudnn is not None else None
    npu = sys.modules.get("torch_npu")
    if npu is not None:
        found["torch_npu"] = str(getattr(npu, "__version__", None))
        version = getattr(npu, "version", None)
        cann = getattr(version, "cann", None) if version is not None else None
        found["cann"] = str(cann) if cann is not None else os.environ.get("ASCEND_TOOLKIT_HOME")
    return found


def _module_version(name: str) -> str | None:
    module = sys.modules.get(name)
    if module is None:
        try:
            module = __import__(name)
        except ImportError:
            return None
    return str(getattr(module, "__version__", None))


def environment(extra_env: Sequence[str] = ()) -> dict[str, Any]:
    """The context part of a checklist: environment variables, versions, switches and the seed."""
    names = dict.fromkeys((*NUMERIC_ENV, *extra_env))
    return {
        "seed": determinism.last_seed(),
        "environment": {name: os.environ.get(name) for name in names},
        "versions": _versions(),
        "switches": switches.switches(),
    }


def fingerprint(tensor: torch.Tensor) -> dict[str, Any]:
    """An exact fingerprint of a tensor (CRC32 of its bytes) with its statistics (min, max, mean, norm; min
    and max only for integers and bools). Its own torch calls are never recorded (it runs in the model's and
    the optimizer's hooks, inside a dumped step) and build no graph."""
    return fingerprints([("", tensor)])[""]


# tensors of at most this many elements are reduced together, those of one dtype and size in one operator each
_SMALL = 4096


def fingerprints(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """:func:`fingerprint` of many tensors, by name, at a fraction of the cost of one at a time: the tensors'
    statistics go to the host in one transfer per dtype, and small tensors of one dtype and size are reduced
    together (a model's many biases and norm weights cost a few operators, not four each)."""
    return untracked(_fingerprints, named)


# device tensors go to the host in batches of up to this many bytes: one transfer (and host synchronisation) a
# batch, not one a tensor, and at most this much device memory beside them
_BATCH = 64 << 20


def on_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the host, in order: CPU tensors as they are, the others copied over a batch at a time (their
    bytes concatenated on their device, moved in one transfer, and viewed back as each tensor)."""
    out: list[torch.Tensor | None] = [t if t.device.type == "cpu" else None for t in tensors]
    batch: list[int] = []
    size = 0

    def move() -> None:
        # the widest dtypes first: every tensor's bytes then start at a multiple of its element size
        order = sorted(batch, key=lambda k: -tensors[k].element_size())
        parts = [tensors[k].contiguous().reshape(-1).view(torch.uint8) for k in order]
        host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu()
        at = 0
        for k in order:
            t = tensors[k]
            n = t.numel() * t.element_size()
            out[k] = host[at : at + n].view(t.dtype).view(t.shape)
            at += n

    for k, t in enumerate(tensors):
        if out[k] is not None:
            continue
        n = t.numel() * t.element_size()
        if batch and (t.device != tensors[batch[0]].device or size + n > _BATCH):
            move()
            batch, size = [], 0
        batch.append(k)
        size += n
    if batch:
        move()
    return [t for t in out if t is not None]


def _fingerprints(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    floats: dict[tuple[torch.dtype, int], list[tuple[dict[str, Any], torch.Tensor]]] = {}
    large: list[tuple[dict[str, Any], torch.Tensor]] = []
    ints: list[tuple[dict[str, Any], torch.Tensor]] = []
    plain: list[tuple[dict[str, Any], torch.Tensor]] = []
    for name, tensor in named:
        t = tensor.detach()
        doc: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        docs[name] = doc
        if t.is_quantized or t.is_sparse or t.layout != torch.strided:
            doc["crc32"] = None
            continue
        plain.append((doc, t))
    for (doc, _), host in zip(plain, on_host([t for _, t in plain])):
        doc["crc32"] = tensor_crc32(host)
        n = host.numel()
        if not n or host.is_complex():
            continue
        if host.dtype.is_floating_point:
            values = host if host.dtype in (torch.float32, torch.float64) else host.float()
            if n <= _SMALL:
                floats.setdefault((values.dtype, n), []).append((doc, values.reshape(-1)))
            else:
                large.append((doc, values))
        else:
            ints.append((doc, host))
    # every statistic a 1-d tensor of results, with the documents they go to; moved to the host by dtype
    results: dict[torch.dtype, list[tuple[list[dict[str, Any]], torch.Tensor]]] = {}
    for members in floats.values():
        rows = torch.stack([v for _, v in members])
        low, high = torch.amin(rows, 1), torch.amax(rows, 1)
        mean, norm = torch.mean(rows, 1), torch.linalg.vector_norm(rows, dim=1)
        results.setdefault(rows.dtype, []).append(
            ([d for d, _ in members], torch.stack((low, high, mean, norm), 1))
        )
    for doc, values in large:
        low, high = torch.aminmax(values)
        row = torch.stack((low, high, values.mean(), torch.linalg.vector_norm(values)))
        results.setdefault(values.dtype, []).append(([doc], row.reshape(1, 4)))
    for by_dtype in results.values():
        table = torch.cat([r for _, r in by_dtype]).tolist()
        docs_in_order = [d for ds, _ in by_dtype for d in ds]
        for doc, (low, high, mean, norm) in zip(docs_in_order, table):
            doc.update(
                min=encode_number(low),
                max=encode_number(high),
                mean=encode_number(mean),
                norm=encode_number(norm),
            )
    if ints:
        table = torch.stack(
            [torch.stack(torch.aminmax(host.to(torch.int64).reshape(-1))) for _, host in ints]
        ).tolist()
        for (doc, _), (low, high) in zip(ints, table):
            doc.update(min=int(low), max=int(high))
    return docs


def structure(model: torch.nn.Module) -> dict[str, Any]:
    """The model's module tree (name, class) and its parameters' and buffers' shapes and dtypes."""
    return {
        "modules": [[name, type(module).__name__] for name, module in model.named_modules()],
        "parameters": {
            name: [list(p.shape), str(p.dtype).removeprefix("torch.")] for name, p in model.named_parameters()
        },
        "buffers": {
            name: [list(b.shape), str(b.dtype).removeprefix("torch.")] for name, b in model.named_buffers()
        },
    }


def _tensors(value: Any, prefix: str, depth: int = 0) -> Iterable[tuple[str, torch.Tensor]]:
    """The tensors of an argument, with their place (``args.0``, ``kwargs.mask``, ``args.1.0``)."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{prefix}.{i}", depth + 1)
    elif depth < 3 and isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}", depth + 1)


def _scalar(value: Any) -> Any:
    """A param group entry as JSON holds it: numbers, bools, strings, None, tuples of those; a tensor's value
    (a capturable lr); anything else by its type."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return f"<tensor {list(value.shape)}>"
        return encode_number(untracked(float, value))
    if isinstance(value, float):
        return encode_number(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_scalar(v) for v in value]
    return f"<{type(value).__name__}>"


_OWN_FRAMES = (os.sep + "pytest_msprobe" + os.sep, os.sep + "contextlib.py")


def caller_model(depth: int = 12, frames: int = 2) -> torch.nn.Module | None:
    """The model of a training loop that started the dump without naming it (``debugger.start()`` at L1): the
    ``torch.nn.Module`` with the most parameters among the local variables of the first ``frames`` callers
    outside this package (a loss module has none). None when there is none."""
    frame = sys._getframe(1)
    best: tuple[int, torch.nn.Module] | None = None
    seen = 0
    while frame is not None and depth > 0 and seen < frames:
        depth -= 1
        if (
            not frame.f_code.co_filename.endswith(_OWN_FRAMES[1])
            and _OWN_FRAMES[0] not in frame.f_code.co_filename
        ):
            seen += 1
            for value in list(frame.f_locals.values()):
                if isinstance(value, torch.nn.Module):
                    count = sum(p.numel() for p in value.parameters())
                    if count and (best is None or count > best[0]):
                        best = (count, value)
        frame = frame.f_back  # type: ignore[assignment]
    return best[1] if best is not None else None


def model_of(groups: Sequence[Mapping[str, Any]]) -> torch.nn.Module | None:
    """The module whose parameters an optimizer's param groups hold: of the live modules holding most of them,
    the innermost (a model rather than its DistributedDataParallel wrapper, which names them ``module.*``)."""
    import gc

    wanted = {id(p) for group in groups for p in group.get("params", ())}
    if not wanted:
        return None
    best: tuple[int, int, torch.nn.Module] | None = None
    # by the object's type, never its __class__ (which warns on some objects, torch.distributed.reduce_op, and
    # raises on some proxies): no warning filter to set and put back, which an interrupt could leave set
    module_type = torch.nn.Module
    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), module_type)]
    for obj in modules:
        ids = [id(p) for p in obj.parameters()]
        overlap = sum(1 for i in ids if i in wanted)
        if overlap and (best is None or (overlap, -len(ids)) > (best[0], best[1])):
            best = (overlap, -len(ids), obj)
    return best[2] if best is not None else None


class StepChecklist:
    """The checklist of one dumped step, started with the capture and written with the step's files.

    ``start()`` fingerprints the model's parameters and buffers and hooks the model's forward (the step's input
    batch) and the optimizers' ``step()`` (their settings); ``detach()`` removes those hooks. Without a model,
    the batch is the first recorded API call's inputs (:meth:`first_call`).
    """

    def __init__(self, step: int, rank: int, device: str | None, extra_env: Sequence[str] = ()) -> None:
        self.step = step
        self.rank = rank
        self.device = device
        self.extra_env = tuple(extra_env)
        self.model: torch.nn.Module | None = None
        self.doc: dict[str, Any] = {}
        self.data: dict[str, Any] | None = None
        self.optimizers: list[dict[str, Any]] = []
        self.policy: Policy | None = None  # with the autocast dtype where the batch was taken
        self._seen: set[int] = set()
        self._param_ids: frozenset[int] = frozenset()
        self._handles: list[Any] = []
        self._owner = threading.get_ident()
        self.started = False

    def start(self, model: torch.nn.Module | None) -> None:
        """At the step's first start: the context, the model's structure and fingerprints; the hooks (again
        at every start: a resumed capture hooks again)."""
        if not self.started:
            self.started = True
            self.model = model
            self.doc = environment(self.extra_env)
            if model is not None:
                self._fingerprint(model, TAKEN_AT_START)
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_step))
        if self.model is not None and self.data is None:
            self._handles.append(
                self.model.register_forward_pre_hook(self._forward, with_kwargs=True, prepend=True)
            )

    def _fingerprint(self, model: torch.nn.Module, taken: str) -> None:
        self.model = model
        self.doc["structure"] = structure(model)
        self.doc["parameters"] = fingerprints(model.named_parameters())
        self.doc["buffers"] = fingerprints(model.named_buffers())
        self.doc["taken"] = taken  # the buffers as the forward left them, when found at the optimizer's step
        self._param_ids = frozenset(id(p) for p in model.parameters())

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def wants_first_call(self) -> bool:
        """Whether the batch comes from the first recorded API call (no model to hook)."""
        return self.model is None and self.data is None

    def first_call(self, api: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """The first recorded API call of the step, when there is no model: its inputs are the batch."""
        if self.data is None:  # its first tensor: the batch (the others are weights, compared as such)
            first = next(iter(_tensors(tuple(args), "args")), None)
            tensors = {first[0]: fingerprint(first[1])} if first is not None else {}
            self.data = {"source": f"the first recorded call, {api}", "tensors": tensors}
            self._take_policy()

    def _forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.data is None and threading.get_ident() == self._owner:
            self.data = self._batch("the model's forward", args, kwargs)
            self._take_policy()
        return None

    def _take_policy(self) -> None:
        """The policy where the step's model forward starts: autocast is a context around the forward, off
        again by the time the step's files are written."""
        if self.policy is None:
            self.policy = untracked(switches.current_policy, self.device, self.doc.get("switches"))

    @staticmethod
    def _batch(source: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        tensors = fingerprints([*_tensors(tuple(args), "args"), *_tensors(dict(kwargs), "kwargs")])
        return {"source": source, "tensors": tensors}

    def _optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if id(optimizer) in self._seen or threading.get_ident() != self._owner:
            return
        groups = getattr(optimizer, "param_groups", None) or []
        if self._param_ids and not any(
            id(p) in self._param_ids for group in groups for p in group.get("params", ())
        ):
            return  # another model's optimizer
        self._seen.add(id(optimizer))
        if self.model is None:  # no model given nor in sight: the one whose weights this optimizer updates
            found = model_of(groups)
            if found is not None:  # its weights as the step started: only the optimizer changes them
                self._fingerprint(found, TAKEN_AT_OPTIMIZER)
        self.optimizers.append(
            {
                "class": type(optimizer).__name__,
                "groups": [
                    {
                        **{k: _scalar(v) for k, v in group.items() if k != "params"},
                        "params": len(group.get("params", ())),
                    }
                    for group in groups
                ],
            }
        )

    def document(self) -> dict[str, Any]:
        """What checklist.json holds (see :mod:`pytest_msprobe.format.checklistfile`)."""
        doc: dict[str, Any] = {"step": self.step, "rank": self.rank, "device": self.device, **self.doc}
        doc["optimizers"] = list(self.optimizers)
        policy = self.policy or policy_from_switches(self.device, self.doc.get("switches") or {})
        doc["precision"] = policy.to_dict()
        if self.data is not None:
            doc["data"] = self.data
        return doc
