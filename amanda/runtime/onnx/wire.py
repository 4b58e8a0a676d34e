"""Read-only NumPy views of a serialized model's initializers, without copies.

``numpy_helper.to_array`` (and ``TensorProto.raw_data``) copy a weight out
of its message. A session that keeps the serialized model anyway (to create
more sessions on a cache hit) can instead hand routines views over those
bytes: `initializer_views` walks the protobuf wire format of a
``ModelProto`` far enough to find each top-level initializer's ``raw_data``
and returns ``np.frombuffer`` views of it. Initializers stored otherwise
(typed fields such as ``float_data``, external data, strings, sub-byte or
8-bit float types) are not found; the caller copies those.
"""

from __future__ import annotations

import os

import numpy as np

# ModelProto.graph, GraphProto.initializer, and the TensorProto fields read
_MODEL_GRAPH = 7
_GRAPH_INITIALIZER = 5
_TENSOR_DIMS, _TENSOR_TYPE, _TENSOR_NAME, _TENSOR_RAW, _TENSOR_LOCATION = 1, 2, 8, 9, 14

#: ONNX element types whose raw bytes are the NumPy array's bytes
#: (little-endian, one element per item)
_PLAIN = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32,
          7: np.int64, 9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32,
          13: np.uint64, 14: np.complex64, 15: np.complex128}


#: the little-endian NumPy dtype of each of them, made once
_PLAIN_LE = {elem: np.dtype(dtype).newbyteorder("<") for elem, dtype in _PLAIN.items()}


class _Malformed(Exception):
    pass


