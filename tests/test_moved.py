"""Old import paths: code written against the package's earlier layout still imports, gets the same objects,
and is told where they are now."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from pathlib import Path

import pytest

from pytest_msprobe.moved import MODULES


@pytest.mark.parametrize("old", sorted(MODULES))
def test_an_old_module_path_imports_the_module_at_its_new_home(old: str) -> None:
    new = MODULES[old]
    assert importlib.util.find_spec(new) is not None, f"{new} does not exist"
    assert not (sys.modules.get(old) is None and _is_a_file(old)), (
        f"{old} is a module again: drop it from MODULES"
    )
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"^{old} is now {new}; import it from there$"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert sys.modules[old] is module


def _is_a_file(old: str) -> bool:
    parent, _, name = old.rpartition(".")
    package = importlib.import_module(parent)
    return any((Path(p) / f"{name}.py").exists() for p in package.__path__)


def test_the_old_validate_path_gives_the_module_and_leaves_the_function_in_place() -> None:
    from pytest_msprobe.compare.validate import DumpCheck, validate

    from pytest_msprobe.compare import dumps

    assert validate is dumps.validate and DumpCheck is dumps.DumpCheck
    from pytest_msprobe.compare import validate as again

    assert again is dumps.validate and callable(again)


def test_names_the_result_module_handed_on_are_read_from_their_packages() -> None:
    from pytest_msprobe.compare import diagnosis, dumps, judging

    with pytest.warns(
        DeprecationWarning, match="compare.result.PASS is now pytest_msprobe.compare.judging.PASS"
    ):
        from pytest_msprobe.compare.result import PASS
    assert PASS == judging.PASS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from pytest_msprobe.compare.result import ENTERS, OUTSIDE_MODULES
        from pytest_msprobe.compare.trend import compare_trend, spikes

    assert ENTERS == diagnosis.ENTERS and OUTSIDE_MODULES == dumps.modules.OUTSIDE_MODULES
    assert callable(compare_trend) and callable(spikes)
    with pytest.raises(ImportError, match="cannot import name 'NO_SUCH_NAME'"):
        from pytest_msprobe.compare.result import NO_SUCH_NAME  # noqa: F401
    result = importlib.import_module("pytest_msprobe.compare.result")
    with pytest.raises(AttributeError, match="has no attribute '_private'"):
        getattr(result, "_private")  # noqa: B009


def test_a_module_path_never_released_is_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pytest_msprobe.compare.no_such_module")
