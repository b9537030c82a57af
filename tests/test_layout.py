"""The package's layout, read from its source with `ast` (nothing of gspo is imported): the arrows point one way.

The import graph and the circle finder are benchmarks/house.py's (`python benchmarks/house.py` prints the
circles too): every `import` counts, those inside functions as well (they run when the function does), relative
ones resolved. Left out here: imports under `if TYPE_CHECKING:` (annotations only, never run), and the package
`__init__` Python runs before a module of that package (else every module would import its package's face).
"""

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gspo"


def _load_house():
    spec = importlib.util.spec_from_file_location("house", ROOT / "benchmarks" / "house.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


house = _load_house()


class _DropTypeChecking(ast.NodeTransformer):
    """Drops the body of every `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`), keeping its `else:`."""

    def visit_If(self, node: ast.If):
        self.generic_visit(node)
        if ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            return node.orelse or None
        return node


def _trees() -> dict[str, tuple[ast.AST, bool]]:
    """module name -> (its syntax tree without TYPE_CHECKING imports, whether it is a package's __init__)."""
    return {name: (_DropTypeChecking().visit(ast.parse(path.read_text())), path.name == "__init__.py")
            for name, path in house.modules(PACKAGE).items()}


TREES = _trees()
GRAPH = {name: house.imported(tree, name, is_package, set(TREES)) for name, (tree, is_package) in TREES.items()}


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _reach(name: str) -> set[str]:
    """The gspo modules `name` imports, directly or through others."""
    seen, todo = set(), list(GRAPH[name])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(GRAPH.get(module, ()))
    return seen - {name}


def _self_contained(name: str) -> bool:
    """True if `name` imports nothing of gspo outside its own package (gspo.<package>), directly or not."""
    own = ".".join(name.split(".")[:2])  # gspo.tasks for gspo.tasks.arithmetic; gspo.given for gspo.given
    return all(_inside(m, own) for m in _reach(name))


def _from_module(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The module a `from ... import` in module `name` imports from, a relative one resolved."""
    if not node.level:
        return node.module
    anchor = (name if is_package else name.rpartition(".")[0]).split(".")
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def _written_imports(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    """Every module `name` names in an import statement (standard library and third-party too)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.add(_from_module(node, name, is_package))
    return out


def test_no_import_circle_anywhere():
    """(a) No two modules of gspo import each other, directly or through others (function-level imports too)."""
    assert house.circles(GRAPH) == []


def test_the_math_imports_nothing_of_gspo():
    """(b) gspo/algo/ is pure: it imports nothing of gspo outside itself."""
    bad = {m: sorted(t for t in GRAPH[m] if not _inside(t, "gspo.algo"))
           for m in GRAPH if _inside(m, "gspo.algo")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_the_config_is_a_leaf():
    """(c) gspo/config/ (and gspo.aliases, which it reads other names through) imports only itself, gspo.aliases,
    the math (gspo.algo) and modules that import nothing of gspo outside their own package, directly or through
    others (a registry such as gspo.rollout.registry, the sandbox, the built-in tasks): so any module may import
    the config, and the config's checks never run the code they check."""
    def allowed(target: str) -> bool:
        return any(_inside(target, p) for p in ("gspo.config", "gspo.aliases", "gspo.algo")) or \
            _self_contained(target)

    config = [m for m in GRAPH if _inside(m, "gspo.config")] + ["gspo.aliases"]
    bad = {m: sorted(t for t in GRAPH[m] if not allowed(t)) for m in config}
    assert {m: t for m, t in bad.items() if t} == {}


def test_the_front_ends_are_imported_by_no_one_and_the_face_by_nothing():
    """(d) Nothing outside gspo/apps/ imports gspo.apps: the front-ends use the trainer, never the reverse (the
    package face gspo/__init__.py and gspo/__main__.py, `python -m gspo`, are front-end entries themselves).
    Nothing imports the face `gspo` itself (`import gspo`, or `from gspo import X` where X is not a module)."""
    entries = ("gspo", "gspo.__main__")
    into_apps = {m: sorted(t for t in GRAPH[m] if _inside(t, "gspo.apps"))
                 for m in GRAPH if not _inside(m, "gspo.apps") and m not in entries}
    assert {m: t for m, t in into_apps.items() if t} == {}
    face = {}
    for name, (tree, is_package) in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(alias.name == "gspo" for alias in node.names):
                face.setdefault(name, []).append(f"line {node.lineno}: import gspo")
            elif isinstance(node, ast.ImportFrom) and _from_module(node, name, is_package) == "gspo":
                names = [a.name for a in node.names if f"gspo.{a.name}" not in TREES]
                if names:
                    face.setdefault(name, []).append(f"line {node.lineno}: from gspo import {', '.join(names)}")
    assert face == {}


def test_the_sandbox_imports_the_standard_library_and_itself_only():
    """(e) gspo/sandbox/ could ship alone: it imports the standard library and gspo.sandbox, nothing else."""
    def allowed(module: str) -> bool:
        return module.split(".")[0] in sys.stdlib_module_names or _inside(module, "gspo.sandbox")

    bad = {name: sorted(m for m in _written_imports(tree, name, is_package) if not allowed(m))
           for name, (tree, is_package) in TREES.items() if _inside(name, "gspo.sandbox")}
    assert {m: t for m, t in bad.items() if t} == {}
    assert len(bad) >= 5  # the sandbox's modules were found (runner, launch, kernel, execute, child, ...)


def test_the_graph_sees_imports_inside_functions_and_leaves_type_checking_out():
    """The reading the rules rest on: a function's import is an edge, an `if TYPE_CHECKING:` one is not."""
    tree = _DropTypeChecking().visit(ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gspo.trainer import train\nelse:\n    import gspo.rng\n"
        "def f():\n    from gspo.config import TrainConfig\n"))
    known = {"gspo", "gspo.trainer", "gspo.rng", "gspo.config", "gspo.x"}
    assert house.imported(tree, "gspo.x", False, known) == {"gspo.rng", "gspo.config"}
    assert house.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
