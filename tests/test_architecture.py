"""The architecture, read off the imports: which part of the repository may import which.

Every module under slimformer/, bench/, tools/ and examples/ is parsed (not imported) and
its module-level imports are checked: those run when the module is imported, so they
make the layering and any import cycle. An import inside a function runs when the
function is called; it is lazy and allowed (the memory CLI's import of ``patch``, a
benchmark's import of transformers). Imports of other projects are not checked.
"""

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("slimformer", "bench", "tools", "examples")
FIRST_PARTY = (*FOLDERS, "tests")
RUNS = ROOT / "bench" / "results"  # what runs wrote (a GPU run's scripts, kept as they ran), not code


@dataclass(frozen=True)
class Rule:
    """What the modules named by ``modules`` (each, and every module under it) may import of
    this repository: only what ``only`` names, or nothing that ``never`` names."""

    modules: str
    reason: str
    only: tuple[str, ...] = ()
    never: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()  # modules under ``modules`` the rule does not bind


# The layers, bottom up. A name stands for that module and every module under it.
RULES = (
    Rule("slimformer.kernels", only=("slimformer.kernels",),
         reason="kernels are functions on tensors; nothing in them knows a layer, a model or a policy"),
    Rule("slimformer.layers", only=("slimformer.kernels", "slimformer.layers", "slimformer._version"),
         reason="layers are torch modules over the kernels; they know no model family and no conversion"),
    Rule("slimformer.integrations", never=("slimformer.patch",),
         reason="a model family tells patch what to swap; the generic machinery in patch calls it, never the reverse"),
    Rule("slimformer.memory", exempt=("slimformer.memory.cli",),
         never=("slimformer.patch", "slimformer.quantize", "slimformer.recompute", "slimformer.integrations",
                "slimformer.transformers_quantizer", "slimformer.unpad", "slimformer.masked_lm"),
         reason="measuring memory does not depend on converting models; only the CLI builds patched ones"),
    Rule("slimformer", never=("bench", "tools", "tests", "examples"),
         reason="the library installs alone: the wheel holds slimformer/ and nothing else"),
    Rule("tools", never=("bench",),
         reason="the compile toolchain stands alone; bench/ holds the benchmarks a user runs"),
)  # fmt: skip


@dataclass(frozen=True)
class Import:
    """One module-level import of a first-party module: who imports what, and where."""

    importer: str
    imported: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.importer} (line {self.line}): {self.text}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_paths() -> dict[str, Path]:
    return {
        _module_name(path): path
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "__pycache__" not in path.parts and not path.is_relative_to(RUNS)
    }


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _module_level(tree: ast.Module):
    """The import statements that run when the module is imported: all but those inside a
    function (or lambda), however deep in ``if`` / ``try`` / ``with`` / class bodies."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]) -> list[str]:
    """The modules an import statement loads: ``from a import b`` loads ``a.b`` where that is
    a module, else ``a`` (whose ``b`` it reads)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importer's package, ``level - 1`` packages up
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def _imports() -> list[Import]:
    paths = _module_paths()
    found = []
    for importer, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _module_level(tree):
            text = ast.unparse(node)
            for imported in dict.fromkeys(_targets(node, importer, path.name == "__init__.py", set(paths))):
                if _under(imported, FIRST_PARTY):
                    found.append(Import(importer, imported, node.lineno, text))
    return sorted(found, key=lambda i: (i.importer, i.line))


IMPORTS = _imports()
MODULES = _module_paths()


def _breaks(rule: Rule, imp: Import) -> bool:
    if not _under(imp.importer, (rule.modules,)) or _under(imp.importer, rule.exempt):
        return False
    if rule.only and not _under(imp.imported, rule.only):
        return True
    return _under(imp.imported, rule.never)


@pytest.mark.parametrize("rule", RULES, ids=[rule.modules for rule in RULES])
def test_layering(rule):
    assert any(_under(module, (rule.modules,)) for module in MODULES), f"no module is {rule.modules} or under it"
    broken = [str(imp) for imp in IMPORTS if _breaks(rule, imp)]
    allowed = f"may import only {', '.join(rule.only)}" if rule.only else f"may not import {', '.join(rule.never)}"
    assert not broken, f"{rule.modules} {allowed} ({rule.reason}):\n  " + "\n  ".join(broken)


def _cycles(edges: dict[str, list[Import]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or a module importing
    itself (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted({imp.imported for imp in edges[root]})))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted({imp.imported for imp in edges.get(successor, [])}))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
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
                    if len(component) > 1 or any(imp.imported == node for imp in edges.get(node, [])):
                        components.append(sorted(component))
    return components


def test_no_import_cycles():
    edges = {module: [] for module in MODULES}
    for imp in IMPORTS:
        if imp.imported in MODULES:
            edges[imp.importer].append(imp)
    cycles = _cycles(edges)
    described = [
        "\n  ".join(
            ["cycle among " + ", ".join(cycle)]
            + [str(imp) for module in cycle for imp in edges[module] if imp.imported in cycle]
        )
        for cycle in cycles
    ]
    assert not cycles, "module-level imports that form a cycle:\n" + "\n".join(described)
