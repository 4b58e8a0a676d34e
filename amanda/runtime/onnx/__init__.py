"""ONNX runtime: lower instrumented IR graphs to ``ModelProto`` and run them.

Three ways in:

* inside ``amanda.apply(...)``, an ``onnxruntime.InferenceSession`` created
  from a model (path, bytes of a ModelProto) runs the instrumented model:
  ``InferenceSession.__init__`` is patched while any thread is inside a scope
  and restored exactly when the last one leaves;
* ``amanda.instrument(model_proto, *tools)`` returns an instrumented copy
  (the input is untouched); Python routines in it are hosted by this process
  (run it with :func:`inference_session`);
* :func:`export` returns an instrumented copy that runs anywhere: every
  routine must lower natively, else the error names it.

The model is lifted into the IR (:mod:`amanda.frontends.onnx`), the tools'
analysis routines run over it (the shared instrumentation pass; contexts have
namespace ``"onnx/<opset>/graph"``, ``get_op()`` is the ``onnx.NodeProto``,
``get_inputs()``/``get_outputs()`` are ``onnx.ValueInfoProto`` symbols), the
actions become ``amanda.routine`` IR ops (:mod:`amanda.passes.lower_actions`),
and :func:`lower` writes the ModelProto:

* a **portable** routine (``amanda.portable.is_portable``) is traced with
  ``amanda.portable.trace`` and emitted as ONNX nodes and initializers
  (``fake_quant`` over an 8-bit range becomes a QuantizeLinear /
  DequantizeLinear pair);
* any other routine becomes an ``ai.onnx.contrib`` custom op hosted by
  ``onnxruntime-extensions`` (a Python op per dtype signature; the node's
  ``key`` attribute selects the action). It receives NumPy arrays and the
  action's keyword arguments.

Instrumented models are cached per amanda session by the SHA-256 of the
model's bytes. How it fits together and its limits: ``docs/onnx.md``.

The code is split along its seams (see "How the ONNX runtime is organised"
in ``docs/onnx.md``); this package's ``__init__`` is the entry point and
re-exports the public names, each imported from its module on first access:

* :mod:`~amanda.runtime.onnx.session`: the driver that patches
  ``InferenceSession`` inside ``apply``, and the per-session cache;
* :mod:`~amanda.runtime.onnx.instrument`: lift, analysis (`evaluate`,
  `example_feeds`), `instrument_model`, `export`;
* :mod:`~amanda.runtime.onnx.bodies`: If/Loop/Scan bodies;
* :mod:`~amanda.runtime.onnx.lowering` and
  :mod:`~amanda.runtime.onnx.routine_nodes`: IR -> ModelProto, routines as
  portable nodes or host nodes;
* :mod:`~amanda.runtime.onnx.portable`: portable routines as ONNX nodes;
* :mod:`~amanda.runtime.onnx.host`: the Python side of host nodes
  (hand-off, checks, errors, `current_run`, `inference_session`);
* :mod:`~amanda.runtime.onnx.observe`: observe-only side branches and the
  zero-copy fetch path (`hosted_observation`, `observation_budget`).
"""

from __future__ import annotations

from amanda.runtime.backends import Backend, load, register

BACKEND = register(Backend(
    name="onnx",
    frameworks=("onnxruntime",),
    value_modules=("onnx",),     # onnx.ValueInfoProto symbols of a model being instrumented
    program_modules=("onnx",),
    driver="amanda.runtime.onnx.session:DRIVER",
    evaluate="amanda.runtime.onnx.instrument:evaluate",
    instrument="amanda.runtime.onnx.instrument:instrument_model",
    tool_support="amanda.runtime.onnx.tools",
    vocabulary="amanda.runtime.onnx.vocabulary",
    rewrite_rules="amanda.runtime.onnx.rewrite_rules",
))

#: public name -> the module of this package that defines it. Every name that
#: was importable from here before the split still is (the constants of
#: lowered models, the observe-only test and the classes behind the driver
#: included). They are resolved on first access (PEP 562), so importing a
#: framework-free module of this package (``amanda.runtime.onnx.tools``, which
#: the built-in tools import) imports neither onnx nor onnxruntime.
_EXPORTS = {
    "CALLBACK_DOMAIN": "host", "ORDER_SLOT": "host", "current_run": "host",
    "inference_session": "host", "session_options": "host",
    "OnnxGraphBackend": "instrument", "evaluate": "instrument", "example_feeds": "instrument",
    "export": "instrument", "instrument_model": "instrument",
    "MAX_IR_VERSION": "lowering", "lower": "lowering",
    "returns_only_none": "routine_nodes",
    "DRIVER": "session", "OnnxRuntimeDriver": "session",
}
#: shared with TensorFlow (the backend-free kernel)
_KERNEL_EXPORTS = {"OBSERVATION_BUDGET", "hosted_observation", "observation_budget"}
_SUBMODULES = ("bodies", "host", "instrument", "lowering", "observe", "portable",
               "routine_nodes", "session", "tools", "wire")

__all__ = ["BACKEND", "DRIVER", "current_run", "evaluate", "example_feeds", "export", "hosted_observation",
           "inference_session", "instrument_model", "lower", "observation_budget",
           "session_options"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(load(f"{__name__}.{_EXPORTS[name]}"), name)
    elif name in _KERNEL_EXPORTS:
        value = getattr(load("amanda.runtime.observation"), name)
    elif name in _SUBMODULES:
        value = load(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | _KERNEL_EXPORTS | set(_SUBMODULES))
