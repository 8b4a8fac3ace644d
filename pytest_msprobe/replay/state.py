"""The torch state an offline replay runs in, whatever its caller's: a dump replayed twice, in any process, on a
loaded machine or an idle one, gives the same own errors to the last bit.

- **One intra-op thread.** torch splits a reduction (a sum, a norm, a layer norm's weight gradient, the sum of a
  broadcast gradient) over its threads, one part each, and adds the parts: a float64 sum of 200K elements
  rounds otherwise with two threads than with one, and so do the figures judged from it. The replay runs on
  one, and the caller's count is put back after.
- **Out of inference mode.** A backward replay needs autograd: under a caller's ``torch.inference_mode()``
  every backward call would be skipped.
- **torch's default dtype, float32.** A recorded call that makes a tensor from numbers alone
  (``torch.full((512,), 0.1)``) makes it in the default dtype: under a caller's float64 default its replay
  would hold 0.1 where the dump holds float32's nearest value.
- **The CPU generator seeded, at each call.** A call whose output is a draw is not replayed
  (:data:`pytest_msprobe.replay.apis.RANDOM`); should one draw anyway, it draws the same numbers every time,
  not the caller's next ones. The caller's generator state is put back after.

The online self-check does not use it: it runs inside the training, on its threads and with its generator
(which it puts back itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SEED = 0  # the CPU generator's seed at each replayed call


@contextlib.contextmanager
def steady() -> Iterator[None]:
    """Run the body (one call's replay and its judging) in the state of the module docstring."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    if threads != 1:
        torch.set_num_threads(1)
    if dtype != torch.float32:
        torch.set_default_dtype(torch.float32)
    try:
        with torch.inference_mode(False), torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(SEED)
            yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)
        if dtype != torch.float32:
            torch.set_default_dtype(dtype)
