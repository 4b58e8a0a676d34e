"""TensorFlow graph mode: the instrumented copy of a graph (`_GraphRewrite`)
and of a function body in it (`_BodyRewrite`).
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from amanda import portable
from amanda.errors import AmandaError, BackendError, NotInstrumentedWarning
from amanda.passes.pipeline import instrument_graph as run_pipeline
from amanda.passes.lower_actions import ROUTINE
from amanda.runtime.routines import call_routine
from amanda.runtime.tensorflow_bodies import (_BodyProbe, _Library, _STATEFUL_TWIN, _body_names,
                                              _called_functions, _gradient_body,
                                              _prefixed_body, _origin, _warn_xla_compiled,
                                              _xla_compiled)
from amanda.runtime.tensorflow_hosting import (_chosen, _crosses_to_python, _kept_constant,
                                               _observer, _replacer, _shaped, _tool_error,
                                               _user_stacklevel)
from amanda.runtime.tensorflow_liveness import (bare_trigger, has_v1_control_flow, live_feed,
                                                refuse_replacing)
from amanda.runtime.tensorflow_observe import _Observers, _reaches
from amanda.runtime.tensorflow_probes import NAMESPACE, TFGraphBackend, _probing
from amanda.runtime.tensorflow_warnings import warn_bodies, warn_inexact


def _structural_constant(tensor):
    """Whether ``tensor`` is an integer constant of the graph (shapes, axes,
    sizes): its value is part of the graph's structure."""
    return tensor.op.type == "Const" and tensor.dtype.is_integer


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
        self.rewrite.scope = prefix   # gradient ops mapped by their names in the function
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


