"""The package's modules import each other without cycles, imports inside functions and type-only ones included: each
module sits above what it imports, so a newcomer can read the package bottom up and a change low down cannot loop back.
An import inside a function is the exception, and says why.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "quasar_deploy"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere in it (a ``from package import name`` counts the submodule
    ``name`` where there is one, else the package)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            target = next(edges, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
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
                    found.append(sorted(component))
    return found


def package_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imported_modules(f, modules) for f in files}


def test_the_package_has_no_import_cycles():
    assert cycles(package_graph()) == []


def test_the_check_finds_a_cycle_and_reads_relative_imports():
    """The check itself: a loop two modules long is found, and relative imports resolve to the modules they name."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    graph = package_graph()
    assert "quasar_deploy.cpu.native" in graph["quasar_deploy.cpu.int8_linear"]  # `from . import native`
    assert "quasar_deploy.engine" in graph["quasar_deploy.api"]  # `from .engine import ...`


def unexplained_imports(source: str) -> list[int]:
    """The lines of imports inside functions with no reason beside them: a comment on the import's first line or alone on
    the line above (a bare ``# noqa`` is no reason)."""
    comments: dict[int, str] = {}
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = re.sub(r"#\s*noqa(:\s*\w+(,\s*\w+)*)?", "", token.string).strip(" #()")
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code.add(token.start[0])

    def says_why(line: int) -> bool:
        return bool(comments.get(line) or (line - 1 not in code and comments.get(line - 1)))

    functions = [f for f in ast.walk(ast.parse(source)) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    imports = {node.lineno for f in functions for node in ast.walk(f) if isinstance(node, (ast.Import, ast.ImportFrom))}
    return sorted(line for line in imports if not says_why(line))


def test_every_import_inside_a_function_says_why():
    """Imports belong at the top; one inside a function keeps ``--help`` light, needs an optional dependency, or spares
    the paths that do not use it a cost, and its comment says which."""
    unexplained = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in unexplained_imports(path.read_text())
    ]
    assert unexplained == []


def test_the_check_reads_reasons_from_comments():
    assert unexplained_imports("import os\ndef f():\n    import json\n    import re  # noqa: F401\n") == [3, 4]
    assert unexplained_imports("def f():\n    import json  # optional: json\n    # heavy: re\n    import re\n") == []
