"""The checklist's fingerprints of a model's parameters and buffers move device tensors to the host a batch at a
time: one transfer (one host synchronisation) per 64 MiB, not one per tensor (a ResNet50 on a GPU made about 1600
a step). A CPU has no transfer to count, so the device path runs here on CPU tensors that say they are elsewhere,
with ``Tensor.cpu`` counted; on a CUDA machine the same runs on the real device."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from pytest_msprobe.dump import checklist

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(20)), torch.nn.BatchNorm1d(16))
    odd = [
        torch.randn(6, 4, generator=g, dtype=torch.float64)[:, ::2],  # non-contiguous
        torch.tensor(True),
        torch.randint(0, 9, (7,), dtype=torch.int16, generator=g),
        torch.randn(3, generator=g).to(torch.bfloat16),
        torch.randn(2, 2, generator=g, dtype=torch.complex64),
        torch.zeros(0),
        torch.tensor(3.5, dtype=torch.float16),
    ]
    return [t.detach() for t in (*model.parameters(), *model.buffers(), *odd)]


@contextmanager
def _elsewhere(tensors: list[torch.Tensor], counted: list[int]) -> Iterator[None]:
    """``tensors``, CPU tensors, report another device (and so do their detached aliases), with the moves of any
    tensor to the host counted."""
    pointers = {t.data_ptr() for t in tensors if t.numel()}
    cpu = torch.Tensor.cpu

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        counted.append(self.numel() * self.element_size())
        return cpu(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        device = torch.Tensor.device

        def where(self: torch.Tensor) -> torch.device:
            elsewhere = self.numel() and self.data_ptr() in pointers
            return torch.device("meta") if elsewhere else device.__get__(self)  # type: ignore[attr-defined]

        mp.setattr(torch.Tensor, "device", property(where))
        mp.setattr(torch.Tensor, "cpu", counting)
        yield


def test_device_tensors_reach_the_host_in_one_transfer_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _tensors()
    named = [(f"t{k}", t) for k, t in enumerate(tensors)]
    expected = checklist.fingerprints(named)
    moves: list[int] = []
    with _elsewhere(tensors, moves):
        got = checklist.fingerprints(named)
    assert got == expected and len(moves) == 1  # every tensor's bytes in one transfer
    monkeypatch.setattr(checklist, "_BATCH", 4096)
    moves.clear()
    with _elsewhere(tensors, moves):
        assert checklist.fingerprints(named) == expected
    # batches of at most 4 KiB, filled before the next begins: every byte moved once, in a few transfers
    assert sum(moves) == sum(t.numel() * t.element_size() for t in tensors)
    assert max(moves) <= 4096 and len(moves) <= 2 * sum(moves) // 4096 + 1 < len(tensors) / 4


@_needs_cuda
def test_fingerprints_on_a_cuda_device_are_those_on_the_cpu() -> None:
    tensors = _tensors()
    on_cpu = checklist.fingerprints([(f"t{k}", t) for k, t in enumerate(tensors)])
    assert checklist.fingerprints([(f"t{k}", t.cuda()) for k, t in enumerate(tensors)]) == on_cpu
