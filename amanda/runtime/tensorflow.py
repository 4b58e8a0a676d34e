"""TensorFlow graph-mode driver: ``Session.run`` and ``tf.function`` calls
execute an instrumented copy.

Inside ``amanda.apply``, ``Session.run`` and concrete functions' ``_call_flat``
are intercepted (the two patches, removed when the outermost scope exits). The
user's graph is lifted into the IR, the tools' analysis routines run over it
(the shared instrumentation pass), the recorded actions are lowered to
``amanda.routine`` IR ops, and those are realised in a *copy* of the user's
graph, which a shadow session runs. The user's graph is never modified: same
operations, same collections.

* Analysis runs while the graph is rewritten; instrumentation routines run
  every time the op executes, as ``tf.numpy_function`` callbacks receiving
  NumPy arrays (None for tensors that cannot leave TensorFlow).
* Rewrites are cached per graph version; when the user's graph grows, the
  pass reuses the previous plan (only new ops are analysed) and only new
  operations are imported into the copy.
* Variables: the shadow session receives the user session's variable values
  at the first instrumented run of each ``apply`` scope and hands them back
  when the scope ends, through the user graph's own read and initializer
  ops (fed), so checkpoints and later plain runs see the trained values and
  no instrumentation state.
* Ops inside the function bodies of ``While``/``If``/``Case`` and
  ``PartitionedCall`` are points too, with ids ``"<call op>/<attribute>/<node>"``
  (`_BodyRewrite`): each body with routines becomes a renamed function in the
  copy's library, called by a stateful twin of the call op; ops of gradient
  bodies are backward points mapped to the forward body's ops.
* While analysis routines run, `evaluate` computes values of the user's
  tensors (uninstrumented, with the current variable values and the inputs of
  the run being rewritten) and `current_session` returns the user's session.

How it all fits together, and its limits, is in ``docs/tensorflow.md``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import threading
import warnings
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.client import session as _tf_session
from tensorflow.python.util import nest
from tensorflow.python.eager.polymorphic_function import concrete_function as _concrete

from amanda import controls, portable
from amanda.errors import (AmandaError, BackendError, NotBitExactWarning, NotInstrumentedWarning,
                           ToolError)
from amanda.ir import Graph
from amanda.passes.instrumentation import GraphBackend
from amanda.passes.pipeline import instrument_graph as run_pipeline
from amanda.passes.lower_actions import ROUTINE, lower_actions
from amanda.runtime import swapped
from amanda.runtime.routines import call_routine, check_replacements

__all__ = ["NAMESPACE", "current_session", "evaluate"]

NAMESPACE = f"tensorflow/{tf.__version__}/graph"
_original_run = _tf_session.BaseSession.run
_original_call_flat = _concrete.ConcreteFunction._call_flat


class TFGraphBackend(GraphBackend):
    """Contexts see the user's graph: ``get_op()`` is its ``tf.Operation``,
    ``get_inputs()`` its symbolic ``tf.Tensor`` objects."""

    namespace = NAMESPACE

    def __init__(self, tf_graph):
        super().__init__()
        self.tf_graph = tf_graph

    def raw_op(self, ir_op):
        return self.tf_graph.get_operation_by_name(ir_op.name)

    def values(self, ir_tensors):
        return [self._tensor(t) for t in ir_tensors]

    def _tensor(self, ir_tensor):
        if ir_tensor.producer is None:
            return None
        return self.tf_graph.get_operation_by_name(ir_tensor.producer.name).outputs[ir_tensor.index]


class _BodiesBackend(TFGraphBackend):
    """A gradient body's contexts: its own ops, and the forward body ops they
    differentiate, each looked up in the graph that holds it."""

    def __init__(self, tf_graphs):
        super().__init__(tf_graphs[0])
        self.tf_graphs = tf_graphs

    def raw_op(self, ir_op):
        for graph in self.tf_graphs:
            try:
                return graph.get_operation_by_name(ir_op.name)
            except KeyError:
                continue
        raise KeyError(ir_op.name)

    def _tensor(self, ir_tensor):
        if ir_tensor.producer is None:
            return None
        return self.raw_op(ir_tensor.producer).outputs[ir_tensor.index]


# -- values for analysis routines -----------------------------------------------

_analysis = threading.local()


def current_session():
    """The user's ``tf.compat.v1.Session`` whose ``run`` is being instrumented.

    Only meaningful while analysis routines (or mapping rules) run: the
    session then holds the current variable values (amanda hands the shadow
    session's values back first if needed), and ``run`` on it executes the
    user's graph uninstrumented.

    Returns:
        The session, or None outside analysis and while a ``tf.function`` is
        being rewritten (use `evaluate` there).
    """
    probe = getattr(_analysis, "probe", None)
    return None if probe is None else probe.session()


def evaluate(tensors):
    """Values of tensors of the graph being rewritten, as NumPy arrays.

    Call it from an analysis routine or a mapping rule, e.g. to read a
    weight: ``evaluate(context.get_inputs()[1])``. The tensors are computed
    without instrumentation, from the current variable values and the inputs
    of the ``Session.run`` (its ``feed_dict``) or ``tf.function`` call being
    rewritten. Each call runs the graph once, so batch tensors in one call.

    Args:
        tensors: a ``tf.Tensor`` of the user's graph (what ``get_inputs()``
            and ``get_outputs()`` return), or a list of them.

    Returns:
        One array, or a list of arrays for a list.

    Raises:
        BackendError: called outside analysis in TensorFlow graph mode.
    """
    probe = getattr(_analysis, "probe", None)
    if probe is None:
        raise BackendError("amanda.runtime.tensorflow.evaluate() works only while analysis "
                           "routines run on a TensorFlow graph")
    if isinstance(tensors, (list, tuple)):
        return list(probe.evaluate(list(tensors)))
    return probe.evaluate([tensors])[0]


def _probing(probe):
    return swapped(_analysis, "probe", probe)


class _SessionProbe:
    """`evaluate` for a ``Session.run``: runs the user session uninstrumented
    with that run's feeds."""

    def __init__(self, shadow, feed_dict):
        self.shadow = shadow
        self.feed_dict = feed_dict

    def session(self):
        # the newest variable values may live in the shadow session; they are
        # only handed back when asked for, as that copies every variable
        _hand_back(self.shadow.user_session)
        return self.shadow.user_session

    def evaluate(self, tensors):
        return _original_run(self.session(), tensors, self.feed_dict or None)


class _FunctionProbe:
    """`evaluate` for a ``tf.function`` call: an uninstrumented copy of the
    function graph, pruned to the requested tensors, called with the call's
    inputs (variables are captured by handle: their current values)."""

    def __init__(self, function_graph, flat_inputs):
        self.function_graph = function_graph
        self.flat_inputs = flat_inputs
        self.plain = None

    def session(self):
        return None

    def evaluate(self, tensors):
        if self.plain is None:
            self.plain = tf.compat.v1.wrap_function(lambda: None, [])
            with self.plain.graph.as_default():
                tf.import_graph_def(self.function_graph.as_graph_def(), name="")
        graph = self.plain.graph
        feeds = [graph.get_tensor_by_name(t.name) for t in self.function_graph.inputs]
        pruned = self.plain.prune(feeds, [graph.get_tensor_by_name(t.name) for t in tensors])
        pruned._amanda_copy = True
        return [t.numpy() for t in pruned(*self.flat_inputs)]


# -- routines as callbacks ----------------------------------------------------------


def _is_array(value):
    return isinstance(value, (np.ndarray, np.generic))


def _crosses_to_python(dtype):
    """Whether tensors of ``dtype`` can be handed to a Python routine.

    Not handles (resource, variant), strings, nor references to v1
    variables (``float32_ref``: the op reading one may assign to it, which a
    copy made in Python would silently break).
    """
    return not dtype._is_ref_dtype and dtype not in (tf.resource, tf.variant, tf.string)


def _read_only(array):
    """A view the routine cannot write through: the array may share memory
    with a TensorFlow buffer (a variable's, even), which an in-place update
    would silently change for every other reader."""
    if isinstance(array, np.ndarray) and array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def _meta(array):
    return tuple(array.shape), array.dtype


