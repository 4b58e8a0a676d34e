"""Encoding of attribute values into JSON-able data, shared by JSON and hashing.

JSON scalars, str, lists (and tuples, which come back as lists) and dicts with str
keys are stored as themselves. Other values become single-key marker dicts:

* ``{"$graph": ...}`` for a nested `Graph` (control-flow bodies);
* ``{"$float": "nan" | "inf" | "-inf"}`` for non-finite floats, which strict JSON
  lacks;
* ``{"$repr": "..."}`` for anything else, keeping only ``repr(value)``; it decodes
  to an `OpaqueAttr`, which encodes back to the same marker, so a round trip keeps
  the structural hash;
* ``{"$dict": {...}}`` wraps a user dict whose only key starts with ``$``, so it is
  never mistaken for a marker.
"""

import math

from .errors import IRError
from .graph import Graph

REPR, GRAPH, FLOAT, DICT = "$repr", "$graph", "$float", "$dict"


class OpaqueAttr:
    """An attr value known only by its ``repr``, as read back from JSON.

    Attributes:
        text: The ``repr`` of the original value.
    """

    __slots__ = ("text",)

    def __init__(self, text):
        self.text = text

    def __eq__(self, other):
        return isinstance(other, OpaqueAttr) and other.text == self.text

    def __hash__(self):
        return hash(self.text)

    def __repr__(self):
        return self.text


def encode_value(value, encode_graph):
    """Returns a JSON-able form of an attr value.

    Args:
        value: Any attr value.
        encode_graph: Called with each nested `Graph`; its result is stored under
            the ``$graph`` marker.

    Returns:
        Data made of dicts, lists, str, int, float (finite), bool and None.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _encode_float(float(value))
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [encode_value(item, encode_graph) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return _encode_dict(value, encode_graph)
    if isinstance(value, Graph):
        return {GRAPH: encode_graph(value)}
    if isinstance(value, OpaqueAttr):
        return {REPR: value.text}
    return {REPR: repr(value)}


def decode_value(data, decode_graph):
    """Inverts `encode_value`.

    Args:
        data: Output of `encode_value` (possibly after a JSON round trip).
        decode_graph: Called with the data under each ``$graph`` marker.

    Returns:
        The attr value.

    Raises:
        IRError: The data holds an unknown ``$`` marker.
    """
    if isinstance(data, list):
        return [decode_value(item, decode_graph) for item in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (key, inner), = data.items()
        if key.startswith("$"):
            return _decode_marker(key, inner, decode_graph)
    return {key: decode_value(item, decode_graph) for key, item in data.items()}


def encode_attrs(attrs, encode_graph):
    """Encodes a whole attrs dict; see `encode_value`."""
    return {key: encode_value(value, encode_graph) for key, value in attrs.items()}


def decode_attrs(data, decode_graph):
    """Decodes a whole attrs dict without reading its keys as markers."""
    return {key: decode_value(value, decode_graph) for key, value in data.items()}


def _encode_float(value):
    if math.isfinite(value):
        return value
    return {FLOAT: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def _encode_dict(value, encode_graph):
    encoded = {key: encode_value(item, encode_graph) for key, item in value.items()}
    if len(encoded) == 1 and next(iter(encoded)).startswith("$"):
        return {DICT: encoded}
    return encoded


def _decode_marker(key, inner, decode_graph):
    if key == DICT:
        return decode_attrs(inner, decode_graph)
    if key == REPR:
        return OpaqueAttr(inner)
    if key == FLOAT:
        return float(inner)
    if key == GRAPH:
        return decode_graph(inner)
    raise IRError(f"unknown attribute marker {key!r} in serialized graph")


def copy_value(value):
    """Copies the `Graph` objects inside an attr value, sharing everything else.

    Containers are rebuilt only on the path to a nested graph, so copying a graph
    stays shallow for plain data.
    """
    if isinstance(value, Graph):
        return value.copy()
    if isinstance(value, (list, tuple)):
        items = [copy_value(item) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        items = {key: copy_value(item) for key, item in value.items()}
        if all(items[key] is value[key] for key in value):
            return value
        return items
    return value


def copy_attrs(attrs):
    """Returns a shallow copy of an attrs dict with nested graphs copied."""
    return {key: copy_value(value) for key, value in attrs.items()}


def iter_graphs(value, path=""):
    """Yields ``(path, graph)`` for every `Graph` nested in an attr value."""
    if isinstance(value, Graph):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from iter_graphs(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from iter_graphs(item, f"{path}[{key!r}]" if path else str(key))
