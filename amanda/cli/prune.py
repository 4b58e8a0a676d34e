"""``amanda prune``: weight masks and the sparsity they reach."""

from __future__ import annotations

import amanda
from amanda.cli.common import (
    Command,
    _add_model_argument,
    _add_out_argument,
    _fraction,
    _jsonable,
    _load,
    _relative_error,
    _require,
    _write_json,
    require,
)
from amanda.cli.table import print_table


def run_prune(args):
    require("prune", [args.model])
    pruning = _require("amanda.tools.pruning", "prune", "the pruning tool")
    work = _load(args.model, "prune", ("pytorch", "tensorflow"))
    pruner = pruning.Pruner(args.pattern, sparsity=args.sparsity)
    dense = work.forward()
    with amanda.apply(pruner):
        work.run()
        pruned = work.forward()
    _print_pruning(pruner, args.model)
    change = _relative_error(dense, pruned)
    print(f"\noutput change (relative L2): {change:.4f}")
    report = pruner.report()
    path = _write_json(args.out, "pruning.json", _jsonable({
        "model": args.model, "pattern": pruner.pattern_name, "sparsity": args.sparsity,
        "output_relative_change": change, **report}))
    print(f"full report: {path}")
    return 0


def _print_pruning(pruner, spec):
    report = pruner.report()
    mask = ("static mask" if pruner.update_every is None
            else f"mask recomputed every {pruner.update_every} executions")
    rows = [[r["module"] or r["op_id"], r["type"], r["shape"], f"{r['pruned']:,}",
             f"{r['sparsity']:.1%}"] for r in report["layers"]]
    total = report["total"]
    print_table(["layer", "type", "shape", "pruned", "sparsity"], rows, "<<<>>",
                title=f"{spec}: pattern {pruner.pattern_name}, {mask}",
                footer=[["total", "", "", f"{total['pruned']:,}", f"{total['sparsity']:.1%}"]],
                notes=[f"skipped {s['module'] or s['op_id']}: {s['reason']}"
                       for s in report["skipped"]])


def add_prune_arguments(parser):
    _add_model_argument(parser)
    parser.add_argument("--pattern", default="unstructured",
                        help="unstructured (magnitude), channel (L1 of output channels) or "
                             "N:M such as 2:4 (default: unstructured)")
    parser.add_argument("--sparsity", type=_fraction, default=0.5,
                        help="fraction of weights (channels) to prune; N:M ignores it "
                             "(default: 0.5)")
    _add_out_argument(parser, "pruning.json")


COMMAND = Command("prune",
    help="mask weights (magnitude, channel, N:M) and report the sparsity",
    description="""\
Prune the weights of every convolution and linear layer with the pruning tool
(amanda.tools.pruning): forward weight masks and gradient masks, applied by
amanda while one training step runs, without touching the model. Prints the
sparsity per layer and how much the output changed; writes OUT/pruning.json.""",
    example="amanda prune resnet50 --pattern 2:4",
    add_arguments=add_prune_arguments, run=run_prune)
