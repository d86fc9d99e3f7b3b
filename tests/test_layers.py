"""The package's layering, read from its source (docs/design.md, "Layers"): no import cycles,
no module importing a layer above its own, no private name of another module used, and a
docstring opening every module.  Lazy imports inside functions and imports under
``TYPE_CHECKING`` count too: the layering is about what a module knows, not when it loads it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import tierstore

PKG = pathlib.Path(tierstore.__file__).parent

# lowest first; a module may import modules of its own layer and of the layers below it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("tierstore.errors",)),
    ("constants", ("tierstore.format.constants",)),
    ("values", ("tierstore.arrays", "tierstore.buffers", "tierstore.objects", "tierstore.names", "tierstore.prefix")),
    ("codecs", ("tierstore.codecs",)),
    ("format", ("tierstore.format",)),
    ("engine", ("tierstore.engine",)),
    ("tiers", ("tierstore.tiers",)),
    ("handle", ("tierstore.store", "tierstore.scoped")),
    ("package", ("tierstore",)),
    ("tools", ("tierstore.cli", "tierstore.bench", "tierstore.integrations", "tierstore.__main__")),
]
# attributes with a leading underscore that are public by convention (namedtuple's API)
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults",
                     # vLLM's KVConnectorBase_V1 gives its subclasses these (the documented way in)
                     "_get_connector_metadata", "_kv_transfer_config", "_kv_cache_config", "_cache_hit_source"}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def layer_of(mod: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{mod} is in no layer: add it to LAYERS"
    return rank


def _resolve(mod: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The tierstore modules an import statement in ``mod`` names."""
    is_pkg = MODULES[mod].name == "__init__.py"
    out = []
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "tierstore"]
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + (node.module.split(".") if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "tierstore":
        return []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return out


def imports_of(mod: str) -> set[str]:
    tree = ast.parse(MODULES[mod].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(t for t in _resolve(mod, node) if t != mod)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_import_names_a_module() -> None:  # a lazy import of a moved module fails only when it runs
    unknown = [f"{m} imports {t}" for m, targets in GRAPH.items() for t in sorted(targets) if t not in MODULES]
    assert not unknown, "imports of modules that do not exist:\n" + "\n".join(unknown)


def test_every_module_has_a_layer_and_a_docstring() -> None:
    for mod, path in MODULES.items():
        layer_of(mod)
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.strip(), f"{mod}: open the module with a docstring saying what it owns"


def test_no_upward_imports() -> None:
    bad = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
           for m, targets in GRAPH.items() for t in sorted(targets)
           if t in MODULES and layer_of(t) > layer_of(m) and not (m == "tierstore.__main__" and t == "tierstore.cli")]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (c := visit(t)) is not None:
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)) is not None:
            return c
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles() -> None:  # the twin: the check above can fail
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines itself: functions, classes, assignments, attributes set on self/cls."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_"):
            out.add(node.value)  # __slots__ entries
    return out


def private_uses(source: str) -> list[str]:
    tree = ast.parse(source)
    own = _defined_names(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            bad += [f"line {node.lineno}: imports {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
        elif isinstance(node, ast.Attribute):
            a = node.attr
            if not a.startswith("_") or a.startswith("__") or a in PUBLIC_UNDERSCORE or a in own:
                continue
            bad.append(f"line {node.lineno}: uses .{a}")
    return bad


def test_no_private_names_of_other_modules() -> None:
    bad = [f"{m}: {u}" for m, p in MODULES.items() for u in private_uses(p.read_text())]
    assert not bad, "private names used outside their module:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, found", [
    ("import x\nx._private()\n", True),
    ("from x import _hidden\n", True),
    ("class A:\n    def _m(self): pass\n    def n(self, o): return o._m()\n", False),
    ("def f(o): return o.__class__, o._replace(a=1)\n", False),
])
def test_the_private_name_check_can_fail(source: str, found: bool) -> None:
    assert bool(private_uses(source)) is found
