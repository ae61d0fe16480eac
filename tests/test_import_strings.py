"""Every module the pack names in a string imports.

Module names written as text escape the import checks of Python and of test_architecture.py: a moved module
leaves them behind, and the failure shows only when that command or child process runs. The source is scanned
(AST) for such names and each one is imported here:

* ``importlib.import_module`` / ``importlib.util.find_spec`` / ``importlib.util.resolve_name`` with a literal or
  an f-string (a ``{name}`` over a module-level table by a ``for`` loop is expanded; another ``{...}`` in front
  is the pack's own name), relative names resolved against the calling module's package;
* calls of the pack's own functions that hand a parameter to ``import_module`` (``_register_optional``,
  ``_chunk_sources``, ...): their literal arguments;
* ``package_target("module:attr")``, ``child_argv("module:function")`` and ``RankWorkers.spawn("module:function",
  ...)``: the module, and that it has the attr;
* the code of ``python -c CODE`` command lines (``import X`` / ``from X import``);
* module-level tables of relative module names (``"..bench.sampler"``: cli/bench.py's BENCHES and ROUTES).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACK = "wan_accel"
SKIP_TOP = ("tests", "docs", "workflows", "web", "build")
RELATIVE = re.compile(r"^\.+[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
CODE_IMPORT = re.compile(r"(?:^|[;\n])\s*(?:import\s+([\w., ]+?)(?:\s+as\s+\w+)?|from\s+([\w.]+)\s+import)"
                         r"\s*(?=$|[;\n])", re.M)


def _modules():
    for path in sorted(REPO_ROOT.rglob("*.py")):
        rel = path.relative_to(REPO_ROOT)
        if rel.parts[0] in SKIP_TOP or rel.parts[0].startswith("."):
            continue
        parts = list(rel.with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        name = ".".join([PACK] + (parts[:-1] if is_pkg else parts))
        yield name, (name if is_pkg else name.rpartition(".")[0]), path


def _tables(tree) -> dict:
    """Module-level ``NAME = (strings...)`` / ``[...]``: name -> the strings."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List)):
            values = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if values and len(values) == len(node.value.elts):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = values
    return out


def _loop_values(tree, tables: dict) -> dict:
    """Loop variables over a module-level table: variable -> the table's strings."""
    out = {}
    for node in ast.walk(tree):
        loops = [(node.target, node.iter)] if isinstance(node, ast.For) else \
            [(g.target, g.iter) for g in node.generators] if isinstance(node, (ast.ListComp, ast.GeneratorExp,
                                                                                ast.SetComp, ast.DictComp)) else []
        for target, it in loops:
            if isinstance(target, ast.Name) and isinstance(it, ast.Name) and it.id in tables:
                out[target.id] = tables[it.id]
    return out


