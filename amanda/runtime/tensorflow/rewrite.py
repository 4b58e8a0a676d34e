"""TensorFlow graph mode: the instrumented copy of a graph (`_GraphRewrite`),
lowered from the instrumented IR op by op (`amanda.runtime.tensorflow.emit`);
function bodies in it are `amanda.runtime.tensorflow.body_rewrite._BodyRewrite`.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from amanda import portable
from amanda.errors import AmandaError, BackendError, NotInstrumentedWarning
from amanda.passes.pipeline import instrument_graph as run_pipeline
from amanda.passes.lower_actions import ROUTINE
from amanda.runtime.routines import call_routine, returns_only_none
from amanda.runtime.tensorflow.bodies import (_Library, _STATEFUL_TWIN,
                                              _called_functions, _gradient_body,
                                              _origin, _warn_xla_compiled,
                                              _xla_compiled)
from amanda.runtime.tensorflow.hosting import (_chosen, _crosses_to_python,
                                               _numpy_function, _observer, _replacer, _shaped,
                                               _tool_error, _user_stacklevel)
from amanda.runtime.tensorflow.emit import (Emitter, _depends_on, _reads_variable, _Standing,
                                            keep_constant)
from amanda.runtime.tensorflow.liveness import (bare_trigger, has_v1_control_flow, live_feed,
                                                refuse_replacing)
from amanda.runtime.tensorflow.observe import _Observers
from amanda.runtime.tensorflow.probes import NAMESPACE, TFGraphBackend, _probing
from amanda.runtime.tensorflow.warnings import warn_bodies, warn_inexact, warn_v1_bare


def _structural_constant(tensor):
    """Whether ``tensor`` is an integer constant of the graph (shapes, axes,
    sizes): its value is part of the graph's structure."""
    return tensor.op.type == "Const" and tensor.dtype.is_integer


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
        self.v1_bare = self.warned_v1_bare = False
        self.user_graph = user_graph
        self.amanda_session = amanda_session
        self.copy = copy
        self.version = None
        self.plan = None
        self.realised = {}          # Action -> its tensors in the copy
        self.final = {}             # user tensor name -> what consumers read in the copy
        self.last_after = {}        # op name -> its last hosted after-routine
        self._bare_before = {}      # op name -> its before-routines that pass no tensor
        self._control_users = None  # (graph version, op name -> user ops waiting on it)
        self.warned_bodies = set()  # call ops whose bodies' ops were said to be no points
        self.bodies = []            # _BodyRewrite per instrumented function body
        self._probe = None
        # a gradient function's body: the forward bodies (_BodyRewrite) its
        # ops differentiate, None for a graph that is no gradient body
        self.gradient_of = None
        self.whole = True           # a whole program (graph tools get it), not a function body
        self.scope = None           # a body's ops are named '<scope>/<node>'
        self.observers = _Observers()   # routines called after Session.run (off unless enabled)
        self.emitter = Emitter(self)    # the user's ops not yet in the copy
        self._reads = {}            # variable-read op name -> hosted routines reading its value
        self._after_ops = {}        # op name -> ops of its after-routines that pass tensors
        # op name -> what it waits on besides its own edges: kept-constant
        # checks, observing routines whose results it reads (`_observing`)
        self._also_waits = {}
        self._observing_ops = {}    # Action -> the callback op of an `_observing` routine
        self._ir_ops = {}           # op name -> its IR op (while realising)
        self._made = None
        self._fetches = {}          # user tensor name -> what a fetch of it reads

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
        warn_v1_bare(self)
        return True

    def tensor(self, name):
        """The tensor of the copy that stands for the user's tensor ``name``.

        Where its op has after-routines that pass no tensor, the tensor is read
        through an identity that waits for them, so fetching it runs them too
        (a fetched gradient has no consumer that would wait on them).
        """
        found = self._fetches.get(name)
        if found is not None:
            return found
        tensor = self.final.get(name)
        if tensor is None:
            tensor = self.copy.get_tensor_by_name(name)
        last = self.last_after.get(name.split(":")[0])
        if last is not None:
            with self.copy.as_default(), tf.control_dependencies(self.emitter.gate([last])):
                tensor = tf.identity(tensor, name="amanda/fetch")
        self._fetches[name] = tensor
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
        library = tf.compat.v1.GraphDef().library
        library.CopyFrom(graph_def.library)
        library.function.extend(added)
        self.emitter.add(new_nodes, graph_def.versions, library)   # created in _realise

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
        from amanda.runtime.tensorflow.body_rewrite import _BodyRewrite
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
        made = self._made = {}  # IR routine op -> its tensors in the copy
        self._v1_flow = None        # whether the user's graph has v1 control flow (asked once)
        self._ir_ops = {op.name: op for op in lowered.ops if op.type != ROUTINE}
        self._read_by = {}  # variable-read op name -> IR routines reading its value
        self._points = {}   # op name -> its IR routine ops not built yet, in program order
        self._building = set()
        for op in lowered.ops:
            if op.type == ROUTINE and op.attrs["action"] not in self.realised:
                self._points.setdefault(op.attrs["target"], []).append(op)
                for origin in {_origin(t).split(":")[0] for t in op.inputs}:
                    if _reads_variable(self.user_graph.get_operation_by_name(origin)):
                        self._read_by.setdefault(origin, []).append(op)
        emitter = self.emitter
        emitter.fresh = set()
        try:
            with self.copy.as_default():
                for op in lowered.ops:
                    if op.type == ROUTINE:
                        if op not in made:      # else made on demand by a reader
                            made[op] = self._routine(op, made)
                    elif op.name in emitter.pending:
                        emitter.create(op.name)
                emitter.finish()
        finally:
            self._ir_ops, self._made = {}, None
            emitter.fresh = set()   # a session may run them from now on
        self.observers.link(lowered)

    def _tensor_in_copy(self, ir_tensor, made):
        producer = ir_tensor.producer
        if producer is None and ir_tensor.attrs.get("back_edge"):   # a loop's NextIteration
            return self.emitter.forward(ir_tensor.attrs["back_edge"])
        if producer is None:
            raise BackendError(f"tensor {ir_tensor.name!r} has no producer in the TF graph")
        if producer.type == ROUTINE:
            if producer not in made:
                # lowered order is not always data order: in a function body
                # (node order of a FunctionDef) a backward op's routine can
                # come before the forward op's routine whose results it reads
                made[producer] = self._routine(producer, made)
            return made[producer][ir_tensor.index]
        return self.emitter.element(f"{producer.name}:{ir_tensor.index}")

    def _routine(self, op, made):
        tensors = self.realised.get(op.attrs["action"])
        if tensors is not None:
            return tensors
        self._building.add(op)   # what it waits for must not build it again
        try:
            # its ops are named under "amanda/": a user op, created later
            # under its own name, must find that name free
            with tf.name_scope("amanda/"):
                return self._build_routine(op, made)
        finally:
            self._building.discard(op)
            waiting = self._points.get(op.attrs["target"])
            if waiting and op in waiting:
                waiting.remove(op)

    def _build_routine(self, op, made):
        action = op.attrs["action"]
        kind = op.attrs["kind"]
        user_target = self.user_graph.get_operation_by_name(op.attrs["target"])
        name = user_target.name
        where = (user_target.type, name, NAMESPACE)
        if action.ad:
            raise BackendError(f"{action.kind} of {name!r}: amanda.ad_enabled() actions "
                               "cannot be differentiated in TensorFlow graph mode (the "
                               "gradient ops are already built)")
        inputs = [self._tensor_in_copy(t, made) for t in op.inputs]
        replacing = kind.startswith("replace")
        like = ([self.emitter.element(t.name) for t in user_target.outputs] if replacing
                else inputs)
        if self.observers.fetch(self, op, action, where, inputs):
            return self.realised[action]
        waits = self._routine_waits(op)
        if portable.is_portable(action.func):
            with tf.control_dependencies(self.emitter.gate(waits)):
                tensors = self._native(action, where, inputs, like, replacing, user_target)
            changed = [t for t, o in zip(tensors, like) if t is not o]
            self.observers.ran_by[action] = [t.op.name for t in changed]
            self.observers.note_point(self.observers.ran_by[action], name)
            if kind.startswith("after"):
                self._after_ops.setdefault(name, []).extend(t.op for t in changed)
            self.realised[action] = tensors
            self._record_final(op, tensors)
            return tensors
        hosted = [i for i, t in enumerate(like) if _crosses_to_python(t.dtype)]
        if replacing and refuse_replacing(user_target, kind):
            raise BackendError(refuse_replacing(user_target, kind))
        if replacing and (len(hosted) != len(like) or len(inputs) != len(
                [t for t in inputs if _crosses_to_python(t.dtype)])):
            raise BackendError(f"replace routine of {name!r}: TensorFlow can only host "
                               "routines over numeric tensors, not resource handles")
        label = action.kind
        self.hosted = True
        if replacing:
            func = _replacer(action, where, [t.shape for t in like],
                             [t.dtype.as_numpy_dtype for t in like])
            with tf.control_dependencies(self.emitter.gate(waits)):
                tensors = _numpy_function(self.copy, func, inputs, [t.dtype for t in like],
                                          stateful=True, name=label)
            tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
            routine = tensors[0].op if tensors else None
            tensors = [_shaped(new, old.shape) for new, old in zip(tensors, like)]
        elif not hosted:   # nothing to pass: a bare callback ordered by control edges
            routine = self._bare(action, where, kind, user_target, len(inputs))
            tensors = list(like)
        else:
            # before a Merge and after a Switch, a view live when the op runs
            feed, spread, looped = live_feed(
                self.emitter.forward, user_target, kind, [_origin(t) for t in op.inputs],
                inputs, hosted, self.emitter.is_back_edge)
            tensors = list(like)
            if returns_only_none(action.func) and not self._has_v1_flow():
                routine = self._observing(action, where, kind, user_target, feed,
                                          lambda: _observer(action, where, len(inputs), hosted,
                                                            None, spread), waits)
            else:
                dtypes = [like[i].dtype for i in hosted]
                func = _observer(action, where, len(inputs), hosted,
                                 [d.as_numpy_dtype for d in dtypes], spread, looped)
                with tf.control_dependencies(self.emitter.gate(waits)):
                    results = _numpy_function(self.copy, func, feed,
                                              [tf.bool] * len(hosted) + dtypes, stateful=True,
                                              name=label)
                routine = results[0].op
                if kind.startswith("after"):
                    self._after_ops.setdefault(name, []).append(routine)
                    if not self._has_v1_flow():
                        # whatever waits on the op waits on it too: it runs
                        # whenever its op does, as `_observing` ones do (a
                        # control edge may not cross a v1 loop's frame)
                        self.last_after[name] = routine
                for i, flag, new in zip(hosted, results, results[len(hosted):]):
                    if i not in looped:
                        tensors[i] = _chosen(like[i], new, flag)
        if routine is not None:
            self.emitter.fresh.add(routine)
            self.observers.ran_by[action] = [routine.name]
            self.observers.note_point([routine.name], name)
            self._note_reads(routine, [_origin(t) for t in op.inputs])
        self.realised[action] = tensors
        self._record_final(op, tensors)
        return tensors

    def _bare(self, action, where, kind, user_target, count):
        """A routine passing no tensor: a callback ordered by control edges.

        A before-routine is a control input of its op (given when the op is
        created, `_waits`). After-routines run in the order they were
        recorded, each after the op, its before-routines and its earlier
        after-routines, and before everything that reads the op's outputs or
        waits on it (`_waits` again).
        """
        name = user_target.name
        func = _observer(action, where, count, [], [])
        self.v1_bare = self._has_v1_flow() or self.v1_bare   # (`warn_v1_bare`)
        label = action.kind
        if kind.startswith("before"):
            target = _Standing(self, user_target) if self._v1_flow else None
            trigger = bare_trigger(target, kind, self._v1_flow, self.emitter.gate)
            routine = _numpy_function(self.copy, func, [trigger], [tf.int32], stateful=True,
                                      name=label)[0].op
            if name not in self.emitter.pending and user_target.type != "Placeholder":
                raise BackendError(f"before-routine of {name!r}: its op already exists in "
                                   "the copy (internal error: it cannot wait on the routine)")
            self._bare_before.setdefault(name, []).append(routine)
            if not self._v1_flow:   # (a target may not sit in a loop's frame)
                self.observers.by_edges.add(routine.name)
            return routine
        target = self.emitter.element("^" + name)
        self._ensure(name, "before")
        trigger = bare_trigger(target, kind, self._v1_flow, self.emitter.gate)
        # the op's own before-routines too: Grappler may remove the op (a
        # no-op Reshape, say) and hand its control edges to its inputs, which
        # would let the after-routine run first
        controls = [self.last_after.get(name, target), *self._bare_before.get(name, ()),
                    *self._after_ops.get(name, ())]
        with tf.control_dependencies(self.emitter.gate(controls)):
            routine = _numpy_function(self.copy, func, [trigger], [tf.int32], stateful=True,
                                      name=label)[0].op
        if not self._v1_flow:
            self.observers.by_edges.add(routine.name)
        self.last_after[name] = routine
        return routine

    def _has_v1_flow(self):
        if self._v1_flow is None:
            self._v1_flow = has_v1_control_flow(self.user_graph)
        return self._v1_flow

    def _observing(self, action, where, kind, user_target, feed, make_callback, waits):
        """A routine that can only return None (`returns_only_none`), passing
        tensors: its callback reads ``feed`` and hands back one token, and it
        is ordered by control edges as `_bare` routines are, so the op's
        tensors flow on untouched. A routine that might return tensors
        needs a ``Switch``/``Merge`` pair, an ``EnsureShape`` and a
        placeholder per tensor to choose between its result and the
        original (`tensorflow_hosting._chosen`): five ops per tensor,
        whose memory and executor cost an observe-everything tool paid on
        every op.

        Not in graphs with v1 control flow: a control edge may not cross
        a loop's frame, and a tensor behind a ``Switch`` may be dead (the
        routine's op would be dead with it); there the routine passes its
        tensors on through ``_chosen``.

        Rule: whatever the IR has reading the routine's results (its op,
        a backward op reading a forward input through a before-routine,
        a later routine) waits on it by a control edge (`_inputs_of`,
        `_routine_waits`), so it runs in every run in which they run, before
        them, as when they read its results. A before-routine is also a
        control input of its op (`_waits`). An after-routine reads the op's
        results, so it runs after the op; it also waits on the op's
        before-routines and earlier after-routines (``waits``,
        `_after_ops`), and everything that reads the op's outputs, waits on
        the op or fetches them waits on it (`last_after`, as for `_bare`).
        """
        name = user_target.name
        after = not kind.startswith("before")
        if after:
            waits = [*waits, *self._after_ops.get(name, ())]
        with tf.control_dependencies(self.emitter.gate(waits)):
            routine = _numpy_function(self.copy, make_callback(), feed, [tf.int32],
                                      stateful=True, name=action.kind)[0].op
        self._observing_ops[action] = routine
        self.observers.by_edges.add(routine.name)
        if after:
            self.last_after[name] = routine
        else:
            self._bare_before.setdefault(name, []).append(routine)
        return routine

    def _native(self, action, where, inputs, like, replacing, target):
        """Lower a portable routine as TF ops: call it once on the copy's
        symbolic tensors (see :mod:`amanda.portable`)."""
        with tf.name_scope(action.kind):
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

    def _routine_waits(self, op):
        """What a routine passing tensors waits on: the observing routines
        whose results it reads (`_observing`), the last after-routine
        passing no tensor of each op whose tensors it reads (and, after an
        op, the op's before-routines passing none: a fed op never runs, but
        its after-routines still bring its before-routines with them)."""
        kind, target = op.attrs["kind"], op.attrs["target"]
        waits = [self._observing_ops[t.producer.attrs["action"]] for t in op.inputs
                 if t.producer is not None and t.producer.type == ROUTINE
                 and t.producer.attrs["action"] in self._observing_ops]
        for name in dict.fromkeys(_origin(t).split(":")[0] for t in op.inputs):
            self._ensure(name, "after", op if name == target else None)
            last = self.last_after.get(name)
            if last is not None:
                waits.append(last)
        if kind.startswith("after"):
            self._ensure(target, "before")
            waits.extend(self._bare_before.get(target, ()))
        return waits

    def _ensure(self, name, point, until=None):
        """Build the routines at ``point`` (``"before"``, ``"after"``) of the
        user's op ``name`` not built yet, in program order (those recorded
        before ``until`` only): a function body's IR is in the order of its
        FunctionDef, not in data order, and an op (or a routine) is created
        after everything it waits for."""
        for routine in list(self._points.get(name, ())):
            if routine is until:
                break
            if routine.attrs["kind"].startswith(point) and routine not in self._building:
                self._routine(routine, self._made)

    def _note_reads(self, routine, origins):
        """Remember ``routine`` as a reader of the variable reads behind
        ``origins``: a stateful op ordered after such a read waits on it
        (`_waits`), as the op the routine instruments would have been done
        before it."""
        for origin in origins:
            read = self.user_graph.get_tensor_by_name(origin).op
            if _reads_variable(read):   # only reads of variables are ordered before writes
                self._reads.setdefault(read.name, []).append(routine)

    def _inputs_of(self, name, data, resolve):
        """The copy's tensors the user's op ``name`` reads when it is created
        (its ``NodeDef``'s ``data`` inputs): a routine's result where the
        lowered IR puts one in between."""
        ir_op = self._ir_ops.get(name)
        inputs = []
        for position, text in enumerate(data):
            ir_input = (ir_op.inputs[position]
                        if ir_op is not None and position < len(ir_op.inputs) else None)
            old = resolve(text)
            if ir_input is None or ir_input.producer is None or ir_input.producer.type != ROUTINE:
                inputs.append(old)
                continue
            new = self._tensor_in_copy(ir_input, self._made)
            observing = self._observing_ops.get(ir_input.producer.attrs["action"])
            if observing is not None:   # its result is its input: wait on it
                self._also_waits.setdefault(name, []).append(observing)
            if new is not old and _structural_constant(old) and not portable.is_portable(
                    ir_input.producer.attrs["action"].func):   # TF ops keep the value visible
                self._also_waits.setdefault(name, []).append(
                    keep_constant(self, name, position, old, new, ir_input.producer))
                new = old
            inputs.append(new)
        return inputs

    def _waits(self, name, node, data, controls):
        """The control edges the user's op ``name`` gets in the copy besides
        its own (see `amanda.runtime.tensorflow.emit`)."""
        user_op = self.user_graph.get_operation_by_name(name)
        self._ensure(name, "before")
        waits = [] if user_op.type == "Placeholder" else list(self._bare_before.get(name, ()))
        for text in [*data, *controls]:
            self._ensure(text.split(":")[0], "after")
            last = self.last_after.get(text.split(":")[0])
            if last is not None:
                waits.append(last)
        if user_op._is_stateful:
            for control in controls:
                for routine in self._read_by.get(control, ()):
                    if not _depends_on(routine, user_op, self.emitter.pending):
                        self._routine(routine, self._made)   # built now, to be waited on
                waits.extend(self._reads.get(control, ()))
        waits.extend(self._also_waits.pop(name, ()))
        return waits

    def _waiting_on(self, target):
        """Ops of the user's graph with ``target`` as a control input
        (indexed once per graph version)."""
        version = self.user_graph.version
        if self._control_users is None or self._control_users[0] != version:
            index = {}
            for op in self.user_graph.get_operations():
                for control in op.control_inputs:
                    index.setdefault(control.name, []).append(op)
            self._control_users = (version, index)
        return list(self._control_users[1].get(target.name, ()))

    def _record_final(self, op, tensors):
        kind = op.attrs["kind"]
        if kind.startswith("replace"):
            target = self.user_graph.get_operation_by_name(op.attrs["target"])
            for original, new in zip(target.outputs, tensors):
                self.final[original.name] = new
        elif kind.startswith("after"):
            for ir_input, new in zip(op.inputs, tensors):
                self.final[_origin(ir_input)] = new
