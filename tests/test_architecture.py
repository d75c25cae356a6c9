"""The shape of the house (ARCHITECTURE.md), read from the source's imports with ``ast``:
no import circles between files, and no file imports from a floor above its own.

Every import counts, also one inside a function: a lazy import is still a dependency, and a
circle of lazy imports is still a circle a reader has to hold in their head."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fastzoo"

# Bottom to top. A module may import its own floor and the floors below; a name is placed by its
# longest listed prefix. ``fastzoo`` alone is the package's __init__ (the public facade).
FLOORS = [
    ("fastzoo.errors", "fastzoo.text", "fastzoo.files", "fastzoo.kernel_ranges", "fastzoo.tracing",
     "fastzoo.cpp_build"),
    ("fastzoo.losses", "fastzoo.attention", "fastzoo.layers", "fastzoo.weights"),
    ("fastzoo.data", "fastzoo.tasks"),
    ("fastzoo.models", "fastzoo.registry"),
    ("fastzoo.train", "fastzoo.equivalence", "fastzoo.kernel_report", "fastzoo.machine", "fastzoo.factories",
     "fastzoo"),
    ("fastzoo.bench", "fastzoo.accuracy"),
    ("fastzoo.cli",),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def floor(module: str) -> int:
    best, best_len = None, -1
    for i, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = i, len(name)
    assert best is not None, f"{module} is on no floor: add it to FLOORS and to ARCHITECTURE.md"
    return best


def _resolve(module: str, package: str, node: ast.ImportFrom) -> list[str]:
    """The fastzoo files an import statement reads: ``from fastzoo.x import y`` is the file
    ``fastzoo.x.y`` when that is a module, else ``fastzoo.x``."""
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("fastzoo"):
        return []
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return out


def imports() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                found.update(_resolve(name, package, node))
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("fastzoo"))
        graph[name] = {t for t in found if t in MODULES and t != name}
    return graph


def test_every_module_has_a_floor():
    for name in MODULES:
        floor(name)


def test_no_module_imports_from_a_higher_floor():
    upward = [
        f"{src} (floor {floor(src)}) imports {dst} (floor {floor(dst)})"
        for src, dsts in imports().items()
        for dst in sorted(dsts)
        if floor(dst) > floor(src)
    ]
    assert not upward, "imports that run up the house:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    cycles = _cycles(imports())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The two checks above can fail: a made-up graph with both is caught."""
    graph = {"fastzoo.cli": {"fastzoo.bench.x"}, "fastzoo.bench.x": {"fastzoo.cli"}, "fastzoo.models.m": {"fastzoo.cli"}}
    assert _cycles(graph) == [["fastzoo.bench.x", "fastzoo.cli"]]
    assert floor("fastzoo.cli") > floor("fastzoo.models.m")


def test_architecture_md_names_every_file():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in MODULES.values()
               if p.name != "__init__.py" and str(p.relative_to(PACKAGE)) not in text]
    assert not missing, f"ARCHITECTURE.md has no line for: {', '.join(missing)}"


# -- references by name ----------------------------------------------------------------------------
# A declaration may name a module of a higher floor by its import path (a string: "fastzoo.bench.x:y"),
# resolved by the floor that reads the declaration, so the lower floor imports nothing of it. These are
# the pairs of packages where that is the design (ARCHITECTURE.md, floors 1 and 2); any other upward
# name is an import in disguise.
NAMED_UPWARD = {("fastzoo.tasks", "fastzoo.bench"), ("fastzoo.tasks", "fastzoo.accuracy"),
                ("fastzoo.losses", "fastzoo.bench")}
_IMPORT_PATH = re.compile(r"^fastzoo(\.\w+)+(:\w+)?$")


def _top_level_names(module: str) -> set[str]:
    names = set()
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names.update(t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                         if isinstance(t, ast.Name))
    return names


def named_references() -> list[tuple[str, str]]:
    """(module, import path) for every string in the package that is a fastzoo import path."""
    return [(name, node.value) for name, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _IMPORT_PATH.match(node.value)]


def _broken(path: str) -> bool:
    module, _, attr = path.partition(":")
    return module not in MODULES or bool(attr) and attr not in _top_level_names(module)


def _disguised(src: str, path: str) -> bool:
    dst = path.partition(":")[0]
    package = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    return floor(dst) > floor(src) and (package(src), package(dst)) not in NAMED_UPWARD


def test_every_module_named_by_its_import_path_exists_and_runs_up_only_where_declared():
    refs = named_references()
    assert any(path.startswith("fastzoo.bench.") for _, path in refs)  # the checker reads the declarations
    broken = [f"{src}: {path}" for src, path in refs if _broken(path)]
    assert not broken, "import paths naming nothing:\n" + "\n".join(broken)
    disguised = [f"{src} (floor {floor(src)}) names {path}" for src, path in refs if _disguised(src, path)]
    assert not disguised, "upward references by name outside NAMED_UPWARD:\n" + "\n".join(disguised)


def test_the_checker_sees_a_broken_and_a_disguised_reference():
    assert _broken("fastzoo.bench.no_such_module:x") and _broken("fastzoo.bench.set_loss:no_such_name")
    assert _disguised("fastzoo.models.vit.spec", "fastzoo.bench.tour:run")
    assert not _disguised("fastzoo.tasks.detection", "fastzoo.bench.detection:tour_entry")
