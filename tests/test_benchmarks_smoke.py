"""Smoke test of the benchmark harness: structure of results, not timings."""

import json

import pytest

torch = pytest.importorskip("torch")

from benchmarks import eager, harness, run  # noqa: E402


def _tiny():
    """Two linear layers: a few forward and backward ops."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.randn(3, 4)


def _tiny_inplace():
    """An in-place ReLU after a linear layer: full backward hooks reject it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(inplace=True))
    return model, torch.randn(3, 4)


TINY = eager.ModelSpec("tiny", _tiny, repeats=2, targets={"analysis-only": 100.0},
                       steps_per_run=2)
TINY_INPLACE = eager.ModelSpec("tiny-inplace", _tiny_inplace, repeats=1,
                               targets={"identity": 100.0})


def test_benchmark_model_structure():
    result = eager.benchmark_model(TINY, repeats=2, warmup=1)
    assert result["model"] == "tiny" and result["repeats"] == 2
    points = result["points"]
    assert points["forward"] > 0 and points["backward"] > 0
    assert points["total"] == points["forward"] + points["backward"]
    assert set(result["configs"]) == set(eager.CONFIG_NAMES)
    assert result["failures"] == {}
    for name, stats in result["configs"].items():
        assert stats["runs"] == 2 and len(result["times_s"][name]) == 2
        assert stats["median_s"] > 0 and stats["ratio"] > 0
        assert {"per_op_us", "spread", "min_s", "max_s"} <= set(stats)
    assert result["configs"]["vanilla"]["ratio"] == 1.0
    assert set(result["targets_met"]) == {"analysis-only"}
    assert "other_processes_cores" in result and result["steps_per_run"] == 2


def test_failing_config_is_reported_not_raised():
    result = eager.benchmark_model(TINY_INPLACE, repeats=1, warmup=1)
    assert "module hooks" not in result["configs"]
    assert "module hooks" not in result["times_s"]
    assert result["failures"]["module hooks"].startswith("RuntimeError")
    assert "\n" not in result["failures"]["module hooks"]
    assert "identity" in result["configs"]


def test_run_renders_and_writes(tmp_path, monkeypatch):
    markdown, raw = eager.run(repeats=1, specs=(TINY, TINY_INPLACE), log=lambda *_: None)
    assert raw["suite"] == "eager" and len(raw["results"]) == 2
    assert {"cpu", "cores", "torch", "torch_threads"} <= set(raw["machine"])
    assert "| tiny |" in markdown and "fails" in markdown and "Machine:" in markdown
    md_path, json_path = harness.write_results("eager", markdown, raw, tmp_path)
    assert md_path.read_text() == markdown
    assert json.loads(json_path.read_text())["results"][0]["model"] == "tiny"


def test_run_main_parses_options(tmp_path, monkeypatch):
    calls = []

    def fake_run(repeats=None, quick=False):
        calls.append((repeats, quick))
        return "# report\n", {"suite": "eager"}

    monkeypatch.setattr(eager, "run", fake_run)
    assert run.main(["--only", "eager", "--repeats", "3", "--quick",
                     "--out", str(tmp_path)]) == 0
    assert calls == [(3, True)]
    assert (tmp_path / "eager.md").read_text() == "# report\n"
    with pytest.raises(SystemExit):
        run.parse_args(["--only", "nope"])


def test_memory_suite_measures_one_configuration(monkeypatch):
    from benchmarks import memory
    monkeypatch.setattr(memory, "_build", lambda model, batch: _tiny())
    plain = memory.one("tiny", 3, "vanilla")
    seen = memory.one("tiny", 3, "observe (4 points)")
    assert plain["routine_calls"] == 0 and seen["routine_calls"] > 0
    assert seen["peak_kib"] >= seen["built_kib"] > 0
    row = {"model": "tiny", "batch": 3, "allocator": "default malloc", "vanilla": plain,
           "observe (4 points)": seen}
    markdown = memory.render([row], harness.machine_info())
    assert "| torch | default malloc | tiny | 3 | observe (4 points) |" in markdown
    assert "memory" in run.SUITES