def _numpy_function(graph, func, *args, **kwargs):
    """``tf.numpy_function`` in ``graph`` (the copy being built), with
    ``func`` kept alive by ``graph``. TensorFlow keeps a hosted function alive
    as long as the outermost graph around the one it is created in: for the
    copy of a ``tf.function`` that is the process's global eager graph, which
    never dies, so every routine (and through it its tool, the tool's
    sessions and their graphs) would be kept for the life of the process.
    The function is handed to the copy instead, which lives as long as amanda's
    cache entry for the user's function."""
    root = tf.compat.v1.get_default_graph()      # where TensorFlow starts its walk
    while getattr(root, "outer_graph", None) is not None and root.outer_graph is not root:
        root = root.outer_graph
    before = len(getattr(root, "_py_funcs_used_in_graph", ()))
    result = tf.numpy_function(func, *args, **kwargs)
    if root is not graph:
        kept = root._py_funcs_used_in_graph
        moved = kept[before:]
        del kept[before:]
        if not hasattr(graph, "_py_funcs_used_in_graph"):
            graph._py_funcs_used_in_graph = []
        graph._py_funcs_used_in_graph.extend(moved)
    return result


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
        self.scope = None           # a body's ops are named '<scope>/<node>'
        self.observers = _Observers()   # routines called after Session.run (off unless enabled)

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
        ir_graph = lift_graph(self.user_graph, namespace=NAMESPACE, scope=self.scope)
        warn_bodies(self, ir_graph)
        if self.gradient_of is not None:   # every op is a backward op of a forward body's op
            backend, forward = _gradient_body(ir_graph, self.user_graph, self.gradient_of)
        else:
            backend, forward = TFGraphBackend(self.user_graph), None
        with _probing(probe):   # analysis may evaluate tensors of the user's graph
            self.plan, lowered = run_pipeline(ir_graph, self.amanda_session, backend,
                                              plan=self.plan, name="tensorflow",
                                              whole=self.whole, forward=forward)
        self._probe = probe
        self._import_new_ops()
        self._realise(lowered)
        self.version = version
        warn_inexact(self)
        return True

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
        compiled = []   # (call op, function) run by XLA: Python routines cannot run inside
        for node in nodes:
            changed = False
            gradient_of = self._gradient_of(node.name)
            for label, func in _called_functions(node):
                fdef = fdefs.get(func.name)
                if fdef is None:
                    continue
                if _xla_compiled(node, fdef):
                    compiled.append((node.name, func.name))
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
        _warn_xla_compiled(compiled)
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
        self._v1_flow = None        # whether the user's graph has v1 control flow (asked once)
        with self.copy.as_default():
            for op in lowered.ops:
                if op.type == ROUTINE:
                    if op not in made:      # else made on demand by a reader
                        made[op] = self._routine(op, made)
                else:
                    self._rewire(op, made)
        self._control_users = None
        self.observers.link(lowered)

    def _tensor_in_copy(self, ir_tensor, made):
        producer = ir_tensor.producer
        if producer is None and ir_tensor.attrs.get("back_edge"):   # a loop's NextIteration
            return self.copy.get_tensor_by_name(ir_tensor.attrs["back_edge"])
        if producer is None:
            raise BackendError(f"tensor {ir_tensor.name!r} has no producer in the TF graph")
        if producer.type == ROUTINE:
            if producer not in made:
                # lowered order is not always data order: in a function body
                # (node order of a FunctionDef) a backward op's routine can
                # come before the forward op's routine whose results it reads
                made[producer] = self._routine(producer, made)
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
        if self.observers.fetch(self, op, action, where, inputs):
            return self.realised[action]
        if portable.is_portable(action.func):
            tensors = self._native(action, where, inputs, like, replacing, target)
            self.observers.ran_by[action] = [t.op.name for t, o in zip(tensors, like) if t is not o]
            self.realised[action] = tensors
            self._record_final(op, tensors)
            return tensors
        hosted = [i for i, t in enumerate(like) if _crosses_to_python(t.dtype)]
        if replacing and refuse_replacing(target, op.attrs["kind"]):
            raise BackendError(refuse_replacing(target, op.attrs["kind"]))
        if replacing and (len(hosted) != len(like) or len(inputs) != len(
                [t for t in inputs if _crosses_to_python(t.dtype)])):
            raise BackendError(f"replace routine of {where[1]!r}: TensorFlow can only host "
                               "routines over numeric tensors, not resource handles")
        name = f"amanda/{action.kind}"
        self.hosted = True
        if replacing:
            func = _replacer(action, where, [t.shape for t in like],
                             [t.dtype.as_numpy_dtype for t in like])
            tensors = _numpy_function(self.copy, func, inputs, [t.dtype for t in like], stateful=True,
                                        name=name)
            tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
            routine = tensors[0].op if tensors else None
            tensors = [_shaped(new, old.shape) for new, old in zip(tensors, like)]
        elif not hosted:   # nothing to pass: a bare callback ordered by control edges
            func = _observer(action, where, len(inputs), hosted, [])
            if self._v1_flow is None:
                self._v1_flow = has_v1_control_flow(self.user_graph)
            trigger = bare_trigger(target, op.attrs["kind"], self._v1_flow)
            routine = _numpy_function(self.copy, func, [trigger], [tf.int32], stateful=True,
                                        name=name)[0].op
            self._order(op.attrs["kind"], target, routine)
            tensors = list(like)
        else:
            dtypes = [like[i].dtype for i in hosted]
            # before a Merge and after a Switch, a view live when the op runs
            feed, spread, looped = live_feed(
                self.copy, self.user_graph.get_operation_by_name(target.name), op.attrs["kind"],
                [_origin(t) for t in op.inputs], inputs, hosted)
            func = _observer(action, where, len(inputs), hosted,
                             [d.as_numpy_dtype for d in dtypes], spread, looped)
            results = _numpy_function(self.copy, func, feed,
                                        [tf.bool] * len(hosted) + dtypes, stateful=True,
                                        name=name)
            routine = results[0].op
            tensors = list(like)
            for i, flag, new in zip(hosted, results, results[len(hosted):]):
                if i not in looped:
                    tensors[i] = _chosen(like[i], new, flag)
        if routine is not None:
            self.observers.ran_by[action] = [routine.name]
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
                        and not _reaches(writer, inputs)):
                    writer._add_control_input(routine)

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
            if (op is not routine and op.name not in self._bare_after
                    and op not in (t.op for t in routine.inputs)):   # its trigger waits on the op
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
            new = self._tensor_in_copy(ir_input, made)     # made on demand if later
            old = tf_op.inputs[position]
            if old is new:
                continue
            if _structural_constant(old) and not portable.is_portable(
                    ir_input.producer.attrs["action"].func):   # TF ops keep the value visible
                self._keep_constant(tf_op, position, old, new, ir_input.producer)
            else:
                tf_op._update_input(position, new)

    def _keep_constant(self, tf_op, position, old, new, routine):
        """An integer constant input (a shape, an axis, a TensorList's
        element shape) that a Python routine sees stays the op's input: TensorFlow reads its value when
        it builds and shape-checks the graph (a `TensorListReserve` fails on
        an element shape it cannot see), which a routine's result would hide.
        The routine still runs before the op (a control input) and sees the
        value; returning another value is refused when the op runs."""
        action = routine.attrs["action"]
        target = self.copy.get_operation_by_name(routine.attrs["target"])
        text = _kept_constant(action, (target.type, target.name, NAMESPACE),
                              f"replaced input {position} of {tf_op.type} {tf_op.name!r}, an "
                              "integer constant TensorFlow needs when it builds the graph; "
                              "routines may read such constants but not replace them "
                              "(docs/tensorflow.md)")
        with tf.control_dependencies([old.op]):   # its constants in the op's loop frame
            check = tf.debugging.assert_equal(new, old, message=text, name="amanda/kept_constant")
        # used as a control input: without this TensorFlow logs "Object was
        # never used" into the user's stderr when the copy is collected
        getattr(check, "mark_used", lambda: None)()
        tf_op._add_control_input(check)
