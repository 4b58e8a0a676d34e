"""The FLOP formula table of :mod:`amanda.tools.flops`.

Op types (canonical, backend-neutral names from
:data:`amanda.tools.mapping_rules.RULES`) map to a formula in
:data:`FORMULAS`; :func:`normalise_type` folds backend aliases onto the
table's names (each backend's vocabulary says how: ``formula_type``, see
:mod:`amanda.runtime.vocabulary`); a formula asks the vocabulary what only
the backend knows (a filter's layout, a product's contracted axis); the
``*_BACKWARD`` tables say how many forward-FLOPs each
backward op computing a gradient of a convolution or matrix product is
charged. An op type without a formula is never counted as zero: the
profiler lists it as unknown. Conventions: see :mod:`amanda.tools.flops`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from amanda.runtime import vocabulary
from amanda.tools._shapes import dims

__all__ = ["BACKWARD_FORMULAS", "BACKWARD_TYPES", "CONV_TYPES", "ELEMENTWISE_TYPES",
           "FORMULAS", "MATMUL_TYPES",
           "NORM_TYPES", "REDUCTION_TYPES", "RNN_ELEMENTWISE", "SOFTMAX_TYPES",
           "ZERO_FLOP_TYPES", "normalise_type"]

#: Convolutions: 2 * output elements * (Cin / groups * kernel area).
CONV_TYPES = frozenset({"conv1d", "conv2d", "conv3d", "depthwise_conv2d", "convolution",
                        "conv_transpose", "conv_transpose1d", "conv_transpose2d",
                        "conv_transpose3d"})
#: Matrix products: 2 * output elements * contracted dimension.
MATMUL_TYPES = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm",
                          "batch_mat_mul", "einsum_matmul"})
#: Forward types whose backward ops are counted (2x forward, see module doc).
BACKWARD_TYPES = CONV_TYPES | MATMUL_TYPES

#: Element-wise ops: 1 FLOP per output element (transcendentals included).
ELEMENTWISE_TYPES = frozenset({
    "add", "iadd", "radd", "sub", "isub", "rsub", "mul", "imul", "rmul", "div", "idiv",
    "truediv", "itruediv", "rtruediv", "floordiv", "real_div", "floor_div", "neg", "abs",
    "pow", "rpow", "sqrt", "rsqrt", "exp", "log", "reciprocal", "square", "squared_difference",
    "relu", "relu6", "gelu", "tanh", "sigmoid", "silu", "elu", "selu", "leaky_relu", "hardtanh",
    "softplus", "erf", "clamp", "clip_by_value", "maximum", "minimum", "where", "masked_fill",
    "bias_add", "add_v2", "sign", "floor", "ceil", "round", "dropout_train", "select_v2",
    "greater", "less", "equal", "greater_equal", "less_equal", "not_equal", "logical_and",
    "logical_or", "logical_not", "gelu_tanh", "le", "lt", "ge", "gt", "eq", "ne",
    # ONNX spellings (Sum/Max/Min/Mean of n inputs: see _elementwise)
    "clip", "prelu", "hard_sigmoid", "hard_swish", "thresholded_relu", "softsign", "mish",
    "celu", "greater_or_equal", "less_or_equal", "not", "and", "or", "xor", "sin", "cos",
    "mod", "average",
})
#: Reductions and pooling: 1 FLOP per input element.
REDUCTION_TYPES = frozenset({
    "sum", "mean", "max", "min", "prod", "amax", "amin", "cumsum", "argmax", "argmin",
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "max_pool",
    "avg_pool", "norm", "global_avg_pool2d", "global_max_pool",
})
#: Normalisations: 5 FLOPs per element (statistics, normalise, affine).
NORM_TYPES = frozenset({"layer_norm", "batch_norm", "group_norm", "instance_norm",
                        "fused_batch_norm", "rms_norm"})
#: Softmax: 3 FLOPs per element (exp, sum, divide).
SOFTMAX_TYPES = frozenset({"softmax", "log_softmax"})

#: Ops without arithmetic: views, shape manipulation, copies, lookups, constants.
ZERO_FLOP_TYPES = frozenset({
    # PyTorch
    "reshape", "view", "flatten", "transpose", "permute", "t", "contiguous", "expand",
    "expand_as", "getitem", "setitem", "squeeze", "unsqueeze", "split", "chunk", "cat",
    "stack", "to", "clone", "detach", "type", "float", "half", "int", "long", "bool",
    "arange", "tensor", "zeros", "ones", "zeros_like", "ones_like", "full", "empty",
    "gather", "index_select", "embedding", "dropout", "size", "narrow", "repeat",
    "new_ones", "new_zeros", "masked_select", "unbind", "tril", "triu", "copy",
    "identity", "roll", "flip", "pad", "cpu", "cuda", "numpy", "item", "len", "dim",
    "numel", "is_floating_point", "finfo", "get_device", "contiguous_", "as_strided",
    "rand", "randn", "randint", "rand_like", "randn_like", "empty_like", "full_like",
    # TensorFlow
    "shape", "read_variable_op", "var_handle_op", "variable_v2", "const", "placeholder",
    "no_op", "cast", "concat_v2", "strided_slice", "slice", "expand_dims", "pack", "unpack",
    "gather_v2", "resource_gather", "fill", "range", "identity_n", "stop_gradient", "prevent_gradient", "pad_v2", "mirror_pad", "tile",
    "broadcast_to", "rank", "split_v", "assign_variable_op", "shape_n",
    "broadcast_args", "broadcast_gradient_args", "check_numerics",
    # ONNX (Gather of an initializer is "embedding", other Gathers "gather")
    "constant", "constant_of_shape", "concat", "cast_like", "gather_elements", "gather_nd",
    "depth_to_space", "space_to_depth", "non_zero", "trilu", "optional",
})


def _numel(shape):
    return int(math.prod(shape))


def _shape(tensor, support=None):
    """A tensor's fully known shape as a tuple of ints, or None. A value
    without a ``shape`` (an ONNX ``ValueInfoProto``) is read by its
    backend's tool support (``static_shape``)."""
    if getattr(tensor, "shape", None) is None:
        return None if support is None else support.static_shape(tensor)
    known = dims(tensor)
    return None if known is None or None in known else tuple(known)


