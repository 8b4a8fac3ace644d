"""The recorder of one step: its records (:mod:`.step_records`) and the parts that make them, put together.

- :mod:`.api_calls`: APIs (L1), called from the wrappers of :mod:`.intercept`, and their backward;
- :mod:`.module_hooks`: modules (L0), forward and backward, and parameter gradients;
- :mod:`.collectives`: the calls of torch.distributed;
- :mod:`.optimizer_hooks`: the optimizer's step as a parent node (mix), each parameter's update (optimizer.json).

Each part is a base class of :class:`Recorder` holding its own state and methods: a wrapper or hook reaches the
method it needs in one call, with nothing in between.

**Threads.** A recorder belongs to the thread that started it (``owner``): API calls reach it through that
thread's slot (:mod:`.threads`), and its other hooks return at once on another thread, but for a device thread
running a backward pass it claimed.

**Interruptions.** A ``KeyboardInterrupt`` (or any exception that is not an ``Exception``: ``SystemExit``, a test
timeout) passing through the recorder's code may leave a record half-built; the recorder then marks itself
``broken``, and the debugger drops the step instead of writing it. Ordinary exceptions raised by the wrapped
functions (a shape error the program catches) leave the records whole and change nothing. After ``closed``, every
hook and wrapper reaching the recorder returns without touching it.

No gradient or activation is kept alive by the capture beyond the hook that records it.
"""

from __future__ import annotations

from pytest_msprobe.dump.api_calls import ApiCalls
from pytest_msprobe.dump.collectives import Collectives
from pytest_msprobe.dump.module_hooks import ModuleHooks
from pytest_msprobe.dump.optimizer_hooks import OptimizerHooks
from pytest_msprobe.dump.threads import release_backward


class Recorder(ApiCalls, ModuleHooks, Collectives, OptimizerHooks):
    """Everything captured in one step: records, stacks, module tree; flushed by the debugger on stop."""

    def detach(self, sweep: bool = False) -> None:
        """Remove every hook this recorder registered (module, node, parameter and optimizer hooks); idempotent.

        ``sweep`` (or a hooking that was cut short) also looks through the model's modules and parameters and the
        optimizer's global hooks for hooks of this recorder whose handle was never kept. A node hook whose handle
        was lost that way stays on its node, and does nothing once the recorder is closed.
        """
        for handle in self._handles:  # remove() is idempotent: cut here, the next detach() goes on
            handle.remove()
        self._handles.clear()
        if sweep or not self._hooks_kept:
            self._sweep_model()
            self._sweep_optimizer()
        release_backward(self)

    def finish(self) -> None:
        """Write out the backward records still incomplete and drop empty reservations."""
        self.guarded(self._finish)

    def _finish(self) -> None:
        self._record_grads()  # a backward pass that did not reach its end (it raised) still accumulated them
        self.dist_pending.clear()  # never waited for: those records keep their inputs only
        self._finish_api_backward()
        if self.self_check is not None:
            self.self_check.finish()
        self._finish_modules()
        self.module_stack.clear()
        self._finish_optimizer()
