"""A fake-quant pair around every matrix product
(:func:`fake_quant_matmul_rules`), per backend.

Each backend's variant lives in its package
(``amanda/runtime/<backend>/rewrite_rules.py``).
"""

from __future__ import annotations

from amanda.tools.rewrite_rules._common import variant


def fake_quant_matmul_rules(backend="pytorch", scale=1 / 64, zero_point=0, quant_min=-128, quant_max=127):
    """Rules inserting a fake-quant pair (one per operand) around every matrix product.

    Each operand of a product is quantized to ``clip(round(x / scale) +
    zero_point, quant_min, quant_max)`` and back. The constraint that an
    operand is not fake-quantized yet is what makes the driver converge (a
    rewritten product does not match again). All rules are named
    ``"fake_quant_matmul"``.

    Args:
        backend: ``"pytorch"`` (graph capture: ``matmul`` and ``linear`` read
            ``fake_quantize_per_tensor_affine``); ``"tensorflow"`` (``MatMul``,
            ``BatchMatMul[V2|V3]`` and two-operand ``Einsum`` on float32 read
            ``FakeQuantWithMinMaxArgs`` with ``min = (quant_min - zero_point)
            * scale``, ``max = (quant_max - zero_point) * scale``; TensorFlow
            rounds half up and nudges the range so that zero is exact, which
            changes nothing when ``scale`` is a power of two); ``"onnx"``
            (the first two inputs of ``MatMul`` and ``Gemm`` on float32 go
            through ``QuantizeLinear`` -> ``DequantizeLinear``, int8 or uint8
            by the range; ONNX rounds half to even).
        scale, zero_point, quant_min, quant_max: the fake-quant parameters.

    Returns:
        A list of `Rule`.
    """
    return variant("fake_quant_matmul_rules", backend)(scale, zero_point, quant_min, quant_max)
