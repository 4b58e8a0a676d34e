"""Call targets named by graph files: resolved only through explicit tables.

A graph read from JSON is data, yet some ops name Python callables: an op of a
captured PyTorch graph carries ``attrs["target"] = "aten.conv2d.default"`` and
lowering calls whatever that name resolves to. Resolving any importable name
would let an edited file run ``os.system``; so a name is turned into an object
only by the *target resolver* registered for the op's namespace, which looks
it up in an explicit table of operators and refuses everything else.

The IR imports no backend, so it holds only the registry. A backend registers
its resolver for a namespace prefix (``"pytorch"`` covers
``"pytorch/2.13.0/graph"``) with `register_target_resolver`. The PyTorch table
lives in `amanda.frontends.pytorch.targets`, which the backend's descriptor
names (``target_provider``); reading a PyTorch graph file loads it (and torch)
on demand through `provider_finder`, which the backend registry
(`amanda.runtime.backends`) sets: the IR imports nothing above it.

`graph_from_json` calls `check_targets` on every graph it reads: an op whose
target is not in the table is refused there, when the file is read, with an
`IRError` naming the op and the target, long before anything is lowered. The
runtime resolves through `resolve_target` again when lowering, so a graph
edited in memory gets the same table.

Which ops are checked: every op other than ``amanda.routine`` with a
``target`` attr whose own namespace, or whose graph's namespace, has a resolver
(routine ops use ``target`` for the *name* of the op they instrument, and their
routine is never restored from a file). Ops of namespaces no backend resolves
are left alone: nothing will ever call their targets.
"""

import threading

from .errors import IRError

#: Op type of lowered actions (`amanda.passes.lower_actions.ROUTINE`; the IR
#: cannot import passes). Their ``target`` attr is an op name, not a callable.
ROUTINE = "amanda.routine"

#: ``provider_finder(namespace)`` loads the module that registers the
#: resolver of ``namespace``'s backend, if it has one (raising ImportError
#: when it cannot be loaded), and returns its name or None. Set by the backend
#: registry; only the modules backends name as target providers are loaded.
provider_finder = None

_resolvers = {}
_lock = threading.Lock()


class TargetResolver:
    """What a backend registers: the table of call targets of its namespace.

    Subclasses override `resolve` and may override `check_graph`.
    """

    def resolve(self, name):
        """Returns the callable the table holds under ``name``.

        Args:
            name: The qualified target name stored in the graph.

        Returns:
            The object to call.

        Raises:
            LookupError: ``name`` is not in the table; the message says why.
        """
        raise LookupError(f"{name!r} is not in the table")

    def check_graph(self, graph):
        """Checks the backend's other data in a graph just read (optional).

        Raises:
            LookupError: Something in the graph would resolve to an object
                outside the table; the message names it.
        """


def register_target_resolver(namespace, resolver):
    """Registers ``resolver`` for the ops of ``namespace`` and the namespaces below it.

    Args:
        namespace: A namespace prefix, matched by path segment (``"pytorch"``
            matches ``"pytorch/2.13.0/graph"``, not ``"pytorchx"``).
        resolver: A `TargetResolver`.
    """
    with _lock:
        _resolvers[namespace.rstrip("/")] = resolver


def resolver_for(namespace):
    """The resolver of ``namespace`` (the longest registered prefix), or None.

    A namespace whose backend names a target provider loads it first
    (`provider_finder`).

    Raises:
        IRError: The provider module could not be imported (for PyTorch: torch
            is not installed), so the namespace's targets cannot be vetted.
    """
    if not isinstance(namespace, str):
        return None
    found = _longest_prefix(_resolvers, namespace)
    if found is not None:
        return _resolvers[found]
    if provider_finder is None:
        return None
    try:
        provider = provider_finder(namespace)
    except ImportError as error:
        raise IRError(f"cannot check the call targets of namespace {namespace!r}: its table "
                      f"could not be loaded ({error})") from error
    if provider is None:
        return None
    found = _longest_prefix(_resolvers, namespace)
    return _resolvers[found] if found is not None else None


def resolve_target(namespace, name, op=None):
    """Resolves a call target through the table of ``namespace``.

    Args:
        namespace: The namespace whose resolver is used.
        name: The target name.
        op: The op naming it, for the message (optional).

    Returns:
        The callable.

    Raises:
        IRError: No table covers ``namespace`` or ``name`` is not in it.
    """
    resolver = resolver_for(namespace)
    if resolver is None:
        raise IRError(f"{_who(op)}names call target {name!r}, but no table of call targets "
                      f"covers namespace {namespace!r}")
    if not isinstance(name, str):
        raise IRError(f"{_who(op)}names a call target that is not a string: {name!r}")
    try:
        return resolver.resolve(name)
    except LookupError as error:
        raise IRError(f"{_who(op)}names call target {name!r}, which is not in the table of "
                      f"allowed targets for {namespace!r}: {_reason(error)}") from None


def check_targets(graph):
    """Refuses a graph naming a call target outside its namespace's table.

    Nested graphs are not visited: `graph_from_json` checks each as it reads it.

    Args:
        graph: A graph just read from a file.

    Raises:
        IRError: An op names a target outside the table (the message names the
            op and the target), or the backend's `TargetResolver.check_graph`
            refused other data of the graph.
    """
    if not _names_anything(graph):
        return  # e.g. an eager trace: readable without loading any backend's table
    graph_resolver = resolver_for(graph.namespace)
    for op in graph:
        if op.type == ROUTINE or "target" not in op.attrs:
            continue
        own = resolver_for(op.namespace) if op.namespace != graph.namespace else graph_resolver
        if own is None and graph_resolver is None:
            continue
        resolve_target(op.namespace if own is not None else graph.namespace, op.attrs["target"], op)
    if graph_resolver is not None:
        try:
            graph_resolver.check_graph(graph)
        except LookupError as error:
            raise IRError(f"graph {graph.name!r}: {_reason(error)}") from None


def _names_anything(graph):
    """Whether the graph holds a name a backend could resolve (a call target or an attribute path)."""
    return ("output_targets" in graph.attrs or any("target" in t.attrs for t in graph.inputs)
            or any("target" in op.attrs and op.type != ROUTINE for op in graph))


def _longest_prefix(table, namespace):
    best = None
    for prefix in table:
        if namespace == prefix or namespace.startswith(prefix + "/"):
            if best is None or len(prefix) > len(best):
                best = prefix
    return best


def _who(op):
    return f"op {op.name!r} ({op.type}) " if op is not None else ""


def _reason(error):
    # KeyError wraps its message in quotes; the others print it as given.
    return error.args[0] if error.args else type(error).__name__
