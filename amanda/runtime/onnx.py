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
in ``docs/onnx.md``); this module is the entry point and re-exports the
public names:

* :mod:`~amanda.runtime.onnx_session`: the driver that patches
  ``InferenceSession`` inside ``apply``, and the per-session cache;
* :mod:`~amanda.runtime.onnx_instrument`: lift, analysis (`evaluate`,
  `example_feeds`), `instrument_model`, `export`;
* :mod:`~amanda.runtime.onnx_bodies`: If/Loop/Scan bodies;
* :mod:`~amanda.runtime.onnx_lowering` and
  :mod:`~amanda.runtime.onnx_routine_nodes`: IR -> ModelProto, routines as
  portable nodes or host nodes;
* :mod:`~amanda.runtime.onnx_portable`: portable routines as ONNX nodes;
* :mod:`~amanda.runtime.onnx_host`: the Python side of host nodes
  (hand-off, checks, errors, `current_run`, `inference_session`);
* :mod:`~amanda.runtime.onnx_observe`: observe-only side branches and the
  zero-copy fetch path (`hosted_observation`, `observation_budget`).
"""

from __future__ import annotations

# every public name that was importable from here before the split still is (the
# constants of lowered models, the observe-only test and the classes behind
# the driver included)
from amanda.runtime.onnx_host import (  # noqa: F401
    CALLBACK_DOMAIN, ORDER_SLOT, current_run, inference_session, session_options)
from amanda.runtime.onnx_instrument import (  # noqa: F401
    OnnxGraphBackend, evaluate, example_feeds, export, instrument_model)
from amanda.runtime.onnx_lowering import MAX_IR_VERSION, lower  # noqa: F401
from amanda.runtime.observation import (  # noqa: F401  (shared with TensorFlow)
    OBSERVATION_BUDGET, hosted_observation, observation_budget)
from amanda.runtime.onnx_routine_nodes import returns_only_none  # noqa: F401
from amanda.runtime.onnx_session import DRIVER, OnnxRuntimeDriver  # noqa: F401

__all__ = ["DRIVER", "current_run", "evaluate", "example_feeds", "export", "hosted_observation",
           "inference_session", "instrument_model", "lower", "observation_budget",
           "session_options"]
