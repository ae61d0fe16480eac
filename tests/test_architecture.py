"""The package's floors (README, docs/architecture.md): each module imports only floors below its own (or its own
folder), ComfyUI only in nodes/, and there is no import circle, counting imports placed inside functions."""
from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# floor of each top-level folder / module of the package (higher floors may import lower ones)
FLOORS = {
    "cache": 0,
    "kernels": 1,
    "model": 2, "vae": 2,
    "sampling": 3,
    "memory": 4, "compile": 4, "profiling": 4,
    "app": 5, "bench": 5, "checks": 5,
    "nodes": 6, "cli": 6, "server_routes": 6, "__main__": 6, "__init__": 7,
}
COMFY_ROOTS = {"comfy", "comfy_extras", "comfy_api", "folder_paths", "server", "nodes", "execution",
               "latent_preview", "node_helpers", "comfy_execution"}


def _modules():
    for path in sorted(REPO_ROOT.rglob("*.py")):
        rel = path.relative_to(REPO_ROOT)
        # tools/: the repository's scripts (carrying ComfyUI to a GPU machine), never imported by the package
        if rel.parts[0] in ("tests", "tools", ".venv", "build", "docs", "workflows", "web") or rel.parts[0].startswith("."):
            continue
        parts = list(rel.with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg and len(parts) > 1 else parts)
        yield name, is_pkg, path


def _imports(name: str, is_pkg: bool, path: Path):
    """(target module, line, inside a function) for every import of the pack's own modules, and ComfyUI roots."""
    tree = ast.parse(path.read_text())
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    if name == "__init__":
        base = []
    func_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    func_lines.add(sub.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            pkg = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            mod = pkg + (node.module.split(".") if node.module else [])
            targets = [".".join(mod)] if node.module else [".".join(mod + [a.name]) for a in node.names]
            for t in targets:
                yield t, node.lineno, node.lineno in func_lines
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield "<abs>" + node.module, node.lineno, node.lineno in func_lines
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield "<abs>" + a.name, node.lineno, node.lineno in func_lines


def _floor(module: str) -> int:
    return FLOORS[module.split(".")[0] if module else "__init__"]


def _edges():
    known = {n for n, _, _ in _modules()}
    for name, is_pkg, path in _modules():
        for target, line, in_func in _imports(name, is_pkg, path):
            if target.startswith("<abs>"):
                yield name, target, line, in_func, path
                continue
            # "from .pkg import name": name may be an attribute, not a module
            while target and target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target == "" or target in known or target.split(".")[0] in FLOORS:
                yield name, target or "__init__", line, in_func, path


def test_every_module_has_a_floor():
    missing = {n.split(".")[0] for n, _, _ in _modules()} - set(FLOORS)
    assert not missing, f"folders without a floor in FLOORS: {sorted(missing)}"


def test_no_import_reaches_a_higher_floor():
    bad = []
    for src, dst, line, in_func, path in _edges():
        if dst.startswith("<abs>"):
            continue
        if _floor(dst) > _floor(src):
            bad.append(f"{src}:{line} imports {dst}" + (" (inside a function)" if in_func else ""))
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_comfyui_is_imported_only_in_nodes():
    bad = [f"{src}:{line} imports {dst[5:]}" for src, dst, line, _f, _p in _edges()
           if dst.startswith("<abs>") and dst[5:].split(".")[0] in COMFY_ROOTS and not src.startswith("nodes")]
    assert not bad, "ComfyUI imported outside nodes/:\n" + "\n".join(bad)


def test_no_import_circle():
    graph: dict = {}
    for src, dst, _line, _f, _p in _edges():
        if not dst.startswith("<abs>") and dst != src and not src.startswith(dst + ".") and dst != "__init__":
            graph.setdefault(src, set()).add(dst)
    # package __init__ re-exports are edges too; find any cycle
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])


def test_no_folder_holds_more_than_a_fifth_of_the_code():
    sizes: dict = {}
    for name, _pkg, path in _modules():
        sizes[name.split(".")[0]] = sizes.get(name.split(".")[0], 0) + len(path.read_text().splitlines())
    total = sum(sizes.values())
    big = {k: round(v / total, 2) for k, v in sizes.items() if v > 0.22 * total}
    assert not big, f"folders over about a fifth of the code: {big}"
