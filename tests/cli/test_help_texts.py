"""The installed package's help texts and error messages point to what a user of the wheel has: docs pages and
``sits-lora`` commands, never the repository's bench scripts or recipe files (the wheel ships neither)."""

from __future__ import annotations

import ast
import os
import re

import sits_lora

PACKAGE_DIR = os.path.dirname(os.path.abspath(sits_lora.__file__))
# a path into the repository outside the package: a bench script, a recipe file or config
OUTSIDE_THE_WHEEL = re.compile(r"\bbench/|\bpython bench\b|\brecipes/")


def _docstrings(tree: ast.AST) -> set:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def outside_references(source: str) -> list:
    """(line, text) of every string in ``source``, docstrings aside, that names a file outside the wheel."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    return [(node.lineno, node.value[:100]) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and OUTSIDE_THE_WHEEL.search(node.value)]


def test_help_texts_and_messages_name_nothing_outside_the_wheel():
    found = []
    for folder, _, names in os.walk(PACKAGE_DIR):
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                found += [f"{os.path.relpath(path, PACKAGE_DIR)}:{line}: {text}"
                          for line, text in outside_references(f.read())]
    assert not found, "strings pointing outside the installed package (name a docs page or a sits-lora command):\n" \
        + "\n".join(found)


def test_the_check_catches_a_message_and_spares_a_docstring():
    source = '"""module (bench/regress.py measures it)"""\n' \
             'def f():\n    """see recipes/train.py"""\n    raise ValueError(f"run python bench/tune_kernels.py {1}")\n' \
             'HELP = "a recipe YAML such as recipes/configs/default.yaml"\n'
    assert sorted(line for line, _ in outside_references(source)) == [4, 5]
