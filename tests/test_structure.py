"""The package's walls: which layer may import what, and where each option is spelled."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pytest_msprobe"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _is_module(name: str) -> bool:
    """Whether a dotted name is one of the package's modules or packages."""
    if not name.startswith("pytest_msprobe."):
        return False
    path = PACKAGE.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, at module level?) for every import statement of a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    top = {id(node) for node in tree.body}
    typing_only = {  # imports under `if TYPE_CHECKING:` are for the type checker only
        id(child)
        for node in tree.body
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pytest_msprobe.compare import judging` imports the module pytest_msprobe.compare.judging
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub if _is_module(sub) else node.module, id(node) in top))
    return found


def _roots(path: Path, module_level_only: bool = False) -> set[str]:
    return {
        name if name.startswith("pytest_msprobe") else name.split(".")[0]
        for name, top in _imports(path)
        if top or not module_level_only
    }


def test_pytest_is_imported_only_by_the_pytest_layer() -> None:
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in MODULES
        if _layer(p) != "pytest" and ("pytest" in _roots(p) or "_pytest" in _roots(p))
    ]
    assert offenders == []


@pytest.mark.parametrize("layer", ["compare", "format"])
def test_compare_and_format_need_neither_torch_nor_pytest(layer: str) -> None:
    for path in (PACKAGE / layer).rglob("*.py"):
        module_level = _roots(path, module_level_only=True)
        assert "torch" not in module_level, path
        assert not {"pytest", "_pytest"} & _roots(path), path
        if layer == "format":  # the format is the bottom layer: it needs nothing of the package but errors
            assert not any(
                name.startswith("pytest_msprobe.")
                and not name.startswith(("pytest_msprobe.format", "pytest_msprobe.errors"))
                for name in _roots(path)
            ), path


def test_dump_and_compare_do_not_import_each_other() -> None:
    for a, b in (("dump", "compare"), ("compare", "dump"), ("dump", "report"), ("compare", "report")):
        for path in (PACKAGE / a).rglob("*.py"):
            assert not any(name.startswith(f"pytest_msprobe.{b}") for name in _roots(path)), (path, b)


def test_the_options_stand_on_the_settings_and_the_thresholds_only() -> None:
    """The option table, the settings and the threshold tables are read by every layer and read none of them:
    only each other, the errors and the format's file helpers."""
    ground = {
        "pytest_msprobe.options",
        "pytest_msprobe.settings",
        "pytest_msprobe.thresholds",
        "pytest_msprobe.errors",
    }
    for name in ("options", "settings", "thresholds"):
        used = {n for n in _roots(PACKAGE / f"{name}.py") if n.startswith("pytest_msprobe.")}
        assert used <= ground | {"pytest_msprobe.format.files"}, (name, used - ground)


def test_report_reads_the_compare_through_its_public_faces() -> None:
    """The reports read the result and the compare's packages by their ``__init__`` only, never a module inside
    one (that is each package's own business)."""
    faces = {"pytest_msprobe.compare.result"} | {
        f"pytest_msprobe.compare.{p.name}"
        for p in (PACKAGE / "compare").iterdir()
        if (p / "__init__.py").exists()
    }
    for path in (PACKAGE / "report").rglob("*.py"):
        used = {name for name in _roots(path) if name.startswith("pytest_msprobe.compare")}
        assert used <= faces, (path, used - faces)


def test_no_module_swaps_its_class() -> None:
    for path in MODULES:
        assert not re.search(r"\.__class__\s*=", path.read_text(encoding="utf-8")), path


def test_each_option_is_spelled_in_the_option_table_only() -> None:
    from pytest_msprobe.options import OPTIONS

    table = PACKAGE / "options.py"
    names = {o.flag for o in OPTIONS if o.flag} | {o.ini for o in OPTIONS if o.ini}
    for path in MODULES:
        if path == table:
            continue
        # a junitxml property may share an ini key's word (msprobe_baseline): it is defined once, as a PROPERTY
        text = "\n".join(
            line for line in path.read_text(encoding="utf-8").splitlines() if "_PROPERTY =" not in line
        )
        for name in names:
            assert not re.search(rf"[\"']{re.escape(name)}[\"'=]", text), (path.relative_to(PACKAGE), name)


def test_the_public_names() -> None:
    import pytest_msprobe
    import pytest_msprobe.compare.result  # importing the package's modules keeps the function's name

    assert callable(pytest_msprobe.compare)
    from pytest_msprobe import compare
    from pytest_msprobe.compare import compare as compare_function

    assert compare is compare_function


def test_test_modules_have_basenames_of_their_own() -> None:
    """pytest imports test modules by basename (the test folders are no packages): two test files of one name
    in two folders make the second an import error at collection."""
    tests = Path(__file__).resolve().parent
    names: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        if "data" not in path.relative_to(tests).parts:
            names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert not {name: where for name, where in names.items() if len(where) > 1}


def test_no_test_module_shares_its_name_with_a_module_a_pytester_run_writes() -> None:
    """pytest imports test modules by basename: a worker that imported tests/x/test_a.py refuses a pytester
    run's own test_a.py (and the other way round)."""
    tests = Path(__file__).resolve().parent
    ours = {path.stem for path in tests.rglob("test_*.py")}
    written = {
        name
        for path in tests.rglob("*.py")
        for name in re.findall(r"makepyfile\(\s*(test_\w+)\s*=", path.read_text(encoding="utf-8"))
    }
    assert not ours & written, sorted(ours & written)
