"""``amanda nan-check``: the first op producing NaN/Inf."""

from __future__ import annotations

import dataclasses

import amanda
from amanda.cli.common import (
    Command,
    UsageError,
    _add_model_argument,
    _add_out_argument,
    _jsonable,
    _load,
    _write_json,
    require,
)
from amanda.cli.table import print_table


class _PlantNaN(amanda.Tool):
    """Turns the first output of the ``index``-th op named ``op_name`` (its
    name or TF type) into NaN, or with ``backward`` the first gradient one of
    its backward ops produces: a bug for the detector to find."""

    def __init__(self, op_name, index=0, backward=False):
        super().__init__()
        self.op_name, self.index, self.backward = op_name, index, backward
        self.seen = 0
        self.planted_at = None    # the forward op's id
        self.planted_in = None    # the backward op's name
        self.add_inst_for_op(self._forward)
        if backward:
            # before the op (not require_outputs), so its after-routine is recorded
            # ahead of the detector's and the detector sees the planted NaN
            self.add_inst_for_op(self._backward, backward=True)

    def _matches(self, context):
        return context.get_op_name() == self.op_name or (
            context.get_op() is not None and getattr(context.get_op(), "type", None) == self.op_name)

    def _forward(self, context):
        if not self._matches(context):
            return
        if self.seen == self.index:
            self.planted_at = context.get_op_id()
            if not self.backward:
                context.insert_after_op(self._poison, outputs=[0])
        self.seen += 1

    def _backward(self, context):
        if self.planted_in is not None or context.get_op_id() != self.planted_at:
            return
        op = context.get_backward_op()
        name = getattr(op, "__name__", None) or getattr(op, "name", "")
        if "AccumulateGrad" in str(name):   # produces no gradient to poison
            return
        context.insert_after_backward_op(self._poison_first)
        self.planted_in = str(name)

    @staticmethod
    def _poison(value):
        return value * float("nan")

    @staticmethod
    def _poison_first(*grads):
        for i, grad in enumerate(grads):
            if grad is not None:
                return [g * float("nan") if j == i else None for j, g in enumerate(grads)]
        return None


def run_nan_check(args):
    require("nan-check", [args.model])
    from amanda.tools.debugging import NanDetector, OpStatistics
    work = _load(args.model, "nan-check")
    detector = NanDetector()
    tools = []
    plant = None
    if args.plant and args.plant_backward:
        raise UsageError("--plant and --plant-backward: choose one")
    if args.plant or args.plant_backward:
        name, index = _plant_target(args.plant or args.plant_backward, args.plant_backward)
        plant = _PlantNaN(name, index, backward=bool(args.plant_backward))
        tools.append(plant)
    stats = OpStatistics() if args.stats else None
    tools += [detector] + ([stats] if stats else [])
    with amanda.apply(*tools):
        work.run()
    if plant is not None:
        _check_planted(plant, args)
    report = detector.report
    result = {"model": args.model, "ops_checked": detector.executions,
              "planted": (args.plant or args.plant_backward), "found": report is not None,
              "report": dataclasses.asdict(report) if report else None}
    if report is None:
        print(f"{args.model}: no NaN or Inf in {detector.executions} op executions "
              "(forward and backward)")
    else:
        side = "backward" if report.backward else "forward"
        print(f"{args.model}: first NaN/Inf in a {side} op\n")
        rows = [["op", f"{report.op_name} (id {report.op_id})"],
                ["module", report.module_path if report.module_path is not None else "-"],
                ["backward op", report.backward_op_name or "-"],
                ["output", (f"#{report.output_index}: nan={report.output_stats['nan']} "
                            f"inf={report.output_stats['inf']} of "
                            f"{report.output_stats['numel']}")]]
        for i, s in enumerate(report.input_stats):
            rows.append([f"input {i}", "-" if s is None else
                         f"min={s['min']:.3g} max={s['max']:.3g} mean={s['mean']:.3g} "
                         f"nan={s['nan']} inf={s['inf']}" if s["min"] is not None else
                         f"nan={s['nan']} inf={s['inf']}"])
        print_table(["first NaN/Inf", ""], rows, "<<")
    written = [_write_json(args.out, "nan.json", _jsonable(result))]
    if stats:
        written.append(_write_json(args.out, "stats.json", _jsonable(stats.report())))
    print("\nwritten: " + ", ".join(written))
    return 1 if report is not None else 0


def _plant_target(text, backward):
    option = "--plant-backward" if backward else "--plant"
    name, _, index = text.partition(":")
    if not name or (index and not index.isdigit()):
        raise UsageError(f"{option} {text}: expected OP or OP:N with N >= 0 "
                         "(e.g. conv2d:2, the third conv2d)")
    return name, int(index or 0)


def _check_planted(plant, args):
    """A NaN that was never planted would report "no NaN": a usage error."""
    option = "--plant-backward" if plant.backward else "--plant"
    target = args.plant_backward if plant.backward else args.plant
    if plant.planted_at is None:
        seen = (f"only {plant.seen} ops named {plant.op_name!r} (N from 0 to {plant.seen - 1})"
                if plant.seen else f"no op named {plant.op_name!r}")
        raise UsageError(f"{option} {target}: one step of {args.model} runs {seen}; "
                         "nothing was planted")
    if plant.backward and plant.planted_in is None:
        raise UsageError(f"{option} {target}: that op has no backward op computing a "
                         "gradient; nothing was planted")


def add_nan_check_arguments(parser):
    _add_model_argument(parser)
    parser.add_argument("--plant", metavar="OP[:N]",
                        help="plant a NaN in the output of the N-th (from 0) forward op "
                             "named OP (conv2d, linear, Conv2D...) to see the detector work")
    parser.add_argument("--plant-backward", metavar="OP[:N]",
                        help="plant it in a gradient computed by that op's backward ops")
    parser.add_argument("--stats", action="store_true",
                        help="also write per-op output statistics to OUT/stats.json")
    _add_out_argument(parser, "nan.json")


COMMAND = Command("nan-check",
    help="name the first op (forward or backward) producing NaN/Inf",
    description="""\
Run one training step under the NaN/Inf detector (amanda.tools.debugging):
it names the first op, forward or backward, whose outputs hold a NaN or an
Inf, with its module path and its inputs' statistics. --plant puts a NaN
into an op's output (--plant-backward into a gradient) to see it work.
Exit status 1 when a NaN/Inf was found. Writes OUT/nan.json.""",
    example="amanda nan-check cnn --plant conv2d:2",
    add_arguments=add_nan_check_arguments, run=run_nan_check)
