"""PyTorch eager driver: what a torch call is and where it comes from.

Which calls are instrumentation points (``_classify``: queries such as
``size`` and most property reads are not), and the frame that identifies an
op (``_calling_site``: the first frame outside torch's internals and amanda's
runtime, never above the module call that runs it). Also the constants the
other modules of the eager driver (``eager/``) share (``NAMESPACE``, the
controls, autograd's sequence numbers). Part of :mod:`amanda.runtime.pytorch`.
"""

from __future__ import annotations

import os
import sys

import torch

from amanda import controls


NAMESPACE = "pytorch/" + torch.__version__.split("+")[0] + "/eager"
_CONTROLS = controls.state
_getframe = sys._getframe

_sequence_nr = torch._C._autograd._get_sequence_nr
_ACCUMULATE = 2 ** 64 - 1  # AccumulateGrad nodes carry the largest sequence number
_Tensor = torch.Tensor

# Calls that compute no tensor are not instrumentation points.
_QUERIES = frozenset("""
size dim numel stride storage_offset is_contiguous element_size nelement ndimension
data_ptr is_floating_point is_complex is_signed get_device is_nonzero equal item tolist
numpy __array__ __array_wrap__ __len__ __bool__ __int__ __float__ __index__ __complex__
__repr__ __str__ __format__ __hash__ __reduce_ex__ __setstate__ __getstate__ __deepcopy__
__iter__ __contains__ __dlpack__ __dlpack_device__ backward register_hook
register_post_accumulate_grad_hook retain_grad requires_grad_ untyped_storage storage
_typed_storage is_shared is_pinned is_set_to has_names is_inference dim_order __set__
__delete__ _is_view is_same_size __torch_function__ __get__ is_conj is_neg is_coalesced
is_distributed _is_zerotensor _nnz dense_dim sparse_dim q_scale q_zero_point qscheme
q_per_channel_axis
""".split())
# Tensor properties that do compute a tensor (views), unlike .shape or .grad.
_TENSOR_PROPERTIES = frozenset("T mT H mH real imag".split())

_NOT_A_POINT = None
# func -> op name, or _NOT_A_POINT. Running the backward pass is not a forward
# op: its nodes are the backward ops.
_FUNCS = {torch.autograd.grad: _NOT_A_POINT, torch.autograd.backward: _NOT_A_POINT}


def _classify(func):
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a property read: x.shape, x.T, x.grad ...
        attr = getattr(getattr(func, "__self__", None), "__name__", None)
        name = attr if attr in _TENSOR_PROPERTIES else _NOT_A_POINT
    elif name in _QUERIES:
        name = _NOT_A_POINT
    _FUNCS[func] = name
    return name


# What a frame's code is to the op it calls, keyed by id(code) (hashing a
# code object rehashes its constants on every call, which is slow for large
# functions; the codes are kept alive in _SEEN_CODE so their ids stay valid):
_SITE = 1        # the op's calling site: user code, models, tools, torch.nn layers
_LIBRARY = 2     # torch internals and amanda's runtime: the site is further up
_MACHINERY = 3   # torch mechanisms (activation checkpointing) whose calls are not ops
_BOUNDARY = 4    # nn.Module's call machinery: the site never lies above it
_HANDLER = 5     # a user's ``__torch_dispatch__``: its calls implement an op or node
#: what `_calling_site` returns for a call made by a ``__torch_dispatch__``
#: method (None: by torch's machinery)
_IN_HANDLER = False
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# amanda's runtime: all of ``amanda/runtime/`` (this file is in
# ``runtime/pytorch/eager/``), the backend-free kernel included
_RUNTIME_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LIBRARY_DIRS = (_TORCH_DIR, _RUNTIME_DIR + os.sep)
# torch's own layers (nn.Conv2d.forward...) are sites, so an op inside a torch
# layer is identified from within it, never by the line that called the model.
_LAYER_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep
_MODULE_FILE = os.path.join(_LAYER_DIR, "module.py")
# torch.autograd.graph's own calls (``view_as`` to find a leaf's gradient
# accumulator for register_multi_grad_hook and GradientEdge, save_on_cpu's
# copies) are not ops either: a routine's replacement changed the node they
# were looking for
_MACHINERY_FILES = (os.path.join(_TORCH_DIR, "utils", "checkpoint.py"),
                    os.path.join(_TORCH_DIR, "autograd", "graph.py"))
# torch's tracers and transforms: a torch call they make themselves (a fake
# copy of a parameter, a batching or functionalization helper) is not an op
# of the model; the model's own calls have their site below them, in the
# model's code.
_MACHINERY_DIRS = tuple(os.path.join(_TORCH_DIR, *part) + os.sep for part in (
    ("export",), ("_export",), ("_subclasses",), ("_functorch",), ("_dynamo",),
    ("fx", "experimental"), ("_higher_order_ops",)))
_CODE_KIND = {}
_SEEN_CODE = []


def _code_kind(code):
    kind = _CODE_KIND.get(id(code))
    if kind is None:
        _SEEN_CODE.append(code)
        path = code.co_filename
        if path == _MODULE_FILE:
            kind = _BOUNDARY if code.co_name in ("_call_impl", "_wrapped_call_impl") \
                else _LIBRARY
        elif path in _MACHINERY_FILES or path.startswith(_MACHINERY_DIRS):
            kind = _MACHINERY
        elif path.startswith(_LAYER_DIR):
            kind = _SITE
        elif path.startswith(_LIBRARY_DIRS):
            kind = _LIBRARY
        else:
            # **Rule: calls a ``__torch_dispatch__`` method makes are not
            # points.** A TorchDispatchMode or tensor subclass runs below
            # autograd: its handler receives the ATen ops that implement a
            # forward op (already a point) or a backward node (one, too),
            # and the OpOverloads it calls reach amanda's mode in the
            # backward pass, which runs under it; they would be counted
            # as forward ops of the model.
            # **Rule: a ``__torch_function__`` method is no site.** A
            # user's TorchFunctionMode inside ``apply`` (or a subclass seen
            # around it) handles the model's call and makes it again: the
            # site is the model's line above it. As a site, its one line
            # gave every op it passed on one key: other ids than without
            # the mode, and distinct ops outside modules merged into one.
            kind = (_HANDLER if code.co_name == "__torch_dispatch__" else
                    _LIBRARY if code.co_name == "__torch_function__" else _SITE)
        _CODE_KIND[id(code)] = kind
    return kind


def _calling_site(frame):
    """The frame that identifies an op called from ``frame``: the first one
    outside torch's internals and amanda's runtime, but never above the
    module call that runs it. None when torch's checkpointing machinery made
    the call (not an op of the model), ``_IN_HANDLER`` (False) when a
    ``__torch_dispatch__`` method made it (not an op either)."""
    kind = _CODE_KIND.get(id(frame.f_code)) or _code_kind(frame.f_code)
    while kind is not _SITE and kind is not _BOUNDARY:
        if kind is _MACHINERY:
            return None
        if kind is _HANDLER:
            return _IN_HANDLER
        back = frame.f_back
        if back is None:
            break
        back_kind = _CODE_KIND.get(id(back.f_code)) or _code_kind(back.f_code)
        if back_kind is _BOUNDARY:
            break        # a hook or helper called by Module.__call__: the site is here
        frame, kind = back, back_kind
    return frame
