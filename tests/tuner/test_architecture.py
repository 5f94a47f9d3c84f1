"""The package's import graph: no cycles (function-local imports and lazy exports included), no loop between
folders (the top-level modules counted as one), no private name imported from another module, no private
attribute of the package's own objects read or written from another module, and the layers depend downwards
only (utils <- ops <- bases <- config, layers <- features <- the tuner <- tooling)."""

from __future__ import annotations

import ast
import os

import sits_lora

PACKAGE_DIR = os.path.dirname(os.path.abspath(sits_lora.__file__))

# what each part of the package may import from sits_lora (by module prefix); a module not listed may import
# anything that does not close a cycle
ALLOWED = {
    "sits_lora.utils": ("sits_lora.utils",),
    "sits_lora.ops": ("sits_lora.ops", "sits_lora.utils"),
    "sits_lora.bases": ("sits_lora.bases", "sits_lora.ops", "sits_lora.utils"),
    "sits_lora.config": ("sits_lora.config", "sits_lora.utils"),
    # serving.mixed_batch: a layer hands a mixed batch (adapter_names) to it; it imports only ops and utils
    "sits_lora.layers": ("sits_lora.layers", "sits_lora.bases", "sits_lora.ops", "sits_lora.serving.mixed_batch",
                         "sits_lora.utils"),
}
TOOLING = ("sits_lora.cli", "sits_lora.recipe")
# The modules that import sits_lora's own modules inside functions, and why: each defers an optional or a slow
# dependency. Anything else imports at the top (a local import cannot hide a cycle: the cycle test counts them).
DEFERRED_IMPORTS = {
    "sits_lora": "apply_native_lora: the config imports peft, `import sits_lora` must not",
    **{f"sits_lora.cli{sub}": "the command line answers --help and bad arguments before torch loads"
       for sub in ("", ".bench", ".check", ".compile", ".profile")},
    "sits_lora.recipe.train": "the recipe's option checks answer before torch loads",
    "sits_lora.recipe.diffusion": "the diffusion recipe's option checks answer before torch and diffusers load",
    "sits_lora.recipe.diffusion_models": "the diffusion recipe's models load torch, diffusers and the adapter when built",
    "sits_lora.recipe.diffusion_files": "the diffusion recipe's export loads the exporter when the run ends",
    "sits_lora.registry": "registration runs when peft is imported, by whoever imports it",
    "sits_lora.model": "a feature (fp8, INT4: Triton; dynamic rank) loads when an adapter asks for it",
    "sits_lora.fp8.model": "the 4-bit layers (bitsandbytes) load only for a model that already holds them",
    "sits_lora.ops": "Triton is optional: the decode kernel loads on its first call",
    "sits_lora.ops.choice": "Triton is optional: the fused kernels load on their first launch (fused_kernels)",
    "sits_lora.ops.int4_linear": "Triton is optional: the PyTorch reference runs without it",
    "sits_lora.ops.bnb4_dequant": "Triton is optional: the PyTorch reference runs without it",
    "sits_lora.ops.cross_entropy": "Triton is optional: the chunked PyTorch path runs without it",
    "sits_lora.serving.mixed_batch": "Triton is optional: without the kernels a mixed batch takes PEFT's loop",
    "sits_lora.training": "transformers' Trainer loads when the trainer is asked for",
    "sits_lora.training.native": "the dynamic-rank callback loads only for a dynamic-rank adapter; transformers' "
                                 "Trainer only when native_step is given a trainer",
}
ENTRY_POINTS = ("sits_lora.__main__",)  # ``python -m sits_lora`` is the command line
# private attributes that are another library's, which the package sets in one module and reads in another
FOREIGN_PRIVATE_ATTRIBUTES = {
    "_gradient_checkpointing_func": "transformers' own: the function its layers checkpoint with, which the "
                                    "offload replaces and the selective checkpointing calls",
}


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


