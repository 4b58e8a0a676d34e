"""OpProfiler on PyTorch eager: every executed op is timed, forward and
backward; times add up within the step; the Chrome trace is valid and nests;
torch.profiler kernels are grouped per op; the docs page runs."""

import contextlib
import io
import json
import os
import pathlib
import re
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import amanda  # noqa: E402
from amanda.tools.profiler import OpProfiler, _lanes, _module_spans  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "tools" / "profiler.md"


class ExecutionRecorder(amanda.Tool):
    """Reference: the op ids of every forward and backward op execution."""

    def __init__(self):
        super().__init__()
        self.forward, self.backward = [], []
        self.add_inst_for_op(lambda c: c.insert_before_op(self.seen, inputs=[], into=self.forward,
                                                          key=c.get_op_id()))
        self.add_inst_for_op(lambda c: c.insert_before_backward_op(
            self.seen, grad_outputs=[], into=self.backward, key=c.get_backward_op_id()),
            backward=True)

    def seen(self, into, key):
        into.append(key)


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, vocab_size=500)
    return transformers.BertModel(config).eval(), torch.randint(0, 500, (2, 16))


def step(model, ids):
    model(ids).last_hidden_state.sum().backward()
    model.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def profiled(bert):
    """A profiler after a warm-up step and one timed step, the step's wall
    time, and the reference executions of that step."""
    model, ids = bert
    profiler, reference = OpProfiler(), ExecutionRecorder()
    with amanda.apply(profiler):
        step(model, ids)            # analysis runs at the first execution
    profiler.reset()
    start = time.perf_counter_ns()
    with amanda.apply(profiler):
        step(model, ids)
    wall_us = (time.perf_counter_ns() - start) / 1e3
    with amanda.apply(reference):
        step(model, ids)
    return profiler, wall_us, reference


def test_every_executed_op_is_timed_forward_and_backward(profiled):
    profiler, _, reference = profiled
    forward = [info.key for info, _, _ in profiler.events if info.phase == "forward"]
    backward = [info.key for info, _, _ in profiler.events if info.phase == "backward"]
    assert sorted(forward) == sorted(reference.forward)
    assert sorted(backward) == sorted(reference.backward)
    assert len(forward) > 50 and len(backward) > 50
    names = {info.name for info, _, _ in profiler.events if info.phase == "backward"}
    assert {"AddmmBackward0", "NativeLayerNormBackward0", "AccumulateGrad"} <= names
    # backward ops are attributed to the type and module of their forward op
    linear_bwd = [i for i, _, _ in profiler.events if i.name == "AddmmBackward0"]
    assert all(i.type == "linear" and i.module.startswith(("encoder.", "pooler"))
               for i in linear_bwd)


def test_times_add_up_within_the_step(profiled):
    profiler, wall_us, _ = profiled
    assert all(end >= start for _, start, end in profiler.events)
    assert 0 < profiler.total_us() <= wall_us
    assert profiler.busy_us() == pytest.approx(profiler.total_us())   # eager: no overlap
    by_type = profiler.by_type()
    assert sum(r["total_us"] for r in by_type.values()) == pytest.approx(profiler.total_us())
    assert by_type["linear"]["calls"] > 0 and by_type["linear"]["backward_us"] > 0
    assert sum(r["calls"] for r in profiler.by_module().values()) == len(profiler.events)
    layers = profiler.by_module(depth=3)
    assert {"encoder.layer.0", "encoder.layer.1"} <= set(layers)
    table = profiler.table(top=5)
    assert "linear" in table and "total" in table and "more" in table
    assert "encoder.layer.0" in profiler.table(by="module", depth=3)
    by_op = profiler.table(by="op", top=None)
    assert len(by_op.splitlines()) == len({(i.phase, i.key) for i, _, _ in profiler.events}) + 4
    with pytest.raises(amanda.AmandaError, match="phase"):
        profiler.total_us("sideways")
    with pytest.raises(amanda.AmandaError, match="by must be"):
        profiler.table(by="colour")


def test_timeline_plot(profiled, tmp_path):
    profiler, _, _ = profiled
    path = profiler.plot_timeline(tmp_path / "timeline.png", title="BERT")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _assert_nested(events):
    """Events of one thread either nest or are disjoint, and come sorted."""
    stack = []
    previous = None
    for event in events:
        key = (event["ts"], -event["dur"])
        assert previous is None or key >= previous
        previous = key
        end = event["ts"] + event["dur"]
        while stack and stack[-1] <= event["ts"]:
            stack.pop()
        assert not stack or end <= stack[-1] + 1e-6, event
        stack.append(end)


