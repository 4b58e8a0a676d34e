"""ONNX frontend: reading models (a ``ModelProto`` from a proto, bytes or a
path, with external data) and naming their element types. Re-exported by
:mod:`amanda.frontends.onnx`.
"""

from __future__ import annotations

import os

from amanda.errors import BackendError


def _onnx():
    import onnx

    return onnx


def default_namespace(model):
    """``"onnx/<version of the default ONNX domain>/graph"`` for a ModelProto."""
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    return f"onnx/{version if version is not None else 'unknown'}/graph"


def default_domain_version(ir_version):
    """The newest version of the default ONNX domain a model of this IR
    version may import (what amanda imports for its own nodes in a model
    that imports none, e.g. one of ``ai.onnx.ml`` ops only)."""
    onnx = _onnx()
    newest = onnx.defs.onnx_opset_version()
    versions = [row[2] for row in onnx.helper.VERSION_TABLE
                if row[1] <= ir_version and row[2] <= newest]
    return max(versions, default=1)


def dtype_name(elem_type):
    """NumPy-style name of an ONNX ``TensorProto.DataType`` (``"float32"``)."""
    onnx = _onnx()
    if elem_type == onnx.TensorProto.UNDEFINED:
        return None
    if not _NAMES:
        _NAMES.update(_names())
    try:
        return _NAMES[elem_type]
    except KeyError:
        pass
    try:
        return onnx.TensorProto.DataType.Name(elem_type).lower()
    except ValueError:   # a number this onnx does not know: the model is malformed
        raise BackendError(f"unknown ONNX element type {elem_type} (this onnx "
                           f"{onnx.__version__} knows {sorted(onnx.TensorProto.DataType.values())})"
                           ) from None


def _names():
    t = _onnx().TensorProto
    return {t.FLOAT: "float32", t.DOUBLE: "float64", t.FLOAT16: "float16", t.BFLOAT16: "bfloat16",
            t.INT8: "int8", t.INT16: "int16", t.INT32: "int32", t.INT64: "int64",
            t.UINT8: "uint8", t.UINT16: "uint16", t.UINT32: "uint32", t.UINT64: "uint64",
            t.BOOL: "bool", t.STRING: "string", t.COMPLEX64: "complex64",
            t.COMPLEX128: "complex128"}


_NAMES = {}


def load_model(model):
    """A ``ModelProto`` from a ModelProto, serialized bytes or a path.

    Raises:
        BackendError: the argument is none of these or is not a readable model.
    """
    onnx = _onnx()
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray, memoryview)):
        try:
            return onnx.ModelProto.FromString(bytes(model))
        except Exception as exc:
            raise BackendError(f"the bytes given are not a serialized ONNX model: {exc}") from None
    if isinstance(model, (str, os.PathLike)):
        return load_model_file(model)[0]
    raise BackendError(f"cannot lift a {type(model).__name__} as an ONNX model "
                       "(give an onnx.ModelProto, its bytes or a file path)")


def load_model_file(path):
    """``(ModelProto, external)``: the model in the file at ``path`` with its
    external data files read in (as ``onnx.load`` does), and whether it had
    any (its tensors then live beside the file, not in it).

    Raises:
        BackendError: no such file, or it is not a readable model.
    """
    onnx = _onnx()
    from onnx import external_data_helper as external_data
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise BackendError(f"no ONNX model file at {path!r}")
    try:
        model = onnx.load(path, load_external_data=False)
        external = any(external_data.uses_external_data(t)
                       for t in external_data._get_all_tensors(model))
        if external:
            external_data.load_external_data_for_model(model, os.path.dirname(path) or ".")
    except Exception as exc:
        raise BackendError(f"cannot read an ONNX model from {path!r}: "
                           f"{type(exc).__name__}: {exc}") from None
    return model, external
