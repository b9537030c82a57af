"""The house in numbers: how gspo's package is laid out, read from its source (nothing is imported or run).

    python benchmarks/house.py [--root gspo] [--json]

Prints: modules at the package root, the largest module and function, functions over 60 and over 80
lines, modules outside gspo/config with a function that takes the whole run config (a parameter named
`cfg` or annotated TrainConfig), and the import circles (every `import`, also those inside functions,
relative ones resolved). tests/test_layout.py holds the rules these numbers are checked against.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports anywhere in its body (functions too)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            named = [f"{base}.{alias.name}" for alias in node.names]
            # `from a.b import c`: the module a.b.c where c is one, else a name of a.b
            targets = [t for t in named if t in known] + ([base] if any(t not in known for t in named) else [])
        else:
            continue
        for target in targets:
            while target and target not in known:  # `from a.b import c`: c may be a name, not a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    found = modules(root)
    known = set(found)
    return {name: imported(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
            for name, path in found.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def functions(root: Path) -> list[tuple[int, str]]:
    """(lines, 'module:qualified.name') of every function and method, decorators included."""
    out = []

    def visit(node, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                out.append((child.end_lineno - start + 1, f"{module}:{prefix}{child.name}"))
                visit(child, module, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, module, f"{prefix}{child.name}.")

    for name, path in modules(root).items():
        visit(ast.parse(path.read_text()), name, "")
    return sorted(out, reverse=True)


def whole_config_readers(root: Path) -> list[str]:
    """Modules outside the config package with a function taking the whole run config."""
    out = []
    for name, path in modules(root).items():
        if name.startswith(f"{root.name}.config"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            if any(a.arg == "cfg" or (a.annotation is not None and "TrainConfig" in ast.unparse(a.annotation))
                   for a in arguments):
                out.append(name)
                break
    return out


def measure(root: Path) -> dict:
    found = modules(root)
    sizes = sorted(((len(p.read_text().splitlines()), n) for n, p in found.items()), reverse=True)
    funcs = functions(root)
    return {
        "modules": len(found),
        "modules_at_root": sum(1 for p in found.values() if p.parent == root and p.name != "__init__.py"),
        "largest_module": sizes[0],
        "modules_over_500": [f"{n} {s}" for s, n in sizes if s > 500],
        "largest_function": funcs[0],
        "functions_over_60": len([f for f in funcs if f[0] > 60]),
        "functions_over_80": [f"{n} {s}" for s, n in funcs if s > 80],
        "whole_config_readers": whole_config_readers(root),
        "import_circles": circles(import_graph(root)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "gspo"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    numbers = measure(Path(args.root).resolve())
    if args.json:
        print(json.dumps(numbers, indent=1))
        return
    for key, value in numbers.items():
        if isinstance(value, list) and value and key != "largest_module":
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"  {item}")
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
