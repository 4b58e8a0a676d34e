"""Graph-level instrumentation: ``amanda.instrument(program, *tools)``.

Returns the instrumented program of the same kind and never modifies the
input: this is how instrumented graphs are exported. Supported kinds, by the
module the program's type comes from:

* ``amanda.ir.Graph`` -> ``amanda.ir.Graph`` with one ``amanda.routine`` op per
  action (see :mod:`amanda.passes.lower_actions`);
* ``tf.Graph`` / ``GraphDef`` -> ``GraphDef`` of an instrumented copy whose
  routines are in-process callbacks;
* ``onnx.ModelProto`` -> ``onnx.ModelProto`` (portable routines as ONNX
  nodes, others as Python custom ops hosted by this process).
"""

from __future__ import annotations

from amanda import controls
from amanda.errors import BackendError
from amanda.runtime import backends
from amanda.tool import session_for


def instrument(program, *tools):
    """Instrument a whole program at once with ``tools``.

    Args:
        program: an :class:`amanda.ir.Graph`, a ``tf.Graph``, a ``GraphDef``,
            an ``onnx.ModelProto``, or a PyTorch graph capture
            (:func:`amanda.runtime.pytorch.capture.capture`).
        *tools: the tools to apply (with their dependencies).

    Returns:
        The instrumented program, of the same kind (a ``GraphDef`` for TF).

    Raises:
        BackendError: no backend instruments programs of this kind.
        ToolError: an analysis routine failed.
    """
    if hasattr(program, "instrument") and callable(program.instrument):
        # programs that instrument themselves (a PyTorch CapturedProgram)
        return program.instrument(*tools)
    from amanda.ir import Graph
    if isinstance(program, Graph):
        instrumenter = instrument_ir
    else:
        backend = backends.for_program(program)
        if backend is None:
            supported = ["amanda.ir"] + [b.name for b in backends.all_backends()
                                         if b.instrument is not None]
            raise BackendError(f"amanda.instrument cannot instrument a "
                               f"{type(program).__name__} (supported: "
                               f"{', '.join(supported)} programs)")
        instrumenter = backend.part("instrument")
    session = session_for(tools)
    with controls.muted():   # analysis calls are not instrumented
        return instrumenter(program, session)


def instrument_ir(graph, session):
    """``amanda.instrument`` for an :class:`amanda.ir.Graph`."""
    from amanda.ir import Graph
    from amanda.passes.instrumentation import GraphBackend
    from amanda.passes.pipeline import instrument_graph
    if not isinstance(graph, Graph):
        raise BackendError(f"amanda.instrument cannot instrument a {type(graph).__name__}")
    return instrument_graph(graph, session, GraphBackend(graph.namespace),
                            name="amanda.instrument")[1]