def _imports(modules: dict[str, str], local_only: bool = False) -> list[tuple[str, str, str]]:
    """(importer, imported module, imported name or '') for every import of sits_lora, at any depth (only
    those inside a function with ``local_only``)."""
    edges = []
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        tree = ast.parse(open(path).read())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes = [n for f in functions for n in ast.walk(f)] if local_only else ast.walk(tree)
        for node in nodes:
            # a package's lazy exports (sits_lora.utils.lazy): {public name: module}, imported on first use
            if (not local_only and isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                    and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)):
                for value in node.value.values:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        name = value.value
                        target = package + name if name.startswith(".") else name
                        edges.append((module, target, ""))
            elif isinstance(node, ast.Import):
                edges += [(module, a.name, "") for a in node.names if a.name.startswith("sits_lora")]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("sits_lora"):
                    continue
                for alias in node.names:
                    submodule = f"{target}.{alias.name}"
                    edges.append((module, submodule, "") if submodule in modules else (module, target, alias.name))
    return edges


def _cycles(modules, edges) -> list[list[str]]:
    graph = {m: set() for m in modules}
    for importer, imported, _ in edges:
        # importing a package's submodule runs the package's __init__, which is not a dependency of the
        # package on its own child
        if imported in modules and importer != imported and not imported.startswith(importer + "."):
            graph[importer].add(imported)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    modules = _modules()
    assert _cycles(modules, _imports(modules)) == []


def _folder(module: str, modules) -> str:
    """The folder a module sits in: its subpackage, or "top" for the modules directly under sits_lora. The entry
    point (``python -m sits_lora``) sits above everything, the command line included: a folder of its own."""
    if module in ENTRY_POINTS:
        return "entry"
    parts = module.split(".")
    if len(parts) > 1 and any(m.startswith(f"sits_lora.{parts[1]}.") for m in modules):
        return parts[1]
    return "top"


def _folder_loops(modules, edges) -> list[list[str]]:
    """The folders that import each other, directly or round a loop (any one import of a module counts)."""
    folders = {_folder(m, modules) for m in modules}
    folder_modules = {f: f"sits_lora.{f}" for f in folders}
    folder_edges = [(folder_modules[_folder(a, modules)], folder_modules[_folder(b, modules)], "")
                    for a, b, _ in edges if b in modules and _folder(a, modules) != _folder(b, modules)]
    return _cycles(set(folder_modules.values()), folder_edges)


def test_no_two_folders_import_each_other():
    """A folder's modules build on folders below it only: the features (dynamic_rank, fp8, int4, ...) on config and
    layers, the tuner's top-level modules (model, export, registry) on the features, the tooling on all of them."""
    modules = _modules()
    assert _folder_loops(modules, _imports(modules)) == []


def test_no_private_name_is_imported_from_another_module():
    modules = _modules()
    private = [f"{importer} imports {name} from {imported}" for importer, imported, name in _imports(modules)
               if name.startswith("_") and not name.startswith("__")]
    assert private == []


def test_layers_import_downwards_only():
    wrong = []
    for importer, imported, _ in _imports(_modules()):
        for part, allowed in ALLOWED.items():
            if (importer == part or importer.startswith(part + ".")) and not any(
                    imported == a or imported.startswith(a + ".") for a in allowed):
                wrong.append(f"{importer} -> {imported}")
        # the library never reaches up into the command line or the recipe
        if not importer.startswith(TOOLING + ENTRY_POINTS) and imported.startswith(TOOLING):
            wrong.append(f"{importer} -> {imported}")
    assert wrong == []


def test_function_local_imports_only_defer_a_dependency():
    modules = _modules()
    unexplained = sorted({f"{importer} -> {imported}" for importer, imported, _ in _imports(modules, local_only=True)
                          if importer not in DEFERRED_IMPORTS})
    assert unexplained == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_attribute_crossings(modules: dict[str, str]) -> list[str]:
    """Uses of ``obj._name`` (or getattr / hasattr / setattr with "_name") in a module other than the ones that define
    ``_name`` (assign it to an object, or hold it as a class attribute or a method), other than on self or cls."""
    trees = {module: ast.parse(open(path).read()) for module, path in modules.items()}
    defined: dict[str, set] = {}
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    # on self, or state a module attaches to another object (a layer): the writer owns it
                    if isinstance(target, ast.Attribute) and _private(target.attr):
                        defined.setdefault(target.attr, set()).add(module)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    names = ([item.name] if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else
                             [t.id for t in getattr(item, "targets", [getattr(item, "target", None)])
                              if isinstance(t, ast.Name)])
                    for name in names:
                        if _private(name):
                            defined.setdefault(name, set()).add(module)
    crossings = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value)):
                name = node.args[1].value
            if name in defined and module not in defined[name] and name not in FOREIGN_PRIVATE_ATTRIBUTES:
                crossings.append(f"{module}:{node.lineno} uses {name} of {sorted(defined[name])}")
    return crossings


