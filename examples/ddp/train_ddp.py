"""Train a small ResNet with DistributedDataParallel for a few steps, every rank dumping its own precision data.

Each rank trains on its own batches, DDP all-reduces the gradients, and pytest-msprobe's ``PrecisionDebugger``
writes ``dump_path/step{N}/rank{R}/`` on every rank. ``--fault-rank R`` makes one relu of every forward 1% wrong
on rank R only (a faulty kernel with its own autograd node): the compare of that dump against a clean one names
rank R, although the all-reduce carries the error to every rank's gradients.

    # two ranks on the CPU (gloo), launched by this script
    python examples/ddp/train_ddp.py --world-size 2 --dump-path ddp_dump
    # the same under torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT come from it)
    torchrun --nproc-per-node 2 examples/ddp/train_ddp.py --dump-path ddp_dump
    # CUDA (nccl) or Ascend NPU (hccl): one device per rank
    torchrun --nproc-per-node 8 examples/ddp/train_ddp.py --device npu --dump-path npu_dump
    # a faulty rank, then the compare
    python examples/ddp/train_ddp.py --world-size 2 --dump-path bad_dump --fault-rank 1
    pytest-msprobe compare bad_dump ddp_dump -o compare_result

The ranks this script launches are watched as torchrun watches its own: when one fails (an exception, a crash),
the others are stopped at once and the run ends with that rank's exit status and error, instead of leaving them
blocked in a collective that rank will never join. ``--world-size`` larger than the number of CUDA or NPU devices
is refused before any rank starts (one device per rank).

``train`` is importable: it runs one rank inside a process group that its caller has initialised.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
# F.relu calls in one forward of TinyResNet: the stem's nn.ReLU, then two in each block
RELUS_PER_FORWARD = 5
# the relu made faulty by --fault-rank: layer1's first (Functional.relu.1 in a dump of the first step)
FAULTY_RELU = 1


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class TinyResNet(nn.Module):
    """A stem, two basic blocks and a classifier: small enough for a few CPU steps on every rank."""

    def __init__(self, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def rank_batch(step: int, rank: int, batch: int = 8, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of one rank at one step: its own samples, the same on every run and every device."""
    gen = torch.Generator().manual_seed(1000 + 100 * rank + step)
    x = torch.randn(batch, 3, size, size, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return x, y


class _FaultyRelu(torch.autograd.Function):
    """A relu kernel whose output is ``1 + scale`` times too large; its gradient is relu's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.clamp_min(x, 0) * (1.0 + scale)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (out,) = ctx.saved_tensors
        return grad * (out > 0), None


def install_relu_fault(scale: float = 0.01) -> Callable[[], None]:
    """Make the ``FAULTY_RELU``-th ``F.relu`` call of every forward faulty; returns the function that undoes it.

    ``F.relu`` itself is replaced, as a faulty device kernel would be: a dump records the call as
    ``Functional.relu`` with the wrong output, and nothing else changes.
    """
    original = F.relu
    calls = [0]

    def relu(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        index = calls[0] % RELUS_PER_FORWARD
        calls[0] += 1
        if index == FAULTY_RELU and not inplace:
            return _FaultyRelu.apply(input, scale)
        return original(input, inplace=inplace)

    F.relu = relu  # type: ignore[assignment]

    def restore() -> None:
        F.relu = original

    return restore


@dataclass(frozen=True)
class RankResult:
    """What one rank's training produced: the loss and the (all-reduced) parameter gradients of every step."""

    rank: int
    world_size: int
    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)


