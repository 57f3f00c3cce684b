"""The direction of imports between the project's packages (design.md, "Layout of the
repository"), checked from the source text.

Every `import` and `from ... import` of every file is read with `ast.walk`, so imports inside
functions, classes and `if TYPE_CHECKING:` count as much as top-level ones, and relative
imports are resolved from the file's own package. `importlib.import_module("x")` and
`__import__("x")` with a literal name count too. Third-party modules are ignored.

Two checks:
- an import from package A of a module of package B where B is not in ALLOWED[A] runs back up;
- a cycle between files: the graph has an edge from a file to each project file it loads
  (`import a.b` loads a/b.py or a/b/__init__.py; `from a.b import c` loads a/b/c.py when it
  exists, else a/b.py or a/b/__init__.py); every strongly connected component of more than one
  file is one cycle. Parent packages are not edges (an `__init__` re-exporting its submodules
  would otherwise be a cycle with each of them).

The shared tool (../shared/tools/layering.py) is not used: a clean clone does not have it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

PACKAGES = ("instruction_set", "cost_models", "planner", "runtime", "profiling", "hetsynth")
ALLOWED: dict[str, frozenset[str]] = {
    "instruction_set": frozenset(),
    "cost_models": frozenset({"instruction_set"}),
    "planner": frozenset({"instruction_set", "cost_models"}),
    "runtime": frozenset({"instruction_set"}),
    "profiling": frozenset({"instruction_set", "cost_models", "planner", "runtime"}),
    "hetsynth": frozenset(PACKAGES) - {"hetsynth"},
}
RULE = ("instruction_set <- cost_models <- planner; instruction_set <- runtime; profiling above "
        "planner and runtime; hetsynth on top (design.md, 'Layout of the repository')")


@dataclass(frozen=True)
class ImportSite:
    path: Path  # relative to the root
    line: int
    module: str  # absolute dotted name of what is imported
    names: tuple[str, ...] = ()  # `from module import names`


def _package_of(path: Path) -> list[str]:
    parts = list(path.with_suffix("").parts)
    return parts[:-1]  # the package a module (or __init__) lives in


def _literal_import(node: ast.Call) -> str | None:
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
        value = node.args[0].value
        return value if isinstance(value, str) else None
    return None


def import_sites(root: Path, path: Path) -> list[ImportSite]:
    """Every import in the file `root / path`, wherever it is written."""
    tree = ast.parse((root / path).read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [ImportSite(path, node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package_of(path)[: len(_package_of(path)) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            out.append(ImportSite(path, node.lineno, base, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Call) and (name := _literal_import(node)):
            out.append(ImportSite(path, node.lineno, name))
    return [ImportSite(s.path, s.line, folder_module(s.module), s.names) for s in out
            if folder_module(s.module).split(".")[0] in PACKAGES]


def folder_module(module: str) -> str:
    """The module's name by folder: installed, the folders below hetsynth/'s siblings are
    `hetsynth.planner`, `hetsynth.runtime` ... (pyproject's package-dir); `hetsynth.planner.x`
    is the file planner/x.py."""
    parts = module.split(".")
    if parts[0] == "hetsynth" and len(parts) > 1 and parts[1] in PACKAGES[:-1]:
        return ".".join(parts[1:])
    return module


def project_files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for pkg in PACKAGES if (root / pkg).is_dir()
                  for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def upward_imports(root: Path) -> list[str]:
    """One message per import that runs against the direction: file, line, rule."""
    out = []
    for path in project_files(root):
        mine = path.parts[0]
        for s in import_sites(root, path):
            target = s.module.split(".")[0]
            if target != mine and target not in ALLOWED[mine]:
                allowed = ", ".join(sorted(ALLOWED[mine])) or "nothing of the project"
                out.append(f"{path}:{s.line}: {mine} imports {s.module}; {mine} may import only "
                           f"{allowed} (rule: {RULE})")
    return out


def _module_file(root: Path, module: str) -> Path | None:
    base = Path(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if (root / p).is_file():
            return p
    return None


def _loaded(root: Path, site: ImportSite) -> list[Path]:
    """The project files an import loads (no parent packages)."""
    targets = [_module_file(root, f"{site.module}.{n}") for n in site.names]
    direct = [t for t in targets if t is not None]
    if len(direct) < len(site.names) or not site.names:
        direct.append(_module_file(root, site.module))
    return [t for t in direct if t is not None]


def import_graph(root: Path) -> nx.DiGraph:
    """Files and the files they load, each edge with the line of its first import."""
    g = nx.DiGraph()
    for path in project_files(root):
        for site in import_sites(root, path):
            for target in _loaded(root, site):
                if target != path and not g.has_edge(path, target):
                    g.add_edge(path, target, line=site.line)
    return g


def import_cycles(root: Path) -> list[str]:
    """One message per cycle of files: each file with the line of its import of the next."""
    g, out = import_graph(root), []
    for component in nx.strongly_connected_components(g):
        if len(component) > 1:
            cycle = nx.find_cycle(g.subgraph(component))
            steps = [f"{a}:{g.edges[a, b]['line']}" for a, b in cycle]
            out.append("cycle: " + " -> ".join(steps + [str(cycle[0][0])]))
    return sorted(out)
