"""Example rule sets for :mod:`amanda.tools.rewrite`, one module each, with a
per-backend variant (op vocabularies differ):

* :func:`fold_batchnorm_rules` (:mod:`.batchnorm`): fold an inference batch
  norm into the convolution before it;
* :func:`gelu_tanh_rules` (:mod:`.gelu`): exact gelu -> its tanh approximation;
* :func:`fake_quant_matmul_rules` (:mod:`.fake_quant`): a fake-quant pair
  around every matrix product.

Each takes ``backend`` (``"pytorch"``, ``"tensorflow"`` or ``"onnx"``) and
returns a list of :class:`~amanda.passes.rewrite.Rule`; all are importable
from :mod:`amanda.tools.rewrite` too. The variants are each backend's own
(``amanda/runtime/<backend>/rewrite_rules.py``, found through its tool
support); what they share is :mod:`amanda.passes.rewrite_helpers`.
"""

from amanda.tools.rewrite_rules.batchnorm import fold_batchnorm_rules
from amanda.tools.rewrite_rules.fake_quant import fake_quant_matmul_rules
from amanda.tools.rewrite_rules.gelu import gelu_tanh_rules

__all__ = ["fake_quant_matmul_rules", "fold_batchnorm_rules", "gelu_tanh_rules"]