def test_chrome_trace_is_valid_and_nests(profiled, tmp_path):
    profiler, wall_us, _ = profiled
    path = profiler.save_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(pathlib.Path(path).read_text())
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {"pid", "tid", "ts", "dur", "name", "cat", "args"} <= set(spans[0])
    ops = [e for e in spans if e["cat"] in ("forward", "backward")]
    assert len(ops) == len(profiler.events)
    assert {e["tid"] for e in ops if e["cat"] == "forward"} == {1}
    assert {e["tid"] for e in ops if e["cat"] == "backward"} == {2}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert max(e["ts"] + e["dur"] for e in spans) <= wall_us
    linear = next(e for e in ops if e["name"] == "linear")
    assert linear["args"]["module"].startswith(("encoder", "pooler"))
    assert linear["args"]["shapes"][0][-1] == 64 and linear["args"]["op_id"]
    modules = {e["name"] for e in spans if e["cat"] == "module"}
    assert {"encoder", "encoder.layer.0", "encoder.layer.0.attention.self"} <= modules
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"forward ops", "backward ops"}
    for tid in (1, 2):
        _assert_nested([e for e in spans if e["tid"] == tid])


def test_lanes_and_module_spans():
    class Info:
        def __init__(self, module):
            self.module, self.namespace = module, "pytorch/x/eager"

    items = [(0, 10, Info("a.b")), (10, 20, Info("a.b")), (20, 30, Info("a.c")),
             (30, 40, Info(None)),
             (40, 50, Info("a"))]
    spans = sorted((".".join(p), s, e) for p, s, e, _ in _module_spans(items))
    assert spans == [("a", 0, 30), ("a", 40, 50), ("a.b", 0, 20), ("a.c", 20, 30)]
    lanes = _lanes([(0, 10, "x"), (5, 8, "y"), (8, 12, "z"), (10, 11, "w")])
    assert [[i[2] for i in lane] for lane in lanes] == [["x", "w"], ["y", "z"]]


def test_kernel_breakdown_groups_torch_profiler_events_by_op(bert):
    model, ids = bert
    profiler = OpProfiler()
    with amanda.apply(profiler):
        step(model, ids)
    with profiler.record_kernels():
        with amanda.apply(profiler):
            step(model, ids)
    assert profiler._record_function is None   # ranges only while recording
    kernels = profiler.kernels()
    forward = [k for (phase, _), k in kernels.items()
               if phase == "forward" and k["info"].type == "linear"]
    assert forward and all(any(n.startswith("aten::") for n in k["cpu"]) for k in forward)
    assert any("aten::addmm" in k["cpu"] for k in forward)
    backward = [k for (phase, _), k in kernels.items() if phase == "backward"
                and k["info"].name == "AddmmBackward0"]
    assert backward and all("aten::mm" in k["cpu"] for k in backward)
    assert all(not k["device"] for k in kernels.values())   # CPU only here
    # nothing leaks out of one op's range into another's: per-op CPU time
    # of the aten ops stays below the op's own wall time plus profiler noise
    assert "aten::addmm" in profiler.kernel_table(top=50)


def _python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


@pytest.mark.slow
def test_docs_page_examples_run(tmp_path, monkeypatch):
    blocks = _python_blocks(DOCS)
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        for number, code in enumerate(blocks, 1):
            exec(compile(code, f"{DOCS.name} example {number}", "exec"), namespace)
    assert "linear" in out.getvalue()
    assert json.loads((tmp_path / "bert_trace.json").read_text())["traceEvents"]


def test_flops_benchmark_structure():
    """benchmarks/flops.py on a tiny model: structure, not timings."""
    from benchmarks import eager, flops

    def tiny():
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                   torch.nn.Linear(8, 2)), torch.randn(3, 4)

    spec = eager.ModelSpec("tiny", tiny, repeats=2, targets={}, steps_per_run=2)
    markdown, raw = flops.run(repeats=2, specs=(spec,), log=lambda *_: None)
    result = raw["results"][0]
    assert set(result["configs"]) == set(flops.CONFIG_NAMES) and not result["failures"]
    assert result["configs"]["vanilla"]["ratio"] == 1.0
    # both count the two matrix products forward (2*3*4*8 + 2*3*8*2) and backward
    assert result["flops"]["FlopCounterMode"] == 3 * (2 * 3 * 4 * 8 + 2 * 3 * 8 * 2) - 2 * 3 * 4 * 8
    # one gradient per operand that needs one: the first layer's input needs none
    assert result["flops"]["FlopsProfiler"]["backward"] == 2 * 3 * 4 * 8 + 2 * (2 * 3 * 8 * 2)
    assert "| tiny |" in markdown and "FlopCounterMode" in markdown
