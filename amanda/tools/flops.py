"""FLOPs profiler: count the floating-point operations every op executes.

:class:`FlopsProfiler` depends on a :class:`~amanda.tools.mapping.MappingTool`
with :data:`amanda.tools.mapping_rules.RULES`, so it reads backend-neutral op
types (``context["type"]``) and works on PyTorch (eager) and TensorFlow
(``tf.compat.v1`` graphs) alike. Its forward analysis routine (registered with
``require_outputs=True``) computes the op's FLOPs once, from the shapes of
``context.get_inputs()`` / ``get_outputs()`` (PyTorch tensors, or TF symbolic
tensors with static shapes, or the ``onnx.ValueInfoProto`` symbols of an ONNX
model, whose shapes the ONNX frontend infers when the model does not declare
them), and inserts an observe-only instrumentation routine that adds them each
time the op executes: counts are per execution, with amanda's analysis cache
on. On ONNX, an op whose shapes are not static (a symbolic batch dimension
``N``) is counted at run time instead, from the shapes of the NumPy arrays its
routines receive.

Conventions (see docs/tools/flops.md):

* a multiply-add counts as 2 FLOPs, as in ``torch.utils.flop_counter.FlopCounterMode``;
* biases of convolutions and linear layers are not counted (as in
  ``FlopCounterMode``); a separate ``BiasAdd`` op (TF) is element-wise;
* backward: each backward op that computes a gradient of a convolution or
  matrix product is charged the forward FLOPs of its op once per gradient
  operand it computes (input and weight: 2x forward). In PyTorch the single
  ``ConvolutionBackward0`` / ``AddmmBackward0`` / ``MmBackward0`` /
  ``BmmBackward0`` node gets 2x forward; in TF ``Conv2DBackpropInput`` and
  ``Conv2DBackpropFilter`` (and the two gradient ``MatMul`` ops) get 1x each.
  Other backward ops are not counted. ONNX models are inference graphs:
  forward only.
* op types without a formula are counted in :attr:`FlopsProfiler.unknown`
  (type -> executions), never silently as zero; ops without arithmetic
  (views, reshapes, copies, lookups) are in :data:`ZERO_FLOP_TYPES`.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import amanda
from amanda.tools import mapping_rules
from amanda.tools._module_path import module_path_of
from amanda.tools._shapes import dims
from amanda.tools.mapping import MappingTool

__all__ = ["BACKWARD_TYPES", "CONV_TYPES", "FORMULAS", "MATMUL_TYPES", "RNN_ELEMENTWISE",
           "ZERO_FLOP_TYPES", "FlopsProfiler", "format_count"]

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


def _shape(tensor):
    """A tensor's fully known shape as a tuple of ints, or None."""
    if getattr(tensor, "shape", None) is None:
        return _onnx_shape(tensor)
    known = dims(tensor)
    return None if known is None or None in known else tuple(known)


def _onnx_shape(value):
    """The static shape of an ``onnx.ValueInfoProto`` (duck-typed: ``onnx`` is
    not imported), or None when its rank or a dimension is unknown or symbolic."""
    tensor_type = getattr(getattr(value, "type", None), "tensor_type", None)
    if tensor_type is None or not value.type.HasField("tensor_type") \
            or not tensor_type.HasField("shape"):
        return None
    sizes = []
    for d in tensor_type.shape.dim:
        if not d.HasField("dim_value"):
            return None
        sizes.append(int(d.dim_value))
    return tuple(sizes)


def _onnx_attr(node, name, default=0):
    for attr in getattr(node, "attribute", ()):
        if attr.name == name:
            return attr.i
    return default


def _attr(op, name, default=False):
    get_attr = getattr(op, "get_attr", None)
    if get_attr is None:
        return default
    try:
        return get_attr(name)
    except (ValueError, KeyError, TypeError):
        return default
    except Exception:  # noqa: BLE001 - any backend error means "no such attr"
        return default