def test_no_private_attribute_is_used_across_modules():
    """A module's private state stays its own: another module goes through a public name (an attribute set by the
    injection pass, a property, a method), so that a reader finds every user of the state by its name."""
    assert _private_attribute_crossings(_modules()) == []


def test_the_checker_sees_a_cycle_and_a_private_import(tmp_path):
    """The two checks above are not vacuous: a planted cycle and a planted private import are found."""
    modules = {"sits_lora.a": str(tmp_path / "a.py"), "sits_lora.b": str(tmp_path / "b.py")}
    (tmp_path / "a.py").write_text("def f():\n    from .b import _helper\n")
    (tmp_path / "b.py").write_text("from .a import f\n")
    edges = _imports(modules)
    assert _cycles(modules, edges) == [["sits_lora.a", "sits_lora.b"]]
    assert ("sits_lora.a", "sits_lora.b", "_helper") in edges
    assert _imports(modules, local_only=True) == [("sits_lora.a", "sits_lora.b", "_helper")]


def test_the_checker_sees_a_loop_between_folders_and_a_lazy_export(tmp_path):
    """A top-level module and a feature folder that import each other, one of them through a lazy export, form a
    loop although no module imports itself round a cycle."""
    (tmp_path / "feature").mkdir()
    modules = {"sits_lora": str(tmp_path / "__init__.py"), "sits_lora.model": str(tmp_path / "model.py"),
               "sits_lora.layer": str(tmp_path / "layer.py"), "sits_lora.feature": str(tmp_path / "feature" / "__init__.py"),
               "sits_lora.feature.variant": str(tmp_path / "feature" / "variant.py")}
    (tmp_path / "__init__.py").write_text('_EXPORTS = {"Model": ".model"}\n')
    (tmp_path / "model.py").write_text("from .feature.variant import Variant\n")
    (tmp_path / "layer.py").write_text("")
    (tmp_path / "feature" / "__init__.py").write_text("")
    (tmp_path / "feature" / "variant.py").write_text("from ..layer import Layer\n")
    edges = _imports(modules)
    assert ("sits_lora", "sits_lora.model", "") in edges
    assert _cycles(modules, edges) == []
    assert _folder_loops(modules, edges) == [["sits_lora.feature", "sits_lora.top"]]


def test_the_checker_sees_a_private_attribute_used_from_another_module(tmp_path):
    modules = {"sits_lora.a": str(tmp_path / "a.py"), "sits_lora.b": str(tmp_path / "b.py")}
    (tmp_path / "a.py").write_text("class Group:\n    def __init__(self):\n        self._kept = None\n"
                                   "    def _plan(self):\n        return self._kept\n")
    (tmp_path / "b.py").write_text("def f(group, layer):\n    layer._own = 1\n    return group._kept, "
                                   "getattr(group, '_plan', None), group._unknown_elsewhere\n")
    assert _private_attribute_crossings(modules) == ["sits_lora.b:3 uses _kept of ['sits_lora.a']",
                                                     "sits_lora.b:3 uses _plan of ['sits_lora.a']"]


def test_the_top_level_api_is_the_users():
    """``sits_lora.__all__`` holds the config, the model helpers, the trainer and callbacks, export and the
    dynamic-rank tools; tooling (the command line's benchmark, the recipe) is reached through its subpackage."""
    assert "BenchmarkRunner" not in sits_lora.__all__
    for name in sits_lora.__all__:
        value = getattr(sits_lora, name)
        module = getattr(value, "__module__", "") or ""
        assert not module.startswith(TOOLING), f"{name} comes from {module}"