def _texts(node, loops: dict, consts: dict) -> list:
    """The strings a literal, a name bound to text or an f-string can stand for (empty: not resolvable)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in consts and consts[node.id] is not node:
        return _texts(consts[node.id], loops, {k: v for k, v in consts.items() if k != node.id})
    if isinstance(node, ast.JoinedStr):
        texts = [""]
        for i, part in enumerate(node.values):
            after = node.values[i + 1] if i + 1 < len(node.values) else None
            if isinstance(part, ast.Constant):
                texts = [t + str(part.value) for t in texts]
            elif isinstance(part.value, ast.Name) and part.value.id in loops:
                texts = [t + v for t in texts for v in loops[part.value.id]]
            elif isinstance(after, ast.Constant) and str(after.value).startswith("."):
                texts = [t + PACK for t in texts]            # f"{package}.x.y": the pack under its import name
            else:
                return []
        return texts
    return []


def _importers(tree) -> dict:
    """Functions of this module that pass a parameter to import_module: name -> (first position, all after it)."""
    out = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        params = [a.arg for a in fn.args.args]
        vararg = fn.args.vararg.arg if fn.args.vararg else None
        loops = {}
        for node in ast.walk(fn):
            for target, it in ([(node.target, node.iter)] if isinstance(node, ast.For) else
                               [(g.target, g.iter) for g in getattr(node, "generators", [])]):
                if isinstance(target, ast.Name) and isinstance(it, ast.Name):
                    loops[target.id] = it.id
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and _callee(node) == "import_module" and node.args \
                    and isinstance(node.args[0], ast.Name):
                arg = loops.get(node.args[0].id, node.args[0].id)
                if arg in params:
                    out[fn.name] = (params.index(arg), False)
                elif arg == vararg:
                    out[fn.name] = (len(params), True)
    return out


def _callee(call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _resolve(text: str, package: str) -> str:
    return importlib.util.resolve_name(text, package) if text.startswith(".") else text


def named_modules() -> list:
    """(where, module, attribute or None) for every module name written as text in the pack."""
    found = []
    all_importers = {}
    trees = []
    for name, package, path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        trees.append((name, package, path, tree))
        for fn, spec in _importers(tree).items():
            all_importers[fn] = (spec, package)
    for name, package, path, tree in trees:
        rel = path.relative_to(REPO_ROOT).as_posix()
        tables = _tables(tree)
        loops = _loop_values(tree, tables)
        consts = {t.id: n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)    # names bound to text
                  and isinstance(n.value, (ast.Constant, ast.JoinedStr)) for t in n.targets if isinstance(t, ast.Name)}
        for node in tree.body:                              # tables of relative module names
            if isinstance(node, ast.Assign):
                for c in ast.walk(node.value):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.startswith("..") \
                            and RELATIVE.match(c.value):
                        found.append((f"{rel}:{c.lineno}", _resolve(c.value, package), None))
        for node in ast.walk(tree):
            if isinstance(node, (ast.List, ast.Tuple)):      # [python, "-c", CODE, ...]
                elts = node.elts
                for i, e in enumerate(elts[:-1]):
                    if isinstance(e, ast.Constant) and e.value == "-c":
                        for code in _texts(elts[i + 1], loops, consts):
                            for m in CODE_IMPORT.finditer(code):
                                for mod in (m.group(1) or m.group(2)).split(","):
                                    found.append((f"{rel}:{node.lineno}", mod.strip(), None))
            if not isinstance(node, ast.Call) or not node.args:
                continue
            callee = _callee(node)
            if callee in ("import_module", "find_spec", "resolve_name"):
                base = package
                if len(node.args) > 1 and isinstance(node.args[1], ast.Name) and node.args[1].id == "__name__":
                    base = name
                for text in _texts(node.args[0], loops, consts):
                    found.append((f"{rel}:{node.lineno}", _resolve(text, base), None))
            elif callee in ("package_target", "child_argv", "spawn"):
                for text in _texts(node.args[0], loops, consts):
                    mod, _, attr = text.partition(":")
                    found.append((f"{rel}:{node.lineno}", f"{PACK}.{mod}", attr or None))
            elif callee in all_importers:
                (pos, rest), callee_package = all_importers[callee]
                for arg in node.args[pos:] if rest else node.args[pos:pos + 1]:
                    for text in _texts(arg, loops, consts):
                        found.append((f"{rel}:{node.lineno}", _resolve(text, callee_package), None))
    return found


NAMED = named_modules()


def test_the_scan_sees_every_kind_of_module_string():
    where = {w.split(":")[0] for w, _, _ in NAMED}
    modules = {m for _, m, _ in NAMED}
    # the lazy command tables, the bench tables, the child processes and the doctor's sources
    assert {"cli/__init__.py", "cli/bench.py", "nodes/__init__.py",
            "app/doctor/probes.py", "bench/compile.py", "bench/kernels.py", "app/ranks/pool.py",
            "cli/profiling.py"} <= where
    assert {f"{PACK}.cli.bench", f"{PACK}.bench.sampler", f"{PACK}.bench.parallel",
            f"{PACK}.nodes.model_nodes", f"{PACK}.sampling.cuda_graphs",
            f"{PACK}.bench.compile", f"{PACK}.app.ranks.pool", f"{PACK}.app.ranks.parallel", "importlib"} <= modules


# optional packages the pack looks for at run time (never dependencies): named, they need not be installed here;
# ComfyUI's own packages too (bench native and the doctor's native probe import them through the guarded import);
# comfyui_version is ComfyUI's own file, found only where ComfyUI is (app/doctor/versions.py reads it)
OPTIONAL = ("xformers", "kernels", "flash_attn", "flash_attn_interface", "comfy", "comfy_extras", "comfyui_version",
            "matplotlib")


@pytest.mark.parametrize("where,module,attr", NAMED, ids=[f"{w}->{m}" + (f":{a}" if a else "") for w, m, a in NAMED])
def test_named_module_imports(where, module, attr):
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if module.split(".")[0] in OPTIONAL and exc.name and exc.name.split(".")[0] == module.split(".")[0]:
            pytest.skip(f"{module}: an optional package, not installed here")
        pytest.fail(f"{where} names the module {module}, which does not import: {exc}")
    if attr:
        obj = mod
        for part in attr.split("."):
            assert hasattr(obj, part), f"{where} names {module}:{attr}, which has no {part!r}"
            obj = getattr(obj, part)
