"""pytest-msprobe: precision regression testing of PyTorch training.

The public names mirror msprobe's, so a training script switches with one import::

    from pytest_msprobe import PrecisionDebugger, seed_all

Importing this package does not import torch: the names that need it load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Imported eagerly, after the subpackage: the name ``compare`` of this package is then the function, not the
# subpackage ``pytest_msprobe.compare`` (as msprobe's own package does), so ``pytest_msprobe.compare(...)``
# calls it. The compare needs numpy only.
from pytest_msprobe.compare.run import compare

__version__ = "0.1.0"

__all__ = ["PrecisionDebugger", "__version__", "compare", "seed_all"]

if TYPE_CHECKING:  # pragma: no cover
    from pytest_msprobe.dump.debugger import PrecisionDebugger
    from pytest_msprobe.dump.determinism import seed_all

_LAZY = {
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