def _varint(data, pos):
    value = shift = 0
    while True:
        if pos >= len(data):
            raise _Malformed
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data, start, end):
    """(field number, wire type, value or (start, end) of a length-delimited
    field) of the message in ``data[start:end]``."""
    pos = start
    while pos < end:
        # one-byte tags and lengths (fields below 16, values under 128
        # bytes: names, shapes, most nodes) are read inline; a graph of a
        # few hundred nodes and outputs is walked field by field
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(data, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = None, pos + 8
        elif wire == 2:
            if pos < end and data[pos] < 0x80:
                size, pos = data[pos], pos + 1
            else:
                size, pos = _varint(data, pos)
            value, pos = (pos, pos + size), pos + size
        elif wire == 5:
            value, pos = None, pos + 4
        else:   # groups are not used by onnx.proto
            raise _Malformed
        if pos > end:
            raise _Malformed
        yield field, wire, value


def _tensor(data, start, end):
    """(name, array view) of one TensorProto, or None when it has no plain raw data."""
    dims, elem, name, raw, external = [], 0, None, None, False
    for field, wire, value in _fields(data, start, end):
        if field == _TENSOR_DIMS:
            if wire == 0:
                dims.append(value)
            else:   # packed
                pos, stop = value
                while pos < stop:
                    dim, pos = _varint(data, pos)
                    dims.append(dim)
        elif field == _TENSOR_TYPE:
            elem = value
        elif field == _TENSOR_NAME:
            name = bytes(data[value[0]:value[1]]).decode("utf-8")
        elif field == _TENSOR_RAW:
            raw = value
        elif field == _TENSOR_LOCATION:
            external = value == 1
    dtype = _PLAIN_LE.get(elem)
    if name is None or raw is None or external or dtype is None:
        return None
    # int64 dims are two's complement varints: a negative one is invalid here
    count = 1
    for d in dims:
        if d >= 1 << 63:
            return None
        count *= d
    if count * dtype.itemsize != raw[1] - raw[0]:
        return None
    array = np.frombuffer(data, dtype=dtype, count=count, offset=raw[0])
    return name, array.reshape(dims)


def initializer_views(data, names, spans=None):
    """``{name: read-only array}`` for the top-level initializers among
    ``names`` that the serialized ``ModelProto`` ``data`` (``bytes``) stores
    as plain raw data; the arrays share memory with ``data``. Others (and
    everything, if the bytes cannot be walked) are missing from the result.
    ``spans``: where each top-level initializer's message lies in ``data``
    (what `write_model` returns for the bytes it wrote), so that the model's
    other fields (its nodes) are not walked."""
    wanted = set(names)
    found = {}
    if not wanted:
        return found
    try:
        if spans is None:
            spans = _initializer_spans(data)
        for span in spans:
            tensor = _tensor(data, *span)
            if tensor is not None and tensor[0] in wanted:
                if tensor[0] in found:   # a repeated name: leave it to the caller
                    del found[tensor[0]]
                    wanted.discard(tensor[0])
                    continue
                found[tensor[0]] = tensor[1]
    except _Malformed:
        return {}
    for array in found.values():
        array.flags.writeable = False
    return found


def _initializer_spans(data):
    """(start, end) of each top-level initializer's message in ``data``."""
    graphs = [v for f, w, v in _fields(data, 0, len(data)) if f == _MODEL_GRAPH and w == 2]
    if len(graphs) != 1:   # several graph fields would be merged: do not guess
        return []
    start, end = graphs[0]
    return [value for field, wire, value in _fields(data, start, end)
            if field == _GRAPH_INITIALIZER and wire == 2]


def viewable(tensor, folder=None):
    """Whether `initializer_views` can view the ``TensorProto`` (well-formed)
    once serialized (by `write_model` with this ``folder``): plain raw data,
    or external data in ``folder``, of a plain element type."""
    if tensor.data_type not in _PLAIN:
        return False
    if tensor.data_location == 1:   # EXTERNAL
        return _external(tensor, folder) is not None
    return tensor.HasField("raw_data")


def _external(tensor, folder):
    """(path, offset, length) of an external tensor's data in ``folder`` (a
    file directly in it), else None. ``folder``: a path, or an object with
    the path as ``name`` and ``owns(file name)`` saying which of its files
    may be read (`amanda.runtime.onnx.scratch.Files`)."""
    if folder is None:
        return None
    owns = getattr(folder, "owns", None)
    folder = getattr(folder, "name", folder)
    entries = {entry.key: entry.value for entry in tensor.external_data}
    location = entries.get("location", "")
    if not location or os.path.basename(location) != location or location in (".", ".."):
        return None
    if owns is not None and not owns(location):
        return None
    try:
        offset, length = int(entries.get("offset", 0)), int(entries["length"])
    except (KeyError, ValueError):
        return None
    return os.path.join(folder, location), offset, length


def raw_size(tensor):
    """Bytes of a `viewable` ``TensorProto``'s raw data, from its shape."""
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count * np.dtype(_PLAIN[tensor.data_type]).itemsize


def _varint_bytes(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


#: GraphProto.output, ValueInfoProto.name and .type
_GRAPH_OUTPUT, _INFO_NAME, _INFO_TYPE = 12, 1, 2


def graph_outputs(outputs):
    """The serialized ``GraphProto`` holding only ``outputs``: ``(name,
    serialized TypeProto or None)`` each, in order. Merged into a graph
    (``MergeFromString``), it appends them to its outputs in one call
    instead of one ``ValueInfoProto`` made and typed at a time."""
    pieces = []
    name_tag, type_tag = bytes([_INFO_NAME << 3 | 2]), bytes([_INFO_TYPE << 3 | 2])
    output_tag = bytes([_GRAPH_OUTPUT << 3 | 2])
    for name, type_bytes in outputs:
        name = name.encode("utf-8")
        info = name_tag + _varint_bytes(len(name)) + name
        if type_bytes is not None:
            info += type_tag + _varint_bytes(len(type_bytes)) + type_bytes
        pieces.append(output_tag + _varint_bytes(len(info)) + info)
    return b"".join(pieces)


def _repeated(field):
    flag = getattr(field, "is_repeated", None)
    return flag if flag is not None else field.label == 3   # LABEL_REPEATED


def _copy_fields(source, target, skip):
    """Copy the set fields of ``source`` but ``skip`` into ``target``."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if _repeated(field):
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def write_model(model, file, folder=None):
    """Write a ``ModelProto`` to the binary ``file`` as ``SerializeToString``
    would (fields in another order, which parses to an equal message), one
    top-level initializer at a time: no serialized copy of the whole model
    is made beside it (``SerializeToString`` makes two, protobuf's buffer and
    the ``bytes``). Top-level initializers whose data is external in a file
    directly in ``folder`` are written with their data as raw data (read a
    piece at a time).

    Returns:
        ``(start, end)`` of each top-level initializer's message, counted
        from where the model starts in ``file``: `initializer_views`' spans.
    """
    from onnx import GraphProto
    head = type(model)()
    _copy_fields(model, head, "graph")
    head = head.SerializeToString()
    file.write(head)
    at = len(head)   # where the next byte written lies
    spans = []
    if not model.HasField("graph"):
        return spans
    graph = model.graph
    rest = GraphProto()
    _copy_fields(graph, rest, "initializer")
    rest = rest.SerializeToString()
    pieces = []   # (size, bytes to write, external data to append or None)
    for tensor in graph.initializer:
        where = _external(tensor, folder) if tensor.data_location == 1 else None
        if where is None:
            pieces.append((tensor.ByteSize(), tensor, None))
            continue
        stub = type(tensor)()
        stub.CopyFrom(tensor)
        stub.ClearField("external_data")
        stub.ClearField("data_location")
        head = stub.SerializeToString() + bytes([_TENSOR_RAW << 3 | 2]) + _varint_bytes(where[2])
        pieces.append((len(head) + where[2], head, where))
    tag = bytes([_GRAPH_INITIALIZER << 3 | 2])
    length = len(rest) + sum(len(tag) + len(_varint_bytes(size)) + size for size, _, _ in pieces)
    opening = bytes([_MODEL_GRAPH << 3 | 2]) + _varint_bytes(length)
    file.write(opening)
    file.write(rest)
    at += len(opening) + len(rest)
    for size, piece, where in pieces:
        prefix = tag + _varint_bytes(size)
        file.write(prefix)
        at += len(prefix)
        spans.append((at, at + size))
        at += size
        if where is None:
            file.write(piece.SerializeToString())
            continue
        file.write(piece)
        path, offset, left = where
        with open(path, "rb") as source:
            source.seek(offset)
            while left:
                chunk = source.read(min(left, 1 << 20))
                if not chunk:
                    raise ValueError(f"{path}: external data ends early")
                file.write(chunk)
                left -= len(chunk)
    return spans