def _conv(op_type, ins, out, op, backend):
    weight = ins[1]
    if op_type.startswith("conv_transpose"):
        # weight (Cin, Cout/groups, k...): each input element feeds Cout/g*k outputs
        return 2 * _numel(ins[0]) * _numel(weight[1:])
    if backend == "tensorflow":
        if op_type == "depthwise_conv2d":  # filter (KH, KW, Cin, multiplier)
            return 2 * _numel(out) * _numel(weight[:2])
        return 2 * _numel(out) * _numel(weight[:-1])  # filter HWIO: KH*KW*Cin
    return 2 * _numel(out) * _numel(weight[1:])  # weight (Cout, Cin/g, k...) (also ONNX)


def _matmul(op_type, ins, out, op, backend):
    if backend == "onnx":
        a = ins[0]
        if getattr(op, "op_type", None) == "Gemm":  # A (M, K), or (K, M) with transA
            return 2 * _numel(out) * (a[0] if _onnx_attr(op, "transA") else a[1])
        return 2 * _numel(out) * a[-1]  # MatMul: numpy semantics, K = A's last dim
    if backend == "tensorflow":
        a = ins[0]
        if op.type == "MatMul":
            k = a[0] if _attr(op, "transpose_a") else a[1]
        else:  # BatchMatMul*: adj_x
            k = a[-2] if _attr(op, "adj_x") else a[-1]
        return 2 * _numel(out) * k
    if op_type == "linear":
        return 2 * _numel(out) * ins[1][-1]  # weight (out, in)
    a = ins[1] if op_type in ("addmm", "baddbmm") else ins[0]
    return 2 * _numel(out) * a[-1]


def _sdpa(op_type, ins, out, op, backend):
    # the two matrix products q @ k^T and p @ v, as FlopCounterMode counts
    q, k, v = ins[:3]
    rows = _numel(q[:-1])
    return 2 * rows * k[-2] * q[-1] + 2 * rows * k[-2] * v[-1]


#: Recurrent ops: element-wise FLOPs per hidden unit and time step (see _rnn).
RNN_ELEMENTWISE = {"rnn_tanh": 2, "rnn_relu": 2, "lstm": 13, "gru": 11}
_RNN_STATES = {"lstm": 2}


def _rnn(op_type, ins, out, op, backend):
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


def _elementwise(op_type, ins, out, op, backend):
    # ONNX Sum/Max/Min of n inputs: n - 1 binary ops per output element; Mean one more
    extra = max(len(ins) - 2, 0) if backend == "onnx" else 0
    return (1 + extra + (op_type == "average")) * _numel(out)


def _per_input(factor):
    return lambda op_type, ins, out, op, backend: factor * _numel(ins[0])


#: Canonical type -> formula(type, input shapes, first output shape, op, backend),
#: backend being "pytorch", "tensorflow" or "onnx"; a shape is a tuple of ints.
FORMULAS = {}
FORMULAS.update({t: _conv for t in CONV_TYPES})
FORMULAS.update({t: _matmul for t in MATMUL_TYPES})
FORMULAS["scaled_dot_product_attention"] = _sdpa
FORMULAS.update({t: _rnn for t in RNN_ELEMENTWISE})
FORMULAS.update({t: _elementwise for t in ELEMENTWISE_TYPES})
FORMULAS.update({t: _per_input(1) for t in REDUCTION_TYPES})
FORMULAS.update({t: _per_input(5) for t in NORM_TYPES})
FORMULAS.update({t: _per_input(3) for t in SOFTMAX_TYPES})

# TensorFlow op types whose canonical type needs renaming.
_TF_ALIASES = {"batch_mat_mul_v2": "matmul", "batch_mat_mul_v3": "matmul",
               "fused_batch_norm": "batch_norm", "fused_batch_norm_v2": "batch_norm",
               "add_v2": "add", "real_div": "div", "max_pool2d": "max_pool2d",
               "conv2_d": "conv2d", "identity": "identity"}