def _tool_error(action, where, message):
    return ToolError(f"instrumentation routine ({action.kind}) {message}", tool=action.tool,
                     routine=action.func, op_name=where[0], op_id=where[1], namespace=where[2])


# A routine's error is raised on one of TensorFlow's threads and comes back as
# an UnknownError carrying only its text; the error itself waits here, under a
# token named in that text, until Session.run or the function call re-raises it.
_failures = {}
_failures_lock = threading.Lock()
_failure_tokens = itertools.count()
_FAILURE_MARK = "amanda-routine-failure-"


class _RoutineFailed(Exception):
    """What a hosted callback raises into TensorFlow (see `_surface`)."""


def _failed(error):
    with _failures_lock:
        while len(_failures) >= 256:   # failures nobody re-raised (e.g. a GraphDef run by hand)
            _failures.pop(next(iter(_failures)))
        token = next(_failure_tokens)
        _failures[token] = error
    return _RoutineFailed(f"{_FAILURE_MARK}{token}: {error}")


@contextlib.contextmanager
def _surface():
    """Turn the TensorFlow error that a failing hosted routine caused back
    into the amanda error it raised (with the routine's exception as its
    ``__cause__``); other TensorFlow errors pass unchanged."""
    try:
        yield
    except tf.errors.OpError as exc:
        match = _FAILURE_RE.search(exc.message or "")
        if match is None:
            raise
        with _failures_lock:
            error = _failures.pop(int(match.group(1)), None)
        if error is None:
            raise
        cause = error.__cause__
        if cause is None:
            raise error from exc
        _keep_cause(error, cause)
        raise error from cause


class _CauseKept:
    """Keeps an error's ``__cause__`` readable after ``tf.function``'s
    traceback filter re-raises it ``from None`` (which clears it)."""

    @property
    def __cause__(self):
        cause = BaseException.__cause__.__get__(self)
        return cause if cause is not None else self._amanda_cause

    @__cause__.setter
    def __cause__(self, value):
        BaseException.__cause__.__set__(self, value)


_cause_kept_types = {}


def _keep_cause(error, cause):
    kind = type(error)
    if not issubclass(kind, _CauseKept):
        kept = _cause_kept_types.get(kind)
        if kept is None:
            kept = _cause_kept_types[kind] = type(kind.__name__, (_CauseKept, kind),
                                                  {"__module__": kind.__module__})
        error.__class__ = kept
    error._amanda_cause = cause


_FAILURE_RE = re.compile(_FAILURE_MARK + r"(\d+)")


