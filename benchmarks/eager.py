"""PyTorch eager overhead: amanda against the uninstrumented training step.

The workload is one training step: forward, ``.sum()`` loss, ``backward()``,
``zero_grad(set_to_none=True)``. Every model is in ``eval()`` mode so dropout
adds no randomness between configurations; autograd is unaffected by
``eval()``, so gradients are still computed for every parameter reached.

Configurations, interleaved round-robin in one process after warm-up rounds
(amanda's analysis cache is warm: each tool object is applied every time):

* ``vanilla``: no instrumentation, the baseline;
* ``analysis-only``: ``amanda.apply(AnalysisOnlyTool())``, no actions;
* ``identity``: ``amanda.apply(IdentityTool())``, identity routines at the
  four points of every forward and backward op;
* ``module hooks``: no-op ``register_forward_hook`` and
  ``register_full_backward_hook`` on every module;
* ``dispatch mode``: a no-op ``TorchDispatchMode``;
* ``FlopCounterMode``: ``torch.utils.flop_counter.FlopCounterMode(display=False)``;
* ``function mode``: a no-op ``TorchFunctionMode``, the floor under amanda's
  own mode (what any TorchFunctionMode-based tool pays before doing anything).

Per-op cost is ``(median(config) - median(vanilla)) / points``, where
``points`` is the number of forward plus backward ops amanda instruments in
one step (counted by a fresh ``AnalysisOnlyTool``).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import amanda
from amanda.tools.identity import AnalysisOnlyTool, IdentityTool
from benchmarks import harness

NAME = "eager"
BASELINE = "vanilla"
#: where the models run: ``AMANDA_BENCH_DEVICE=cuda`` (benchmarks/gpu.sh) or the CPU
DEVICE = os.environ.get("AMANDA_BENCH_DEVICE", "cpu")
CONFIG_NAMES = ("vanilla", "analysis-only", "identity", "module hooks", "dispatch mode",
                "FlopCounterMode", "function mode")


class ModelSpec:
    """A model to benchmark.

    ``build()`` returns ``(model, inputs)``; ``inputs`` is a tensor passed
    positionally or a dict passed as keywords. ``targets`` maps config names
    to the largest acceptable ratio to vanilla. Each timed run averages
    ``steps_per_run`` steps (more for fast models, whose single steps are
    noisy).
    """

    def __init__(self, name, build, repeats, targets, quick_repeats=3, steps_per_run=1):
        self.name = name
        self.build = build
        self.repeats = repeats
        self.quick_repeats = quick_repeats
        self.targets = targets
        self.steps_per_run = steps_per_run


def _bert():
    """BERT-base (default config, random weights), input ids (1, 8)."""
    from transformers import BertConfig, BertModel
    return BertModel(BertConfig()), torch.randint(0, BertConfig().vocab_size, (1, 8))


def _resnet50():
    """ResNet-50 (default ResNetConfig, random weights), input (1, 3, 224, 224)."""
    from transformers import ResNetConfig, ResNetModel
    return ResNetModel(ResNetConfig()), torch.randn(1, 3, 224, 224)


def _gpt2_small():
    """A 2-layer, 128-wide GPT-2: many small ops. Input ids (1, 16)."""
    from transformers import GPT2Config, GPT2Model
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4)
    return GPT2Model(config), torch.randint(0, config.vocab_size, (1, 16))


LARGE_TARGETS = {"analysis-only": 1.02, "identity": 1.10}
SMALL_TARGETS = {"analysis-only": 1.15, "identity": 2.0}

MODELS = (
    ModelSpec("BERT-base", _bert, repeats=15, targets=LARGE_TARGETS),
    ModelSpec("ResNet-50", _resnet50, repeats=15, targets=LARGE_TARGETS),
    ModelSpec("GPT-2 2-layer (small ops)", _gpt2_small, repeats=21, targets=SMALL_TARGETS,
              quick_repeats=7, steps_per_run=10),
)


# -- the workload -------------------------------------------------------------------

def first_tensor(output):
    """The model's main output tensor (``last_hidden_state`` for HF models)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return next(iter(output.values()))
    return output[0]