def train(
    steps: int = 3,
    dump_path: str | os.PathLike[str] | None = None,
    task: str = "statistics",
    level: str = "L1",
    dump_ranks: Sequence[int] | None = None,
    fault_rank: int | None = None,
    fault_scale: float = 0.01,
    device: str = "cpu",
    width: int = 8,
    seed: int = 1234,
    debugger: Any = None,
) -> RankResult:
    """Train this rank of an initialised process group with DDP; dump to ``dump_path`` when it is given.

    ``dump_ranks`` limits the dump to those global ranks (the others dump nothing but train as usual);
    ``fault_rank`` makes one relu faulty on that rank (see ``install_relu_fault``). ``debugger`` is a
    configured ``PrecisionDebugger`` to drive instead (the pytest plugin's ``msprobe.debugger``): it is given the
    model and left open for its owner.
    """
    from pytest_msprobe import PrecisionDebugger, seed_all

    if not dist.is_initialized():
        raise RuntimeError(
            "train() runs one rank of a process group: call torch.distributed.init_process_group"
        )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seed_all(seed=seed, mode=True)
    dev = torch.device(device if device == "cpu" else f"{device}:{int(os.environ.get('LOCAL_RANK', rank))}")
    if dev.type != "cpu":
        getattr(torch, dev.type).set_device(dev)  # nccl / hccl: one device per rank, the rank's own
    net = TinyResNet(width=width).to(dev)  # the same weights on every rank: seeded alike (DDP checks it)
    model = DistributedDataParallel(net, device_ids=None if dev.type == "cpu" else [dev.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    own = debugger is None and dump_path is not None
    if own:
        summary = {"summary_mode": "md5"} if task == "md5" else {}
        debugger = PrecisionDebugger(
            dump_path=str(dump_path),
            task="statistics" if task == "md5" else task,
            level=level,
            rank=list(dump_ranks) if dump_ranks is not None else None,
            **summary,
        )
    restore = install_relu_fault(fault_scale) if fault_rank == rank else None
    result = RankResult(rank=rank, world_size=world_size)
    try:
        for step in range(steps):
            x, y = (t.to(dev) for t in rank_batch(step, rank))
            if debugger is not None:
                debugger.start(model=model if level != "L1" or not own else None)
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if debugger is not None:
                debugger.stop()
                debugger.step()
            result.losses.append(loss.detach().cpu().clone())
            result.grads.append(
                {n: p.grad.detach().cpu().clone() for n, p in net.named_parameters() if p.grad is not None}
            )
    finally:
        if restore is not None:
            restore()
        if own:
            debugger.close()
    return result


def host_store() -> dist.TCPStore:
    """The ranks' TCPStore, served from the launcher as torchrun's agent serves it, on a port the system picks:
    no rank hosts it, so none takes it down while a peer still uses it (gloo aborted a rank 0 that left first:
    'terminate called without an active exception')."""
    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)


def device_shortage(device: str, world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot run on this machine's ``device`` devices (one per rank), or None."""
    if device == "cpu":
        return None
    module = getattr(torch, device, None)
    available = module is not None and module.is_available()
    count = int(module.device_count()) if available else 0
    if count >= world_size:
        return None
    return f"needs {world_size} {device} devices (one per rank), this machine has {count}"


class RankFailure(RuntimeError):
    """A launched rank failed, was killed or ran out of time; the others were stopped. ``status``: what the
    launcher exits with (the failing rank's exit status, 1 when it was killed by a signal)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


GRACE = 5.0  # seconds the other ranks get to end after SIGTERM before SIGKILL (torchrun's order, shorter)
_POLL = 0.05
_TAIL = 40  # lines of a rank's error output kept for the failure message


def _relay(stream: IO[bytes], tail: deque[str]) -> None:
    """Copy a rank's stderr to ours as it comes, keeping its last lines for the failure message."""
    for line in iter(stream.readline, b""):
        text = line.decode("utf-8", errors="replace")
        tail.append(text.rstrip("\n"))
        sys.stderr.write(text)
        sys.stderr.flush()
    stream.close()


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM to every rank still running (and what it started), SIGKILL to those alive after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        running = [p for p in procs if p.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)  # each rank leads its own process group
        deadline = time.monotonic() + (wait or 0)
        while wait is not None and any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(_POLL)
    for proc in procs:
        proc.wait()


def _how(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"


def _ranks(ranks: Sequence[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"


def launch(
    script: str | os.PathLike[str],
    args: Sequence[str],
    world_size: int,
    timeout: float = 300,
    grace: float = GRACE,
) -> int:
    """Run ``script args`` once per rank, torchrun-style (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Every rank is watched, as torchrun watches them: when one ends with a non-zero status or is killed, the
    others (often blocked in a collective or the rendezvous, waiting for it) get SIGTERM, then SIGKILL after
    ``grace`` seconds, and ``RankFailure`` is raised at once with that rank's status and the end of its error
    output. The same happens to every rank still running after ``timeout`` seconds. Each rank's stderr is
    passed on to ours as it comes. Returns 0 when every rank succeeded.
    """
    store = host_store()
    procs: list[subprocess.Popen[bytes]] = []
    tails: list[deque[str]] = []
    relays: list[threading.Thread] = []
    failed: int | None = None
    late: list[int] = []
    try:
        for rank in range(world_size):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port),
                # as under torchrun: every rank is a client of the store the launcher serves at MASTER_ADDR:PORT
                TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_RESTART_COUNT="0",
            )
            # a session of its own: Ctrl-C reaches the launcher only, which stops the rank and its children
            proc = subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            procs.append(proc)
            assert proc.stderr is not None
            tails.append(deque(maxlen=_TAIL))
            relays.append(threading.Thread(target=_relay, args=(proc.stderr, tails[-1]), daemon=True))
            relays[-1].start()
        deadline = time.monotonic() + timeout
        while True:
            failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            late = [r for r, p in enumerate(procs) if p.poll() is None]
            if failed is not None or not late or time.monotonic() >= deadline:
                break
            time.sleep(_POLL)
    finally:
        _stop(procs, grace)
        for relay in relays:
            relay.join(timeout=5)
        del store  # its server stops once every rank has ended
    if failed is None and not late:
        return 0
    if failed is not None:
        status = procs[failed].returncode
        stopped = f"; {_ranks(late)} stopped" if late else ""
        head = f"rank {failed} of {world_size} failed ({_how(status)}){stopped}"
        shown, code = [failed], status if status > 0 else 1
    else:
        head = f"{_ranks(late)} of {world_size} still running after {timeout:g} s: stopped"
        shown, code = late, 1
    lines = [head]
    for rank in shown:
        lines += [
            f"rank {rank}'s error output (end):",
            *(f"  {line}" for line in tails[rank] or ["(nothing)"]),
        ]
    raise RankFailure("\n".join(lines), code)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="DDP TinyResNet training steps with per-rank precision dumping."
    )
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks to launch (default: 2; torchrun's wins)"
    )
    parser.add_argument("--device", default="cpu", choices=sorted(BACKENDS), help="cpu (gloo), cuda, npu")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    parser.add_argument("--dump-path", default=None, help="write the dump here (default: no dumping)")
    parser.add_argument("--task", default="statistics", choices=["statistics", "tensor", "md5"])
    parser.add_argument("--level", default="L1", choices=["L0", "L1", "mix"])
    parser.add_argument(
        "--rank", type=int, nargs="*", default=None, help="dump only these ranks (default: all)"
    )
    parser.add_argument("--fault-rank", type=int, default=None, help="make one relu 1%% wrong on this rank")
    parser.add_argument("--fault-scale", type=float, default=0.01, help="relative error of the fault (0.01)")
    parser.add_argument(
        "--results", default=None, help="save each rank's losses and gradients here (rank{R}.pt)"
    )
    return parser.parse_args(argv)


def run_rank(args: argparse.Namespace) -> int:
    """One rank, in a torchrun-style environment: join the group, train, leave."""
    dist.init_process_group(backend=BACKENDS[args.device], init_method="env://")
    try:
        result = train(
            steps=args.steps,
            dump_path=args.dump_path,
            task=args.task,
            level=args.level,
            dump_ranks=args.rank,
            fault_rank=args.fault_rank,
            fault_scale=args.fault_scale,
            device=args.device,
        )
        if args.results:
            Path(args.results).mkdir(parents=True, exist_ok=True)
            torch.save(
                {"losses": result.losses, "grads": result.grads},
                Path(args.results) / f"rank{result.rank}.pt",
            )
        losses = " ".join(f"{float(v):.6f}" for v in result.losses)
        print(f"rank {result.rank}/{result.world_size}: losses {losses}", flush=True)
        # every rank leaves together: gloo aborted a rank ("terminate called without an active exception") that
        # tore its group down while its peer was still using the connections (a rank that failed instead is
        # stopped by the launcher, so no rank waits here for ever)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun, or one of the ranks launched below
        return run_rank(args)
    shortage = device_shortage(args.device, args.world_size)
    if shortage is not None:
        print(f"train_ddp.py: --world-size {args.world_size} {shortage}", file=sys.stderr)
        return 2
    try:
        launch(__file__, sys.argv[1:] if argv is None else list(argv), args.world_size)
    except RankFailure as exc:
        print(f"train_ddp.py: {exc}", file=sys.stderr)
        return exc.status
    if args.dump_path:
        print(f"dump written to {args.dump_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
