"""What the ``msprobe`` fixture hands a test: the few names a training test uses, and nothing of the machinery.

The run behind it (:class:`pytest_msprobe.run.runner.MsprobeRun`: its folders, baseline store, compare) stays
the plugin's; a test sees the device, its rank, the debugger and the two calls that frame a training step. This
module names the run only by what it reads of it (:class:`_Run`), so that the package's public face can hand the
class on without standing above the run.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from pytest_msprobe.dump.debugger import PrecisionDebugger


class _Run(Protocol):
    """What the fixture reads of the run behind it."""

    device: torch.device
    rank: int
    world_size: int
    seed: int
    steps: tuple[int, ...]
    debugger: Any
    dump_dir: Path

    def step(self, model: Any = None) -> AbstractContextManager[None]: ...

    def loss(self, value: Any) -> None: ...


class MsprobeFixture:
    """The ``msprobe`` fixture's value: where to train, and how to frame each training step.

    Before the test body runs, the seed is set (``seed_all(seed, mode=True)``, so that the model starts the
    same on every device and rank) and float32 math runs in float32 (TF32 and HF32 off unless the marker
    says ``allow_tf32=True``); after it, the chosen steps' dump is compared with the test's baseline (or
    written as it, with ``--msprobe-regen-baseline``)::

        import pytest
        from pytest_msprobe import MsprobeFixture

        @pytest.mark.msprobe(steps=[0, 1], trend_steps=5)
        def test_training(msprobe: MsprobeFixture) -> None:
            model = Net().to(msprobe.device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in batches(seed=msprobe.rank):       # each rank its own data
                with msprobe.step(model):                  # dumps the step when it is a chosen one
                    loss = F.cross_entropy(model(x.to(msprobe.device)), y.to(msprobe.device))
                    msprobe.loss(loss)                     # for the trend (trend_steps=N)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()

    Without ``--msprobe-baseline`` (and without the self-check) nothing is dumped: the steps just run.
    """

    __slots__ = ("_run",)

    def __init__(self, run: _Run) -> None:
        self._run = run

    @property
    def device(self) -> torch.device:
        """The device to train on: ``--msprobe-device`` (auto: NPU, then CUDA, then CPU); in a multi-rank test
        the rank's own (``cuda:LOCAL_RANK``)."""
        return self._run.device

    @property
    def rank(self) -> int:
        """This process's rank in a multi-rank test (marker ``world_size=N``); 0 otherwise."""
        return self._run.rank

    @property
    def world_size(self) -> int:
        """How many rank processes run the test body (the marker's ``world_size``, 1 by default)."""
        return self._run.world_size

    @property
    def seed(self) -> int:
        """The seed set before the test body (the marker's ``seed``)."""
        return self._run.seed

    @property
    def steps(self) -> tuple[int, ...]:
        """The training steps that are dumped and compared (the marker's ``steps``), counted from 0."""
        return self._run.steps

    @property
    def debugger(self) -> PrecisionDebugger:
        """The debugger that dumps the chosen steps, for tests that call ``start()`` / ``stop()`` / ``step()``
        themselves instead of :meth:`step`. When nothing is dumped it is a stand-in whose calls do nothing."""
        return cast("PrecisionDebugger", self._run.debugger)

    @property
    def dump_dir(self) -> Path:
        """The folder the test's dump is written to (``step{N}/rank{R}/`` below it)."""
        return self._run.dump_dir

    def step(self, model: Any = None) -> AbstractContextManager[None]:
        """Frame one training step (forward, loss, backward, optimizer step)::

            with msprobe.step(model):
                train_one_step(...)

        The step is dumped when it is one of the chosen ``steps``. Levels ``L0`` and ``mix`` dump modules and
        need the model; at ``L1`` it is optional (the checklist fingerprints its weights). Steps do not nest.
        """
        return self._run.step(model)

    def loss(self, value: Any) -> None:
        """Give the step's loss (a number or a one-element tensor) to the trend, inside :meth:`step`.

        With ``trend_steps=N`` each of the first N steps must give one (the last value given in a step
        counts); without a trend it is not recorded.
        """
        self._run.loss(value)

    def __repr__(self) -> str:
        return f"<msprobe fixture: device {self.device}, rank {self.rank} of {self.world_size}>"
