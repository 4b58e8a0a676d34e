"""Conformance: every op of PyTorch's own OpInfo database, under amanda, by difference.

For every OpInfo of ``torch.testing._internal.common_methods_invocations.op_db``
that runs in float32 on CPU, its first ``SAMPLES`` samples run plainly and under
identity tools (routines at all four points handing back what they got, or
copies of it) and a counting tool, forward and, where the OpInfo supports
autograd, backward. Outputs, gradients and the inputs after the call (what the
op wrote in place) must equal the plain run bit for bit; the counter's
executions of (op id, point) must be the same with and without the analysis
cache, with as many after-routines as before-routines; leaving ``apply`` must
leave no mode or hook behind. A sample whose plain run does not repeat itself
from the same seed has its values compared only for errors raised.

Where amanda says that bits may differ (``NotBitExactWarning``), values are not
compared; the sweep counts such samples and the README names them. An op that
cannot pass is listed in ``EXPECTED_FAILURES`` with the reason; none is now.

The whole database is slow-marked (3 to 10 minutes here); ``QUICK`` runs in the
fast loop.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")

from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

from tests.pytorch.opinfo_harness import backend_clean, check_sample  # noqa: E402

SAMPLES = 3

#: Ops whose samples are known not to pass, with the reason (strict xfail:
#: one that starts passing fails the sweep until it is taken off).
EXPECTED_FAILURES = {}

#: Ops whose results are uninitialised memory: torch defines no values to
#: compare (torch's own OpInfo tests skip their values too); errors, counts
#: and the cache are still checked.
VALUES_UNDEFINED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                    "new_empty_strided"}

#: A fixed quick subset across kinds of op: pointwise, reductions, views,
#: in-place, random, linear algebra, convolution, normalisation (the batch
#: norm variants that update running statistics), indexing.
QUICK = ("add", "mul", "empty_like", "sparse.sampled_addmm", "as_strided.partial_views", "sum", "mean", "view", "transpose", "index_select", "nn.functional.dropout",
         "matmul", "nn.functional.conv2d", "nn.functional.batch_norm", "native_batch_norm",
         "_batch_norm_with_update", "nn.functional.layer_norm", "softmax", "cat", "where",
         "nn.functional.embedding", "cumsum", "max.reduction_with_dim", "addmm", "clamp")


def _name(op):
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


OPS = [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def _param(op):
    name = _name(op)
    marks = [] if name in QUICK else [pytest.mark.slow]
    if name in EXPECTED_FAILURES:
        marks.append(pytest.mark.xfail(reason=EXPECTED_FAILURES[name], strict=True))
    return pytest.param(op, id=name, marks=marks)


def test_the_quick_subset_names_real_ops():
    names = {_name(op) for op in OPS}
    assert set(QUICK) <= names, set(QUICK) - names


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("op", [_param(op) for op in OPS])
def test_opinfo_under_amanda_equals_plain(op):
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd))
    assert samples, "the OpInfo gave no sample"
    problems = []
    for index, sample in enumerate(samples[:SAMPLES]):
        found, _ = check_sample(op, sample, op.supports_autograd,
                                values_defined=op.name not in VALUES_UNDEFINED)
        problems += [f"sample {index}: {p}" for p in found]
        assert backend_clean(), "apply left a mode or a hook behind"
    assert not problems, "\n".join(problems)
