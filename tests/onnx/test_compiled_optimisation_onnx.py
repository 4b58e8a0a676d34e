"""onnxruntime's model compiler stands for a session saving its optimised model.

Side branches are attached to the model onnxruntime optimised
(`amanda.runtime.onnx.observe`); amanda gets that model from
``ModelCompiler`` where it may (`session._compiles`), which skips the
session's kernels, and from a session with ``optimized_model_filepath``
otherwise. Checked by difference, through ``_optimise_into`` itself: on
real networks, the hand-made models of the other tests and a fixed sample of
onnx's node cases, the two ways give the same graph up to what does not
change what runs (empty names, attributes written at their defaults, the
order of attributes and of independent nodes); a graph with bodies, which
the compiler writes otherwise (a body's constants twice), comes from the
session.
"""

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_model

from amanda.runtime.onnx import scratch, session
from tests.onnx.conftest import DATA, mlp, ort
from tests.onnx.test_sites_onnx import chain, tied

LIGHT = ["light_densenet121.onnx", "light_inception_v2.onnx", "light_resnet50.onnx",
         "light_shufflenet.onnx", "light_squeezenet.onnx"]
#: every how many of onnx's node cases one is checked (in name order)
EVERY = 12


def _normal(model):
    """``model`` with what does not change what runs made canonical: node
    names, empty strings, attributes at their defaults, the order of
    attributes and nodes."""
    versions = {o.domain: o.version for o in model.opset_import}

    def empty(message):
        for field, value in list(message.ListFields()):
            if field.type == field.TYPE_MESSAGE:
                for item in (value if hasattr(value, "__len__") and
                             not hasattr(value, "ListFields") else [value]):
                    empty(item)
            elif field.type == field.TYPE_STRING and value == "":
                message.ClearField(field.name)

    def graph(g):
        for node in g.node:
            node.ClearField("name")   # (onnxruntime numbers the nodes it makes per process)
            try:
                schema = onnx.defs.get_schema(node.op_type, versions.get(node.domain, 1),
                                              node.domain)
            except onnx.defs.SchemaError:
                schema = None
            kept = []
            for attribute in node.attribute:
                default = schema.attributes.get(attribute.name) if schema else None
                if default is not None and default.default_value.type and \
                        onnx.helper.get_attribute_value(attribute) == \
                        onnx.helper.get_attribute_value(default.default_value):
                    continue
                kept.append(onnx.AttributeProto.FromString(attribute.SerializeToString()))
            kept.sort(key=lambda a: a.name)
            del node.attribute[:]
            node.attribute.extend(kept)
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    graph(attribute.g)
                for body in attribute.graphs:
                    graph(body)
        nodes = sorted((n.SerializeToString() for n in g.node))
        del g.node[:]
        g.node.extend(onnx.NodeProto.FromString(n) for n in nodes)

    empty(model)
    graph(model.graph)
    return model


def _optimised(data, options=None, own=False):
    """``_optimise_into`` of the model's bytes (a CPU session), its weights
    written beside it read in (their bytes, not the file's name)."""
    if options is None:
        options = session._fresh_options(register=False) if own else ort.SessionOptions()
    folder = scratch.Files()
    try:
        model = session._optimise_into(folder, data, options, own, ["CPUExecutionProvider"],
                                       None, {})
        load_external_data_for_model(model, scratch.folder())
        return model
    finally:
        folder.cleanup()


def _both(data, own=False, monkeypatch=None):
    """(compiled, saved by a session) through ``_optimise_into``."""
    made = []
    for compiles in (True, False):
        monkeypatch.setattr(session, "_compiles", lambda *a, c=compiles: c)
        made.append(_optimised(data, own=own))
    return made


def test_the_compiler_is_used_for_a_cpu_session_of_the_users_options():
    options = ort.SessionOptions()
    cpu = ["CPUExecutionProvider"]
    available = session._COMPILER is not None
    assert session._compiles(options, cpu, None, {}) == available
    # none named: a session uses the CPU's alone, as the compiler does
    assert session._compiles(options, None, None, {}) == available
    assert ort.InferenceSession(mlp().SerializeToString()).get_providers() == cpu
    assert not session._compiles(options, ["CPUExecutionProvider", "CUDAExecutionProvider"],
                                 None, {})
    assert not session._compiles(options, cpu, None, {"disabled_optimizers": ["X"]})
    assert not session._compiles(options, [("CPUExecutionProvider", {"a": "1"})], None, {})
    options.optimized_model_filepath = "users.onnx"
    assert not session._compiles(options, cpu, None, {})


