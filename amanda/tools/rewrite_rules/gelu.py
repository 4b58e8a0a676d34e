"""Exact gelu replaced by its tanh approximation (:func:`gelu_tanh_rules`),
per backend.

Each backend's variant lives in its package
(``amanda/runtime/<backend>/rewrite_rules.py``).
"""

from __future__ import annotations

from amanda.tools.rewrite_rules._common import variant


def gelu_tanh_rules(backend="pytorch"):
    """Rules replacing exact gelu by its tanh approximation
    ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``.

    All rules are named ``"gelu_tanh"`` (so ``result.counts()`` sums them);
    their patterns spell exact gelu the ways each backend writes it, and
    `explain` takes the whole list to say why none matches.

    Args:
        backend: ``"pytorch"`` (graph capture: ``gelu`` with
            ``approximate='none'``, replaced by ``pow``/``tanh``/``mul``/``add``
            ops); ``"tensorflow"`` (GraphDef: ``tf.nn.gelu`` and Keras
            ``activation="gelu"`` give ``0.5 * x * erfc(-x / sqrt 2)`` in
            TF 2.21, older TensorFlow and hand-written models
            ``0.5 * x * (1 + erf(x / sqrt 2))``; every association order of the
            two products is matched, and the constants 0.5, 1 and sqrt 2 are
            checked; replaced by ``Mul``/``AddV2``/``Tanh`` in the gelu's dtype);
            ``"onnx"`` (``Gelu`` with ``approximate='none'`` at opset 20 becomes
            ``Gelu`` with ``approximate='tanh'``; the ``Div``/``Erf``/``Add``/
            ``Mul``/``Mul`` subgraph that torch.onnx writes below opset 20, in
            the orders of both exporters, becomes ``Mul``/``Add``/``Tanh`` on
            float32).

    Returns:
        A list of `Rule`.
    """
    return variant("gelu_tanh_rules", backend)()
