"""The shape of the house, as rules a test holds (DESIGN.md section 5).

* A backend is a unit: its code is in ``runtime/<backend>/`` and
  ``frontends/<backend>/`` packages, never in flat ``<backend>_*.py`` modules.
* No private name (``_x``) is imported across packages; a backend's package
  with its sub-packages counts as one, the kernel (the modules directly in
  ``runtime/``) as one, and the modules directly in ``amanda/`` as one.
* No import cycle spans two packages (cycles inside one package are the
  package's own business).
* The runtime builds a ``ToolError`` about a routine in one place.

Every rule is read from the syntax trees of the package's files, imports
inside functions included.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "amanda"
BACKENDS = ("pytorch", "tensorflow", "onnx")


def _modules():
    """``{dotted name: path}`` of every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def package_of(module):
    """The package a module belongs to for these rules."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] in ("runtime", "frontends") and parts[2] in BACKENDS:
        return ".".join(parts[:3])
    if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir():
        return ".".join(parts[:2])
    return "amanda"


def _imports(module, path):
    """``(imported module, name or None, line)`` for every import of amanda's
    own modules in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "amanda":
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if full in MODULES:
                    yield full, None, node.lineno
                else:
                    yield target, alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "amanda":
                    yield alias.name, None, node.lineno


def test_backends_live_in_packages_only():
    flat = [f"amanda/{place}/{path.name}" for place in ("runtime", "frontends")
            for path in (PACKAGE / place).glob("*.py")
            if path.stem.split("_")[0] in BACKENDS]
    assert not flat, f"backend modules outside their package: {flat}"
    for place in ("runtime", "frontends"):
        for backend in BACKENDS:
            assert (PACKAGE / place / backend / "__init__.py").is_file(), (place, backend)


def test_no_private_name_is_imported_across_packages():
    found = []
    for module, path in MODULES.items():
        for target, name, line in _imports(module, path):
            if name is None or not name.startswith("_") or name.startswith("__"):
                continue
            if package_of(target) != package_of(module):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {target}.{name}")
    assert not found, "private names imported across packages:\n" + "\n".join(found)


def _cycles():
    edges = {module: set() for module in MODULES}
    for module, path in MODULES.items():
        for target, _, _ in _imports(module, path):
            if target in MODULES and target != module:
                edges[module].add(target)
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):       # Tarjan's strongly connected components, iteratively deep enough here
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for module in MODULES:
        if module not in index:
            visit(module)
    return components


def test_no_import_cycle_spans_packages():
    spanning = [sorted(c) for c in _cycles() if len({package_of(m) for m in c}) > 1]
    assert not spanning, f"import cycles across packages: {spanning}"


def test_the_runtime_builds_tool_errors_in_one_place():
    builders = []
    for module, path in MODULES.items():
        if not module.startswith("amanda.runtime"):
            continue
        tree = ast.parse(path.read_text())
        builders += [f"{module}:{node.lineno}" for node in ast.walk(tree)
                     if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ToolError"]
    assert builders == [b for b in builders if b.startswith("amanda.runtime.routines:")], builders
    assert len(builders) == 1, builders


def test_the_rules_see_what_they_look_for():
    # the scan resolves relative imports and names in packages
    assert package_of("amanda.runtime.pytorch.eager.mode") == "amanda.runtime.pytorch"
    assert package_of("amanda.runtime.host") == "amanda.runtime"
    assert package_of("amanda.tool") == "amanda"
    imports = list(_imports("amanda.runtime.pytorch.eager.mode",
                            MODULES["amanda.runtime.pytorch.eager.mode"]))
    assert any(t == "amanda.runtime.pytorch.eager.sites" for t, _, _ in imports)
    assert _cycles(), "the IR's own modules import each other in a cycle: the scan must see it"


def test_modules_are_imported_by_name_in_one_place():
    """One registry resolves backends: ``importlib`` (and ``__import__``)
    appear only in :mod:`amanda.runtime.backends`."""
    found = []
    for module, path in MODULES.items():
        if module == "amanda.runtime.backends":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Name) and node.id == "__import__":
                names = ["__import__"]
            found += [f"{module}:{node.lineno}" for name in names
                      if name.split(".")[0] in ("importlib", "__import__")]
    assert not found, f"imports by name outside the registry: {found}"