def _hosting(action, where, run):
    """Run ``run`` as a callback: every error becomes an amanda error that
    `_surface` re-raises in the caller's thread."""

    def callback(*arrays):
        try:
            with controls.muted():   # TF may call it in the user's thread: a routine's own runs stay plain
                return run(*arrays)
        except AmandaError as exc:
            raise _failed(exc) from None
        except Exception as exc:   # amanda's own bug: still name the routine
            error = _tool_error(action, where, f"failed in amanda: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            raise _failed(error) from None

    return callback


def _chosen(original, new, flag):
    """``new`` where ``flag`` is True, else ``original`` itself.

    Switch and Merge forward one of the two tensors without touching their
    data: the cheapest way to let the original tensor flow on when the
    routine returned None.
    """
    kept, _ = tf.raw_ops.Switch(data=original, pred=flag)
    _, replaced = tf.raw_ops.Switch(data=new, pred=flag)
    chosen = tf.raw_ops.Merge(inputs=[kept, replaced]).output
    return _shaped(chosen, original.shape)


def _shaped(tensor, shape):
    """``tensor``, its static ``shape`` stated in the graph itself.

    ``set_shape`` informs Python only: Grappler infers shapes from the
    GraphDef, where a PyFunc's outputs (and a Merge reading one) have none.
    Without them it cannot fold shape computations or rewrite sums as it does
    in the plain graph (MobileNetV2's gradients came out summed in another
    order), so even an observing routine changed the numbers. EnsureShape
    gives Grappler the shape, at the cost of a check when the graph runs.
    """
    tensor.set_shape(shape)
    if shape.rank is None:
        return tensor
    return tf.ensure_shape(tensor, shape)


def _observer(action, where, count, hosted, dtypes):
    """The callback of a before/after routine.

    It receives the hosted tensors (read-only arrays; the others are None to
    the routine) and returns one flag per hosted tensor, then one array per
    hosted tensor: where the flag is False the graph lets the original
    tensor flow on and the array (a 0-d placeholder) is never read, so an
    observing routine feeds nothing of its own into the graph.
    """
    kept = [np.False_] * len(hosted) + [np.zeros((), d) for d in dtypes]

    def run(*arrays):
        values = [None] * count
        for i, array in zip(hosted, arrays):
            values[i] = _read_only(array)
        result = call_routine(action, values, _is_array, where)
        if not hosted:
            if result is not None and any(r is not None for r in result):
                raise _tool_error(action, where, "returned a replacement for a tensor that "
                                  "cannot leave TensorFlow (a resource handle, variant, string "
                                  "or variable reference)")
            return [np.int32(0)]
        if result is None:
            return kept
        for position, new in enumerate(result):
            if new is not None and values[position] is None:
                raise _tool_error(action, where, f"returned a replacement at selected position "
                                  f"{position}, a tensor that cannot leave TensorFlow (a resource "
                                  "handle, variant, string or variable reference)")
        check_replacements(action, values, result, _meta, where)
        flags, arrays_out = [], []
        for i, placeholder in zip(hosted, kept[len(hosted):]):
            new = result[i]
            flags.append(np.bool_(new is not None))
            # a copy: the routine may keep its array and change it later,
            # while TensorFlow still reads it
            arrays_out.append(placeholder if new is None else np.array(new, copy=True))
        return flags + arrays_out

    return _hosting(action, where, run)


def _replacer(action, where, shapes, dtypes):
    """The callback of a replace routine: the op's inputs in (read-only), one
    array per output of the op out, each with that output's dtype and a
    shape its static shape allows."""

    def run(*arrays):
        values = [_read_only(a) for a in arrays]
        try:
            result = action.func(*values, **action.kwargs)
        except AmandaError:
            raise
        except Exception as exc:
            raise _tool_error(action, where, f"raised {type(exc).__name__}: {exc}") from exc
        if _is_array(result):
            result = [result]
        if not isinstance(result, (list, tuple)) or len(result) != len(dtypes):
            raise _tool_error(action, where, f"must return {len(dtypes)} arrays, one per output "
                              f"of the op; got {type(result).__name__}")
        out = []
        for position, (new, shape, dtype) in enumerate(zip(result, shapes, dtypes)):
            if not _is_array(new) or new.dtype != dtype or not shape.is_compatible_with(new.shape):
                got = (f"{type(new).__name__}" if not _is_array(new)
                       else f"shape {list(new.shape)} and dtype {new.dtype}")
                raise _tool_error(action, where, f"returned {got} for output {position}, which "
                                  f"has shape {shape} and dtype {np.dtype(dtype)}; a routine must "
                                  "keep the shape and dtype of the tensor it replaces")
            out.append(np.array(new, copy=True))
        return out

    return _hosting(action, where, run)


def _user_stacklevel():
    """The ``stacklevel`` that makes a warning name the user's line (the
    first caller outside amanda and TensorFlow)."""
    import sys
    skip = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            os.path.dirname(os.path.abspath(tf.__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


# Ops of a function body that are its plumbing, not computation.
_BODY_PLUMBING = frozenset({"Placeholder", "Const", "Identity", "IdentityN", "NoOp"})


def _ops_in_bodies(ir_graph):
    """The call ops of ``ir_graph`` (``While``, ``If``, ``PartitionedCall``...)
    whose function bodies compute something, each with the number of
    computing ops in its bodies (nested bodies included)."""
    def count(graph):
        total = 0
        for op in graph.ops:
            total += op.type not in _BODY_PLUMBING
            total += sum(count(v) for v in op.attrs.values() if isinstance(v, Graph))
        return total
    found = []
    for op in ir_graph.ops:
        if op.type in _BODY_ATTRS:
            continue   # instrumented op by op (`_BodyRewrite`)
        bodies = [v for v in op.attrs.values() if isinstance(v, Graph)]
        if bodies:
            n = sum(count(body) for body in bodies)
            if n:
                found.append((op, n))
    return found


# Call ops whose function bodies are instrumented op by op: the attributes
# naming the functions they run (a list for Case), and the stateful twin a
# call becomes once its body holds a routine (a callback is stateful).
_BODY_ATTRS = {
    "While": ("cond", "body"), "StatelessWhile": ("cond", "body"),
    "If": ("then_branch", "else_branch"), "StatelessIf": ("then_branch", "else_branch"),
    "Case": ("branches",), "StatelessCase": ("branches",),
    "PartitionedCall": ("f",), "StatefulPartitionedCall": ("f",),
}
_STATEFUL_TWIN = {"StatelessWhile": "While", "StatelessIf": "If", "StatelessCase": "Case",
                  "PartitionedCall": "StatefulPartitionedCall"}
_body_names = itertools.count()


def _called_functions(node):
    """``(label, NameAttrList)`` per function a call NodeDef runs; the
    label is the attribute, ``"branches/<i>"`` for Case's list (TF op names
    cannot hold ONNX's ``[i]``)."""
    for attr in _BODY_ATTRS.get(node.op, ()):
        if attr not in node.attr:
            continue
        value = node.attr[attr]
        if value.HasField("func"):
            yield attr, value.func
        elif value.HasField("list"):
            for index, func in enumerate(value.list.func):
                yield f"{attr}/{index}", func


class _BodyProbe:
    """`evaluate` inside a body: its values exist once per execution of the
    body (each iteration, or never), so there is none to compute."""

    def __init__(self, outer, prefix):
        self.outer = outer
        self.prefix = prefix

    def session(self):
        return None if self.outer is None else self.outer.session()

    def evaluate(self, tensors):
        raise BackendError(f"evaluate: tensors of the function body {self.prefix!r} have a value "
                           "per execution of the body (each loop iteration, or none), not one "
                           "per run; read them in an instrumentation routine instead")


class _BodyRewrite:
    """One function body, instrumented: a `_GraphRewrite` of the body's
    graph, and the FunctionDef realising it (None when no routine landed in
    it nor in a body nested in it: the call keeps the user's function).

    The body's ops are imported under ``prefix`` (``"while/body"``) into a
    graph of their own, so their names are their point ids and ``get_op()``
    is the op of that graph; the copy keeps those names, and the new
    function's signature is the original one (same arguments, same results,
    in order).
    """

    def __init__(self, holder, label, fdef, library, amanda_session, outer_probe,
                 gradient_of=None):
        from tensorflow.python.framework.func_graph import FuncGraph
        self.holder = holder
        self.prefix = prefix = f"{holder}/{label}"
        self.original = fdef
        user, inputs, outputs = _prefixed_body(prefix, fdef, library)
        self.user = user
        self.rewrite = _GraphRewrite(user, amanda_session, FuncGraph(f"{prefix}/amanda"))
        self.rewrite.gradient_of = gradient_of
        self.rewrite.whole = False
        self.rewrite.refresh(_BodyProbe(outer_probe, prefix))
        self.fdef = None
        if self.rewrite.realised or any(b.fdef is not None for b in self.rewrite.bodies):
            self.fdef = self._function(inputs, outputs)

    def forward_names(self):
        """{name a gradient scope may give a forward op of this body: its id}.

        Gradient scopes name an op as it was when the body was traced; a
        FunctionDef may have renamed the node (``mul`` -> ``mul_0`` where an
        output is called ``mul``), which its ``ret`` map records."""
        names = {}
        for node in self.original.node_def:
            names[node.name] = f"{self.prefix}/{node.name}"
        for output, source in self.original.ret.items():
            node = source.split(":")[0]
            if node in names:
                names.setdefault(output, names[node])
        return names

    def functions(self):
        """This body's FunctionDef and those of the bodies nested in it."""
        found = [self.fdef]
        for body in self.rewrite.bodies:
            if body.fdef is not None:
                found.extend(body.functions())
        return found

    def _function(self, inputs, outputs):
        from tensorflow.python.framework.graph_to_function_def import graph_to_function_def
        copy, rewrite = self.rewrite.copy, self.rewrite
        ins = [copy.get_tensor_by_name(name) for name in inputs]
        outs = [rewrite.tensor(name) for name in outputs]
        user_ops = {op.name for op in self.user.get_operations()}
        routines = [op for op in copy.get_operations()
                    if op.name not in user_ops and op._is_stateful]
        if routines and outs:
            # the body's results wait on every routine: a routine on an
            # argument (or after an op whose result is not returned) is tied
            # to nothing else, and a lowered If would drop it with the
            # branch's control outputs unless something read them
            with copy.as_default():
                done = tf.raw_ops.NoOp(name="amanda/routines_done")
                for routine in routines:
                    done._add_control_input(routine)
                outs = [tf.identity(t, name="amanda/result") for t in outs]
            for out in outs:
                out.op._add_control_input(done)
        original = self.original
        fdef = graph_to_function_def(copy, copy.get_operations(), ins, outs,
                                     [a.name for a in original.signature.output_arg])
        fdef.signature.name = f"{original.signature.name}_amanda_{next(_body_names)}"
        fdef.signature.is_stateful = True
        for key in original.attr:
            fdef.attr[key].CopyFrom(original.attr[key])
        for index in original.arg_attr:
            fdef.arg_attr[index].CopyFrom(original.arg_attr[index])
        # ops that must run though no result needs them: the user's own (a
        # variable update) and every routine, which only a control edge may
        # tie to the body (a routine on an argument, or after an op whose
        # result is not returned)
        kept = {f"{self.prefix}/{node}" for node in original.control_ret.values()}
        kept.update(op.name for op in routines)
        for k, name in enumerate(sorted(kept)):
            label = f"amanda_keep_{k}"
            fdef.signature.control_output.append(label)
            fdef.control_ret[label] = name
        return fdef


class _Library:
    """A FunctionDefLibrary, and a graph holding its functions (built once,
    on first need: rebuilding a body resolves the calls in it there)."""

    def __init__(self, proto):
        self.proto = proto
        self._graph = None

    def graph(self):
        if self._graph is None:
            self._graph = tf.Graph()
            holder = tf.compat.v1.GraphDef()
            holder.library.CopyFrom(self.proto)
            with self._graph.as_default():
                tf.import_graph_def(holder, name="")
        return self._graph


def _prefixed_body(prefix, fdef, library):
    """The body of ``fdef`` (a function of the `_Library` ``library``) as a
    FuncGraph whose ops are named ``"<prefix>/<node>"``, with its input
    placeholders' and output tensors' names."""
    from tensorflow.python.framework.func_graph import FuncGraph
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph
    with library.graph().as_default():
        plain = function_def_to_graph(fdef)
    graph_def = plain.as_graph_def()
    graph_def.library.CopyFrom(library.proto)
    _drop_outer_colocation(graph_def)
    user = FuncGraph(prefix)
    with user.as_default():
        tf.import_graph_def(graph_def, name=prefix)
    inputs = [f"{prefix}/{t.name}" for t in plain.inputs]
    outputs = [f"{prefix}/{t.name}" for t in plain.outputs]
    user.inputs = [user.get_tensor_by_name(name) for name in inputs]
    user.outputs = [user.get_tensor_by_name(name) for name in outputs]
    return user, inputs, outputs


def _drop_outer_colocation(graph_def):
    """Remove colocation constraints (``_class: loc:@op``) naming ops outside
    the body (a gradient body's nodes name the forward call op): importing
    the body on its own would fail on them."""
    names = {node.name for node in graph_def.node}
    for node in graph_def.node:
        if "_class" not in node.attr:
            continue
        kept = [c for c in node.attr["_class"].list.s
                if not c.startswith(b"loc:@") or c[5:].decode() in names]
        if kept:
            del node.attr["_class"].list.s[:]
            node.attr["_class"].list.s.extend(kept)
        else:
            del node.attr["_class"]


class _GraphRewrite:
    """An instrumented copy of a user graph, kept up to date as it grows.

    Args:
        user_graph: the user's graph (never modified).
        amanda_session: the applied tools.
        copy: an empty graph to build the copy in (a ``tf.Graph`` or the
            FuncGraph of a wrapped function).
    """

    def __init__(self, user_graph, amanda_session, copy, rewrites=None):
        self.rewrites = rewrites    # () -> the Grappler options the copy runs under
        self.hosted = False         # a Python routine sits between two ops
        self.warned_exact = False
        self.user_graph = user_graph
        self.amanda_session = amanda_session
        self.copy = copy
        self.version = None
        self.plan = None
        self.realised = {}          # Action -> its tensors in the copy
        self.final = {}             # user tensor name -> what consumers read in the copy
        self.last_after = {}        # op name -> its last after-routine that passes no tensor
        self._bare_after = set()    # names of those routines
        self._bare_before = {}      # op name -> its before-routines that pass no tensor
        self._control_users = None  # op name -> copy ops having it as control input
        self.warned_bodies = set()  # call ops whose bodies' ops were said to be no points
        self.bodies = []            # _BodyRewrite per instrumented function body
        self._probe = None
        # a gradient function's body: the forward bodies (_BodyRewrite) its
        # ops differentiate, None for a graph that is no gradient body
        self.gradient_of = None
        self.whole = True           # a whole program (graph tools get it), not a function body

    def refresh(self, probe=None):
        """Bring the copy up to date with the user's graph.

        Args:
            probe: what `evaluate` and `current_session` use meanwhile.

        Returns:
            Whether anything was rewritten (False on a cache hit).
        """
        version = self.user_graph.version
        if version == self.version:
            return False
        from amanda.frontends.tensorflow import lift_graph
        ir_graph = lift_graph(self.user_graph, namespace=NAMESPACE)
        self._warn_bodies(ir_graph)
        with _probing(probe):   # analysis may evaluate tensors of the user's graph
            if self.gradient_of is not None:
                with controls.muted():
                    self.plan = self._analyse_gradient_body(ir_graph)
                lowered = lower_actions(ir_graph, self.plan)
            else:
                self.plan, lowered = run_pipeline(
                    ir_graph, self.amanda_session, TFGraphBackend(self.user_graph),
                    plan=self.plan, name="tensorflow", whole=self.whole)
        self._probe = probe
        self._import_new_ops()
        self._realise(lowered)
        self.version = version
        self._warn_inexact()
        return True

    def _analyse_gradient_body(self, ir_graph):
        """The plan of a gradient function's body: all its ops are backward
        ops; one named after a forward body op's gradient scope
        (``gradients/mul_grad/Mul``) gets that op as its forward op, and its
        context starts from that op's context, as at top level.

        The shared pass looks forward ops up in the plan of the graph it
        analyses; these live in the forward body's plan, so the backward
        analysis is run here per op, with both plans' ops in view.
        """
        from amanda.frontends.tensorflow import forward_op_of
        from amanda.passes.instrumentation import InstrumentationPlan, _analyse_backward
        prefix = self.user_graph.name + "/"
        known = InstrumentationPlan(ir_graph)
        names, graphs = {}, [self.user_graph]
        for body in self.gradient_of:
            known.ops.update(body.rewrite.plan.ops)
            names.update(body.forward_names())
            graphs.append(body.user)
        backend = _BodiesBackend(graphs)
        plan = InstrumentationPlan(ir_graph)
        for op in ir_graph.ops:
            local = op.name[len(prefix):] if op.name.startswith(prefix) else op.name
            owner = forward_op_of(local, names) if names else None
            op.attrs["backward"] = True
            op.attrs["forward_op"] = names[owner] if owner is not None else None
            plan.ops[op.name] = known.ops[op.name] = _analyse_backward(
                op, ir_graph, self.amanda_session, backend, known)
        return plan

    def _warn_inexact(self):
        """Say once that Grappler may compute the copy's floats in another
        order than the plain graph's (docs/tensorflow.md, Bit-exactness).

        Grappler's arithmetic optimizer re-associates chains of ``Mul``/``Add``
        and its constant folding folds ``c1 * (c2 * x)``; a hosted routine
        between two ops of such a chain (even one that returns None) keeps
        them apart, so the last bits may differ. Portable routines are TF ops
        and Grappler sees through them. Nothing is said when both rewrites
        are off."""
        if self.warned_exact or not self.hosted or self.rewrites is None:
            return
        on = [name for name, enabled in self.rewrites().items() if enabled]
        if not on:
            return
        self.warned_exact = True
        warnings.warn(
            "amanda (TensorFlow): Python routines sit between the graph's ops; Grappler's "
            f"{' and '.join(on)} rewrite float expressions of the plain graph that the "
            "routines keep apart, so outputs may differ from an uninstrumented run in the "
            "last bits, even with routines that return None. They are bit-identical with "
            "those rewrites off (rewrite_options.arithmetic_optimization / constant_folding "
            "= OFF in the session config; tf.config.optimizer.set_experimental_options("
            "{'arithmetic_optimization': False, 'constant_folding': False}) for "
            "tf.function), or with portable routines. See docs/tensorflow.md, Bit-exactness.",
            NotBitExactWarning, stacklevel=_user_stacklevel())

    def _warn_bodies(self, ir_graph):
        """Say, once per call op, that the ops in its function bodies are not
        points of their own (docs/tensorflow.md, Limits)."""
        calls = [(op, count) for op, count in _ops_in_bodies(ir_graph)
                 if op.name not in self.warned_bodies]
        if not calls:
            return
        self.warned_bodies.update(op.name for op, _ in calls)
        listed = ", ".join(f"{op.name!r} ({op.type}, {count} ops)" for op, count in calls[:5])
        more = f" and {len(calls) - 5} more" if len(calls) > 5 else ""
        warnings.warn(
            f"amanda (TensorFlow): {sum(c for _, c in calls)} ops inside the function "
            f"bodies of {len(calls)} call op(s) are not instrumented one by one; only the "
            f"call ops are points: {listed}{more}. See docs/tensorflow.md, Limits.",
            NotInstrumentedWarning, stacklevel=_user_stacklevel())

    def tensor(self, name):
        """The tensor of the copy that stands for the user's tensor ``name``.

        Where its op has after-routines that pass no tensor, the tensor is read
        through an identity that waits for them, so fetching it runs them too
        (a fetched gradient has no consumer that would wait on them).
        """
        final = self.final.get(name)
        if final is not None:
            return final
        tensor = self.copy.get_tensor_by_name(name)
        last = self.last_after.get(tensor.op.name)
        if last is not None:
            with self.copy.as_default():
                tensor = tf.identity(tensor, name="amanda/fetch")
            # the edge goes on the new identity only: tf.control_dependencies
            # would also set an attribute on `last`, which may already have run
            # in a session (TF then warns that the mutation has no effect)
            tensor.op._add_control_input(last)
            self.final[name] = tensor
        return tensor

    def operation(self, name):
        """What to run in the copy for the user's operation ``name``: the op,
        or its last after-routine when that passes no tensor (so fetching an
        op with no outputs, e.g. a training op, still runs its routines)."""
        last = self.last_after.get(name)
        return last if last is not None else self.copy.get_operation_by_name(name)

    def _import_new_ops(self):
        graph_def = self.user_graph.as_graph_def()
        present = {op.name for op in self.copy.get_operations()}
        new_nodes = [node for node in graph_def.node if node.name not in present]
        if not new_nodes:
            return
        # the nodes are copies (as_graph_def): calls of instrumented bodies
        # are redirected here, before they reach the copy
        added = self._instrument_bodies(new_nodes, graph_def.library)
        new_names = {node.name for node in new_nodes}
        input_map = {}
        for node in new_nodes:
            for name in node.input:
                op_name = name.lstrip("^").split(":")[0]
                if op_name not in new_names:
                    input_map[name] = self._copy_element(name)
        part = tf.compat.v1.GraphDef()
        part.versions.CopyFrom(graph_def.versions)
        part.library.CopyFrom(graph_def.library)
        part.library.function.extend(added)
        part.node.extend(new_nodes)
        with self.copy.as_default():
            tf.import_graph_def(part, input_map=input_map, name="")

    def _instrument_bodies(self, nodes, library):
        """Instrument the function bodies called by ``nodes`` (in place).

        Each body a call op runs (`_BODY_ATTRS`) is analysed as a graph of
        its own, its ops named ``"<call op>/<attribute>/<node>"``; a body
        that gets routines (or holds a call whose body does) is realised as a
        renamed copy of its function, and the node calls that copy; a
        stateless call becomes its stateful twin, a routine being stateful.

        Returns:
            The new FunctionDefs (nested ones included) for the library.
        """
        fdefs = {f.signature.name: f for f in library.function}
        functions = _Library(library)
        added = []
        for node in nodes:
            changed = False
            gradient_of = self._gradient_of(node.name)
            for label, func in _called_functions(node):
                fdef = fdefs.get(func.name)
                if fdef is None:
                    continue
                try:
                    body = _BodyRewrite(node.name, label, fdef, functions, self.amanda_session,
                                        self._probe, gradient_of)
                except AmandaError:
                    raise
                except Exception as exc:   # a body TF cannot rebuild: run it as it is
                    warnings.warn(
                        f"amanda (TensorFlow): the ops of function {func.name!r} "
                        f"({node.name}/{label}) are not instrumented one by one: it could not "
                        f"be rebuilt ({type(exc).__name__}: {exc}). See docs/tensorflow.md, "
                        "Limits.", NotInstrumentedWarning, stacklevel=_user_stacklevel())
                    continue
                self.bodies.append(body)
                self.hosted = self.hosted or body.rewrite.hosted
                if body.fdef is not None:
                    func.name = body.fdef.signature.name
                    added.extend(body.functions())
                    changed = True
            if changed:
                node.op = _STATEFUL_TWIN.get(node.op, node.op)
        return added

    def _gradient_of(self, call_name):
        """For a call op that is a gradient op (the gradient of a While is
        another While): the bodies of its forward op, whose ops its bodies'
        ops differentiate ([] when unknown). None for a forward call op."""
        if self.gradient_of is not None:
            return []   # nested in a gradient body: backward too
        entry = self.plan.ops.get(call_name) if self.plan is not None else None
        if entry is None or not entry.op.attrs.get("backward"):
            return None
        forward = entry.op.attrs.get("forward_op")
        return [body for body in self.bodies if forward is not None and body.holder == forward]

    def _copy_element(self, name):
        if name.startswith("^"):
            return self.copy.get_operation_by_name(name[1:])
        op_name, _, index = name.partition(":")
        outputs = self.copy.get_operation_by_name(op_name).outputs
        if int(index or 0) >= len(outputs):
            # TF changes some ops in place after they were built: tf.gradients
            # of a While/If adds outputs to the forward op. The copy holds the
            # op as it was when amanda first copied it.
            raise BackendError(
                f"the op {op_name!r} of the user's graph changed after it was instrumented "
                f"(it has more outputs now than its copy's {len(outputs)}): TensorFlow adds "
                "outputs to a While/If when tf.gradients differentiates it after the graph "
                "ran. TensorFlow cannot run that graph in the same session either; call "
                "tf.compat.v1.experimental.output_all_intermediates(True) before building "
                "the loop, or build the gradients before the first run")
        return outputs[int(index or 0)]

    def _realise(self, lowered):
        made = {}  # IR routine op -> its tensors in the copy
        self._control_users = None
        with self.copy.as_default():
            for op in lowered.ops:
                if op.type == ROUTINE:
                    made[op] = self._routine(op, made)
                else:
                    self._rewire(op, made)
        self._control_users = None

    def _tensor_in_copy(self, ir_tensor, made):
        producer = ir_tensor.producer
        if producer is None:
            raise BackendError(f"tensor {ir_tensor.name!r} has no producer in the TF graph")
        if producer.type == ROUTINE:
            return made[producer][ir_tensor.index]
        return self.copy.get_operation_by_name(producer.name).outputs[ir_tensor.index]

    def _routine(self, op, made):
        action = op.attrs["action"]
        tensors = self.realised.get(action)
        if tensors is not None:
            return tensors
        target = self.copy.get_operation_by_name(op.attrs["target"])
        where = (target.type, target.name, NAMESPACE)
        if action.ad:
            raise BackendError(f"{action.kind} of {where[1]!r}: amanda.ad_enabled() actions "
                               "cannot be differentiated in TensorFlow graph mode (the "
                               "gradient ops are already built)")
        inputs = [self._tensor_in_copy(t, made) for t in op.inputs]
        replacing = op.attrs["kind"].startswith("replace")
        like = list(target.outputs) if replacing else inputs
        if portable.is_portable(action.func):
            tensors = self._native(action, where, inputs, like, replacing, target)
            self.realised[action] = tensors
            self._record_final(op, tensors)
            return tensors
        hosted = [i for i, t in enumerate(like) if _crosses_to_python(t.dtype)]
        if replacing and (len(hosted) != len(like) or len(inputs) != len(
                [t for t in inputs if _crosses_to_python(t.dtype)])):
            raise BackendError(f"replace routine of {where[1]!r}: TensorFlow can only host "
                               "routines over numeric tensors, not resource handles")
        name = f"amanda/{action.kind}"
        self.hosted = True
        if replacing:
            func = _replacer(action, where, [t.shape for t in like],
                             [t.dtype.as_numpy_dtype for t in like])
            tensors = tf.numpy_function(func, inputs, [t.dtype for t in like], stateful=True,
                                        name=name)
            tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
            routine = tensors[0].op if tensors else None
            tensors = [_shaped(new, old.shape) for new, old in zip(tensors, like)]
        elif not hosted:   # nothing to pass: a bare callback ordered by control edges
            func = _observer(action, where, len(inputs), hosted, [])
            routine = tf.numpy_function(func, [tf.constant(0)], [tf.int32], stateful=True,
                                        name=name)[0].op
            self._order(op.attrs["kind"], target, routine)
            tensors = list(like)
        else:
            dtypes = [like[i].dtype for i in hosted]
            func = _observer(action, where, len(inputs), hosted,
                             [d.as_numpy_dtype for d in dtypes])
            results = tf.numpy_function(func, [inputs[i] for i in hosted],
                                        [tf.bool] * len(hosted) + dtypes, stateful=True,
                                        name=name)
            routine = results[0].op
            tensors = list(like)
            for i, flag, new in zip(hosted, results, results[len(hosted):]):
                tensors[i] = _chosen(like[i], new, flag)
        if routine is not None:
            origins = [self.copy.get_tensor_by_name(_origin(t)) for t in op.inputs]
            self._before_writers(routine, origins, inputs)
            if op.attrs["kind"].startswith("after"):
                # a before-routine passing no tensor is a control input of the
                # op, which never runs when the op is fed (a placeholder) or
                # folded (a Const under Grappler): waiting on it here makes an
                # op that gets its after-routines get its before-routines too
                for before in self._bare_before.get(target.name, ()):
                    routine._add_control_input(before)
        self.realised[action] = tensors
        self._record_final(op, tensors)
        return tensors

    def _native(self, action, where, inputs, like, replacing, target):
        """Lower a portable routine as TF ops: call it once on the copy's
        symbolic tensors (see :mod:`amanda.portable`)."""
        with tf.name_scope(f"amanda/{action.kind}"):
            results = call_routine(action, inputs, tf.is_tensor, where)
        if replacing and (results is None or len(results) != len(like)):
            raise _tool_error(action, where, f"must return {len(like)} tensors, one per "
                              "output of the op")
        tensors = list(like)
        for i, new in enumerate(results or ()):
            if new is None or new is like[i] or like[i].dtype._is_ref_dtype:
                continue   # a v1 variable reference must stay one (its op may assign)
            # checked here, once: a dynamic dimension is only known when the
            # graph runs, and then it is TensorFlow's own shape checks that apply
            if new.dtype != like[i].dtype or not new.shape.is_compatible_with(like[i].shape):
                raise _tool_error(action, where, f"returned a tensor of shape {new.shape} and "
                                  f"dtype {new.dtype.name} at selected position {i}, replacing "
                                  f"one of shape {like[i].shape} and dtype {like[i].dtype.name}; "
                                  "a routine must keep the shape and dtype of the tensor it "
                                  "replaces")
            new.set_shape(like[i].shape)
            tensors[i] = new
        return tensors

    def _before_writers(self, routine, origins, inputs):
        """Order ``routine`` before the stateful ops that were ordered after
        the producers of its inputs.

        A ``tf.function`` orders a variable's reads before its later updates
        with control edges from the read ops; a routine reading such a value
        must also be done before the update runs, as the op it instruments
        would have been.

        Args:
            routine: the routine op.
            origins: the user's tensors behind its inputs (in the copy).
            inputs: its inputs (outputs of earlier routines, possibly).
        """
        for tensor in origins:
            if not any(t.dtype == tf.resource or t.dtype._is_ref_dtype
                       for t in tensor.op.inputs):
                continue   # only reads of variables are ordered before their writes
            for writer in self._waiting_on(tensor.op):
                if (writer._is_stateful and writer is not routine
                        and not self._reaches(writer, inputs)):
                    writer._add_control_input(routine)

    @staticmethod
    def _reaches(start, inputs, limit=10000):
        """Whether ``start`` is an ancestor of one of ``inputs`` (an edge from
        the routine reading them to ``start`` would close a cycle); also True
        when the search gives up after ``limit`` ops."""
        goals = {t.op for t in inputs}
        seen, stack = {start}, [start]
        while stack:
            op = stack.pop()
            if op in goals or len(seen) > limit:
                return True
            followers = [c for out in op.outputs for c in out.consumers()]
            followers += op._control_outputs
            for follower in followers:
                if follower not in seen:
                    seen.add(follower)
                    stack.append(follower)
        return False

    def _order(self, kind, target, routine):
        """Make a routine that passes no tensor run before/after its op.

        After-routines run in the order they were recorded, each after the op
        and before everything that reads the op's outputs or waits on it.
        """
        if kind.startswith("before"):
            # a fed placeholder never runs, nor do its control inputs; its
            # after-routines wait on the routine (in _routine), and an edge to
            # the placeholder would let Grappler drop theirs as redundant
            if target.type != "Placeholder":
                target._add_control_input(routine)
            self._bare_before.setdefault(target.name, []).append(routine)
            return
        previous = self.last_after.get(target.name, target)
        routine._add_control_input(previous)
        # also wait on the op's own before-routines directly: Grappler may
        # remove the op (a no-op Reshape, say) and hand its control edges to
        # its inputs, which would let the after-routine run first
        for before in self._bare_before.get(target.name, ()):
            routine._add_control_input(before)
        waiting = [c for output in target.outputs for c in output.consumers()]
        waiting += self._waiting_on(target)
        for op in waiting:
            # earlier routines of the chain wait on the op too: they must not
            # wait on this one as well (a cycle)
            if op is not routine and op.name not in self._bare_after:
                op._add_control_input(routine)
        self._bare_after.add(routine.name)
        self.last_after[target.name] = routine

    def _waiting_on(self, target):
        """Ops of the copy with ``target`` as a control input (indexed once
        per rewrite: scanning the graph per routine is quadratic)."""
        if self._control_users is None:
            index = {}
            for op in self.copy.get_operations():
                for control in op.control_inputs:
                    index.setdefault(control.name, []).append(op)
            self._control_users = index
        return list(self._control_users.get(target.name, ()))

    def _record_final(self, op, tensors):
        kind = op.attrs["kind"]
        if kind.startswith("replace"):
            target = self.copy.get_operation_by_name(op.attrs["target"])
            for original, new in zip(target.outputs, tensors):
                self.final[original.name] = new
        elif kind.startswith("after"):
            for ir_input, new in zip(op.inputs, tensors):
                self.final[_origin(ir_input)] = new

    def _rewire(self, op, made):
        tf_op = None
        for position, ir_input in enumerate(op.inputs):
            if ir_input.producer is None or ir_input.producer.type != ROUTINE:
                continue
            tf_op = tf_op or self.copy.get_operation_by_name(op.name)
            new = made[ir_input.producer][ir_input.index]
            if tf_op.inputs[position] is not new:
                tf_op._update_input(position, new)


def _origin(ir_tensor):
    """Name of the user tensor behind a chain of routine ops."""
    while ir_tensor.producer.type == ROUTINE:
        ir_tensor = ir_tensor.producer.inputs[ir_tensor.index]
    return f"{ir_tensor.producer.name}:{ir_tensor.index}"


class _Shadow:
    """The instrumented copy of one user session's graph, and its session."""

    def __init__(self, user_session, session):
        self.user_session = user_session
        self.user_graph = user_session.graph
        config = user_session._config
        self.rewrite = _GraphRewrite(self.user_graph, session, tf.Graph(),
                                     lambda: _session_rewrites(config))
        self.copy = self.rewrite.copy
        self.session = None
        self.sync = _VariableSync(self)
        self._elements = {}   # user fetch/feed element -> its counterpart in the copy

    def refresh(self, feed_dict):
        if self.user_graph.version != self.rewrite.version:
            if self.rewrite.refresh(_SessionProbe(self, feed_dict)):
                self._elements.clear()
        if self.session is None:
            self.session = tf.compat.v1.Session(graph=self.copy,
                                                config=getattr(self.user_session, "_config", None))
            self.session._amanda_shadow = True

    def close(self):
        """Free the shadow session (its user session was closed)."""
        if self.session is not None:
            self.session.close()
            self.session = None

    def run(self, fetches, feed_dict, options, run_metadata):
        """``Session.run`` of the copy, answering exactly as the user's
        session would: TensorFlow's own fetch handler flattens the fetches
        (variables, sparse tensors, nested structures) into tensors and ops
        of the user's graph and rebuilds its answer from their values."""
        feeds, fed = self._feeds(feed_dict)
        handler = _tf_session._FetchHandler(self.user_graph, fetches, fed)
        tensors = handler.fetches()
        mapped = [self._cached_fetch(t) for t in tensors]
        mapped += [self._cached_fetch(op) for op in handler.targets()]
        values = []
        if mapped:
            with _surface():
                values = _original_run(self.session, mapped, feeds or None, options,
                                       run_metadata)
        return handler.build_results(self.user_session, values[:len(tensors)])

    def _feeds(self, feed_dict):
        """The feeds for the copy, and the user's fed tensors with their
        values (a fetched feed is answered with the fed value, as TF does)."""
        if not feed_dict:
            return {}, {}
        feeds, fed = {}, {}
        for key, value in nest.flatten_dict_items(feed_dict).items():
            for subkey, subvalue in _expand_feed(key, value):
                tensor = self._cached(("feed", subkey), self._feed_tensor, subkey)
                feeds[self._cached(("copy", tensor.name), self._feed_key, tensor)] = subvalue
                try:
                    fed[tensor.ref()] = np.asarray(subvalue, tensor.dtype.as_numpy_dtype)
                except (TypeError, ValueError):
                    pass   # the run of the copy reports it, as TF would
        return feeds, fed

    def _cached_fetch(self, element):
        return self._cached(element, self._fetch, element)

    def _cached(self, key, compute, element):
        """Mapping a fetch costs graph lookups; a training loop fetches the
        same elements every run (the memo is cleared when the copy grows)."""
        try:
            return self._elements[key]
        except (KeyError, TypeError):   # TypeError: an unhashable element
            mapped = compute(element)
            try:
                self._elements[key] = mapped
            except TypeError:
                pass
            return mapped

    def _fetch(self, element):
        if isinstance(element, tf.Tensor):
            return self.rewrite.tensor(element.name)
        if isinstance(element, tf.Operation):
            return self.rewrite.operation(element.name)
        raise BackendError(f"amanda cannot map the fetch {element!r} to the instrumented graph")

    def _feed_tensor(self, key):
        try:
            return self.user_graph.as_graph_element(key, allow_tensor=True, allow_operation=False)
        except Exception as exc:   # TF's own wording and type
            raise TypeError(f"Cannot interpret feed_dict key as Tensor: {exc.args[0]}") from exc

    def _feed_key(self, tensor):
        return self.copy.get_tensor_by_name(tensor.name)


def _expand_feed(key, value):
    """``(tensor or name, value)`` pairs for one ``feed_dict`` entry, split as
    ``Session.run`` splits it (a SparseTensor key feeds three tensors)."""
    for kind, _, expand, _ in _tf_session._REGISTERED_EXPANSIONS:
        if isinstance(key, kind):
            return expand(key, value)
    raise TypeError(f"{key} in argument `feed_dict` has invalid type \"{type(key).__name__}\"")


class _VariableSync:
    """Copies variable values between a user session and its shadow.

    The user side uses only the user graph's existing read and initializer ops
    (fed), so the user's graph gets no new op. The copy side uses ops of its
    own, on their own handles to the same variables, so a sync never runs an
    instrumentation routine placed on a variable op.
    """

    def __init__(self, shadow):
        self.shadow = shadow
        self._copy_ops = {}

    def _variables(self):
        """(name, read tensor in user graph, assign op in user graph) per variable.

        Only ops that run nothing but themselves are used: a read or assign
        with a control input (``var.assign(var * mask)`` under
        ``tf.control_dependencies([train_op])``, or the read TensorFlow adds
        after a resource variable's assign) would run the user's other ops
        during a sync (a training step, a placeholder the run does not feed),
        and an assign must write the variable itself, not take a reference
        variable as its value.
        """
        graph = self.shadow.user_graph
        found = []
        for op in graph.get_operations():
            if op.type == "VarHandleOp":
                reads, assigns = ("ReadVariableOp",), ("AssignVariableOp",)
            elif op.type in ("VariableV2", "Variable"):
                reads, assigns = (), ("Assign",)
            else:
                continue
            consumers = op.outputs[0].consumers()
            read = op.outputs[0] if not reads else next(
                (c.outputs[0] for c in consumers if c.type in reads and _runs_alone(c)), None)
            assign = next((c for c in consumers
                           if c.type in assigns and _runs_alone(c)
                           and c.inputs[0].name == op.outputs[0].name
                           and graph.is_feedable(c.inputs[1])),
                          None)
            if read is not None:
                found.append((op.name, read, assign))
        return found

    def _read(self, run, session, tensors):
        """Values of the initialised variables: {index: value}."""
        try:
            return dict(enumerate(run(session, list(tensors))))
        except tf.errors.FailedPreconditionError:
            values = {}
            for i, tensor in enumerate(tensors):
                try:
                    values[i] = run(session, tensor)
                except tf.errors.FailedPreconditionError:
                    pass
            return values

    def _copy_side(self, variables):
        """(placeholder, assign op, read tensor) in the copy per variable that
        the copy has; built on first need (the copy is ours to extend)."""
        copy, ops = self.shadow.copy, self._copy_ops
        present = {op.name for op in copy.get_operations()}
        missing = [(name, read) for name, read, _ in variables
                   if name not in ops and name in present]
        if missing:
            with copy.as_default(), tf.name_scope("amanda_sync"):
                for name, read in missing:
                    ops[name] = _sync_ops(copy.get_operation_by_name(name), read.dtype)
        return ops

    def into_shadow(self):
        """User session -> shadow session (initialised variables only)."""
        variables = self._variables()
        values = self._read(_original_run, self.shadow.user_session, [r for _, r, _ in variables])
        side = self._copy_side(variables)
        assigns, feeds = [], {}
        for i, value in values.items():
            entry = side.get(variables[i][0])
            if entry is None:
                continue
            placeholder, assign, _ = entry
            assigns.append(assign)
            feeds[placeholder] = value
        if assigns:
            _original_run(self.shadow.session, assigns, feeds)

    def out_of_shadow(self):
        """Shadow session -> user session (variables initialised in the shadow)."""
        if getattr(self.shadow.user_session, "_closed", False) or self.shadow.session is None:
            return  # the user closed it inside the scope: its state is gone anyway
        variables = self._variables()
        side = self._copy_side(variables)
        variables = [v for v in variables if v[0] in side]
        values = self._read(_original_run, self.shadow.session,
                            [side[name][2] for name, _, _ in variables])
        assigns, feeds, missing = [], {}, []
        for i, value in values.items():
            name, _, assign = variables[i]
            if assign is None:
                missing.append(name)
                continue
            assigns.append(assign)
            feeds[assign.inputs[1]] = value
        if assigns:
            _original_run(self.shadow.user_session, assigns, feeds)
        if missing:
            warnings.warn("amanda could not hand these variables back to the user session "
                          f"(no fed assign op that runs alone): {', '.join(missing)}")


def _runs_alone(op):
    """Whether running ``op`` (its value input fed, if any) runs no other op
    of the user's graph than the variable it reads or writes: no control
    inputs. Consumers are in no fixed order (TensorFlow keeps them in a hash
    set), so this is checked, never assumed from the order."""
    return not op.control_inputs


def _sync_ops(var, dtype):
    """Placeholder, assign op and read tensor for the variable op ``var`` of
    the copy, on a handle of their own (same container and shared name: the
    same variable) so that routines on ``var`` do not run during a sync."""
    value = tf.compat.v1.placeholder(dtype)
    shared_name = var.get_attr("shared_name")
    container = var.get_attr("container")
    with tf.device(var.device):
        if var.type == "VarHandleOp":
            handle = var.outputs[0]
            if shared_name:   # an empty one would mean a different variable
                handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=var.get_attr("shape"),
                                                container=container, shared_name=shared_name)
            assign = tf.raw_ops.AssignVariableOp(resource=handle, value=value)
            reader = tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
        else:
            ref = tf.raw_ops.VariableV2(shape=var.get_attr("shape"), dtype=dtype,
                                        container=container,
                                        shared_name=shared_name or var.name)
            assign = tf.compat.v1.assign(ref, value, validate_shape=False).op
            reader = tf.identity(ref)
    return value, assign, reader


_EXACTNESS_REWRITES = ("arithmetic_optimization", "constant_folding")


def _session_rewrites(config):
    """{rewrite: on?} for the Grappler rewrites that break bit-exactness,
    under a session's ``ConfigProto`` (None: TF's defaults, all on)."""
    from tensorflow.core.protobuf import rewriter_config_pb2
    options = config.graph_options.rewrite_options if config is not None else None
    if options is not None and options.disable_meta_optimizer:
        return dict.fromkeys(_EXACTNESS_REWRITES, False)
    off = rewriter_config_pb2.RewriterConfig.OFF
    return {name: options is None or getattr(options, name) != off for name in _EXACTNESS_REWRITES}


def _function_rewrites():
    """The same for functions, from ``tf.config.optimizer``'s options."""
    options = tf.config.optimizer.get_experimental_options()
    if options.get("disable_meta_optimizer"):
        return dict.fromkeys(_EXACTNESS_REWRITES, False)
    return {name: options.get(name, True) for name in _EXACTNESS_REWRITES}


class _FunctionCopy:
    """An instrumented copy of a concrete function's graph, callable with the
    same flat inputs (captured variables are fed by handle: same state)."""

    def __init__(self, function, session):
        self.function = function
        self.wrapped = tf.compat.v1.wrap_function(lambda: None, [])
        self.rewrite = _GraphRewrite(function.graph, session, self.wrapped.graph,
                                     _function_rewrites)
        self.pruned = None

    def call(self, flat_inputs):
        probe = _FunctionProbe(self.function.graph, flat_inputs)
        if self.rewrite.refresh(probe) or self.pruned is None:
            graph = self.function.graph
            feeds = [self.rewrite.copy.get_tensor_by_name(t.name) for t in graph.inputs]
            fetches = [self.rewrite.tensor(t.name) for t in graph.outputs]
            self.pruned = self.wrapped.prune(feeds, fetches)
            self.pruned._amanda_copy = True
        with _surface():
            return self.pruned(*flat_inputs)


def _patched_call_flat(self, tensor_inputs, captured_inputs):
    sessions = controls.state.sessions
    if (not sessions or controls.state.disabled or getattr(_tls, "live", None) is None
            or getattr(self, "_amanda_copy", False) or not tf.executing_eagerly()):
        return _original_call_flat(self, tensor_inputs, captured_inputs)
    copy = _cached_per_session(sessions[-1], "tensorflow_functions", self, _FunctionCopy)
    flat = copy.call(list(tensor_inputs) + list(captured_inputs))
    return self.function_type.pack_output(flat)


def _cached_per_session(session, kind, user_object, make):
    """The amanda session's instrumented stand-in for a user session or
    function, made on first use and dropped with the user object."""
    table = session.caches.get(kind)
    if table is None:
        table = session.caches[kind] = weakref.WeakKeyDictionary()
    made = table.get(user_object)
    if made is None:
        made = table[user_object] = make(user_object, session)
    return made


def current_rewrite(user_session):
    """The instrumented copy (``.copy`` is its ``tf.Graph``) standing for
    ``user_session`` in the innermost ``amanda.apply`` scope, or None before
    its first instrumented run. For inspection and tests."""
    sessions = controls.state.sessions
    table = sessions[-1].caches.get("tensorflow") if sessions else None
    shadow = table.get(user_session) if table is not None else None
    return shadow.rewrite if shadow is not None else None


# -- the driver -------------------------------------------------------------------

_tls = threading.local()


def _hand_back(user_session):
    """Give ``user_session`` its newest variable values if a shadow holds
    them; the next instrumented run moves them into the shadow again."""
    live = getattr(_tls, "live", None)
    holder = None if live is None else live.pop(user_session, None)
    if holder is not None:
        holder.sync.out_of_shadow()


def _activate(shadow):
    """Move the variable values into ``shadow`` if another place holds them.

    Nested scopes with other tools use other shadows of the same user
    session; the values go through the user session from one to the other.
    """
    live = _tls.live
    holder = live.get(shadow.user_session)
    if holder is shadow:
        return
    if holder is not None:
        holder.sync.out_of_shadow()
    shadow.sync.into_shadow()
    live[shadow.user_session] = shadow


def _patched_run(self, fetches, feed_dict=None, options=None, run_metadata=None):
    sessions = controls.state.sessions
    if not sessions or getattr(_tls, "live", None) is None or getattr(self, "_amanda_shadow", False):
        return _original_run(self, fetches, feed_dict, options, run_metadata)
    if controls.state.disabled:   # amanda.disabled(), or a rule running the user's graph
        _hand_back(self)
        return _original_run(self, fetches, feed_dict, options, run_metadata)
    shadow = _cached_per_session(sessions[-1], "tensorflow", self, _Shadow)
    shadow.refresh(feed_dict)
    _activate(shadow)
    return shadow.run(fetches, feed_dict, options, run_metadata)


def _instrumenting(session):
    """Whether a run of ``session`` on this thread executes an instrumented copy."""
    return (bool(controls.state.sessions) and getattr(_tls, "live", None) is not None
            and not getattr(session, "_amanda_shadow", False) and not controls.state.disabled)


_original_do_run = _tf_session.BaseSession._do_run
_original_call_tf_sessionrun = _tf_session.BaseSession._call_tf_sessionrun
_original_partial_run_setup = _tf_session.BaseSession.partial_run_setup
_original_partial_run = _tf_session.BaseSession.partial_run


def _patched_do_run(self, *args):
    # marks the low-level runs that Session.run itself makes (see below)
    _tls.do_run = getattr(_tls, "do_run", 0) + 1
    try:
        return _original_do_run(self, *args)
    finally:
        _tls.do_run -= 1


def _patched_call_tf_sessionrun(self, options, feed_dict, fetch_list, target_list,
                                run_metadata):
    """Callables of ``Session.make_callable`` (made inside the scope or
    before it) run here without going through ``Session.run``: their fetches
    are mapped back to the user's graph and run instrumented."""
    if getattr(_tls, "do_run", 0) or not _instrumenting(self):
        return _original_call_tf_sessionrun(self, options, feed_dict, fetch_list, target_list,
                                            run_metadata)
    if options is not None or run_metadata is not None or feed_dict:
        raise BackendError("a Session.make_callable callable with RunOptions, RunMetadata or "
                           "feeds of its own cannot run instrumented inside amanda.apply; "
                           "use Session.run")
    graph = self.graph
    tensors = [graph._get_tensor_by_tf_output(output) for output in fetch_list]
    targets = [graph._get_operation_by_tf_operation(op) for op in target_list]
    return _patched_run(self, tensors + targets)[:len(tensors)]


def _refusing(original):
    """``original`` (a partial-run method), refused where runs are instrumented."""

    def refused(self, *args, **kwargs):
        if _instrumenting(self):
            raise BackendError("Session.partial_run / partial_run_setup cannot run instrumented "
                               "inside amanda.apply (a partial run is a stateful handle on the "
                               "user's graph); use Session.run, or run it under "
                               "amanda.disabled()")
        return original(self, *args, **kwargs)

    return refused


_SESSION_PATCHES = {
    "run": (_original_run, _patched_run),
    "_do_run": (_original_do_run, _patched_do_run),
    "_call_tf_sessionrun": (_original_call_tf_sessionrun, _patched_call_tf_sessionrun),
    "partial_run_setup": (_original_partial_run_setup, _refusing(_original_partial_run_setup)),
    "partial_run": (_original_partial_run, _refusing(_original_partial_run)),
}


class TensorFlowGraphDriver:
    """Intercepts ``Session.run`` and ``tf.function`` calls while any thread
    is inside ``apply``.

    Shadows (instrumented copies and their sessions) are cached per user
    session in the amanda session, so later scopes reuse the rewrite; variable
    values move into a shadow at its first run in a scope and back out when
    the outermost scope ends.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0

    def enter(self, session):
        depth = getattr(_tls, "depth", 0)
        _tls.depth = depth + 1
        if depth == 0:
            _tls.live = {}
            with self._lock:
                self._users += 1
                if self._users == 1:
                    for name, (_, patched) in _SESSION_PATCHES.items():
                        setattr(_tf_session.BaseSession, name, patched)
                    _concrete.ConcreteFunction._call_flat = _patched_call_flat

    def exit(self, session, restored):
        _tls.depth -= 1
        if _tls.depth:
            return
        live, _tls.live = _tls.live, None
        try:
            for user_session, shadow in live.items():
                if getattr(user_session, "_closed", False):
                    shadow.close()
                else:
                    shadow.sync.out_of_shadow()
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for name, (original, _) in _SESSION_PATCHES.items():
                        setattr(_tf_session.BaseSession, name, original)
                    _concrete.ConcreteFunction._call_flat = _original_call_flat


DRIVER = TensorFlowGraphDriver()


_EXPORTED = []   # rewrites whose GraphDefs were handed out: their callbacks stay registered


def instrument_graph(graph, session):
    """``amanda.instrument`` for a ``tf.Graph`` or ``GraphDef``: the GraphDef
    of an instrumented copy. Routines are ``tf.numpy_function`` callbacks
    registered in this process, so the result runs in this process only."""
    if isinstance(graph, tf.compat.v1.GraphDef):
        user = tf.Graph()
        with user.as_default():
            tf.import_graph_def(graph, name="")
        graph = user
    rewrite = _GraphRewrite(graph, session, tf.Graph())
    rewrite.refresh()
    _EXPORTED.append(rewrite)
    return rewrite.copy.as_graph_def()