def _conv(op_type, ins, out, op, words):
    weight = ins[1]
    if op_type.startswith("conv_transpose"):
        # weight (Cin, Cout/groups, k...): each input element feeds Cout/g*k outputs
        return 2 * _numel(ins[0]) * _numel(weight[1:])
    # the weight elements one output reads: the layout is the backend's
    return 2 * _numel(out) * words.kernel_elements(op_type, weight)


def _matmul(op_type, ins, out, op, words):
    # the contracted dimension: which operand and axis is the backend's
    return 2 * _numel(out) * words.contracted(op_type, ins, op)


def _sdpa(op_type, ins, out, op, words):
    # the two matrix products q @ k^T and p @ v, as FlopCounterMode counts
    q, k, v = ins[:3]
    rows = _numel(q[:-1])
    return 2 * rows * k[-2] * q[-1] + 2 * rows * k[-2] * v[-1]


#: Recurrent ops: element-wise FLOPs per hidden unit and time step (see _rnn).
RNN_ELEMENTWISE = {"rnn_tanh": 2, "rnn_relu": 2, "lstm": 13, "gru": 11}
_RNN_STATES = {"lstm": 2}


def _rnn(op_type, ins, out, op, words):
    """``torch.rnn_tanh/rnn_relu/lstm/gru`` (inputs: the sequence, the
    hidden state(s), then per layer and direction ``w_ih``, ``w_hh`` and
    optional biases). Every time step multiplies each weight matrix (rows,
    cols) with one column per sequence element: ``2 * T*B * rows * cols``;
    biases are not counted, as for ``linear``. The gate arithmetic adds
    :data:`RNN_ELEMENTWISE` FLOPs per hidden unit and step: RNN 2 (sum,
    activation); LSTM 13 (4 sums, 4 activations, ``f*c + i*g`` 3, ``o *
    tanh(c)`` 2); GRU 11 (2 sums, 2 sigmoids, ``tanh(x_n + r * h_n)`` 3,
    ``(1 - z) * n + z * h`` 4)."""
    weights = [shape for shape in ins[1 + _RNN_STATES.get(op_type, 1):] if len(shape) == 2]
    input_to_hidden, hidden_to_hidden = weights[0::2], weights[1::2]
    if not hidden_to_hidden or len(input_to_hidden) != len(hidden_to_hidden):
        raise IndexError("weights of an RNN not found")
    steps = _numel(ins[0]) // input_to_hidden[0][1]      # time steps x batch
    matmuls = sum(2 * steps * rows * cols for rows, cols in weights)
    hidden = sum(cols for _, cols in hidden_to_hidden)    # H per layer and direction
    return matmuls + RNN_ELEMENTWISE[op_type] * steps * hidden


