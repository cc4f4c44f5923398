"""The import direction: every import inside specd points to its own layer or one below, and the
packages import each other without cycles (the README's layer diagram, checked on every import,
top-level or lazy, by reading the source's syntax tree)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "specd"

# bottom first: a module may import modules of its own layer and of the layers below it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("specd", "specd.core")),
    ("model", ("specd.model", "specd.testing")),
    ("transport", ("specd.transport",)),
    ("drafter", ("specd.drafter",)),
    ("engine", ("specd.engine",)),
    ("hotswap", ("specd.hotswap",)),
    ("control", ("specd.control",)),
    ("learner", ("specd.learner",)),
    ("offline", ("specd.offline",)),
    ("serving", ("specd.serving",)),
    ("entry points", ("specd.cli", "specd.demo")),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    """The layer a module belongs to: the longest matching prefix wins (specd itself is the base)."""
    best, best_length = None, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_length:
                best, best_length = rank, len(prefix)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS (and to docs/architecture.md's diagram)")
    return best


def specd_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of specd in the file, wherever it stands."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            # `from specd.x import y` may name a submodule y: count the deepest one that exists
            found += [(node.lineno, _deepest(target, alias.name)) for alias in node.names]
    return [(line, module) for line, module in found if module == "specd" or module.startswith("specd.")]


def _deepest(package: str, name: str) -> str:
    candidate = f"{package}.{name}"
    relative = Path(*candidate.split("."))
    if (ROOT.parent / relative).with_suffix(".py").is_file() or (ROOT.parent / relative / "__init__.py").is_file():
        return candidate
    return package


SOURCES = sorted(ROOT.rglob("*.py"))


def test_every_module_has_a_layer():
    for path in SOURCES:
        layer_of(module_name(path))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_point_down_only(path):
    here = module_name(path)
    rank = layer_of(here)
    upward = [f"line {line}: {module} ({LAYERS[layer_of(module)][0]})"
              for line, module in specd_imports(path) if layer_of(module) > rank]
    assert not upward, f"{here} ({LAYERS[rank][0]}) imports from higher layers: {upward}"


def package_of(module: str) -> str:
    """specd.drafter.hybrid -> specd.drafter; a top-level module is its own package."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_packages_import_each_other_without_cycles():
    edges: dict[str, set[str]] = {}
    for path in SOURCES:
        source = package_of(module_name(path))
        for _, module in specd_imports(path):
            target = package_of(module)
            if target not in (source, "specd"):
                edges.setdefault(source, set()).add(target)

    def cycle_from(start: str, node: str, trail: list[str]) -> list[str] | None:
        for following in sorted(edges.get(node, ())):
            if following == start:
                return [*trail, following]
            if following not in trail:
                found = cycle_from(start, following, [*trail, following])
                if found:
                    return found
        return None

    for package in sorted(edges):
        cycle = cycle_from(package, package, [package])
        assert cycle is None, f"package import cycle: {' -> '.join(cycle)}"


def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch):
    """A planted lazy import from the model layer up to the server must be reported."""
    fake_root = tmp_path / "specd"
    (fake_root / "model").mkdir(parents=True)
    (fake_root / "serving").mkdir()
    (fake_root / "serving" / "api.py").write_text("")
    planted = fake_root / "model" / "bad.py"
    planted.write_text("def f():\n    from specd.serving import api\n    return api\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake_root)
    assert specd_imports(planted) == [(2, "specd.serving.api")]
    assert layer_of("specd.serving.api") > layer_of(module_name(planted))