@pytest.mark.skipif(session._COMPILER is None, reason="onnxruntime before 1.22 has no compiler")
@pytest.mark.parametrize("own", [False, True], ids=["users-options", "own-options"])
@pytest.mark.parametrize("name", LIGHT + ["mlp", "chain", "tied"])
def test_the_compiler_gives_the_graph_a_session_saves(name, own, monkeypatch):
    if name in LIGHT:
        with open(os.path.join(DATA, "light", name), "rb") as file:
            data = file.read()
    else:
        data = {"mlp": mlp, "chain": chain, "tied": tied}[name]().SerializeToString()
    compiled, saved = _both(data, own, monkeypatch)
    assert len(compiled.graph.node) == len(saved.graph.node)
    assert _normal(compiled) == _normal(saved)


@pytest.mark.skipif(session._COMPILER is None, reason="onnxruntime before 1.22 has no compiler")
def test_the_compiler_agrees_on_a_sample_of_onnx_node_cases(monkeypatch):
    from tests.onnx.node_sweep_cases import cases
    ort.set_default_logger_severity(3)
    compared = bodies = 0
    for name, case in list(cases().items())[::EVERY]:
        data = case.model.SerializeToString()
        try:
            compiled, saved = _both(data, monkeypatch=monkeypatch)
        except Exception:   # noqa: BLE001 - a case plain onnxruntime cannot load
            continue
        compared += 1
        has_bodies = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                         for n in saved.graph.node for a in n.attribute)
        bodies += has_bodies
        if has_bodies:   # (from the session both times)
            assert compiled == saved, name
        else:
            assert _normal(compiled) == _normal(saved), name
    assert compared >= 120 and bodies >= 1, (compared, bodies)


@pytest.mark.skipif(session._COMPILER is None, reason="onnxruntime before 1.22 has no compiler")
def test_a_graph_with_bodies_comes_from_the_session(monkeypatch):
    """onnxruntime 1.32's compiler writes a Loop body's Constant both as a
    node and as an initializer, a model onnxruntime then refuses:
    `_optimise_into` sees the body in what the compiler wrote and asks a
    session instead."""
    from tests.onnx.node_sweep_cases import cases
    data = cases(("loop",))["test_loop16_seq_none"].model.SerializeToString()
    compiles = []
    real = session._compile
    monkeypatch.setattr(session, "_compile", lambda *a: compiles.append(1) or real(*a))
    got = _optimised(data)
    assert compiles == [1]
    monkeypatch.setattr(session, "_compiles", lambda *a: False)
    assert got == _optimised(data)
    ort.InferenceSession(got.SerializeToString(), providers=["CPUExecutionProvider"])


def gelu():
    """x -> the erf form of GELU -> y: onnxruntime fuses it into ``Gelu``,
    or ``FastGelu`` when the options ask for the approximation."""
    graph = helper.make_graph(
        [helper.make_node("Div", ["x", "sqrt2"], ["d"]),
         helper.make_node("Erf", ["d"], ["e"]),
         helper.make_node("Add", ["e", "one"], ["a"]),
         helper.make_node("Mul", ["x", "a"], ["m"]),
         helper.make_node("Mul", ["m", "half"], ["y"])], "gelu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(np.array(2 ** 0.5, np.float32), "sqrt2"),
         numpy_helper.from_array(np.array(1.0, np.float32), "one"),
         numpy_helper.from_array(np.array(0.5, np.float32), "half")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.mark.skipif(session._COMPILER is None, reason="onnxruntime before 1.22 has no compiler")
def test_the_compiler_reads_the_users_config_entries(monkeypatch):
    """A config entry of the user's options that changes the optimised graph
    (``optimization.enable_gelu_approximation``) changes the compiler's too."""
    data = gelu().SerializeToString()
    made = {}
    for compiles in (True, False):
        monkeypatch.setattr(session, "_compiles", lambda *a, c=compiles: c)
        options = ort.SessionOptions()
        options.add_session_config_entry("optimization.enable_gelu_approximation", "1")
        made[compiles] = _optimised(data, options)
    assert [n.op_type for n in made[True].graph.node] == ["FastGelu"]
    assert _normal(made[True]) == _normal(made[False])
