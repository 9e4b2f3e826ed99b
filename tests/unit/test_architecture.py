"""The house rules of docs/architecture.md, read from the source: layers import downwards only
(kernels <- plan <- engine <- adapters and tools), the core never imports a framework, no module
imports one that imports it back (lazy imports inside functions included), and no module grows past
MAX_LINES lines unless LONG_MODULES says why it stays one file."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "striped_sp"

#: what each layer may import of the package (itself always)
ALLOWED = {
    "kernels": {"kernels"},
    "plan": {"plan", "kernels"},
    "engine": {"engine", "plan", "kernels"},
}
FRAMEWORKS = ("megatron", "deepspeed", "transformers", "accelerate", "trl")


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every module of ours (and every top-level foreign package) that ``path`` imports."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            for alias in node.names:  # `from . import x` imports the module x
                candidate = f"{target}.{alias.name}"
                if (PKG.parent / candidate.replace(".", "/")).with_suffix(".py").exists():
                    found.add(candidate)
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in PKG.rglob("*.py"):
        mod = _module(path)
        ours = {m for m in _imports(path) if m.startswith("striped_sp")}
        graph[mod] = {m for m in ours if m != mod}
        graph[mod + "#foreign"] = {m.split(".")[0] for m in _imports(path) if not m.startswith("striped_sp")}
    return graph


def _layer(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_layers_import_downwards_only():
    graph = _graph()
    bad = []
    for mod, deps in graph.items():
        if mod.endswith("#foreign") or _layer(mod) is None:
            continue
        for dep in deps:
            if dep == "striped_sp":
                bad.append((mod, dep))
            elif _layer(dep) not in ALLOWED[_layer(mod)]:
                bad.append((mod, dep))
    assert not bad, bad


def test_the_core_never_imports_a_framework():
    graph = _graph()
    bad = [(mod, sorted(deps & set(FRAMEWORKS))) for mod, deps in graph.items()
           if mod.endswith("#foreign") and _layer(mod[:-8]) is not None and deps & set(FRAMEWORKS)]
    assert not bad, bad


def test_no_import_circles():
    graph = {m: {d for d in deps if d in _graph_modules()} for m, deps in _graph().items() if not m.endswith("#foreign")}
    # a package's __init__ re-exporting its own submodules is not a circle of callers
    for mod, deps in graph.items():
        graph[mod] = {d for d in deps if not (d.startswith(mod + ".") and _is_package(mod))}
    seen, stack, cycles = set(), [], []

    def visit(node):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep.startswith(node + "."):
                continue
            visit(dep)
        stack.pop()

    for mod in sorted(graph):
        visit(mod)
    # importing a package runs its __init__: a submodule importing its own package's __init__ is fine
    cycles = [c for c in cycles if not all(_is_package(a) and b.startswith(a + ".") or _is_package(b) and a.startswith(b + ".")
                                           for a, b in zip(c, c[1:]))]
    assert not cycles, cycles


def _graph_modules() -> set[str]:
    return {_module(p) for p in PKG.rglob("*.py")}


def _is_package(mod: str) -> bool:
    return (PKG.parent / mod.replace(".", "/") / "__init__.py").exists()


def test_kernel_backends_import_no_layer_above():
    for path in sorted((PKG / "kernels").glob("*.py")):
        deps = {d for d in _imports(path) if d.startswith("striped_sp")}
        assert all(d.startswith("striped_sp.kernels") for d in deps), (path.name, deps)


#: a module of the package past this many lines does more than one job: split it by what its parts do
#: (docs/architecture.md's map), or list it in LONG_MODULES with the reason it stays whole
MAX_LINES = 450
#: modules allowed past MAX_LINES (path under striped_sp/ -> why one file)
LONG_MODULES = {
    "kernels/torch_sdpa.py": "one kernel: PyTorch's fused ops, each op's gate transcribing PyTorch's own "
                             "(sdp_utils.cpp) beside the call it guards",
    "kernels/native.py": "one compile step: the varlen programs' rewrites (staircases, window edges, launch "
                         "sets) are stages of one pass over a plan's calls",
    "megatron/arguments.py": "one flag's checks (--context-parallel-algo and every setting it must agree with)",
}


def _long_modules() -> dict[str, int]:
    sizes = {path.relative_to(PKG).as_posix(): len(path.read_text().splitlines()) for path in PKG.rglob("*.py")}
    return {path: lines for path, lines in sizes.items() if lines > MAX_LINES}


def test_no_module_outgrows_one_job_unlisted():
    long = _long_modules()
    unlisted = {path: lines for path, lines in long.items() if path not in LONG_MODULES}
    assert not unlisted, (f"modules over {MAX_LINES} lines: split them by what their parts do (one job a module, "
                          f"docs/architecture.md's map) or list them in LONG_MODULES with a reason: {unlisted}")
