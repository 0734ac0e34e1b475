"""DESIGN.md's layers, checked: an import only ever points down (read from each module's source, imports
inside functions included), and importing the contract, the engine or the trainer's package loads no more
than its layer allows (in a fresh interpreter)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = {"rollout.params", "rollout.schema", "rollout.config", "rollout.checks"}  # checks: the structs' field checks
CLIENT_SIDE = {"rollout.stream", "rollout.weight_sync", "rollout.local_ray", "rollout.service_lost"}
PROJECT = ("rollout", "workers", "trainer_client")


def module_name(path: Path) -> str:
    """The dotted name a project file is imported as."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether `name` is one of the project's modules or packages (not a name defined in one)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported(path: Path) -> set[str]:
    """Every module `path` imports (`from m import x` counts m, and m.x where x is a module), relative imports
    resolved."""
    package = module_name(path).split(".")[:None if path.name == "__init__.py" else -1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *filter(None, [node.module])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if is_module(f"{base}.{alias.name}"))
    return names


def allowed(importer: str, name: str) -> bool:
    """Whether DESIGN.md's table lets module `importer` import module `name` (`rollout` alone is the package's
    lazy `__init__`, which loads nothing above the contract)."""
    top = name.split(".")[0]
    contract = name in CONTRACT or name == "rollout"
    if importer in CONTRACT:
        return contract or top not in {*PROJECT, "torch", "ray", "transformers"}
    if top not in {*PROJECT, "ray"}:
        return True
    if importer.startswith("workers.engine"):
        return name.startswith("workers.engine") or contract
    if importer.startswith("workers"):
        return top == "workers" or top == "ray" or contract
    if importer.startswith("rollout"):
        return top != "trainer_client"
    return top in {"trainer_client", "ray"} or contract or name in CLIENT_SIDE


def test_every_import_points_down():
    wrong = [f"{module_name(path)} imports {name}"
             for package in PROJECT for path in sorted((ROOT / package).rglob("*.py"))
             for name in sorted(imported(path)) if not allowed(module_name(path), name)]
    assert wrong == []


@pytest.mark.parametrize(("module", "absent"), [
    ("rollout.params", ["ray", "torch", "workers"]),
    ("rollout.schema", ["ray", "torch", "workers"]),
    ("rollout.config", ["ray", "torch", "workers"]),
    ("workers.engine", ["ray"]),
    ("workers.engine.engine", ["ray"]),
    ("trainer_client", ["workers.engine.engine", "workers.actor", "workers.loop", "transformers"]),
])
def test_importing_a_layer_loads_nothing_above_it(module, absent):
    code = f"import sys, {module}; print(sorted(m for m in {absent!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
