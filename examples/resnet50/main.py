"""Train torchvision's ResNet50 for a few steps on synthetic data, with precision dumping on.

The msprobe ResNet50 tutorial runs the PyTorch ImageNet example (``main.py -a resnet50 -b 32 --gpu 1 --dummy``)
with msprobe's PrecisionDebugger on a GPU and on an NPU, then compares the two dumps. This script is that
workflow with pytest-msprobe's drop-in ``PrecisionDebugger``, trimmed to what the precision check needs:
random weights (nothing is downloaded), synthetic images (``--dummy``), a chosen number of steps.

    # GPU runner: the baseline ("bench") dump
    python examples/resnet50/main.py -a resnet50 -b 4 --dummy --image-size 64 --device cuda --dump-path gpu_dump
    # NPU runner: the same command with --device npu (imports torch_npu and transfer_to_npu)
    python examples/resnet50/main.py -a resnet50 -b 4 --dummy --image-size 64 --device npu --dump-path npu_dump
    # anywhere: compare them
    pytest-msprobe compare npu_dump gpu_dump -o compare_result

``test_resnet50.py`` beside this file runs the same training steps as a pytest test against a stored baseline.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn


class StepDebugger(Protocol):
    """What the training loop needs from a debugger: msprobe's PrecisionDebugger shape."""

    def start(self, model: nn.Module | None = None) -> None: ...
    def stop(self) -> None: ...
    def step(self) -> None: ...


def build_model(arch: str = "resnet50", num_classes: int = 1000) -> nn.Module:
    """A torchvision classification model with random weights (``weights=None``: nothing is downloaded)."""
    import torchvision.models as models

    if arch not in models.list_models(module=models):
        raise SystemExit(f"unknown architecture {arch!r}; try one of: resnet18, resnet50, mobilenet_v2, ...")
    return models.get_model(arch, weights=None, num_classes=num_classes)


def synthetic_batches(
    steps: int, batch_size: int, image_size: int, num_classes: int = 1000
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic synthetic images and labels, like the tutorial's ``--dummy`` (torchvision FakeData).

    Each sample depends only on its index, never on the device or on the global random state, so every runner
    trains on the same numbers.
    """
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    data = datasets.FakeData(
        size=steps * batch_size,
        image_size=(3, image_size, image_size),
        num_classes=num_classes,
        transform=transforms.ToTensor(),
    )
    yield from DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=0)


def train(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    debugger: StepDebugger | None = None,
    pass_model: bool = False,
    log: Any = None,
) -> list[float]:
    """The tutorial's training loop; the four debugger lines are the only additions precision dumping needs."""
    model.train()
    losses = []
    for i, (images, target) in enumerate(batches):
        start = time.perf_counter()
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        if debugger is not None:
            debugger.start(model) if pass_model else debugger.start()
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if debugger is not None:
            debugger.stop()
            debugger.step()
        losses.append(float(loss.detach()))
        if log is not None:
            print(
                f"step {i}: loss {losses[-1]:.6f} ({time.perf_counter() - start:.2f} s)", file=log, flush=True
            )
    return losses


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="ResNet50 training steps with precision dumping.")
    parser.add_argument("-a", "--arch", default="resnet50", help="torchvision model name (default: resnet50)")
    parser.add_argument("-b", "--batch-size", type=int, default=4, help="images per step (default: 4)")
    parser.add_argument("--dummy", action="store_true", help="use synthetic data (the only data source here)")
    parser.add_argument("--image-size", type=int, default=64, help="image side in pixels (default: 64)")
    parser.add_argument("--steps", type=int, default=2, help="training steps to run (default: 2)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default: 0.1)")
    parser.add_argument(
        "--device", default="auto", help="auto, cpu, cuda or npu (default: auto: npu, then cuda, then cpu)"
    )
    parser.add_argument("--gpu", type=int, default=None, help="GPU/NPU index, as in the tutorial's --gpu")
    parser.add_argument("--seed", type=int, default=1234, help="seed for seed_all (default: 1234)")
    parser.add_argument("--dump-path", default=None, help="write a dump here (default: no dumping)")
    parser.add_argument("--task", default="statistics", choices=["statistics", "tensor", "md5"])
    parser.add_argument("--level", default="L1", choices=["L0", "L1", "mix"])
    parser.add_argument(
        "--dump-step", type=int, nargs="+", default=[0, 1], help="steps to dump (default: 0 1)"
    )
    args = parser.parse_args(argv)
    if not args.dummy:
        parser.error("only synthetic data is supported: pass --dummy (no data set is downloaded)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from pytest_msprobe import PrecisionDebugger, seed_all
    from pytest_msprobe.run.device import describe_device, select_device

    device_name = args.device if args.gpu is None or ":" in args.device else f"{args.device}:{args.gpu}"
    device = select_device(device_name)
    seed_all(seed=args.seed, mode=True)
    model = build_model(args.arch).to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    debugger = None
    if args.dump_path:
        task = "statistics" if args.task == "md5" else args.task
        extra = {"summary_mode": "md5"} if args.task == "md5" else {}
        debugger = PrecisionDebugger(
            dump_path=args.dump_path, task=task, level=args.level, step=args.dump_step, **extra
        )
    print(
        f"{args.arch} on {describe_device(device)}, batch {args.batch_size}, {args.image_size}px", flush=True
    )
    batches = synthetic_batches(args.steps, args.batch_size, args.image_size)
    train(
        model, batches, criterion, optimizer, device, debugger, pass_model=args.level != "L1", log=sys.stdout
    )
    if debugger is not None:
        debugger.close()
        print(f"dump written to {args.dump_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
