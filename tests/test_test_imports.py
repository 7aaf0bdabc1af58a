"""Tests share code only through :mod:`diffdraft_testing`, a name no installed package takes.

A folder of tests is no package, so an import of anything tests/ itself holds by a name of its own (a
test folder, a test module, conftest) resolves wherever ``sys.path`` and the installed packages say:
``from kernels.test_lean_forward import ...`` found Hugging Face's ``kernels`` package first once
transformers 5.25 began to pull it in, and no test was collected. The imports are read with
:mod:`ast`, wherever they stand (inside a function too).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SUPPORT = "diffdraft_testing"


def local_names(root: Path) -> set[str]:
    """The top-level names under which a file in ``root`` could import something of ``root`` itself,
    other than :data:`SUPPORT`: the name of every folder and module in it."""
    paths = [path for path in root.rglob("*") if "__pycache__" not in path.parts]
    names = {path.name for path in paths if path.is_dir()} | {
        path.stem for path in paths if path.suffix == ".py"
    }
    return names - {SUPPORT, "__init__"}


def local_imports(path: Path, names: set[str]) -> list[str]:
    """``line: module`` for every import in the file at ``path`` of a module whose top-level name is
    one of ``names``, and for every relative import."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = ["." * node.level + (node.module or "")]
        else:
            continue
        found += [f"{node.lineno}: {m}" for m in modules if m.startswith(".") or m.split(".")[0] in names]
    return found


def test_no_file_under_tests_imports_a_test_module_conftest_or_a_test_folder():
    names = local_names(TESTS)
    offending = {
        str(path.relative_to(TESTS)): imports
        for path in sorted(TESTS.rglob("*.py"))
        if (imports := local_imports(path, names))
    }
    assert offending == {}, f"import these from {SUPPORT} instead"


def test_the_check_catches_what_collection_tripped_on(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "test_lean_forward.py").write_text("")
    (tmp_path / "conftest.py").write_text("")
    test = tmp_path / "test_x.py"
    test.write_text(
        "from kernels.test_lean_forward import check\n"
        "from diffdraft_testing.engine import run_engine\n"
        "import torch\n"
        "def f():\n"
        "    from conftest import tiny_target\n"
        "    from .test_y import z\n"
    )
    assert local_imports(test, local_names(tmp_path)) == [
        "1: kernels.test_lean_forward",
        "5: conftest",
        "6: .test_y",
    ]


def test_the_shared_code_is_this_folder_s():
    spec = importlib.util.find_spec(SUPPORT)
    assert spec is not None and spec.origin == str(TESTS / SUPPORT / "__init__.py")
