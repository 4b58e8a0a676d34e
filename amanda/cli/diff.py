"""``amanda diff``: a model vs its ONNX export, module by module."""

from __future__ import annotations

import dataclasses

from amanda.cli.common import (
    Command,
    UsageError,
    _add_model_argument,
    _add_out_argument,
    _jsonable,
    _load,
    _require,
    _write_json,
    require,
)


def run_diff(args):
    # the export (PyTorch) or tf2onnx conversion (keras:), then onnxruntime
    converter = ["tf2onnx"] if args.model.startswith("keras:") else []
    require("diff", [args.model], "onnx", *converter, "onnxruntime")
    diff = _require("amanda.tools.diff", "diff", "the numeric diff tool")
    work = _load(args.model, "diff", ("pytorch", "tensorflow"))
    if work.framework == "tensorflow":
        return _run_diff_tf(args, diff, work)
    import io

    import onnx
    import torch
    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(work.model, work.inputs, buffer, dynamo=False, opset_version=17)
    exported = onnx.load_from_string(buffer.getvalue())
    if args.perturb:
        module = dict(work.model.named_modules()).get(args.perturb)
        if module is None:
            raise UsageError(f"--perturb: {args.model} has no module {args.perturb!r}")
        with torch.no_grad():
            for parameter in module.parameters(recurse=False):
                parameter.add_(args.perturb_by)
    atol = 1e-5 if args.atol is None else args.atol
    report = diff.diff_torch_onnx(work.model, work.inputs, onnx_model=exported,
                                  rtol=args.rtol, atol=atol)
    print(f"{args.model}: PyTorch vs its ONNX export (rtol {args.rtol}, atol {atol})\n")
    print(report.describe())
    result = {"model": args.model, "framework": "pytorch", "perturbed": args.perturb,
              "first": dataclasses.asdict(report.first) if report.first else None,
              "compared": report.compared, "fused": report.fused,
              "unmatched": report.unmatched, "output_error": report.output_error}
    path = _write_json(args.out, "diff.json", _jsonable(result))
    print(f"\nfull report: {path}")
    return 1 if report.first else 0


def _keras_layer(model, selector):
    """The Keras layer named ``selector``, or ``CLASS:K``: the K-th (from 0)
    layer whose class is CLASS (``conv2d:2``, case-insensitive)."""
    def walk(layer):
        for inner in getattr(layer, "layers", ()):
            yield inner
            yield from walk(inner)

    layers = [layer for layer in walk(model.keras_model) if layer.weights]
    for layer in layers:
        if layer.name == selector:
            return layer
    kind, _, index = selector.rpartition(":")
    if kind and index.isdigit():
        same = [layer for layer in layers if type(layer).__name__.lower() == kind.lower()]
        if int(index) < len(same):
            return same[int(index)]
    raise UsageError(f"--perturb: no layer {selector!r} with weights; layers: "
                     f"{', '.join(layer.name for layer in layers)} (or CLASS:K, e.g. conv2d:2)")


def _run_diff_tf(args, diff, work):
    """TF graph (keras: specs) vs its tf2onnx conversion, op by op."""
    model = work.model
    feeds = {model.x: work.inputs[0]}
    converted = diff.tf_to_onnx(model.session, [model.x], [model.y])
    perturbed_ops, layer = [], None
    if args.perturb:
        layer = _keras_layer(model, args.perturb)
        for weight in layer.weights:
            variable = weight.value
            value = model.session.run(variable)
            # through the variable's own initializer op (fed): no op is added to the graph
            model.session.run(variable.initializer,
                              {variable.initializer.inputs[1]: value + args.perturb_by})
            perturbed_ops += [reader.name for read in variable.op.outputs[0].consumers()
                              for out in read.outputs for reader in out.consumers()
                              if not reader.name.startswith("gradients")]
    atol = 0.0 if args.atol is None else args.atol
    report = diff.diff_tf_onnx(model.session, feeds, model.y, onnx_model=converted,
                               rtol=args.rtol, atol=atol)
    print(f"{args.model}: TensorFlow vs its ONNX conversion (tf2onnx; rtol {args.rtol}, "
          f"atol {atol})\n")
    print(report.describe())
    result = {"model": args.model, "framework": "tensorflow", "perturbed": args.perturb,
              "perturbed_layer": layer.name if layer is not None else None,
              "perturbed_ops": perturbed_ops,
              "first": dataclasses.asdict(report.first) if report.first else None,
              "compared": [dataclasses.asdict(m) for m in report.compared],
              "unmatched": report.unmatched, "incomparable": report.incomparable,
              "onnx_only": report.onnx_only, "output_error": report.output_error}
    path = _write_json(args.out, "diff.json", _jsonable(result))
    print(f"\nfull report: {path}")
    return 1 if report.first else 0


def add_diff_arguments(parser):
    _add_model_argument(parser)
    parser.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance")
    parser.add_argument("--atol", type=float, default=None,
                        help="absolute tolerance (default 1e-5 for PyTorch; 0 for TF, whose "
                             "tolerance is relative to each tensor's largest value)")
    parser.add_argument("--perturb", metavar="MODULE",
                        help="after exporting, add --perturb-by to this module's parameters "
                             "(e.g. conv_layer3; for keras: models a layer name or CLASS:K, "
                             "e.g. conv2d:2) to plant a mismatch")
    parser.add_argument("--perturb-by", type=float, default=1e-2, metavar="X")
    _add_out_argument(parser, "diff.json")


COMMAND = Command("diff",
    help="a model vs its ONNX export: the first module/op whose outputs diverge",
    description="""\
Export a PyTorch model to ONNX, run both, and match every module's output
with the ONNX node of its scope (amanda.tools.diff); reports the first
module whose output diverges beyond the tolerance. A keras: model is
converted with tf2onnx and compared op by op (TF ops matched with ONNX
nodes by tensor name and op type). --perturb MODULE changes that module's
(Keras layer's) parameters after the export to plant a mismatch. Exit
status 1 when a divergence was found. Writes OUT/diff.json.""",
    example="amanda diff cnn --perturb conv_layer3",
    add_arguments=add_diff_arguments, run=run_diff)
