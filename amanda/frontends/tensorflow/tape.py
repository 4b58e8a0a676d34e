"""Owners of ``GradientTape`` ops, from names, types and data flow.

A tape names its ops after the *name scope* the forward op ran in, which
several forward ops may share; `_GradientMapper` narrows the candidates
(rules in `amanda.frontends.tensorflow.gradients.map_gradients`).
"""

from __future__ import annotations

import bisect

from amanda.frontends.tensorflow.gradient_names import (
    _CALL_TYPES,
    _GRAD_YS,
    _NO_GRADIENT_TYPES,
    _SEED_TYPES,
    _TAPE_ROOT,
    _VERSION_SUFFIX,
    _grad_kernel_base,
    _is_backward_function,
    _tf_gradients_match,
)

class _GradientMapper:
    def __init__(self, graph):
        self.graph = graph
        self.ops = list(graph)
        self.by_name = {op.name: op for op in self.ops}
        self.owner = {}  # gradient op name -> owner name or None

    def run(self):
        self._tf_gradients()
        tape = [op for op in self.ops if op.name.split("/", 1)[0] == _TAPE_ROOT and op.name not in self.owner]
        for op in tape:
            self.owner[op.name] = None
        helpers = self._tape_helpers()
        if tape or helpers:
            self._tape_owners(tape, helpers)
        return {op.name: self.owner[op.name] for op in self.ops if op.name in self.owner}

    # -- tf.gradients -----------------------------------------------------------
    def _tf_gradients(self):
        names = self.by_name
        matches = {}
        valid_roots = set()
        for op in self.ops:
            match = _tf_gradients_match(op.name, names)
            if match is None:
                continue
            matches[op.name] = match
            root, owner = match
            if owner is not None or _GRAD_YS.match(op.name[len(root) + 1 :].split("/", 1)[0]):
                valid_roots.add(root)
        for name, (root, owner) in matches.items():
            if root in valid_roots:
                self.owner[name] = owner

    # -- GradientTape -----------------------------------------------------------
    def _is_backward(self, op):
        return op.name in self.owner

    def _tape_helpers(self):
        """Gradient ops a tape builds outside ``gradient_tape/``; returns {name: domain}."""
        helpers = {}
        # Calls of backward functions, and AddN aggregations, in graph order.
        for op in self.ops:
            if self._is_backward(op):
                continue
            if op.type in _CALL_TYPES and _is_backward_function(op.attrs.get("f")):
                readers = []
                for tensor in op.inputs:
                    producer = tensor.producer
                    if (producer is not None and not self._is_backward(producer)
                            and producer.type in _CALL_TYPES and producer.name not in readers):
                        readers.append(producer.name)
                self.owner[op.name] = None
                helpers[op.name] = set(readers)
            elif op.type == "AddN" and op.inputs and all(
                t.producer is not None and self._is_backward(t.producer) for t in op.inputs
            ):
                self.owner[op.name] = None
        # Seeds: constants whose readers are all gradient ops (reverse order so
        # that a Fill is classified before the Const feeding it).
        for op in reversed(self.ops):
            if self._is_backward(op) or op.type not in _SEED_TYPES:
                continue
            readers = list(op.users) + list(op.control_users)
            if readers and not any(t.is_graph_output for t in op.outputs) and all(
                self._is_backward(r) for r in readers
            ):
                self.owner[op.name] = None
        return helpers

    def _tape_owners(self, tape, helpers):
        forward = [op for op in self.ops if not self._is_backward(op)]
        self.forward_index = {op.name: i for i, op in enumerate(forward)}
        self.ancestors = _ancestor_bits(forward, self.forward_index)
        children = {}
        for op in forward:
            if op.type not in _NO_GRADIENT_TYPES:
                children.setdefault(op.name.rpartition("/")[0], []).append(op.name)
        domains = {}
        for op in tape:
            domains[op.name] = self._narrow(op, self._name_candidates(op.name, children))
        for name, readers in helpers.items():
            domains[name] = set(readers)
        for name, domain in domains.items():
            if len(domain) == 1:
                self.owner[name] = next(iter(domain))
        self._propagate(domains)

    def _name_candidates(self, name, children):
        """Forward ops whose name scope could be the one in ``name``."""
        comps = name.split("/")[1:]  # drop "gradient_tape"
        candidates = set()
        for k in range(len(comps)):  # strict prefixes, "" included
            prefix = "/".join(comps[:k])
            if prefix in self.forward_index and self.by_name[prefix].type not in _NO_GRADIENT_TYPES:
                candidates.add(prefix)
            candidates.update(children.get(prefix, ()))
        return candidates

    def _narrow(self, op, domain):
        evidence = False
        base = _grad_kernel_base(op.type)
        if base is not None:
            typed = {f for f in domain if _VERSION_SUFFIX.sub("", self.by_name[f].type) == base}
            if typed:
                domain, evidence = typed, True
        if len(domain) > 1:
            read = domain & self._touched_forward(op)
            if read:
                domain, evidence = read, True
        if len(domain) > 1 and evidence:
            return _deepest(op.name, domain)
        return domain

    def _touched_forward(self, op):
        """Forward ops having every forward tensor ``op`` reads as input or output.

        A gradient function sees only its op's inputs and outputs (and the
        incoming gradients); if no forward op fits all the tensors read (a
        custom gradient reading captured values), the ops fitting any of them.
        """
        every, some = None, set()
        for tensor in op.inputs:
            producer = tensor.producer
            if producer is None or producer.name not in self.forward_index:
                continue
            fits = {producer.name}
            fits.update(user.name for user, _ in tensor.uses if user.name in self.forward_index)
            every = fits if every is None else every & fits
            some |= fits
        return every if every else some

    # Gradient flow between gradient ops. A gradient op reading a gradient
    # tensor g made by an op of the call for F' is either in that same call
    # (owner F'), or in the call for an ancestor of F' that has an output shaped
    # like g (the gradient may pass unchanged through ops such as BiasAdd or
    # Identity that make no gradient ops). Across an AddN, or a control edge
    # (a gradient function waiting on its incoming gradient), the calls differ.

    def _is_ancestor(self, ancestor, op_name):
        return (self.ancestors[self.forward_index[op_name]] >> self.forward_index[ancestor]) & 1 == 1

    def _upstream_ok(self, candidate, owner, tensor, same_call):
        if same_call and candidate == owner:
            return True
        if not self._is_ancestor(candidate, owner):
            return False
        return tensor is None or _has_shape(self.by_name[candidate].outputs, tensor)

    def _downstream_ok(self, candidate, owner, tensor, same_call):
        if same_call and candidate == owner:
            return True
        if not self._is_ancestor(owner, candidate):
            return False
        return tensor is None or _has_shape(self.by_name[candidate].inputs, tensor)

    def _sources(self, op):
        """``(tensor or None, gradient op, same call possible)`` feeding ``op``."""
        for tensor in op.inputs:
            producer = tensor.producer
            if producer is None or producer.name not in self.owner:
                continue
            if producer.type == "AddN" and producer.name not in self.domains:
                for inner in producer.inputs:
                    if inner.producer is not None and inner.producer.name in self.owner:
                        yield tensor, inner.producer, False
            else:
                yield tensor, producer, True
        for control in op.control_inputs:
            # Gradient functions wait on their incoming gradients
            # (``with control_dependencies([grad])``): another call's op.
            if control.name in self.owner:
                yield _single_output(control), control, False

    def _sinks(self, op):
        """``(tensor or None, gradient op, same call possible)`` reading ``op``."""
        for tensor in op.outputs:
            for user, _ in tensor.uses:
                if user.name not in self.owner:
                    continue
                if user.type == "AddN" and user.name not in self.domains:
                    for inner in user.outputs:
                        for reader, _ in inner.uses:
                            if reader.name in self.owner:
                                yield tensor, reader, False
                else:
                    yield tensor, user, True
        for user in op.control_users:
            if user.name in self.owner:
                yield _single_output(op), user, False

    def _propagate(self, domains):
        self.domains = domains
        self.position = {op.name: i for i, op in enumerate(self.ops)}
        changed = True
        while changed:
            changed = False
            self._index_calls(domains)
            for name, domain in domains.items():
                if self.owner[name] is not None or len(domain) < 2:
                    continue
                narrowed = self._contiguous(name, self._flow_narrow(self.by_name[name], domain))
                if len(narrowed) == 1:
                    self.owner[name] = next(iter(narrowed))
                    domains[name] = narrowed
                    changed = True

    def _index_calls(self, domains):
        """Positions of the mapped gradient ops, overall and per owner."""
        self.resolved = sorted(self.position[n] for n in domains if self.owner[n] is not None)
        self.calls = {}
        for name in domains:
            owner = self.owner[name]
            if owner is not None:
                self.calls.setdefault(owner, []).append(self.position[name])
        for positions in self.calls.values():
            positions.sort()

    def _contiguous(self, name, domain):
        """Drops owners whose gradient call cannot contain op ``name``.

        A gradient function makes its ops one after the other, so the ops of
        one call are contiguous in creation order: an op cannot belong to F if
        the ops of another call lie between it and F's nearest mapped op.
        """
        if len(domain) < 2:
            return domain
        p = self.position[name]
        kept = set()
        for candidate in domain:
            positions = self.calls.get(candidate)
            if not positions:
                kept.add(candidate)
                continue
            k = bisect.bisect_left(positions, p)
            nearest = [positions[i] for i in (k - 1, k) if 0 <= i < len(positions)]
            q = min(nearest, key=lambda x: abs(x - p))
            lo, hi = min(p, q), max(p, q)
            between = bisect.bisect_left(self.resolved, hi) - bisect.bisect_right(self.resolved, lo)
            if between == 0:
                kept.add(candidate)
        return kept

    def _flow_narrow(self, op, domain):
        narrowed = set(domain)
        constrained = False
        for tensor, source, same_call in self._sources(op):
            owner = self.owner.get(source.name)
            if owner is not None and owner in self.forward_index:
                narrowed = {c for c in narrowed if self._upstream_ok(c, owner, tensor, same_call)}
                constrained = True
            elif (owner is None and source.type in _SEED_TYPES and tensor is not None and not source.inputs
                  and source.name not in self.domains):
                # A seed (ones/zeros shaped like the target) feeds the call of
                # the op producing the target.
                narrowed = {c for c in narrowed if _has_shape(self.by_name[c].outputs, tensor)}
                constrained = True
        for tensor, sink, same_call in self._sinks(op):
            owner = self.owner.get(sink.name)
            if owner is not None and owner in self.forward_index:
                narrowed = {c for c in narrowed if self._downstream_ok(c, owner, tensor, same_call)}
                constrained = True
        if not op.inputs:
            # No data inputs: a constant made inside a gradient function,
            # which belongs to the call of the gradient ops reading it.
            owners = {self.owner.get(u.name) for u in list(op.users) + list(op.control_users)}
            if len(owners) == 1 and None not in owners and owners <= domain:
                return owners
            return narrowed if len(narrowed) == 1 else domain
        if len(narrowed) > 1 and constrained:
            return _deepest(op.name, narrowed)
        return narrowed


