"""TensorFlow graph mode: the instrumented copy of a function body
(`_BodyRewrite`), a `_GraphRewrite` of the body's graph realised as a new
FunctionDef.
"""

from __future__ import annotations

import tensorflow as tf

from amanda.runtime.tensorflow.bodies import _BodyProbe, _body_names, _prefixed_body


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
        from amanda.runtime.tensorflow.rewrite import _GraphRewrite
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
                with tf.control_dependencies(routines):
                    done = tf.raw_ops.NoOp(name="amanda/routines_done")
                with tf.control_dependencies([done]):
                    outs = [tf.identity(t, name="amanda/result") for t in outs]
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