def test_memory_suite_tf_and_onnx_cases(monkeypatch, tmp_path):
    """The TF Session step and the onnxruntime run, on tiny models."""
    from benchmarks import memory
    tf = pytest.importorskip("tensorflow")
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    import numpy as np

    def tiny_keras():
        inputs = tf.keras.Input((4,))
        return tf.keras.Model(inputs, tf.keras.layers.Dense(2)(tf.keras.layers.Dense(8)(inputs)))

    monkeypatch.setattr(memory, "_build_tf", lambda model, batch: (
        tiny_keras, (batch, 4), tf.float32, lambda shape: np.ones(shape, np.float32)))
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["input"], ["h"]),
         onnx.helper.make_node("Neg", ["h"], ["output"])], "tiny",
        [onnx.helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [None, 4])],
        [onnx.helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, [None, 4])])
    path = tmp_path / "tiny.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)],
                                     ir_version=10), str(path))
    monkeypatch.setattr(memory, "onnx_path", lambda model: str(path))
    monkeypatch.setattr(memory, "_onnx_feed",
                        lambda model, batch: {"input": np.ones((batch, 4), np.float32)})
    rows = []
    for backend in ("tf", "onnx"):
        row = {"backend": backend, "model": "tiny", "batch": 2, "allocator": "default malloc"}
        for config in memory.CONFIGS[backend]:
            row[config] = memory.one("tiny", 2, config, backend)
            assert row[config]["peak_kib"] >= row[config]["step_peak_kib"] > 0
            assert row[config]["build_peak_kib"] >= row[config]["built_kib"] > 0
        assert row["vanilla"]["routine_calls"] == 0
        assert row[memory.OBSERVE]["routine_calls"] > 0
        rows.append(row)
    # before and after each of the two nodes, three runs
    assert rows[1][memory.OBSERVE]["routine_calls"] == 12
    assert rows[1][memory.OBSERVE_HOSTED]["routine_calls"] == 12
    markdown = memory.render(rows, harness.machine_info())
    assert "| tf | default malloc | tiny | 2 | observe (4 points) |" in markdown
    assert "| onnx | default malloc | tiny | 2 | observe, hosted_observation() |" in markdown


def _tiny_onnx():
    """x -> Relu -> Neg -> y: (model bytes, feeds)."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    import numpy as np
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["h"], name="relu"),
         onnx.helper.make_node("Neg", ["h"], ["y"], name="neg")], "tiny",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)],
                                   ir_version=10)
    return model.SerializeToString(), {"x": np.ones((2, 4), np.float32)}


def _tiny_tf_graph():
    tf = pytest.importorskip("tensorflow")
    import numpy as np
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        w = tf.Variable(np.ones((3, 2), np.float32), name="w")
        y = tf.nn.relu(tf.matmul(x, w), name="y")
        init = tf.compat.v1.global_variables_initializer()
    return graph, x, y, init, np.ones((2, 3), np.float32)


def test_counting_suite_rows_and_counts():
    from benchmarks import counting
    data, feeds = _tiny_onnx()
    result = counting.onnx_counting("tiny", data, feeds, repeats=2, runs=2, warmup=1)
    assert result["ops"] == 2 and result["observed_tensors"] == 1    # h
    assert set(result["rows"]) == {"count, inputs=[]", "count, inputs", counting.FETCH_FLOOR}
    for row in result["rows"].values():
        assert row["plain_ms"] > 0 and row["ratio"] > 0
    switching = counting.onnx_switching("tiny", data, feeds, repeats=2, runs=1, warmup=1)
    assert set(switching["rows"]) == {"scope per step, analysis-only",
                                      "scope per step, count inputs=[]"}
    assert switching["amanda_work_ms"] > 0
    markdown = counting.render([result, switching], harness.machine_info())
    assert "| onnx | tiny | 2 | count, inputs=[] |" in markdown
    assert "first scope's session creation" in markdown
    assert "counting" in run.SUITES


def test_counting_suite_tf_row():
    from benchmarks import counting
    result = counting.tf_counting(repeats=1, runs=1, warmup=1, build=_tiny_tf_graph,
                                  model="tiny")
    # the variable's handle and read, MatMul, Relu (x is fed)
    assert result["ops"] == len(counting.executed_ops(*_tiny_fetch())) == 4
    assert set(result["rows"]) == {"count, inputs=[]", "count, inputs", counting.FETCH_FLOOR}
    assert "| tf | tiny | 4 | count, inputs |" in counting.render([result],
                                                                   harness.machine_info())


def _tiny_fetch():
    graph, x, y, _, _ = _tiny_tf_graph()
    return y, [x]


def test_counting_suite_fails_on_a_wrong_count(monkeypatch):
    """A counter that misses an op must fail the benchmark, not be printed."""
    from benchmarks import counting
    data, feeds = _tiny_onnx()
    real = counting._counter

    def skipping(select_none):
        tool = real(select_none)
        count = tool.count

        def twice(*tensors):    # counts every call twice
            tool.calls += 1
            count(*tensors)
        tool.count = twice
        return tool

    monkeypatch.setattr(counting, "_counter", skipping)
    with pytest.raises(counting.CountMismatch):
        counting.onnx_counting("tiny", data, feeds, repeats=1, runs=1, warmup=1)