def _deepest(name, candidates):
    """The candidates whose name scope is the longest prefix of ``name``.

    ``name`` is ``gradient_tape/<scope>/<rest>``; a candidate ``F`` fits a
    prefix ``P`` when ``F`` is named ``P`` (it opened that scope) or lies in it.
    Among the deepest fitting candidates one named ``P`` itself wins. Returns
    the candidates unchanged when that leaves more than one.
    """
    comps = name.split("/")[1:]
    for k in range(len(comps) - 1, -1, -1):
        prefix = "/".join(comps[:k])
        exact = [c for c in candidates if c == prefix]
        if exact:
            return set(exact)
        inside = [c for c in candidates if c.rpartition("/")[0] == prefix]
        if len(inside) == 1:
            return set(inside)
        if inside:
            return set(candidates)
    return set(candidates)


def _single_output(op):
    return op.outputs[0] if len(op.outputs) == 1 else None


def _ancestor_bits(ops, index):
    """Per op (by position), a bitset (int) of its data-flow ancestors among ``ops``."""
    bits = [0] * len(ops)
    for i, op in enumerate(ops):
        value = 0
        for tensor in op.inputs:
            producer = tensor.producer
            if producer is not None:
                j = index.get(producer.name)
                if j is not None and j < i:
                    value |= bits[j] | (1 << j)
        bits[i] = value
    return bits


def _has_shape(tensors, like):
    """Whether one of ``tensors`` has a shape compatible with ``like``'s."""
    target = like.attrs.get("shape")
    for tensor in tensors:
        shape = tensor.attrs.get("shape")
        if target is None or shape is None:
            return True
        if len(shape) == len(target) and all(a is None or b is None or a == b for a, b in zip(shape, target)):
            return True
    return False
