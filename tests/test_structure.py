"""The codebase's shape: the kernel lab stands alone, no import cycles, small files."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def modules(package: str) -> dict[str, ast.Module]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def imports(tree: ast.Module, package: str) -> set[str]:
    """Every module of `package` this module imports, at any depth (lazy imports too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m == package or m.startswith(package + ".")}


def test_kernels_import_nothing_from_the_library():
    for name, tree in modules("kernels").items():
        assert not imports(tree, "paged_jax"), f"{name} imports {imports(tree, 'paged_jax')}"


def test_library_imports_have_no_cycle():
    mods = modules("paged_jax")
    graph = {m: {i for i in imports(t, "paged_jax") if i in mods and i != m}
             for m, t in mods.items()}
    graph = {m: {i for i in deps if not m.startswith(i + ".")}  # a package's own __init__
             for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph[m]:
            assert state.get(d) != 1, "import cycle: " + " -> ".join(path + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_files_and_functions_stay_small():
    too_long = []
    for package in ("paged_jax", "kernels"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            if text.count("\n") > MAX_FILE_LINES:
                too_long.append(f"{path.name}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        too_long.append(f"{path.name}:{node.name}: {n} lines")
    assert not too_long, too_long
