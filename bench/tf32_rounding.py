"""How a GPU rounds float32 operands to TF32: the self-check's emulation (pytest_msprobe/replay/emulate.py)
rounds them to nearest, ties to even; this check says whether the device's own TF32 matmuls and convolutions
are reproduced by that, by rounding toward zero (truncation) or by nothing.

    python bench/tf32_rounding.py                  # on a CUDA machine; a few seconds
    python bench/tf32_rounding.py --json out.json

For a matmul (512x512 by 512x512) and a convolution (8x64x32x32, 64 3x3 filters), computed on the device with
``torch.backends.cuda.matmul.allow_tf32`` / ``torch.backends.cudnn.allow_tf32`` on, the device's output is
judged by the self-check's standard (``pytest_msprobe.replay.standard.own_error``: the share of elements more
than 0.1% off) against a float64 replay on the CPU of: the inputs as they are (float32), rounded to 10 bits to
nearest even (the emulation), and truncated to 10 bits. The emulation is right when its share is 0 (and its
mean relative error at float32's level), and the table says which rounding the device does otherwise. The same
for the backward of the convolution (input and weight gradients from the incoming gradient and the operands).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pytest_msprobe.replay.emulate import round_mantissa
from pytest_msprobe.replay.standard import own_error


def truncated(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor with its 13 lowest mantissa bits cleared (rounded toward zero to TF32)."""
    return (t.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


ROUNDINGS = {
    "float32": lambda t: t,
    "nearest-even": lambda t: round_mantissa(t, "tf32"),
    "truncated": truncated,
}


def _judge(name: str, device_out: torch.Tensor, replay: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"case": name}
    for rounding, fn in ROUNDINGS.items():
        want = replay(fn).detach().numpy()
        own = own_error(device_out.detach().cpu().numpy(), want, "float32")
        row[rounding] = {"share_off": own.rel_share, "mean_rel": own.mean_rel, "max_rel": own.max_rel}
    return row


def run(device: torch.device) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
    x, w = torch.randn(8, 64, 32, 32, generator=g), torch.randn(64, 64, 3, 3, generator=g) * 0.05
    grad = torch.randn(8, 64, 32, 32, generator=g)
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    matmul.allow_tf32, cudnn.allow_tf32 = True, True
    try:
        mm = a.to(device) @ b.to(device)
        xd, wd = x.to(device).requires_grad_(), w.to(device).requires_grad_()
        conv = F.conv2d(xd, wd, padding=1)
        gx, gw = torch.autograd.grad(conv, (xd, wd), grad.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved

    def conv_grads(fn: Any) -> tuple[torch.Tensor, torch.Tensor]:
        xr = fn(x).double().requires_grad_()
        wr = fn(w).double().requires_grad_()
        return torch.autograd.grad(F.conv2d(xr, wr, padding=1), (xr, wr), fn(grad).double())

    return [
        _judge("matmul", mm, lambda fn: fn(a).double() @ fn(b).double()),
        _judge("conv2d", conv, lambda fn: F.conv2d(fn(x).double(), fn(w).double(), padding=1)),
        _judge("conv2d input gradient", gx, lambda fn: conv_grads(fn)[0]),
        _judge("conv2d weight gradient", gw, lambda fn: conv_grads(fn)[1]),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the table as JSON here too")
    parser.add_argument("--device", default="cuda", help="the device to check (default: cuda)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tf32_rounding: no CUDA device here: nothing to check")
        return 0
    rows = run(torch.device(args.device))
    print(f"{'case':<24}" + "".join(f"{r:>26}" for r in ROUNDINGS))
    for row in rows:
        cells = "".join(f"{row[r]['share_off']:>12.3%} off, {row[r]['mean_rel']:8.2e}" for r in ROUNDINGS)
        print(f"{row['case']:<24}{cells}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
