"""The backend registry: one descriptor per backend, one place that resolves them.

A backend is a unit: its packages (``amanda/frontends/<name>/``,
``amanda/runtime/<name>/``) and one :class:`Backend` descriptor that says
everything the framework-free rest of amanda needs to reach it. The
descriptor names its parts as ``"module:attribute"`` strings (or
``"module"`` for a whole module), loaded on first use, so that importing
amanda, or registering a backend, never imports a framework.

Everything outside a backend's packages reaches it through this module:
``apply`` asks :func:`active` for the drivers of the frameworks the user has
imported; ``evaluate`` and the portable vocabulary ask :func:`for_value`;
the op vocabulary (:mod:`amanda.runtime.vocabulary`) asks :func:`for_namespace`;
``amanda.instrument`` and ``amanda.export`` ask :func:`for_program` and
:func:`for_model`; tools ask :func:`for_namespace` for their tool support;
the IR loads call-target resolvers through :func:`load_target_provider`;
and every module amanda imports by name goes through :func:`load`.

Adding a backend is writing its packages and calling :func:`register` with
its descriptor (see docs/architecture.md, "Adding a backend").
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import threading

from amanda.errors import BackendError
from amanda.ir import targets as _targets

__all__ = ["Backend", "active", "all_backends", "for_model", "for_namespace",
           "for_program", "for_value", "get", "installed", "lazy_names", "load", "load_skipping_package", "load_source",
           "load_target_provider", "register", "unregister"]

#: Packages whose import registers a built-in backend. They import no
#: framework: each declares its descriptor and loads its runtime lazily.
BUILTIN = ("amanda.runtime.pytorch", "amanda.runtime.tensorflow", "amanda.runtime.onnx")


@dataclasses.dataclass(frozen=True)
class Backend:
    """What amanda needs to know of one backend.

    Every part but ``name`` is optional: a backend provides what it supports.
    Parts are ``"module:attribute"`` strings loaded on first use (see
    :meth:`part`), or the objects themselves.

    Attributes:
        name: the first part of the backend's namespaces (``"pytorch"`` for
            ``"pytorch/2.13.0/eager"``).
        frameworks: top-level modules whose presence in ``sys.modules`` means
            the user may run this backend's programs (``("torch",)``); the
            driver is entered by ``apply`` only then.
        value_modules: top-level modules of the tensor types this backend's
            ``evaluate`` reads and its portable ops compute on.
        program_modules: top-level modules of the program types
            ``amanda.instrument`` hands to ``instrument``.
        model_modules: top-level modules of the model types ``amanda.export``
            hands to ``export``.
        driver: the object ``apply`` enters and exits (``enter(session)``,
            ``exit(session, restored)``).
        evaluate: ``evaluate(values)`` -> NumPy arrays of backend tensors.
        instrument: ``instrument(program, session)`` -> the instrumented
            program of the same kind (``amanda.instrument``).
        export: ``export(model, args, tools, **options)`` -> an ONNX model.
        tool_support: the module of facts built-in tools ask of a backend
            (see :mod:`amanda.runtime.tool_support`).
        portable_ops: the module running the portable vocabulary on this
            backend's tensors (:mod:`amanda.portable`).
        target_provider: the module that registers the backend's call-target
            resolver when imported (:mod:`amanda.ir.targets`).
        vocabulary: the module of the backend's op facts: its ops' canonical
            types, input roles, layouts and attribute names (see
            :mod:`amanda.runtime.vocabulary`).
        rewrite_rules: the module of the backend's variants of the example
            rewrite rule sets (``fold_batchnorm_rules()``, ``gelu_tanh_rules()``,
            ``fake_quant_matmul_rules(...)``; :mod:`amanda.tools.rewrite_rules`).
    """

    name: str
    frameworks: tuple = ()
    value_modules: tuple = ()
    program_modules: tuple = ()
    model_modules: tuple = ()
    driver: object = None
    evaluate: object = None
    instrument: object = None
    export: object = None
    tool_support: object = None
    portable_ops: object = None
    target_provider: object = None
    vocabulary: object = None
    rewrite_rules: object = None

    def part(self, field):
        """The part named ``field``, loaded on first use; None when the
        backend has none."""
        cache = _loaded.setdefault(self.name, {})
        if field not in cache:
            cache[field] = load(getattr(self, field))
        return cache[field]


_registry = {}        # name -> Backend, in registration order
_loaded = {}          # name -> {field: loaded part}
_lock = threading.RLock()
_builtins_done = False


def load(reference):
    """The object a ``"module:attribute"`` (or ``"module"``) string names,
    imported now; any other value is returned as it is. The one place where
    amanda imports a module by name."""
    if not isinstance(reference, str):
        return reference
    module, _, attribute = reference.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attribute) if attribute else loaded


def lazy_names(package, table):
    """A module-level ``__getattr__`` for a backend package (PEP 562): each
    name of ``table`` (name -> the module defining it) is loaded from its
    module on first read, so the package itself imports no framework."""
    def __getattr__(name):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(load(module), name)
    return __getattr__


def register(backend):
    """Register ``backend`` (replacing one of the same name) and return it.

    Raises:
        BackendError: ``backend`` is not a :class:`Backend`, or has no name.
    """
    if not isinstance(backend, Backend) or not backend.name or "/" in backend.name:
        raise BackendError(f"amanda.runtime.backends.register takes a Backend with a name "
                           f"without '/', not {backend!r}")
    with _lock:
        _registry[backend.name] = backend
        _loaded.pop(backend.name, None)
    return backend


def unregister(name):
    """Remove the backend ``name`` (a no-op for an unknown name)."""
    with _lock:
        _registry.pop(name, None)
        _loaded.pop(name, None)


def all_backends():
    """Every registered backend, the built-in ones first."""
    _register_builtins()
    return list(_registry.values())


def get(name):
    """The backend named ``name``, or None."""
    _register_builtins()
    return _registry.get(name)


def for_namespace(namespace):
    """The backend of a namespace (``"onnx/21/graph"``) or backend name, or None."""
    return get((namespace or "").split("/", 1)[0])


def active():
    """The backends whose framework the user has imported, in registry order."""
    return [b for b in all_backends() if b.driver is not None
            and any(module in sys.modules for module in b.frameworks)]


def _by_module(field, value):
    module = type(value).__module__.split(".")[0]
    for backend in all_backends():
        if module in getattr(backend, field):
            return backend
    return None


def for_value(value):
    """The backend whose tensors ``value`` is one of, or None."""
    return _by_module("value_modules", value)


def for_program(program):
    """The backend that instruments programs of ``program``'s type, or None."""
    return _by_class("program_modules", "instrument", program)


