"""One rank of the distributed dump tests: ``python dist_ranks.py OUT`` under a torchrun-style environment.

Everything the tests look at is made in one process group, so the ranks start once:

- ``OUT/collectives``: every collective and point-to-point call of torch.distributed that gloo runs, at L1;
- ``OUT/filtered``: a dump with ``rank=[1]`` around an all_reduce (``OUT/filtered_rank{R}.json``: its result);
- ``OUT/tensors``: an all_reduce, synchronous then asynchronous, with task ``tensor``;
- ``OUT/functional``: a ``torch.distributed.nn.functional.all_reduce`` with its backward, at L1;
- ``OUT/ddp_{plain,L1,mix}.pt`` and ``OUT/ddp_L1``, ``OUT/ddp_mix``: the DDP example's training, undumped and
  dumped (losses and gradients of each rank, ``rank{R}`` appended to the ``.pt`` name).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "examples" / "ddp" / "train_ddp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_ddp"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def collectives(out: Path, rank: int, world: int) -> None:
    """Each collective once; asynchronous ones waited for, as a program must before reading their tensors."""
    from pytest_msprobe import PrecisionDebugger

    peer = 1 - rank
    debugger = PrecisionDebugger(dump_path=str(out), task="statistics", level="L1")
    debugger.start()
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)  # 1 + 2 on every rank
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    b = torch.arange(3.0) if rank == 0 else torch.zeros(3)
    dist.broadcast(b, src=0)
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    flat = torch.zeros(2 * world)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))  # calls all_gather_single in torch 2.14
    if hasattr(dist, "all_gather_single"):
        dist.all_gather_single(flat, torch.full((2,), float(rank + 1)))
    scattered = torch.zeros(2)
    dist.reduce_scatter(scattered, [torch.full((2,), float(i + rank)) for i in range(world)])
    reduced = torch.full((2,), float(rank + 1))
    dist.reduce(reduced, dst=0)
    work = dist.all_reduce(torch.full((3,), float(rank + 1)), async_op=True)
    assert work is not None
    work.wait()
    if rank == 0:
        dist.send(torch.full((2,), 7.0), dst=1)
    else:
        received = torch.zeros(2)
        dist.recv(received, src=0)
    buf = torch.zeros(2)
    works = [dist.isend(torch.full((2,), float(rank + 10)), peer), dist.irecv(buf, peer)]
    for w in works:
        w.wait()
    ops = [
        dist.P2POp(dist.isend, torch.full((2,), float(rank + 20)), peer),
        dist.P2POp(dist.irecv, torch.zeros(2), peer),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    dist.all_reduce(torch.ones(1), group=dist.new_group([0, 1]))
    debugger.stop()
    debugger.close()


def filtered(out: Path, rank: int) -> None:
    """``rank=[1]``: rank 0 dumps nothing, and still takes part in the collective."""
    from pytest_msprobe import PrecisionDebugger

    debugger = PrecisionDebugger(dump_path=str(out / "filtered"), task="statistics", level="L1", rank=[1])
    debugger.start()
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    debugger.stop()
    debugger.close()
    (out / f"filtered_rank{rank}.json").write_text(json.dumps(t.tolist()))


def tensors(out: Path, rank: int) -> None:
    """task tensor: the files of an in-place all_reduce hold the tensor before and after the reduction."""
    from pytest_msprobe import PrecisionDebugger

    debugger = PrecisionDebugger(dump_path=str(out), task="tensor", level="L1", list=["Distributed"])
    debugger.start()
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    work = dist.all_reduce(t, async_op=True)
    assert work is not None
    work.wait()
    debugger.stop()
    debugger.close()


def functional(out: Path, rank: int) -> None:
    """An all_reduce with autograd: its forward and its backward (itself an all_reduce of the gradient)."""
    import torch.distributed.nn.functional as dist_fn

    from pytest_msprobe import PrecisionDebugger

    debugger = PrecisionDebugger(dump_path=str(out), task="statistics", level="L1")
    debugger.start()
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    y = dist_fn.all_reduce(x * 2)
    (y * (rank + 1)).sum().backward()
    debugger.stop()
    debugger.close()


def ddp(out: Path, rank: int) -> None:
    example = _example()
    for name, kwargs in (("plain", {}), ("L1", {"level": "L1"}), ("mix", {"level": "mix"})):
        dump = {"dump_path": out / f"ddp_{name}"} if kwargs else {}
        result = example.train(steps=2, **dump, **kwargs)
        torch.save({"losses": result.losses, "grads": result.grads}, out / f"ddp_{name}_rank{rank}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        collectives(out / "collectives", rank, world)
        filtered(out, rank)
        tensors(out / "tensors", rank)
        functional(out / "functional", rank)
        ddp(out, rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