def _elementwise(op_type, ins, out, op, words):
    # ONNX Sum/Max/Min of n inputs: n - 1 binary ops per output element; Mean one more
    extra = max(len(ins) - 2, 0) if words.VARIADIC_ELEMENTWISE else 0
    return (1 + extra + (op_type == "average")) * _numel(out)


def _per_input(factor):
    return lambda op_type, ins, out, op, words: factor * _numel(ins[0])


#: Canonical type -> formula(type, input shapes, first output shape, op, words),
#: ``words`` being the op's backend's vocabulary (:mod:`amanda.runtime.vocabulary`);
#: a shape is a tuple of ints.
FORMULAS = {}
FORMULAS.update({t: _conv for t in CONV_TYPES})
FORMULAS.update({t: _matmul for t in MATMUL_TYPES})
FORMULAS["scaled_dot_product_attention"] = _sdpa
FORMULAS.update({t: _rnn for t in RNN_ELEMENTWISE})
FORMULAS.update({t: _elementwise for t in ELEMENTWISE_TYPES})
FORMULAS.update({t: _per_input(1) for t in REDUCTION_TYPES})
FORMULAS.update({t: _per_input(5) for t in NORM_TYPES})
FORMULAS.update({t: _per_input(3) for t in SOFTMAX_TYPES})

# -- backward of the other ops (PyTorch autograd nodes) ---------------------------------
#
# A backward formula gives the FLOPs of each gradient an op's autograd node
# computes, from the forward op's output elements ``n``, its first input's
# elements ``n_in`` and its forward FLOPs ``f``: a tuple, one cost per gradient
# position (the last one repeats for further positions); a gradient autograd
# does not compute (None: a frozen weight, an integer input) costs nothing.
# Element-wise ops: the gradient is the incoming one times the derivative, so
# 1 FLOP for the product plus the derivative's own FLOPs per element.

#: Extra FLOPs per element to evaluate the derivative (beyond the product with
#: the incoming gradient), from the forward input or output.
_DERIVATIVE = {
    # a mask or a constant: only the product (or a select)
    "relu": 0, "relu6": 0, "leaky_relu": 0, "hardtanh": 0, "clamp": 0, "clip": 0,
    "clip_by_value": 0, "masked_fill": 0, "where": 0, "select_v2": 0, "dropout_train": 0,
    "abs": 0, "maximum": 0, "minimum": 0, "elu": 1, "selu": 1, "celu": 1, "prelu": 0,
    "mul": 0, "imul": 0, "rmul": 0, "neg": 0,
    # from the output: exp' = y, tanh' = 1 - y^2, sigmoid' = y (1 - y), sqrt' = 0.5 / y
    "exp": 0, "tanh": 2, "sigmoid": 2, "sqrt": 1, "rsqrt": 2, "reciprocal": 2, "square": 1,
    # from the input: log' = 1 / x; erf' = 2/sqrt(pi) exp(-x^2); softplus' = sigmoid(x)
    "log": 1, "erf": 3, "softplus": 3, "pow": 3, "rpow": 2, "silu": 4, "mish": 8,
    # gelu' = Phi(x) + x phi(x) (erf, exp and 5 arithmetic); tanh form: 2 more
    "gelu": 7, "gelu_tanh": 9,
    # a / b: grad_a = g / b, grad_b = -g a / b^2 (3 more)
    "div": 1, "idiv": 1, "truediv": 1, "itruediv": 1, "rtruediv": 1, "real_div": 1,
}
#: Add and subtract pass the incoming gradient through (negated for the
#: subtrahend): no arithmetic, but for a negation.
_PASS_THROUGH = {"add", "iadd", "radd", "add_v2", "bias_add", "sub", "isub", "rsub"}
#: Views and copies whose backward adds: a lookup's gradient is scattered
#: with an addition per element (embedding, gather), a broadcast's is summed.
SCATTER_BACKWARD_TYPES = frozenset({"embedding", "gather", "index_select", "expand",
                                    "expand_as", "repeat", "broadcast_to"})


