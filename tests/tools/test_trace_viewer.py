"""The profiler's Chrome trace, loaded as a trace viewer loads it.

``check_perfetto_json`` applies the conventions of Perfetto's JSON trace
importer (and chrome://tracing's) that decide whether a file shows what it
should: a ``traceEvents`` list; every event with ``ph``, ``pid``, ``tid`` and
``name``; complete events with numeric ``ts`` and ``dur >= 0``; ``B``/``E``
balanced per thread; slices of one thread nesting (a partial overlap is
misdrawn); flow events ``s``/``f`` pairing up by id, each binding to a slice
that encloses it; metadata naming every process and thread that has slices.
"""

import json
import math
import numbers
import os
from collections import Counter, defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda.models import tutorial_cnn  # noqa: E402
from amanda.tools.profiler import ACCUMULATE_GRAD, OpProfiler, profile_steps  # noqa: E402

PHASES = set("XBEMsftiICbena")
METADATA = {"process_name", "process_labels", "process_sort_index", "thread_name",
            "thread_sort_index"}


def _number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and math.isfinite(value)


def _check_nesting(slices, where):
    """Slices of one thread (sorted by start, longest first) nest or are disjoint."""
    ends = []
    for event in slices:
        start, end = event["ts"], event["ts"] + event["dur"]
        while ends and ends[-1] <= start:
            ends.pop()
        assert not ends or end <= ends[-1] + 1e-3, f"{where}: {event['name']} overlaps its parent"
        ends.append(end)


def _enclosing(slices, ts):
    return [e for e in slices if e["ts"] <= ts <= e["ts"] + e["dur"]]


def check_perfetto_json(trace):
    """Assert ``trace`` (a loaded JSON trace) follows the importer's conventions.

    Returns:
        ``{"slices": {(pid, tid): [X events]}, "flows": {id: (s, f)}}``.
    """
    assert isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list)
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    slices, stacks, flows = defaultdict(list), defaultdict(list), defaultdict(dict)
    names = {"process": set(), "thread": set()}
    for event in trace["traceEvents"]:
        for key in ("ph", "pid", "tid", "name"):
            assert key in event, f"event without {key}: {event}"
        assert event["ph"] in PHASES, event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int), event
        thread = (event["pid"], event["tid"])
        if event["ph"] == "M":
            assert event["name"] in METADATA, event
            field = "sort_index" if event["name"].endswith("sort_index") else "name"
            assert field in event["args"], event
            if event["name"] == "process_name":
                names["process"].add(event["pid"])
            elif event["name"] == "thread_name":
                names["thread"].add(thread)
            continue
        assert _number(event.get("ts")), event
        if event["ph"] == "X":
            assert _number(event.get("dur")) and event["dur"] >= 0, event
            slices[thread].append(event)
        elif event["ph"] == "B":
            stacks[thread].append(event["ts"])
        elif event["ph"] == "E":
            assert stacks[thread] and stacks[thread].pop() <= event["ts"], event
        elif event["ph"] in "sf":
            key = (event.get("cat"), event["name"], event["id"])
            assert event["ph"] not in flows[key], f"two {event['ph']} events for flow {key}"
            flows[key][event["ph"]] = event
    assert not any(stacks.values()), "B events without their E"
    for thread, events in slices.items():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        _check_nesting(events, thread)
        assert thread[0] in names["process"], f"process {thread[0]} has no process_name"
        assert thread in names["thread"], f"thread {thread} has no thread_name"
    for key, ends in flows.items():
        assert set(ends) == {"s", "f"}, f"flow {key} is not one s and one f"
        start, finish = ends["s"], ends["f"]
        assert start["ts"] <= finish["ts"], key
        assert finish.get("bp") == "e", key       # binds to the enclosing slice
        for end in (start, finish):
            assert _enclosing(slices[(end["pid"], end["tid"])], end["ts"]), \
                f"flow {key}: no slice encloses its {end['ph']} event"
    return {"slices": slices, "flows": {key[2]: (e["s"], e["f"]) for key, e in flows.items()}}


def _op_at(slices, event):
    """The op slice (forward or backward) enclosing a flow event; the
    innermost where ops nest (aten ops nest inside ops, ops in modules)."""
    ops = [e for e in _enclosing(slices[(event["pid"], event["tid"])], event["ts"])
           if e["cat"] in ("forward", "backward")]
    return min(ops, key=lambda e: e["dur"])


