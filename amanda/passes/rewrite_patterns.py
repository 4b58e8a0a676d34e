"""Patterns for subgraph rewriting: small IR graphs to look for, with constraints.

Part of `amanda.passes.rewrite` (import the names from there): a `Pattern` wraps a
pattern graph whose inputs are wildcards; `Pattern.trace` builds one from a plain
function over ``op.Type(...)`` calls. Matching is in `rewrite_matching`, the rules
and the driver in `rewrite`.
"""

from __future__ import annotations

from amanda.errors import AmandaError
from amanda.ir import Graph


class RewriteError(AmandaError):
    """A pattern or rule is malformed, or a replacement is inconsistent."""


class _Any:
    def __repr__(self):
        return "ANY"


#: An attr value in a pattern op that matches any value (or no value).
ANY = _Any()

# Pattern-op attr keys that configure matching rather than being compared.
EXTRA_INPUTS = "$extra_inputs"
_CONTROL_KEYS = frozenset({EXTRA_INPUTS})


# ---------------------------------------------------------------------------
# Patterns
# ---------------------------------------------------------------------------


class Pattern:
    """A small IR graph to look for, with constraints.

    Args:
        graph: the pattern graph; its inputs are wildcards, its outputs the
            tensors a replacement must provide (the first one's producer is the
            anchor).
        constraints: ``{name: predicate or [predicate, ...]}`` where ``name`` is
            a pattern op or pattern input name and ``predicate(target, match)``
            gets the graph op (or the bound tensor) and the `Match` so far and
            returns a bool. Give a predicate a readable ``__name__`` or use
            `constraint` to name it: explanations quote the name.
        commutative: op types whose two inputs may match in either order.
        name: the pattern's name in messages.

    Raises:
        RewriteError: the pattern has no outputs, an output is a wildcard, an op
            is not an ancestor of the anchor, or a constraint names nothing.
    """

    def __init__(self, graph, constraints=None, commutative=(), name=None):
        self.graph = graph
        self.name = name or graph.name
        self.commutative = frozenset(commutative)
        self.constraints = {}
        for key, predicates in (constraints or {}).items():
            if callable(predicates):
                predicates = [predicates]
            self.constraints[key] = list(predicates)
        self._check()

    @property
    def anchor(self):
        """The pattern op matching starts from."""
        return self.graph.outputs[0].producer

    @property
    def anchor_types(self):
        """The op types an anchor candidate may have."""
        return frozenset(self.anchor.type.split("|"))

    @classmethod
    def trace(cls, fn, constraints=None, commutative=(), name=None, namespace=""):
        """Builds a pattern from a plain Python function over symbolic ops.

        ``fn`` receives one wildcard per parameter and returns one value (or a
        tuple); inside it, ``op("Conv2D", x, w)`` or ``op.Conv2D(x, w)`` (see
        `PatternOps`) records a pattern op, whose result is its first output;
        ``value.output(i)`` reads another output::

            def conv_bn(x, w, scale, offset, mean, var):
                return op.FusedBatchNormV3(op.Conv2D(x, w), scale, offset, mean, var)

        Args:
            fn: the function; its parameter names name the wildcards.
            constraints, commutative: as for `Pattern`.
            name: the pattern's name (``fn.__name__`` if None).
            namespace: the namespace of the recorded ops ("" matches any).

        Returns:
            A `Pattern`.
        """
        import inspect

        graph = Graph(name or fn.__name__, namespace=namespace)
        params = list(inspect.signature(fn).parameters)
        values = [_Value(graph.add_input(p)) for p in params]
        token = _TRACING.push(graph)
        try:
            result = fn(*values)
        finally:
            _TRACING.pop(token)
        results = result if isinstance(result, (tuple, list)) else [result]
        for r in results:
            if not isinstance(r, _Value):
                raise RewriteError(f"pattern function {fn.__name__!r} must return values made by op(...), "
                                   f"got {type(r).__name__}")
        graph.set_outputs([r.tensor for r in results])
        return cls(graph, constraints=constraints, commutative=commutative, name=name or fn.__name__)

    def _check(self):
        graph = self.graph
        if not graph.outputs:
            raise RewriteError(f"pattern {self.name!r} has no outputs")
        for t in graph.outputs:
            if t.producer is None:
                raise RewriteError(f"pattern {self.name!r}: output %{t.name} is a wildcard, not an op output")
        reached = set()
        stack = [self.anchor]
        while stack:
            op = stack.pop()
            if op in reached:
                continue
            reached.add(op)
            stack.extend(t.producer for t in op.inputs if t.producer is not None)
        stray = [op.name for op in graph if op not in reached]
        if stray:
            raise RewriteError(f"pattern {self.name!r}: ops {stray} are not ancestors of the anchor "
                               f"{self.anchor.name!r}; matching starts at the anchor")
        op_names, input_names = {op.name for op in graph}, {t.name for t in graph.inputs}
        if op_names & input_names:
            raise RewriteError(f"pattern {self.name!r}: {sorted(op_names & input_names)} name both an op and "
                               "a wildcard; constraints and Match[...] look nodes up by name")
        names = op_names | input_names
        unknown = sorted(set(self.constraints) - names)
        if unknown:
            raise RewriteError(f"pattern {self.name!r}: constraints name {unknown}, which are neither "
                               f"ops nor inputs of the pattern ({sorted(names)})")

    def __repr__(self):
        return f"<Pattern {self.name!r}: {len(self.graph)} ops, anchor {self.anchor.type}>"


