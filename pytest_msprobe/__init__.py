"""pytest-msprobe: precision regression testing of PyTorch training.

The public names mirror msprobe's, so a training script switches with one import::

    from pytest_msprobe import PrecisionDebugger, seed_all

and a test annotates the ``msprobe`` fixture with :class:`MsprobeFixture`.

Importing this package does not import torch: the names that need it load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Imported eagerly, after the subpackage: the name ``compare`` of this package is then the function, not the
# subpackage ``pytest_msprobe.compare`` (as msprobe's own package does), so ``pytest_msprobe.compare(...)``
# calls it. The compare needs numpy only.
from pytest_msprobe.compare.run import compare
from pytest_msprobe.moved import install as _install_old_paths
from pytest_msprobe.version import __version__

_install_old_paths()  # the module paths of the package's earlier layout still import (pytest_msprobe.moved)

__all__ = ["MsprobeFixture", "PrecisionDebugger", "__version__", "compare", "seed_all"]

if TYPE_CHECKING:  # pragma: no cover
    from pytest_msprobe.dump.debugger import PrecisionDebugger
    from pytest_msprobe.dump.determinism import seed_all
    from pytest_msprobe.fixture import MsprobeFixture

_LAZY = {
    "MsprobeFixture": "pytest_msprobe.fixture",
    "PrecisionDebugger": "pytest_msprobe.dump.debugger",
    "seed_all": "pytest_msprobe.dump.determinism",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_msprobe' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
