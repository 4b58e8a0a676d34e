"""Peak memory of an observe-everything tool (the paper's Fig. 13 quantity).

Each (model, batch, configuration) runs in a fresh process: build the model,
run ``STEPS`` training steps (forward, ``.sum()`` loss, backward) either
plainly or inside ``amanda.apply`` of a tool whose routines observe every
op at all four points (they return None), and report the process's peak
resident set size (``ru_maxrss``) and its size after the model was built. The
ratio is peak over vanilla peak; the increment is what the step itself added
above the built model, which isolates activations from imports and weights.

Run: ``python -m benchmarks.run --only memory`` (or ``python -m
benchmarks.memory``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

NAME = "memory"
STEPS = 3
CASES = (("BERT (6 layers)", "bert", (1, 8)), ("ResNet-50", "resnet50", (1, 8)))
CONFIGS = ("vanilla", "observe (4 points)")


def _build(model, batch):
    import torch
    if model == "bert":
        from transformers import BertConfig, BertModel
        config = BertConfig(num_hidden_layers=6)
        return BertModel(config), torch.randint(0, config.vocab_size, (batch, 128))
    from transformers import ResNetConfig, ResNetModel
    return ResNetModel(ResNetConfig()), torch.randn(batch, 3, 224, 224)


def _observer():
    import amanda

    class ObserveAll(amanda.Tool):
        """Routines at all four points of every op, each returning None."""

        def __init__(self):
            super().__init__()
            self.calls = 0
            self.add_inst_for_op(self._forward, require_outputs=True)
            self.add_inst_for_op(self._backward, backward=True, require_outputs=True)

        def _forward(self, context):
            context.insert_before_op(self.look)
            context.insert_after_op(self.look)

        def _backward(self, context):
            context.insert_before_backward_op(self.look)
            context.insert_after_backward_op(self.look)

        def look(self, *tensors):
            self.calls += 1

    return ObserveAll()


def _peak_kib():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def one(model, batch, config):
    """Run one configuration in this process; a dict of KiB figures."""
    import contextlib

    import torch

    import amanda
    from benchmarks.eager import first_tensor
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    net, inputs = _build(model, batch)
    built = _peak_kib()
    tool = _observer() if config != "vanilla" else None
    scope = amanda.apply(tool) if tool is not None else contextlib.nullcontext()
    with scope:
        for _ in range(STEPS):
            first_tensor(net(inputs)).sum().backward()
            net.zero_grad(set_to_none=True)
    return {"built_kib": built, "peak_kib": _peak_kib(),
            "routine_calls": tool.calls if tool is not None else 0}


# glibc's malloc raises its mmap threshold after a large block is freed, so
# later large tensors come from the heap, where small allocations between
# them (a routine call's Python objects) keep freed space from going back to
# the system: resident size then grows without any reference held. With a
# fixed threshold every large tensor is mapped and unmapped on its own, which
# isolates what is really kept alive.
ALLOCATORS = {"default malloc": {}, "fixed mmap threshold": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def _measure(model, batch, config, allocator):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               **ALLOCATORS[allocator])
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--one", model,
                           str(batch), config], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(repeats=None, quick=False, log=print):
    """Run the suite. Returns ``(markdown, raw)``."""
    from benchmarks import harness
    results = []
    for allocator in ALLOCATORS:
        for label, model, batches in CASES:
            for batch in batches[:1] if quick else batches:
                row = {"model": label, "batch": batch, "allocator": allocator}
                for config in CONFIGS:
                    log(f"[{NAME}] {label} batch {batch} ({allocator}): {config} ...")
                    row[config] = _measure(model, batch, config, allocator)
                results.append(row)
    machine = harness.machine_info()
    return render(results, machine), {"suite": NAME, "machine": machine, "results": results}


def render(results, machine):
    from benchmarks import harness
    lines = ["# amanda peak memory (PyTorch eager, observe-only routines at four points)", "",
             f"{STEPS} training steps per process; peak RSS (`ru_maxrss`) in MiB; "
             "'step' is the peak above the process after the model was built.", "",
             "| allocator | model | batch | vanilla peak | observe peak | × vanilla "
             "| vanilla step | observe step | × step | routine calls |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results:
        plain, seen = row["vanilla"], row["observe (4 points)"]
        plain_step = plain["peak_kib"] - plain["built_kib"]
        seen_step = seen["peak_kib"] - seen["built_kib"]
        lines.append(
            f"| {row['allocator']} | {row['model']} | {row['batch']} "
            f"| {plain['peak_kib'] / 1024:.0f} "
            f"| {seen['peak_kib'] / 1024:.0f} | {seen['peak_kib'] / plain['peak_kib']:.3f} "
            f"| {plain_step / 1024:.0f} | {seen_step / 1024:.0f} "
            f"| {seen_step / max(plain_step, 1):.3f} | {seen['routine_calls']:,} |")
    lines += ["", harness.machine_markdown(machine)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
    else:
        markdown, raw = run()
        print(markdown)
