"""The codebase's shape: layers import only downward, the kernel lab stands alone, no import
cycles, small files."""

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
    """Every module of `package` this module imports, at any depth (lazy imports too).

    `from a import b` counts as importing `a.b` when that is a module, else `a`.
    """
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            mods = {s for s in subs if _is_module(s)}
            found |= mods | ({node.module} if mods != subs else set())
    return {m for m in found if m == package or m.startswith(package + ".")}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_kernels_import_nothing_from_the_library():
    for name, tree in modules("kernels").items():
        assert not imports(tree, "paged_jax"), f"{name} imports {imports(tree, 'paged_jax')}"


# The library's layers, lowest first. A module imports its own package and lower layers only;
# packages of the same rank (models and sample; study and the entry points) are independent.
LAYERS = {
    "paged_jax.types": 0, "paged_jax.sizes": 0, "paged_jax.compile_cache": 0,
    "paged_jax.sampling_params": 0, "paged_jax.outputs": 0,
    "paged_jax.cache": 1,
    "paged_jax.models": 2, "paged_jax.sample": 2,
    "paged_jax.lora": 2.5,  # adapters: read into the models' slots, placed by the engine
    "paged_jax.nn": 2.7,  # a user's own Flax NNX model on the paged cache (the engine
    # runs it through the forward it is given, never importing this)
    "paged_jax.engine": 3, "paged_jax.precision": 3,
    "paged_jax.llm_setup": 3.5,  # what LLM() does before building its engines
    "paged_jax.study": 4, "paged_jax.llm": 4,
    "paged_jax.generate": 5, "paged_jax.distributed": 5, "paged_jax.routing": 5,
    "paged_jax.serve": 6,
    "paged_jax": 7,  # the package's own __init__: the public API, re-exported
}


def unit(module: str) -> str:
    """The layer unit a module belongs to (its package, or itself for a top-level module)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def test_layers_import_only_downward():
    bad = []
    for name, tree in modules("paged_jax").items():
        for dep in imports(tree, "paged_jax"):
            mine, theirs = unit(name), unit(dep)
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{name} imports {dep}")
    assert not bad, "\n".join(sorted(bad))


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


def test_the_architecture_doc_names_every_module():
    """docs/architecture.md lists every module of the library and the kernel lab by its file
    name, so a new file cannot land unexplained."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [f"{package}/{path.relative_to(ROOT / package)}"
               for package in ("paged_jax", "kernels")
               for path in sorted((ROOT / package).rglob("*.py"))
               if path.name != "__init__.py" and path.name not in doc]
    assert not missing, missing