def training_step(model, inputs):
    """Forward, ``.sum()`` loss, backward, zero gradients."""
    output = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    first_tensor(output).sum().backward()
    model.zero_grad(set_to_none=True)
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()      # the step's kernels are part of its time


def _to_device(model, inputs):
    """The model and its inputs on `DEVICE`."""
    if isinstance(inputs, dict):
        inputs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    else:
        inputs = inputs.to(DEVICE)
    return model.to(DEVICE), inputs


def count_points(model, inputs):
    """Forward plus backward ops amanda instruments in one step.

    A fresh ``AnalysisOnlyTool`` analyses each op once (the cache is on), so
    after one step its counters are the points of one step.
    """
    tool = AnalysisOnlyTool()
    with amanda.apply(tool):
        training_step(model, inputs)
    return {"forward": tool.ops, "backward": tool.backward_ops,
            "total": tool.ops + tool.backward_ops}


# -- configurations ---------------------------------------------------------------

class NoOpDispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` that only calls the op: the floor of modes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class NoOpFunctionMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` that only calls the function."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _no_op_forward_hook(module, args, output):
    return None


def _no_op_backward_hook(module, grad_input, grad_output):
    return None


@contextlib.contextmanager
def module_hooks(model):
    """No-op forward and full backward hooks on every module while inside."""
    handles = []
    try:
        for module in model.modules():
            handles.append(module.register_forward_hook(_no_op_forward_hook))
            handles.append(module.register_full_backward_hook(_no_op_backward_hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def make_configs(model):
    """The configurations, in report order. amanda tools are created once."""
    analysis, identity = AnalysisOnlyTool(), IdentityTool()
    return [
        harness.Config("vanilla", contextlib.nullcontext),
        harness.Config("analysis-only", lambda: amanda.apply(analysis)),
        harness.Config("identity", lambda: amanda.apply(identity)),
        harness.Config("module hooks", lambda: module_hooks(model)),
        harness.Config("dispatch mode", NoOpDispatchMode),
        harness.Config("FlopCounterMode", lambda: FlopCounterMode(display=False)),
        harness.Config("function mode", NoOpFunctionMode),
    ]


# -- running and reporting -----------------------------------------------------------

def benchmark_model(spec, repeats, warmup=2):
    """Benchmark one model in every configuration; return its raw result."""
    torch.manual_seed(0)
    model, inputs = _to_device(*spec.build())
    model.eval()
    points = count_points(model, inputs)
    configs = make_configs(model)
    with warnings.catch_warnings():
        # Expected with no-op module hooks on models returning ModelOutput objects.
        warnings.filterwarnings("ignore", message="For backward hooks to be called")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        start = harness.cpu_snapshot()
        times, failures = harness.interleaved_times(
            lambda: training_step(model, inputs), configs, repeats, warmup=warmup,
            cleanup=lambda: model.zero_grad(set_to_none=True), number=spec.steps_per_run)
        other_load = harness.foreign_load(start, harness.cpu_snapshot())
    summary = harness.summarize(times, BASELINE)
    base = summary[BASELINE]["median_s"]
    for stats in summary.values():
        stats["per_op_us"] = (stats["median_s"] - base) / points["total"] * 1e6
    return {"model": spec.name, "repeats": repeats, "warmup": warmup,
            "steps_per_run": spec.steps_per_run, "points": points,
            "targets": dict(spec.targets), "configs": summary, "failures": failures,
            "times_s": times, "targets_met": targets_met(summary, spec.targets),
            "other_processes_cores": other_load}


def targets_met(summary, targets):
    """Per target config: whether its ratio is within the target."""
    return {name: (name in summary and summary[name]["ratio"] <= limit)
            for name, limit in targets.items()}


def _ratio_cell(result, name):
    if name in result["failures"]:
        return "fails¹"
    return f"{result['configs'][name]['ratio']:.3f}"


def _target_cell(result):
    missed = [f"{name} {result['configs'].get(name, {}).get('ratio', float('nan')):.3f}"
              f" > {limit}" for name, limit in result["targets"].items()
              if not result["targets_met"][name]]
    return "yes" if not missed else "no (" + "; ".join(missed) + ")"


def _load_line(results):
    """How busy other processes kept the CPU while each model ran."""
    loads = [(r["model"], r.get("other_processes_cores")) for r in results]
    text = "CPU used by other processes during the runs (cores): " + ", ".join(
        f"{m} {'n/a' if v is None else f'{v:.2f}'}" for m, v in loads)
    if any(v is not None and v > 0.25 for _, v in loads):
        text += " — **the machine was shared; timings are noisy, rerun on a quiet machine**"
    return text


def render(results, machine):
    """The markdown report: one table row per model, footnotes, machine."""
    header = ("| model | vanilla ms | points/step | analysis-only × | identity × | "
              "module hooks × | dispatch mode × | FlopCounterMode × | function mode × | "
              "per-op µs analysis / identity | target met? |")
    lines = ["# amanda PyTorch eager overhead", "",
             "Training step (forward, `.sum()` loss, backward, zero grads); models in "
             "`eval()` (dropout off, gradients on). Ratios are median(config) / "
             "median(vanilla) over interleaved runs in one process. module hooks: no-op "
             "forward + full backward hooks on every module; dispatch / function mode: "
             "no-op `TorchDispatchMode` / `TorchFunctionMode` (the latter is the floor "
             "under amanda's mechanism). Per-op µs = (median − vanilla median) / points, "
             "points = forward + backward ops amanda instruments per step.", "",
             header, "|" + "---|" * (header.count("|") - 1)]
    notes = []
    for r in results:
        c = r["configs"]
        per_op = " / ".join(f"{c[n]['per_op_us']:.2f}" if n in c else "–"
                            for n in ("analysis-only", "identity"))
        cells = [f"{r['model']}", f"{c[BASELINE]['median_s'] * 1e3:.1f}",
                 f"{r['points']['total']} ({r['points']['forward']} fwd + "
                 f"{r['points']['backward']} bwd)"]
        cells += [_ratio_cell(r, n) for n in CONFIG_NAMES[1:]]
        cells += [per_op, _target_cell(r)]
        lines.append("| " + " | ".join(cells) + " |")
        for name, error in r["failures"].items():
            notes.append(f"{r['model']}, {name}: `{harness.first_sentence(error)}`")
    lines.append("")
    lines.append("Timed runs per config: " + ", ".join(
        f"{r['model']} {r['repeats']} × {r['steps_per_run']} step(s) (+{r['warmup']} warm-up)"
        for r in results))
    lines.append("Vanilla run-to-run noise (IQR / median): " + ", ".join(
        f"{r['model']} {r['configs'][BASELINE]['spread']:.1%}" for r in results))
    lines.append(_load_line(results))
    if notes:
        lines += ["", "¹ failed:"] + [f"- {n}" for n in notes]
    lines += ["", harness.machine_markdown(machine), ""]
    return "\n".join(lines)


def machine():
    """Machine description plus the torch build and its thread count."""
    info = harness.machine_info(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                                device=DEVICE)
    if DEVICE.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(DEVICE))
    return info


def run(repeats=None, quick=False, specs=MODELS, log=print):
    """Run the eager suite. Returns ``(markdown, raw)``.

    ``repeats`` overrides every model's repeat count; ``quick`` uses each
    model's short count and one warm-up round.
    """
    results = harness.benchmark_models(NAME, specs, CONFIG_NAMES, benchmark_model,
                                       repeats, quick, log)
    info = machine()
    return render(results, info), {"suite": NAME, "machine": info, "results": results}
