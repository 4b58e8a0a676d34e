"""Layering: frameworks are imported only by the backend modules.

Backend-specific code lives in ``amanda/frontends/`` and ``amanda/runtime/``
(one package per backend); the CLI and the model zoos (``amanda/cli/``,
``amanda/models.py``, ``amanda/pruning_models.py``) load real models.
Everything else, the tools included, reaches a backend through a registry keyed by namespace
(:mod:`amanda.runtime.backends`), so this test walks every module's
syntax tree, function bodies included, for imports of a framework.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "amanda"
FRAMEWORKS = {"torch", "tensorflow", "onnx", "onnxruntime"}

#: Where the backends live: any framework import is fine there.
BACKEND_AREAS = ("frontends/", "runtime/", "cli/", "models.py",
                 "pruning_models.py")   # the pruning projects' model zoo (torch and Keras models)

#: Modules outside the backend areas that may import a framework, with why.
#: Keep it empty: a tool that only makes sense for one framework keeps its
#: framework code in ``amanda/runtime/`` too (``pytorch/pruning_*.py``).
EXCEPTIONS = {}


def _framework_imports(path):
    """``(line, module)`` of every framework import in a file, at any depth;
    ``importlib.import_module("torch")``/``__import__`` with a literal count too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__"):
                names = [node.args[0].value]
        found += [(node.lineno, name) for name in names if name.split(".")[0] in FRAMEWORKS]
    return found


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path


def test_frameworks_are_imported_only_by_backend_modules():
    offenders = []
    for name, path in _modules():
        if name.startswith(BACKEND_AREAS) or name in EXCEPTIONS:
            continue
        offenders += [f"amanda/{name}:{line}: import {module}"
                      for line, module in _framework_imports(path)]
    assert not offenders, "framework imports outside frontends/ and runtime/:\n" + \
        "\n".join(offenders)


@pytest.mark.parametrize("name", sorted(EXCEPTIONS))
def test_every_exception_is_still_needed(name):
    path = PACKAGE / name
    assert path.exists(), f"amanda/{name} is listed in EXCEPTIONS but does not exist"
    assert _framework_imports(path), f"amanda/{name} imports no framework: drop its exception"


def test_the_scan_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import numpy\n\ndef f():\n    import torch.nn as nn\n"
                      "    from onnx import helper\n    return importlib.import_module('tensorflow')\n")
    assert [module for _, module in _framework_imports(sample)] == \
        ["torch.nn", "onnx", "tensorflow"]


def test_every_backend_support_module_has_the_common_interface():
    from amanda.runtime import backends, tool_support
    common = ("module_path_from_op", "MODULE_PATH_SEPARATOR", "is_whole_graph", "stable_op_id",
              "backward_flop_factor", "trainable_parameters", "is_weight_input",
              "ROUTINES_ORDERED_BY_DATAFLOW", "weight_value", "static_shape",
              "OTHER_BACKWARD_FLOPS", "ANALYSED_PER_CALL_SITE", "COUNTS_AT_RUN_TIME",
              "parameter_operand", "operand_grad", "accumulates_gradient")
    for backend in [b.name for b in backends.all_backends()]:
        module = tool_support.support_for(backend)
        assert [name for name in common if not hasattr(module, name)] == [], backend
    assert tool_support.support_for("amanda/portable") is None
    assert tool_support.support_for(None) is None


def test_every_backend_vocabulary_has_the_common_interface_without_a_framework():
    """The op facts of each backend (runtime/<backend>/vocabulary.py) answer
    the same questions, agree with their own rows, and load no framework."""
    import subprocess
    import sys

    from amanda.runtime import vocabulary
    common = ("SPECS", "TYPES", "op_type", "weight_layout", "weight_grad", "formula_type",
              "kernel_elements", "contracted", "VARIADIC_ELEMENTWISE", "WEIGHT_CHANNELS",
              "PARAM_READERS", "check_params", "INITIALISER_TYPES", "INITIALISER_SCOPES",
              "FOLDED_TYPES", "variable_of")
    names = vocabulary.backends_with_vocabulary()
    assert set(names) >= {"pytorch", "tensorflow", "onnx"}
    for name in names:
        words = vocabulary.of(name)
        assert [n for n in common if not hasattr(words, n)] == [], name
        index = vocabulary.backend_ops(name)
        disagree = {op: canonical for op, canonical in words.TYPES.items()
                    if op in index and index[op].canonical != canonical}
        assert disagree == {}, (name, disagree)
    code = ("import sys\nfrom amanda.runtime import vocabulary as v\n"
            "[v.of(b) for b in v.backends_with_vocabulary()]\nv.table()\n"
            "import amanda.tools.mapping_rules, amanda.tools.flops\n"
            "print(sorted({'torch', 'tensorflow', 'onnx', 'onnxruntime'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("namespace, op_name, recorded, expected", [
    ("pytorch/2.0/eager", "conv2d", "features.0", "features.0"),
    ("pytorch/2.0/eager", "conv2d", "", ""),             # the root module
    ("pytorch/2.0/eager", "conv2d", None, None),         # outside every module
    ("tensorflow/2.0/graph", "block1/conv/Conv2D", None, "block1/conv"),
    ("tensorflow/2.0/graph", "MatMul", None, None),
    ("onnx/21/graph", "/encoder/stages.0/layer/layer.1/conv/Conv", None,
     "encoder.stages.0.layer.1.conv"),
    ("onnx/21/graph", "Conv_3", None, None),
    ("amanda/portable", "x/y", None, None),              # no backend rule
])
def test_get_module_path_answers_on_every_backend(namespace, op_name, recorded, expected):
    import types

    import amanda
    op = types.SimpleNamespace(name=op_name)
    context = amanda.OpContext(namespace, op, 1, op_name, module_path=recorded)
    assert context.get_module_path() == expected


def test_tf_backward_context_without_forward_op_uses_the_gradient_op_scope():
    import types

    import amanda
    grad = types.SimpleNamespace(name="gradients/dense/MatMul_grad/MatMul")
    context = amanda.OpContext("tensorflow/2.0/graph", None, None, None, backward_op=grad,
                               backward_op_id=7)
    assert context.get_module_path() == "gradients/dense/MatMul_grad"