# ONNX op types whose snake-case name means something else in the table: the
# variadic element-wise Sum/Max/Min/Mean, the Reduce* ops, the normalisations.
_ONNX_ALIASES = {"sum": "add", "max": "maximum", "min": "minimum", "mean": "average",
                 "reduce_sum": "sum", "reduce_mean": "mean", "reduce_max": "max",
                 "reduce_min": "min", "reduce_prod": "prod", "reduce_l2": "norm",
                 "arg_max": "argmax", "arg_min": "argmin",
                 "instance_normalization": "instance_norm",
                 "group_normalization": "group_norm"}

# Backward ops that compute the gradients of a convolution / matrix product,
# and how many forward-FLOPs each is charged.
_TORCH_BACKWARD = {"ConvolutionBackward0": 2, "AddmmBackward0": 2, "MmBackward0": 2,
                   "BmmBackward0": 2, "BaddbmmBackward0": 2, "LinearBackward0": 2,
                   "MvBackward0": 2, "ConvolutionBackwardBackward0": 2}
_TF_BACKWARD = {"Conv2DBackpropInput": 1, "Conv2DBackpropFilter": 1,
                "Conv2DBackpropInputV2": 1, "Conv2DBackpropFilterV2": 1,
                "DepthwiseConv2dNativeBackpropInput": 1,
                "DepthwiseConv2dNativeBackpropFilter": 1,
                "MatMul": 1, "BatchMatMul": 1, "BatchMatMulV2": 1, "BatchMatMulV3": 1}


def normalise_type(op_type, backend=None):
    """Fold PyTorch dunder / in-place names (``__iadd__``, ``relu_``) and TF
    and ONNX aliases onto the formula table's names."""
    if op_type is None:
        return None
    if backend == "onnx":
        return _ONNX_ALIASES.get(op_type, op_type)
    name = op_type.strip("_")
    return _TF_ALIASES.get(name, name)


#: ONNX element types a hosted routine can receive (float16/bfloat16 cannot).
_ONNX_HOSTED = frozenset({1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13})


def _backend(namespace):
    return namespace.split("/", 1)[0]


def _needed_inputs(formula, op_type, backend):
    """How many leading inputs the formula reads the shapes of."""
    if formula in (_conv, _matmul):
        return 3 if op_type in ("addmm", "baddbmm") and backend == "pytorch" else 2
    if formula is _sdpa:
        return 3
    if formula is _elementwise:
        return 0
    return 1


def format_count(value):
    """A count in auto-scaled units: ``512``, ``1.23K``, ``45.60M``, ``7.89G``."""
    for factor, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= factor:
            return f"{value / factor:.2f}{unit}"
    return f"{value:,}" if isinstance(value, int) else f"{value:.3g}"


def _parameters(inputs, backend):
    """``{key: element count}`` of the inputs that are trainable parameters:
    ``torch.nn.Parameter`` objects; TF values read from a variable."""
    found = {}
    for value in inputs:
        if backend == "pytorch":
            if type(value).__name__ == "Parameter":
                found[id(value)] = value.numel()
        elif backend == "tensorflow":
            producer = getattr(value, "op", None)
            if getattr(producer, "type", None) in ("ReadVariableOp", "VariableV2"):
                shape = _shape(value)
                if shape is not None:
                    found[producer.inputs[0].name if producer.inputs else producer.name] = \
                        _numel(shape)
    return found


def _apply(formula, op_type, ins, out, op, backend):
    """The formula's FLOPs, or None when a shape it needs is unknown."""
    if out is None:
        return None
    needed = _needed_inputs(formula, op_type, backend)
    if len(ins) < needed or any(s is None for s in ins[:needed]):
        return None
    try:
        return int(formula(op_type, ins, out, op, backend))
    except (IndexError, TypeError):
        return None


