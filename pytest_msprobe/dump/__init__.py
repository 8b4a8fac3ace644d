"""The dump engine: msprobe-compatible capture of a training step's APIs and modules, forward and backward.

- :mod:`.debugger`: ``PrecisionDebugger``, msprobe's start/stop/step calls;
- :mod:`.determinism`: ``seed_all``;
- :mod:`.config`: the settings, from arguments and msprobe's config.json;
- :mod:`.intercept` and :mod:`.api_lists`: the API wrappers (level L1);
- :mod:`.capture`: the records of one step, module hooks (L0) and backward hooks;
- :mod:`.stats` and :mod:`.analyze`: tensor statistics on the device, other values as msprobe writes them;
- :mod:`.naming`, :mod:`.stack`, :mod:`.writer`: names, call stacks, the files.

This package imports torch; ``import pytest_msprobe`` does not (its names load on first use).
"""
