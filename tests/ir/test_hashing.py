"""Structural hash: what it depends on, what it ignores, and cross-process stability."""

import os
import subprocess
import sys
from pathlib import Path

from amanda.ir import Graph, structural_hash

REPO_ROOT = Path(__file__).resolve().parents[2]

# Built identically here and in subprocesses with other hash seeds.
BUILD_SOURCE = """
from amanda.ir import Graph
g = Graph("main", namespace="pytorch/2.13.0/eager", attrs={"z": 1, "a": [1, 2]})
x = g.add_input("x", shape=[2, 3], dtype="float32")
w = g.add_input("w")
mm = g.create_op("matmul", [x, w], attrs={"zeta": "s", "alpha": 0.1, "keys": {"q": 1, "b": 2, "m": [True, None]}})
sp = g.create_op("split", mm.outputs, num_outputs=2, namespace="onnx/21/graph", control_inputs=[mm])
g.create_op("print", [sp.outputs[1]], num_outputs=0, attrs={"set_like": ["c", "b", "a"]})
g.set_outputs([sp.outputs[0]])
"""


def build():
    scope = {}
    exec(BUILD_SOURCE, scope)
    return scope["g"]


def two_op_graph():
    g = Graph()
    x, y = g.add_input("x"), g.add_input("y")
    a = g.create_op("add", [x, y], attrs={"alpha": 1})
    b = g.create_op("mul", [a.outputs[0], x])
    g.set_outputs(b.outputs)
    return g


def test_hash_is_a_hex_digest_and_method_agrees():
    g = build()
    digest = structural_hash(g)
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert g.structural_hash() == digest == structural_hash(build())


def test_hash_is_stable_across_processes():
    expected = structural_hash(build())
    code = BUILD_SOURCE + "\nprint(g.structural_hash())\n"
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
        )
        assert result.stdout.strip() == expected


def test_renaming_does_not_change_hash():
    g = two_op_graph()
    before = structural_hash(g)
    g.name = "renamed"
    for i, op in enumerate(g):
        op.name = f"op_{i}"
    for t in g.inputs:
        t.name = "in_" + t.name
    g.ops[0].outputs[0].name = "sum"
    assert structural_hash(g) == before


def test_attr_key_order_does_not_change_hash():
    g1, g2 = Graph(), Graph()
    g1.create_op("c", attrs={"a": 1, "b": 2})
    g2.create_op("c", attrs={"b": 2, "a": 1})
    assert structural_hash(g1) == structural_hash(g2)


def changed(mutate):
    g = two_op_graph()
    before = structural_hash(g)
    mutate(g)
    return structural_hash(g) != before


def test_hash_depends_on_structure():
    assert changed(lambda g: g.ops[0].attrs.update(alpha=2))
    assert changed(lambda g: g.ops[0].attrs.update(alpha=1.0))  # int vs float
    assert changed(lambda g: g.ops[0].attrs.update(alpha=True))  # int vs bool
    assert changed(lambda g: setattr(g.ops[0], "type", "sub"))
    assert changed(lambda g: setattr(g.ops[0], "namespace", "onnx"))
    assert changed(lambda g: g.ops[1].replace_input_with(1, g.inputs[1]))
    assert changed(lambda g: g.ops[0].set_inputs(reversed(g.ops[0].inputs)))
    assert changed(lambda g: g.set_outputs([g.ops[0].outputs[0]]))
    assert changed(lambda g: g.set_outputs(g.ops[1].outputs * 2))
    assert changed(lambda g: g.ops[1].set_control_inputs([g.ops[0]]))
    assert changed(lambda g: g.inputs[0].attrs.update(shape=[1]))
    assert changed(lambda g: g.create_op("extra"))
    assert changed(lambda g: g.attrs.update(opset=1))


def test_nested_graph_changes_change_hash():
    body = two_op_graph()
    g = Graph()
    g.create_op("loop", attrs={"body": body})
    before = structural_hash(g)
    body.ops[0].name = "still_same"
    assert structural_hash(g) == before
    body.ops[0].attrs["alpha"] = 3
    assert structural_hash(g) != before
