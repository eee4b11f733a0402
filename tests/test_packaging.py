"""The three import packages come from this repository (PyPI has unrelated old projects named
schemas, publisher and consumers), their dependencies run one way, and each package's public
surface is explicit."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGES = ("schemas", "publisher", "consumers")


@pytest.mark.parametrize("name", PACKAGES)
def test_each_package_imports_from_this_repository(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__file__ is not None
    assert Path(module.__file__).resolve().parent == (ROOT / name).resolve()


def _imports(package: str) -> dict[str, set[str]]:
    """Top-level packages imported by each module of ``package``."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_dependencies_run_one_way_publisher_to_schemas_from_consumers() -> None:
    crossing = []
    for module, names in _imports("schemas").items():
        crossing += [f"{module} imports {n}" for n in names & {"publisher", "consumers"}]
    for module, names in _imports("publisher").items():
        crossing += [f"{module} imports consumers" for n in names if n == "consumers"]
    for module, names in _imports("consumers").items():
        # The demo runs the whole system in one process: the one place allowed to start agents.
        if module != "consumers/_demo.py" and "publisher" in names:
            crossing.append(f"{module} imports publisher")
    assert crossing == []


def test_importing_the_contract_loads_no_broker_library() -> None:
    code = (
        "import sys, schemas, schemas.transport, schemas.messages;"
        "loaded = {'aio_pika', 'azure', 'proton', 'starlette', 'uvicorn'} & set(sys.modules);"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("name", PACKAGES)
def test_the_public_surface_is_explicit_and_complete(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert sorted(exported) == sorted(set(exported)), "duplicates in __all__"
    missing = [n for n in exported if not hasattr(module, n)]
    assert missing == []
    public = {
        n
        for n, value in vars(module).items()
        if not n.startswith("_") and getattr(value, "__module__", "").startswith(f"{name}.")
    }
    assert public <= set(exported), (
        f"public names missing from {name}.__all__: {public - set(exported)}"
    )