class FlopsProfiler(amanda.Tool):
    """Count forward (and backward) FLOPs per op execution.

    Args:
        backward: also count the backward FLOPs of convolutions and matrix
            products (see the module doc for the convention).

    Attributes:
        unknown: ``Counter`` of op types without a formula -> executions.
        records: (namespace, op id) -> dict(name, type, module, flops, calls)
            for every forward op with a nonzero count. For an ONNX op counted
            at run time (shapes not static), ``flops`` is that of its latest
            execution and ``dynamic`` is True.
    """

    def __init__(self, backward=True):
        super().__init__()
        self.depends_on(MappingTool(rules=mapping_rules.RULES))
        self.unknown = Counter()
        self.records = {}
        self._flops = {"forward": defaultdict(int), "backward": defaultdict(int)}
        self._by_module = {"forward": defaultdict(int), "backward": defaultdict(int)}
        self._dynamic = {}    # key -> (formula, type, module, op, input count)
        self._modules = {}    # module -> {"params": {key: numel}, "shape", "last"}
        self._analysed = 0    # forward ops analysed so far (orders the modules' outputs)
        self._pending = {}    # key -> input shapes stashed before the op ran
        self.add_inst_for_op(self.forward_analysis, require_outputs=True)
        if backward:
            self.add_inst_for_op(self.backward_analysis, backward=True)

    # -- analysis ------------------------------------------------------------
    def forward_analysis(self, context):
        backend = _backend(context.namespace)
        op_type = normalise_type(context.get("type"), backend)
        if op_type is None:
            op_type = normalise_type(context.get_op_name(), backend)
        module = module_path_of(context)
        self._note_module(context, backend, module)
        if op_type in ZERO_FLOP_TYPES:
            return
        formula = FORMULAS.get(op_type)
        flops = None
        if formula is not None:
            flops = self._compute(formula, op_type, context, backend)
            if flops is None and backend == "onnx" \
                    and self._count_at_run_time(context, formula, op_type, module):
                return
        if flops is None:
            label = op_type if formula is None else f"{op_type} (shape unknown)"
            context.insert_after_op(self._count_unknown, outputs=[], label=label)
            return
        # PyTorch: analysis runs once per call site; if a later execution
        # there has another output shape, the cached count would be stale, so
        # the routines check the output's (or its gradient's) shape (no copy:
        # the tensor itself)
        check = backend == "pytorch" and len(context.get_outputs()) > 0
        shape = _shape(context.get_outputs()[0]) if check else None
        context["flops"] = flops
        context["flops_type"] = op_type
        context["flops_module"] = module
        context["flops_shape"] = shape
        if flops == 0:
            return
        key = (context.namespace, context.get_op_id())
        self.records[key] = {"name": context.get_op_name(), "type": op_type,
                             "module": module, "flops": flops, "calls": 0}
        context.insert_after_op(self._count, outputs=[0] if check else [], key=key,
                                op_type=op_type, module=module, flops=flops, shape=shape)

    def backward_analysis(self, context):
        flops = context.get("flops")
        op_type = context.get("flops_type")
        if not flops or op_type not in BACKWARD_TYPES:
            return
        backward_op = context.get_backward_op()
        if context.namespace.startswith("tensorflow"):
            factor = _TF_BACKWARD.get(getattr(backward_op, "type", None), 0)
        else:
            factor = _TORCH_BACKWARD.get(type(backward_op).__name__,
                                         _TORCH_BACKWARD.get(getattr(backward_op, "__name__", ""), 0))
        if not factor:
            return
        module, shape = context.get("flops_module"), context.get("flops_shape")
        if shape is not None:
            # the incoming gradient has the forward output's size: checked
            # like the forward count (PyTorch only, a reference, no copy)
            context.insert_before_backward_op(self._count_backward, grad_outputs=[0],
                                              op_type=op_type, module=module,
                                              flops=factor * flops, numel=_numel(shape))
        else:
            context.insert_after_backward_op(self._count_backward, grad_inputs=[],
                                             op_type=op_type, module=module,
                                             flops=factor * flops)

    def _note_module(self, context, backend, module):
        """Remember the module's parameters (the op's inputs that are
        parameters) and the output shape of its latest op (analysis runs in
        execution order, so at the end: its last op's)."""
        if module is None:
            return
        entry = self._modules.setdefault(module, {"params": {}, "shape": None, "last": -1})
        entry["params"].update(_parameters(context.get_inputs(), backend))
        outputs = context.get_outputs()
        self._analysed += 1
        if outputs:
            entry["shape"], entry["last"] = _shape(outputs[0]), self._analysed

    @staticmethod
    def _compute(formula, op_type, context, backend):
        ins = [_shape(t) for t in context.get_inputs()]
        outs = [_shape(t) for t in context.get_outputs()]
        return _apply(formula, op_type, ins, outs[0] if outs else None, context.get_op(),
                      backend)

    def _count_at_run_time(self, context, formula, op_type, module):
        """ONNX ops whose shapes are not static: routines receive the arrays
        the formula needs and count from their shapes. False when a needed
        tensor cannot be handed to a Python routine (float16, unknown type)."""
        inputs, outputs = context.get_inputs(), context.get_outputs()
        needed = _needed_inputs(formula, op_type, "onnx")
        values = list(inputs[:needed]) + list(outputs[:1])
        if len(inputs) < needed or not outputs or any(
                v is None or v.type.tensor_type.elem_type not in _ONNX_HOSTED for v in values):
            return False
        key = (context.namespace, context.get_op_id())
        self._dynamic[key] = (formula, op_type, module, context.get_op(), len(inputs))
        self.records[key] = {"name": context.get_op_name(), "type": op_type, "module": module,
                             "flops": None, "calls": 0, "dynamic": True}
        if needed:
            context.insert_before_op(self._stash_shapes, inputs=list(range(needed)), key=key)
        context.insert_after_op(self._count_dynamic, outputs=[0], key=key)
        return True

    # -- instrumentation routines (observe only) -----------------------------
    def _count(self, *tensors, key, op_type, module, flops, shape=None):
        if shape is not None and tensors and _shape(tensors[0]) not in (None, shape):
            # never a stale count: listed (see docs/tools/flops.md)
            self.unknown[f"{op_type} (shape changed)"] += 1
            return
        self.records[key]["calls"] += 1
        self._flops["forward"][op_type] += flops
        self._by_module["forward"][module] += flops

    def _count_backward(self, *tensors, op_type, module, flops, numel=None):
        # numel, not shape: autograd may see the output through a view (a 3-D
        # linear's MmBackward0 gets a 2-D gradient)
        if numel is not None and tensors and tensors[0] is not None \
                and tensors[0].numel() != numel:
            self.unknown[f"{op_type} backward (shape changed)"] += 1
            return
        self._flops["backward"][op_type] += flops
        self._by_module["backward"][module] += flops

    def _count_unknown(self, *tensors, label):
        self.unknown[label] += 1

    def _stash_shapes(self, *arrays, key):
        self._pending[key] = [tuple(a.shape) for a in arrays]

    def _count_dynamic(self, output, key):
        formula, op_type, module, op, count = self._dynamic[key]
        ins = self._pending.pop(key, [])
        ins = ins + [None] * (count - len(ins))
        flops = _apply(formula, op_type, ins, tuple(output.shape), op, "onnx")
        if flops is None:
            self.unknown[f"{op_type} (shape unknown)"] += 1
            return
        record = self.records[key]
        record["flops"] = flops
        record["calls"] += 1
        self._flops["forward"][op_type] += flops
        self._by_module["forward"][module] += flops

    # -- report --------------------------------------------------------------
    def _phases(self, phase):
        if phase == "all":
            return ("forward", "backward")
        if phase not in ("forward", "backward"):
            raise ValueError(f"phase must be 'forward', 'backward' or 'all', got {phase!r}")
        return (phase,)

    def total(self, phase="all"):
        """Total FLOPs counted: ``phase`` is "forward", "backward" or "all"."""
        return sum(sum(self._flops[p].values()) for p in self._phases(phase))

    def by_type(self, phase="all"):
        """Canonical op type -> FLOPs, largest first."""
        return self._merge(self._flops, phase)

    def by_module(self, phase="all"):
        """Module path (PyTorch; TF: the op's name scope) -> FLOPs, largest
        first. Ops outside any module are under None."""
        return self._merge(self._by_module, phase)

    def _merge(self, table, phase):
        merged = Counter()
        for p in self._phases(phase):
            merged.update(table[p])
        return dict(sorted(merged.items(), key=lambda item: -item[1]))

    def modules(self, max_depth=None):
        """FLOPs per module, with every module's children summed into it.

        One row per module path seen (PyTorch module path; TF name scope;
        ONNX: the exporter's node-name scopes) and per ancestor of one, the
        root (``""``) first, in the order the modules first ran. Ops outside
        any module are not in it (see :meth:`by_module`, key None).

        Args:
            max_depth: leave out rows deeper than this (the root is 0);
                their numbers still add up in their ancestors.

        Returns:
            A list of dicts ``{"module", "depth", "parameters",
            "output_shape", "forward", "backward"}``: ``parameters`` counts
            the elements of the parameters the module's ops read (each
            once), ``output_shape`` is the shape of the first output of the
            module's last op.
        """
        rows, params = {}, {}
        for module, entry in self._modules.items():
            namespace_sep = "/" if "/" in module else "."
            parts = module.split(namespace_sep) if module else []
            for depth in range(len(parts) + 1):
                path = namespace_sep.join(parts[:depth])
                row = rows.setdefault(path, {"module": path, "depth": depth, "parameters": 0,
                                             "output_shape": None, "forward": 0, "backward": 0,
                                             "last": -1})
                params.setdefault(path, {}).update(entry["params"])
                if entry["last"] > row["last"]:
                    row["output_shape"], row["last"] = entry["shape"], entry["last"]
                for phase in ("forward", "backward"):
                    row[phase] += self._by_module[phase].get(module, 0)
        result = []
        for path, row in rows.items():
            row["parameters"] = sum(params[path].values())
            del row["last"]
            if max_depth is None or row["depth"] <= max_depth:
                result.append(row)
        return result

    def module_table(self, max_depth=None):
        """:meth:`modules` as text: the module tree indented, parameters and
        FLOPs in K/M/G/T units."""
        rows = self.modules(max_depth)
        labels = [("  " * r["depth"]) + (r["module"] or "model") for r in rows]
        cells = [[label, format_count(r["parameters"]),
                  "-" if r["output_shape"] is None else str(tuple(r["output_shape"])),
                  format_count(r["forward"]), format_count(r["backward"])]
                 for label, r in zip(labels, rows)]
        headers = ["module", "parameters", "output shape", "forward FLOPs", "backward FLOPs"]
        widths = [max(len(line[i]) for line in [headers] + cells) for i in range(5)]
        lines = ["  ".join(f"{c:{'<' if i < 1 else '>'}{w}}"
                           for i, (c, w) in enumerate(zip(line, widths))).rstrip()
                 for line in [headers] + cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def reset(self):
        """Forget all counts (the analysis stays cached: ops keep counting)."""
        for table in (self._flops, self._by_module):
            for p in table.values():
                p.clear()
        for record in self.records.values():
            record["calls"] = 0
        self.unknown.clear()
        self._pending.clear()

    def table(self, top=None):
        """A readable text report: FLOPs by type (forward/backward), totals and
        unknown op types."""
        forward, backward = self._flops["forward"], self._flops["backward"]
        types = sorted(set(forward) | set(backward),
                       key=lambda t: -(forward.get(t, 0) + backward.get(t, 0)))
        if top is not None:
            types = types[:top]
        width = max([len("type")] + [len(t) for t in types])
        lines = [f"{'type':<{width}}  {'forward':>16}  {'backward':>16}",
                 f"{'-' * width}  {'-' * 16}  {'-' * 16}"]
        for t in types:
            lines.append(f"{t:<{width}}  {forward.get(t, 0):>16,}  {backward.get(t, 0):>16,}")
        lines.append(f"{'-' * width}  {'-' * 16}  {'-' * 16}")
        lines.append(f"{'total':<{width}}  {self.total('forward'):>16,}  "
                     f"{self.total('backward'):>16,}")
        if self.unknown:
            listed = ", ".join(f"{t} x{n}" for t, n in sorted(self.unknown.items()))
            lines.append(f"unknown (not counted): {listed}")
        return "\n".join(lines)

    def __repr__(self):
        return (f"FlopsProfiler(forward={self.total('forward'):,}, "
                f"backward={self.total('backward'):,}, unknown={len(self.unknown)} types)")
