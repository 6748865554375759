"""Rules the package's source keeps, read from the files themselves (ast, nothing imported):
the layering of docs/architecture.md for `ane_spec/model/`, and no class body that defines one
name twice (the first definition is dead: the second silently replaces it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ane_spec"
# The layers above `model` (architecture.md: model <- shards <- manifests <- runtime <-
# probes/decode <- daemon/bench).
ABOVE_MODEL = ("shards", "manifests", "runtime", "probes", "decode", "daemon", "bench")


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import in the tree, function-level ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "ane_spec":  # from ane_spec import shards
                out += [(node.lineno, f"ane_spec.{alias.name}") for alias in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


def test_the_model_layer_imports_nothing_above_it() -> None:
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
             for path in sorted((PACKAGE / "model").rglob("*.py"))
             for line, module in _imported_modules(ast.parse(path.read_text(encoding="utf-8")))
             if module.split(".")[:1] == ["ane_spec"] and module.count(".")
             and module.split(".")[1] in ABOVE_MODEL]
    assert not found, "\n".join(found)


def _redefined(body: list[ast.stmt]) -> list[tuple[str, int, int]]:
    """(name, first line, second line) for each def in `body` defined again later in it. A
    property's `@x.setter`/`@x.deleter` and `typing.overload` stubs are meant to repeat."""
    seen: dict[str, int] = {}
    out = []
    for node in body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if any(d.endswith((".setter", ".deleter")) or d in ("overload", "typing.overload")
               for d in decorators):
            continue
        if node.name in seen:
            out.append((node.name, seen[node.name], node.lineno))
        seen[node.name] = node.lineno
    return out


def test_no_name_is_defined_twice_in_one_scope() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for scope in scopes:
            for name, first, second in _redefined(scope.body):
                found.append(f"{path.relative_to(PACKAGE.parent)}: {name} at line {first} is "
                             f"replaced by the one at line {second}")
    assert not found, "\n".join(found)