def _elementwise_backward(op_type, n, n_in, f):
    if op_type in _PASS_THROUGH:
        return (0, n) if op_type in ("sub", "isub", "rsub") else (0,)
    if op_type in ("div", "idiv", "truediv", "itruediv", "rtruediv", "real_div"):
        return (n, 4 * n)
    derivative = _DERIVATIVE.get(op_type)
    return None if derivative is None else ((1 + derivative) * n,)


def _norm_backward(op_type, n, n_in, f):
    # input: recompute x-hat, scale by gamma, two means and the combination
    # (8 per element); gamma: g * x-hat summed (2); beta: g summed (1)
    return (8 * n_in, 2 * n_in, n_in)


def _reduction_backward(op_type, n, n_in, f):
    if op_type == "sum":                 # an expand: no arithmetic
        return (0,)
    if op_type in ("cumsum",):           # a reversed cumulative sum
        return (n_in,)
    if op_type in ("argmax", "argmin"):  # no gradient
        return (0,)
    return (n_in,)                       # mean, avg pool: divide; max pool: scatter


#: Canonical type -> backward(op type, n, n_in, forward FLOPs) -> costs per
#: gradient position, or None when the formula does not cover that type.
BACKWARD_FORMULAS = {}
BACKWARD_FORMULAS.update({t: _elementwise_backward for t in ELEMENTWISE_TYPES})
BACKWARD_FORMULAS.update({t: _norm_backward for t in NORM_TYPES})
BACKWARD_FORMULAS.update({t: _reduction_backward for t in REDUCTION_TYPES})
# softmax: y (g - sum(g y)), 4 per element; log-softmax: g - exp(y) sum(g), 3
BACKWARD_FORMULAS.update({"softmax": lambda t, n, n_in, f: (4 * n,),
                          "log_softmax": lambda t, n, n_in, f: (3 * n,)})
# attention: four products of the size of one of the two forward ones (as
# FlopCounterMode counts), 2x forward: the gradient of the probabilities and
# q's (one each), k's and v's
BACKWARD_FORMULAS["scaled_dot_product_attention"] = lambda t, n, n_in, f: (f, f // 2, f // 2)
# recurrent layers: like matrix products, 2x forward
BACKWARD_FORMULAS.update({t: (lambda t, n, n_in, f: (2 * f,)) for t in RNN_ELEMENTWISE})
BACKWARD_FORMULAS.update({t: (lambda t, n, n_in, f: (n,)) for t in SCATTER_BACKWARD_TYPES})


def backward_costs(op_type, n, n_in, flops):
    """FLOPs per gradient position of ``op_type``'s autograd node, or None
    (no formula: listed as unknown, never zero)."""
    formula = BACKWARD_FORMULAS.get(op_type)
    if formula is None or n is None:
        return None
    costs = formula(op_type, n, n_in if n_in is not None else n, flops)
    return None if costs is None else tuple(max(int(c), 0) for c in costs)


#: what the formulas assume of a backend without a vocabulary: weights
#: ``(out, in, k...)``, products contracting their first operand's last axis
PLAIN_VOCABULARY = SimpleNamespace(
    kernel_elements=lambda op_type, weight: _numel(weight[1:]),
    contracted=lambda op_type, ins, op: (ins[1] if op_type in ("addmm", "baddbmm")
                                         else ins[0])[-1],
    VARIADIC_ELEMENTWISE=False)


def normalise_type(op_type, namespace=None):
    """Fold a backend's spellings onto the formula table's names (PyTorch
    dunder / in-place names such as ``__iadd__`` and ``relu_``, TF and ONNX
    aliases): the vocabulary of ``namespace``'s backend says how
    (``formula_type``); without one, leading and trailing ``_`` go."""
    if op_type is None:
        return None
    words = vocabulary.of(namespace)
    return op_type.strip("_") if words is None else words.formula_type(op_type)


def _needed_inputs(formula, op_type):
    """How many leading inputs the formula reads the shapes of."""
    if formula in (_conv, _matmul):
        return 3 if op_type in ("addmm", "baddbmm") else 2
    if formula is _sdpa:
        return 3
    if formula is _elementwise:
        return 0
    return 1


def _apply(formula, op_type, ins, out, op, words):
    """The formula's FLOPs, or None when a shape it needs is unknown.
    ``words``: the op's backend's vocabulary."""
    if out is None:
        return None
    needed = _needed_inputs(formula, op_type)
    if len(ins) < needed or any(s is None for s in ins[:needed]):
        return None
    try:
        return int(formula(op_type, ins, out, op, words))
    except (IndexError, TypeError):
        return None