@pytest.fixture(scope="module")
def cnn_trace():
    torch.manual_seed(0)
    model, x = tutorial_cnn(), torch.rand(2, 3, 32, 32)
    profiler = OpProfiler()
    measured = profile_steps(profiler, lambda: model(x).sum().backward(), steps=3, kernels=True)
    assert measured == 2
    return profiler, json.loads(json.dumps(profiler.chrome_trace()))


def test_trace_loads_as_a_viewer_loads_it(cnn_trace):
    profiler, trace = cnn_trace
    loaded = check_perfetto_json(trace)
    spans = [e for events in loaded["slices"].values() for e in events]
    steps = [e for e in spans if e["cat"] == "step"]
    assert [e["name"] for e in steps] == ["step 1", "step 2"]        # step 0 was the warm-up
    ops = [e for e in spans if e["cat"] in ("forward", "backward")]
    for step in steps:                                               # every op inside a step
        inside = [e for e in ops if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        assert Counter(e["name"] for e in inside)["conv2d"] == 4


def test_flows_link_each_forward_op_to_its_backward_ops(cnn_trace):
    _, trace = cnn_trace
    loaded = check_perfetto_json(trace)
    pairs = Counter()
    for start, finish in loaded["flows"].values():
        source = _op_at(loaded["slices"], start)
        target = _op_at(loaded["slices"], finish)
        assert (source["cat"], target["cat"]) == ("forward", "backward")
        assert source["args"]["op_id"] == target["args"]["op_id"]
        pairs[(source["name"], target["name"])] += 1
    assert pairs[("conv2d", "ConvolutionBackward0")] == 2 * 4         # 2 steps, 4 convs
    assert pairs[("linear", "AddmmBackward0")] == 2 * 2
    assert not any(target == "AccumulateGrad" for _, target in pairs)


def test_kernels_nest_in_their_op_and_accumulation_has_its_own_row(cnn_trace):
    profiler, trace = cnn_trace
    loaded = check_perfetto_json(trace)
    spans = [e for events in loaded["slices"].values() for e in events]
    kernels = [e for e in spans if e["cat"] == "kernel"]
    assert any(e["name"] == "aten::conv2d" for e in kernels)
    for kernel in kernels:
        parents = [e for e in _enclosing(loaded["slices"][(kernel["pid"], kernel["tid"])],
                                         kernel["ts"]) if e["cat"] in ("forward", "backward")]
        assert any(p["name"] == kernel["args"]["op"] for p in parents), kernel
    by_type = profiler.by_type()
    # 2 measured steps: 4 convs forward + 4 ConvolutionBackward0, no AccumulateGrad
    assert by_type["conv2d"]["calls"] == 2 * (4 + 4)
    assert by_type[ACCUMULATE_GRAD]["calls"] == 2 * 12              # 6 weights + 6 biases
    assert by_type[ACCUMULATE_GRAD]["forward_us"] == 0


def test_cli_trace_writes_a_loadable_trace_without_kineto_noise(tmp_path, capfd):
    from amanda.cli import main
    assert main(["trace", "cnn", "--kernels", "--out", str(tmp_path)]) == 0
    captured = capfd.readouterr()
    assert "USDT" not in captured.err + captured.out and "STAGE:" not in captured.err
    assert "accumulate_grad" in captured.out
    loaded = check_perfetto_json(json.loads((tmp_path / "trace.json").read_text()))
    cats = Counter(e["cat"] for events in loaded["slices"].values() for e in events)
    assert cats["step"] == 2 and cats["kernel"] > 0 and loaded["flows"]


def test_checker_rejects_what_a_viewer_misdraws():
    base = [{"ph": "M", "pid": 1, "tid": 1, "name": "process_name", "args": {"name": "p"}},
            {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "t"}}]
    good = {"ph": "X", "pid": 1, "tid": 1, "name": "a", "ts": 0, "dur": 10}
    check_perfetto_json({"traceEvents": base + [good]})
    bad = [[dict(good, dur=-1)],
           [good, dict(good, name="b", ts=5, dur=10)],                     # partial overlap
           [{"ph": "B", "pid": 1, "tid": 1, "name": "open", "ts": 0}],
           [good, {"ph": "s", "pid": 1, "tid": 1, "name": "f", "id": 1, "ts": 1}],
           [good, {"ph": "s", "pid": 1, "tid": 1, "name": "f", "id": 1, "ts": 1},
            {"ph": "f", "bp": "e", "pid": 1, "tid": 1, "name": "f", "id": 1, "ts": 50}],
           [dict(good, tid=2)]]                                             # unnamed thread
    for events in bad:
        with pytest.raises(AssertionError):
            check_perfetto_json({"traceEvents": base + events})
