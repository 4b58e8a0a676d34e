"""Structural hash of a graph: the cache key for rewrites and lowered programs.

The hash covers what a backend would execute: op types, namespaces and attrs, the
wiring (which output of which op feeds which input position), graph inputs and
outputs by position, control edges, tensor attrs (shape, dtype), and the graph's
namespace and attrs. It ignores every name, so renaming changes nothing. Ops are
identified by their position in the op list, so two insertion orders of the same
graph may hash differently.

The digest is SHA-256 over canonical JSON (sorted keys, no whitespace), never
``hash()`` or ``id()``, so it is stable across processes. Attr values that are not
JSON-able enter through their ``repr`` (see `amanda.ir.attrs`): keep them JSON-able
if the hash must be stable across runs.
"""

import hashlib
import json

from .attrs import encode_attrs
from .errors import IRError

_HASH_FORMAT = 1  # bump when the description below changes


def structural_hash(graph):
    """Returns the structural hash of ``graph`` as a hex string.

    Args:
        graph: The graph to hash; nested graphs in attrs enter through their own
            structural hash.

    Returns:
        A 64-character SHA-256 hex digest.

    Raises:
        IRError: The graph refers to an op or tensor outside it (run
            ``graph.verify()`` for details).
    """
    text = json.dumps(describe_structure(graph), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def describe_structure(graph):
    """Returns the name-free JSON-able description that `structural_hash` digests."""
    positions = {op: i for i, op in enumerate(graph.ops)}
    try:
        return {
            "format": _HASH_FORMAT,
            "namespace": graph.namespace,
            "attrs": _attrs(graph.attrs),
            "inputs": [_attrs(t.attrs) for t in graph.inputs],
            "ops": [_describe_op(op, positions) for op in graph.ops],
            "outputs": [_reference(t, positions) for t in graph.outputs],
        }
    except KeyError as missing:
        raise IRError(f"graph {graph.name!r} refers to {missing} outside it; run verify()") from None


def _describe_op(op, positions):
    return [
        op.namespace,
        op.type,
        _attrs(op.attrs),
        [_reference(t, positions) for t in op.inputs],
        [_attrs(t.attrs) for t in op.outputs],
        [positions[c] for c in op.control_inputs],
    ]


def _reference(tensor, positions):
    # A graph input is ["in", position]; an op output is [op position, output index].
    if tensor.producer is None:
        return ["in", tensor.index]
    return [positions[tensor.producer], tensor.index]


def _attrs(attrs):
    return encode_attrs(attrs, structural_hash)
