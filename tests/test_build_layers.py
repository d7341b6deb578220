"""The house's layers (docs/architecture.md), checked from the sources: every import in tfclip/ and
every include in csrc/ runs from a higher layer to a lower one (or within one room), none runs
back up, the engine's modules import each other without a loop, and no module is so long that it
does two jobs."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "tfclip")

# -- Python: tfclip/ ----------------------------------------------------------------------------
# A module's layer, by its dotted name's first matching prefix; a module may import its own layer's
# and lower layers' modules. The front doors (layer 3) import the engine, never each other (but
# tfclip.ops its own rule objects, tfclip.rules); the package's face and its tools sit above all.
LAYERS = [
    # bottom: what the build wrote, loading the op library, the public clip objects
    ("tfclip._build_info", 0), ("tfclip._core", 0), ("tfclip._eager", 0), ("tfclip._keras_version", 0),
    ("tfclip._loader", 0), ("tfclip.clipping", 0),
    ("tfclip._engine", 1),  # the one fused step and what every front door shares
    ("tfclip.rules", 2),  # tfclip.fused_clip_apply's rule objects
    ("tfclip.ops", 3), ("tfclip.keras", 3), ("tfclip.tf_keras", 3), ("tfclip.compat", 3),
    ("tfclip._tf_keras_loss_scale", 4),  # (saved configs' old module path: tfclip.tf_keras's classes)
    ("tfclip.checkpoint", 4), ("tfclip.info", 4), ("tfclip", 5),
    ("tfclip.demo", 6),  # (the demo: a user of the package's face)
]
FRONT_DOORS = ("tfclip.ops", "tfclip.keras", "tfclip.tf_keras", "tfclip.compat", "tfclip.rules")
ALLOWED_ACROSS = {("tfclip.ops", "tfclip.rules")}  # (fused_clip_apply takes a rule object)
MAX_LINES = 600


def _layer(name):
    for prefix, layer in LAYERS:
        if name == prefix or name.startswith(prefix + "."):
            return prefix, layer
    raise AssertionError(f"{name}: no layer in tests/test_build_layers.py's LAYERS")


def _modules():
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imports(name, path):
    """The tfclip modules `name` imports (absolute imports; `from tfclip.x import y` counts y when
    it is a module)."""
    mods = _modules()
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tfclip")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tfclip") and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                known = sub in mods or any(sub == prefix for prefix, _ in LAYERS)
                found.add(sub if known else node.module)
    return found - {name}


PY = sorted(_modules().items())


@pytest.mark.parametrize("name,path", PY, ids=[n for n, _ in PY])
def test_python_imports_run_down(name, path):
    prefix, layer = _layer(name)
    for imported in sorted(_imports(name, path)):
        iprefix, ilayer = _layer(imported)
        if iprefix == prefix or (prefix, iprefix) in ALLOWED_ACROSS:
            continue
        assert ilayer < layer or (ilayer == layer and layer in (0, 1)), \
            f"{name} (layer {layer}) imports {imported} (layer {ilayer}): an import that runs up or across"
        if prefix in FRONT_DOORS:
            assert iprefix not in FRONT_DOORS, f"front door {name} imports another front door, {imported}"


def test_the_engine_has_no_import_loop():
    graph = {n: {i for i in _imports(n, p) if i.startswith("tfclip._engine")} for n, p in PY
             if n.startswith("tfclip._engine")}
    done, visiting = set(), []

    def visit(n):
        assert n not in visiting, "an import loop: " + " -> ".join(visiting[visiting.index(n):] + [n])
        if n in done:
            return
        visiting.append(n)
        for m in sorted(graph.get(n, ())):
            visit(m)
        visiting.pop()
        done.add(n)

    for n in sorted(graph):
        visit(n)


@pytest.mark.parametrize("name,path", PY, ids=[n for n, _ in PY])
def test_python_modules_do_one_job(name, path):
    lines = sum(1 for _ in open(path, encoding="utf-8"))
    assert lines <= MAX_LINES, f"{name} has {lines} lines (> {MAX_LINES}): split it by job"


# -- C++: csrc/ ---------------------------------------------------------------------------------
# A file's room, by its path's first matching prefix, and the rooms it may include. The core
# includes no adapter; its CPU and CUDA drivers include the shared core and never each other;
# the TF-free XLA handlers include the core; TF's XLA kernels include the handlers' contract, the
# TF glue and the core; every adapter includes down.
ROOMS = [
    ("csrc/core/cpu/", "cpu"), ("csrc/core/cuda/", "cuda"), ("csrc/core/", "core"),
    ("csrc/xla/ffi/", "xla_ffi"), ("csrc/xla/tf/", "xla_tf"), ("csrc/xla/testing/", "xla_testing"),
    ("csrc/tf/", "tf"), ("csrc/py/", "py"),
]
MAY_INCLUDE = {
    "core": {"core"},
    "cpu": {"cpu", "core"},
    "cuda": {"cuda", "core"},
    "xla_ffi": {"xla_ffi", "core", "cpu", "cuda"},
    "xla_tf": {"xla_tf", "xla_ffi", "tf", "core"},
    "xla_testing": {"xla_testing", "xla_ffi", "core", "cuda"},
    "tf": {"tf", "core", "cpu", "cuda"},
    "py": {"py", "core", "cpu", "cuda"},
}
SOURCES = sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "csrc"))
                 for f in fs if f.endswith((".h", ".cc", ".cu", ".cuh", ".inc")))


def _room(path):
    for prefix, room in ROOMS:
        if path.startswith(prefix):
            return room
    raise AssertionError(f"{path}: no room in tests/test_build_layers.py's ROOMS")


@pytest.mark.parametrize("path", SOURCES)
def test_includes_run_down(path):
    room = _room(path)
    for line in open(os.path.join(ROOT, path), encoding="utf-8"):
        m = re.match(r'\s*#\s*include\s+"(csrc/[^"]+)"', line)
        if m:
            assert os.path.exists(os.path.join(ROOT, m.group(1))), f"{path} includes {m.group(1)}, which is not there"
            target = _room(m.group(1))
            assert target in MAY_INCLUDE[room], f"{path} ({room}) includes {m.group(1)} ({target}): it runs up"