#: top-level modules of the frameworks amanda instruments
FRAMEWORKS = ("torch", "tensorflow", "keras", "onnx", "onnxruntime", "onnxruntime_extensions",
              "tf2onnx", "torchvision", "transformers")


def _names_a_backend(value):
    return isinstance(value, str) and value.split("/")[0] in BACKENDS


def _tool_modules():
    return {module: path for module, path in MODULES.items()
            if module == "amanda.tools" or module.startswith("amanda.tools.")}


def backend_knowledge(path):
    """``(line, what)`` for every import of a framework or of a backend's
    package in ``path``, and every
    string naming a backend (``"onnx"``, ``"pytorch/2.13.0/eager"``) outside
    docstrings and default argument values: a comparison, a ``startswith``,
    a table keyed by backend, ``support_for("pytorch")``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                allowed.add(id(body[0].value))          # a docstring
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            defaults = node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
            allowed.update(id(d) for d in defaults)     # public API: ``backend="pytorch"``
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.split(".")[0] in FRAMEWORKS]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            if parts[0] in FRAMEWORKS or (parts[0] == "amanda" and len(parts) > 2
                                          and parts[1] in ("runtime", "frontends")
                                          and parts[2] in BACKENDS):
                found.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, ast.Constant) and id(node) not in allowed \
                and _names_a_backend(node.value):
            found.append((node.lineno, repr(node.value)))
    return found


def test_tools_import_no_framework_and_name_no_backend():
    """One op vocabulary (issue 27): ``amanda/tools/`` is written against
    canonical op types and asks the registry (``runtime.vocabulary``,
    ``runtime.tool_support`` with a context's namespace) for whatever only a
    backend knows; it imports no framework and branches on no backend name."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
             for module, path in sorted(_tool_modules().items())
             for line, what in backend_knowledge(path)]
    assert not found, "backend knowledge in amanda/tools:\n" + "\n".join(found)


def test_the_backend_knowledge_scan_sees_it(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Tools for "onnx"."""\nimport torch.nn\nfrom onnx import helper\n'
                      'def f(ns, backend="pytorch"):\n    """"tensorflow" only."""\n'
                      '    if ns.startswith("tensorflow"):\n        return support_for("onnx")\n'
                      '    return {"pytorch/2/eager": 1}\n')
    assert sorted(line for line, _ in backend_knowledge(sample)) == [2, 3, 6, 7, 8]


def _defined_names(tree):
    """Names a module defines at its top level (functions, classes,
    assignments, imports, also inside top-level ``if``/``try`` blocks), and
    whether it has a module ``__getattr__`` (PEP 562: it may define more)."""
    names, lazy = set(), False

    def visit(body):
        nonlocal lazy
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                lazy = lazy or node.name == "__getattr__"
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                    if isinstance(target, ast.Name) and target.id == "__getattr__":
                        lazy = True
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names.add((alias.asname or alias.name).split(".")[0])
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", ()):
                    visit(handler.body)
                visit(getattr(node, "finalbody", ()))
    visit(tree.body)
    return names, lazy


def _all_names(tree):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return None   # computed: not checked here
    return None


def test_every_name_in_all_is_defined():
    """A name listed in a module's ``__all__`` but defined nowhere breaks
    ``from module import *`` (three tool-support modules kept a removed
    function's name there)."""
    missing = []
    for module, path in sorted(MODULES.items()):
        tree = ast.parse(path.read_text(), filename=str(path))
        listed = _all_names(tree)
        if not listed:
            continue
        names, lazy = _defined_names(tree)
        if lazy:
            continue
        missing += [f"{module}: {name}" for name in listed if name not in names]
    assert missing == []
