"""What the checklist adds to a dumped step: the fingerprints of every weight and buffer at the step's start.

torchvision's resnet50 (25.6M parameters, 102 MB in float32), batch 4x3x64x64, SGD: the median of ``--repeat``
plain training steps against the median time of one step's checklist start (environment, structure, every
parameter's and buffer's CRC32 and statistics), in one process, with torch's default threads. Run:
``python bench/checklist_cost.py [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision

from pytest_msprobe.dump.checklist import StepChecklist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 1000, (4,))
    plain, checklist = [], []
    for _ in range(args.repeat + 1):  # the first of each is a warm-up
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        StepChecklist(0, 0, "cpu").start(model)
        checklist.append(time.perf_counter() - start)
    step, check = statistics.median(plain[1:]), statistics.median(checklist[1:])
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    print(
        f"resnet50 ({size:.0f} MB of parameters): plain step {step * 1e3:.0f} ms, checklist at the step's start "
        f"{check * 1e3:.0f} ms ({check / step:.1%} of a plain step; {check * 1e3 / size * 100:.0f} ms per 100 MB)"
    )


if __name__ == "__main__":
    main()
