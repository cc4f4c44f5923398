"""The checks a reviewer makes of the package's rooms, kept true on every change: no module over
400 lines, no function over 60 lines, no learner class with more than 12 methods, and no two
modules of the same name in different folders (a name says what a file is, once)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "specd"
SOURCES = sorted(ROOT.rglob("*.py"))


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"


def test_no_function_is_over_60_lines():
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({length})")
    assert not long, f"functions over 60 lines: {long}"


def test_no_learner_class_has_more_than_12_methods():
    crowded = []
    for path in sorted((ROOT / "learner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > 12:
                    crowded.append(f"{path.name}:{node.name} ({len(methods)})")
    assert not crowded, f"learner classes with more than 12 methods: {crowded}"


def test_no_two_modules_share_a_name():
    names = Counter(p.name for p in SOURCES if p.name != "__init__.py")
    twins = sorted(name for name, count in names.items() if count > 1)
    assert not twins, f"module names used in more than one folder: {twins}"