def for_model(model):
    """The backend that exports models of ``model``'s type, or None."""
    return _by_class("model_modules", "export", model)


def _by_class(field, part, value):
    """The backend naming the module of ``value``'s class, or of one of its
    bases, in ``field`` and having ``part``."""
    for cls in type(value).__mro__:
        module = cls.__module__.split(".")[0]
        for backend in all_backends():
            if module in getattr(backend, field) and getattr(backend, part) is not None:
                return backend
    return None


def load_target_provider(namespace):
    """Load the module that registers the call-target resolver of
    ``namespace``'s backend (:mod:`amanda.ir.targets` calls this as its
    ``provider_finder``); returns its name, or None when the backend names none.

    Raises:
        ImportError: the module (or its framework) cannot be imported.
    """
    backend = for_namespace(namespace)
    if backend is None or backend.target_provider is None:
        return None
    backend.part("target_provider")
    return backend.target_provider


def installed(module):
    """Whether ``module`` can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):   # a parent missing; sys.modules[name] = None
        return False


def load_skipping_package(name):
    """Import the module ``name`` (``package.module``) without running its
    package's ``__init__`` where the package is not imported yet (that
    ``__init__`` may import a framework the module does not need); the
    package is left unimported. A package already imported is used as it is.

    Raises:
        ImportError: the module cannot be imported.
    """
    package = name.rpartition(".")[0]
    spec = None if package in sys.modules else importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return load(name)   # imported already, or not installed: the ImportError it raises
    sys.modules[package] = importlib.util.module_from_spec(spec)   # not executed
    try:
        return load(name)
    finally:
        del sys.modules[package]


def load_source(name, path):
    """Import the Python file ``path`` as module ``name`` (registered in
    ``sys.modules``, as ``python path`` would run it) and return the module."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _register_builtins():
    global _builtins_done
    if _builtins_done:
        return
    with _lock:
        if _builtins_done:
            return
        _builtins_done = True
        for package in BUILTIN:
            load(package)   # each registers its descriptor; no framework is imported


_targets.provider_finder = load_target_provider