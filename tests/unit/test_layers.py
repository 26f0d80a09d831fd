"""Imports only go down the layers: foundation -> data -> env -> pallas_kernels -> agent ->
backend -> training -> research -> policy -> api -> research.walkforward -> cli.

Every module of ``foxhunt_jax`` and ``pallas_kernels`` is parsed with ``ast`` and each of its
imports (top-level and inside functions) of those packages is checked:

* it goes to the module's own layer or a lower one;
* ``pallas_kernels`` imports nothing of ``foxhunt_jax`` but ``foxhunt_jax.env`` (the kernels run
  the env's own step) and, below it, the foundation modules that ``env`` stands on;
* no module imports one of these packages inside a function (deferred imports hide cycles),
  except the command-line surface (``cli``, ``bench``, reached from ``foxhunt-jax``): its
  commands import the library when they run, so that ``--help`` and ``data check`` start
  without JAX and ``train`` initializes ``jax.distributed`` before any library module loads.
  Deferred imports of optional third-party packages (orbax, tensorboardX, rich, matplotlib)
  are not checked;
* the module graph has no cycle.

The foundation is the modules that import nothing of the library but ``errors``: ``errors``,
``version``, ``parallel`` (mesh and shard-key helpers), ``jitcache``, ``executable_codec`` and
``pystack``; ``config`` belongs to the data layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("foxhunt_jax", "pallas_kernels")
FOUNDATION = ("foxhunt_jax.errors", "foxhunt_jax.files", "foxhunt_jax.parallel",
              "foxhunt_jax.jitcache", "foxhunt_jax.executable_codec", "foxhunt_jax.version",
              "foxhunt_jax.pystack")
# (layer, module prefixes), lowest first
LAYERS = [
    ("foundation", FOUNDATION),
    # the config sits with the data: it names and checks the feature list data/features.py
    # defines, and data/loader.py reads the synthetic market's settings from it
    ("data", ("foxhunt_jax.config", "foxhunt_jax.data")),
    ("env", ("foxhunt_jax.env",)),
    ("pallas_kernels", ("pallas_kernels",)),
    ("agent", ("foxhunt_jax.agent",)),
    ("backend", ("foxhunt_jax.backend",)),
    ("training", ("foxhunt_jax.training",)),
    ("research", ("foxhunt_jax.research",)),  # significance of the training's metrics
    ("policy", ("foxhunt_jax.policy",)),
    ("api", ("foxhunt_jax.api",)),
    # the walk-forward trains whole runs through the api, one per fold
    ("walk-forward", ("foxhunt_jax.research.walkforward",)),
    ("cli", ("foxhunt_jax.cli", "foxhunt_jax.bench", "foxhunt_jax.__main__", "foxhunt_jax")),
]
CLI_SURFACE = ("foxhunt_jax.cli", "foxhunt_jax.bench")
# (module, target): jitcache imports JAX only when a function runs, so that reading its constants
# does not start JAX; it defers its import of the codec, which imports JAX at the top (no cycle:
# the codec imports nothing of the library)
DEFERRED_FOR_START_UP = {("foxhunt_jax.jitcache", "foxhunt_jax.executable_codec")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _layer(module: str) -> int:
    """The layer of the longest prefix that names ``module`` or a package holding it."""
    matches = [(len(p), rank) for rank, (_, prefixes) in enumerate(LAYERS) for p in prefixes
               if p != "foxhunt_jax" and (module == p or module.startswith(p + "."))]
    if matches:
        return max(matches)[1]
    if module == "foxhunt_jax":
        return len(LAYERS) - 1
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for each import of the packages."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                      ast.Lambda))
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                    pkg = pkg[:len(pkg) - child.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                # `from pkg import mod` imports the submodule where one exists
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in _MODULES else base
                         for a in child.names]
            for name in names:
                if name.split(".")[0] in PACKAGES:
                    found.append((_owner(name), child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def _owner(name: str) -> str:
    """The module an imported dotted name lives in (``a.b.func`` -> ``a.b``)."""
    while name not in _MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


_MODULES = _modules()
_GRAPH = {m: _imports(m, p) for m, p in _MODULES.items()}


def test_every_module_has_a_layer():
    assert len(_MODULES) > 20
    for module in _MODULES:
        _layer(module)


@pytest.mark.parametrize("module", sorted(_MODULES))
def test_imports_go_down(module):
    bad = [f"line {line}: {module} ({LAYERS[_layer(module)][0]}) imports {target} "
           f"({LAYERS[_layer(target)][0]})"
           for target, line, _ in _GRAPH[module] if _layer(target) > _layer(module)]
    assert not bad, "\n".join(bad)


def test_kernels_import_only_the_env_and_its_foundation():
    allowed = ("foxhunt_jax.env",) + FOUNDATION
    for module in _MODULES:
        if module.startswith("pallas_kernels"):
            for target, line, _ in _GRAPH[module]:
                assert target.startswith("pallas_kernels") or target.startswith(allowed), \
                    f"{module} line {line} imports {target}"
    # and env stands on what it may: the foundation and data, nothing above
    for module in ("foxhunt_jax.env", "foxhunt_jax.env.trading"):
        assert all(_layer(t) <= _layer("foxhunt_jax.env") for t, _, _ in _GRAPH[module])


def test_no_library_import_inside_a_function():
    bad = [f"{module} line {line} imports {target} inside a function"
           for module, imports in _GRAPH.items() if module not in CLI_SURFACE
           for target, line, inside in imports
           if inside and (module, target) not in DEFERRED_FOR_START_UP]
    assert not bad, "\n".join(bad)


def test_the_module_graph_has_no_cycle():
    edges = {m: {t for t, _, _ in imports if t != m} for m, imports in _GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(m, path):
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycle = path[path.index(t):] + [t] if t in path else [m, t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                walk(t, path + [t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            walk(m, [m])


def test_the_checker_sees_deferred_and_relative_imports(tmp_path):
    """The parser itself: an import inside a function and a relative import are found."""
    src = tmp_path / "mod.py"
    src.write_text("import os\n\ndef f():\n    from foxhunt_jax.agent import network\n"
                   "from .config import Config\n")
    found = _imports("foxhunt_jax.training.mod", src)
    assert ("foxhunt_jax.agent.network", 4, True) in found
    assert ("foxhunt_jax.training", 5, False) in found  # no such module: its package
