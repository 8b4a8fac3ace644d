"""The dump engine: msprobe-compatible capture of a training step's APIs and modules, forward and backward.

- :mod:`.debugger`: ``PrecisionDebugger``, msprobe's start/stop/step calls;
- :mod:`.determinism`: ``seed_all`` and the environment variables it sets;
- :mod:`.config`: the settings, from arguments and msprobe's config.json;
- :mod:`.intercept` and :mod:`.api_lists`: the API wrappers (level L1), installed and restored;
- :mod:`.threads`: each thread's slot, naming the recorder its API calls go to;
- :mod:`.recorder`: the recorder of one step, put together from :mod:`.step_records` (its records and bookkeeping,
  filtered by :mod:`.selection`), :mod:`.api_calls` (APIs), :mod:`.module_hooks` (modules, L0, and parameter
  gradients), :mod:`.collectives` (torch.distributed) and :mod:`.optimizer_hooks` (mix); :mod:`.autograd`: the
  backward records filled by hooks on autograd nodes, and what is read from the graph;
- :mod:`.entries`: arguments and outputs as msprobe writes them; :mod:`.stats` and :mod:`.reductions`: tensor
  statistics on the device, batched into one transfer per step; :mod:`.ops`: the torch functions they call;
- :mod:`.stack`, :mod:`.writer`, :mod:`.signals`: call stacks, the files, sections a signal must not cut;
- :mod:`.online_self_check`: each API call replayed in float64 as it returns, its own error in ``self_check.json``
  (through :mod:`pytest_msprobe.replay`).

Names and file layout are msprobe's, from :mod:`pytest_msprobe.format`. This package imports torch;
``import pytest_msprobe`` does not (its names load on first use).
"""
