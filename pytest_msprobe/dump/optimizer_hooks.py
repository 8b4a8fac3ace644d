"""The optimizer in the records (level mix): APIs run inside ``optimizer.step()`` get the parent node
"optimizer" in construct.json, as msprobe gives them.

The hooks are torch's global optimizer-step hooks, so they see every optimizer of every thread: only the owner
thread's steps count.
"""

from __future__ import annotations

import threading
from typing import Any

from pytest_msprobe.dump.config import DumpConfig
from pytest_msprobe.dump.records import StepRecords
from pytest_msprobe.dump.stats import StatEngine
from pytest_msprobe.format.names import OPTIMIZER_NODE

_get_ident = threading.get_ident


class OptimizerHooks(StepRecords):
    """The recorder's part that notes when an optimizer's step runs."""

    def __init__(self, config: DumpConfig, engine: StatEngine) -> None:
        super().__init__(config, engine)
        self._optimizer_hooked = False

    def attach_optimizer_hooks(self) -> None:
        """APIs run inside ``optimizer.step()`` get the parent node "optimizer" in construct.json (mix)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        # noted before registering: a cut in between leaves a hook for detach() to sweep
        self._optimizer_hooked = True
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(self._optimizer_post))

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.closed and _get_ident() == self.owner:  # optimizer hooks are global: other threads' too
            self.construct.setdefault(OPTIMIZER_NODE, None)
            self.in_optimizer = True

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if _get_ident() == self.owner:
            self.in_optimizer = False

    def _sweep_optimizer(self) -> None:
        """Remove this recorder's global optimizer hooks, those whose handle was lost too."""
        if not self._optimizer_hooked:
            return
        from torch.optim import optimizer as optim_module

        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
            hooks = getattr(optim_module, name, None)
            if hooks:
                for key in [k for k, fn in hooks.items() if getattr(fn, "__self__", None) is self]:
                    hooks.pop(key, None)
