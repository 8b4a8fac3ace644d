"""Old import paths: the modules and names of the package's earlier layout still import, with a warning.

The compare layer was grouped into packages by feature (alignment, judging, diagnosis, checklist, trend, dumps)
and a few modules were renamed so that no two share a file name. Code written against the earlier layout that
imports an old path gets the very module (or name) at its new home, and a DeprecationWarning that names it.
Importing this module imports nothing else of the package: the finder loads a module only when it is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

_C = "pytest_msprobe.compare."
_D = "pytest_msprobe.dump."
_F = "pytest_msprobe.format."

# old module path -> where it is now (compare.validate, whose name the package gives the function, is set in
# sys.modules by pytest_msprobe.compare itself: loaded here, the import would set the package's name to the module)
MODULES = {
    _C + "align": _C + "alignment.align",
    _C + "coverage": _C + "alignment.coverage",
    _C + "editscript": _C + "alignment.editscript",
    _C + "interchange": _C + "alignment.interchange",
    _C + "rank_order": _C + "alignment.rank_order",
    _C + "checklist_diff": _C + "checklist.diff",
    _C + "checklist_records": _C + "checklist.from_records",
    _C + "checklist_settings": _C + "checklist.setting_causes",
    _C + "checklist_values": _C + "checklist.weights",
    _C + "calls": _C + "diagnosis.calls",
    _C + "devices": _C + "diagnosis.devices",
    _C + "divergence": _C + "diagnosis.divergence",
    _C + "fallback": _C + "diagnosis.fallback",
    _C + "sources": _C + "diagnosis.sources",
    _C + "modules": _C + "dumps.modules",
    _C + "optimizer": _C + "dumps.optimizer",
    _C + "records": _C + "dumps.reader",
    _C + "tensors": _C + "dumps.tensors",
    _C + "judge": _C + "judging.judge",
    _C + "metrics": _C + "judging.metrics",
    _C + "overflow": _C + "judging.overflow",
    _C + "own": _C + "judging.self_check",
    _C + "stat_relations": _C + "judging.stat_relations",
    _C + "trend_result": _C + "trend.outcome",
    _C + "thresholds": "pytest_msprobe.thresholds",
    _D + "values": _D + "entries",
    _D + "self_check": _D + "online_self_check",
    _D + "overflow": _D + "overflow_filter",
    _D + "records": _D + "step_records",
    _D + "precision": _D + "switches",
    _D + "trend": _D + "trend_recorder",
    _F + "checklist": _F + "checklistfile",
    _F + "precision": _F + "numerics",
    _F + "optimizer": _F + "optimizerfile",
    "pytest_msprobe.pytest.session": "pytest_msprobe.pytest.session_hooks",
    "pytest_msprobe.replay.values": "pytest_msprobe.replay.arguments",
    "pytest_msprobe.report.own": "pytest_msprobe.report.own_error_table",
    "pytest_msprobe.run.settings": "pytest_msprobe.settings",
}


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is now {new}; import it from there", DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new one: the same object, under both names in sys.modules."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        _deprecated(spec.name, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        return None  # it ran under its new name


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        new = MODULES.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Let the old module paths import (once per process, whoever asks)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.append(_Finder())


def names_from(module: str, homes: Sequence[str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for ``module``: a name it no longer holds is looked up in ``homes``,
    in order, and handed on with a DeprecationWarning naming its home."""

    def __getattr__(name: str) -> Any:
        if not name.startswith("_"):
            for home in homes:
                found = importlib.import_module(home)
                if name in vars(found):
                    _deprecated(f"{module}.{name}", f"{home}.{name}")
                    return vars(found)[name]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