def constraint(description):
    """Decorator naming a predicate for explanations: ``@constraint("is 2-D")``."""
    def wrap(predicate):
        predicate.description = description
        return predicate
    return wrap


def _describe_predicate(predicate):
    return getattr(predicate, "description", None) or getattr(predicate, "__name__", repr(predicate))


class _Tracing:
    """The pattern graph `op(...)` records into (a stack, for nested traces)."""

    def __init__(self):
        self.graphs = []

    def push(self, graph):
        self.graphs.append(graph)
        return len(self.graphs)

    def pop(self, token):
        del self.graphs[token - 1:]

    def current(self):
        if not self.graphs:
            raise RewriteError("op(...) records pattern ops only inside Pattern.trace")
        return self.graphs[-1]


_TRACING = _Tracing()


class _Value:
    """A symbolic tensor while a pattern function is traced."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def output(self, index):
        """Another output of the op that produced this value."""
        producer = self.tensor.producer
        if producer is None or index >= len(producer.outputs):
            raise RewriteError(f"%{self.tensor.name} has no sibling output {index}")
        return _Value(producer.outputs[index])


class PatternOps:
    """Records pattern ops while a function is traced by `Pattern.trace`.

    ``op(type, *inputs, num_outputs=1, name=None, extra_inputs=False, **attrs)``
    records one op; ``op.Type(*inputs, ...)`` is the same with the type as an
    attribute name. Attrs given become requirements on the matched op.
    """

    def __call__(self, type, *inputs, num_outputs=1, name=None, extra_inputs=False, **attrs):
        graph = _TRACING.current()
        for value in inputs:
            if not isinstance(value, _Value):
                raise RewriteError(f"pattern op {type!r}: inputs must be wildcards or op results, "
                                   f"got {value!r} (put constants in constraints)")
        if extra_inputs:
            attrs[EXTRA_INPUTS] = True
        op = graph.create_op(type, [v.tensor for v in inputs], num_outputs=max(num_outputs, 1),
                             attrs=attrs, name=name or type.split("|")[0].split(".")[-1])
        return _Value(op.outputs[0])

    def __getattr__(self, type):
        if type.startswith("__"):
            raise AttributeError(type)
        return lambda *inputs, **kw: self(type, *inputs, **kw)


#: The recorder used inside pattern functions: ``op.Conv2D(x, w)``.
op = PatternOps()
