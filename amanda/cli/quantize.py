"""``amanda quantize``: fake quantization, calibration, QAT and QDQ export."""

from __future__ import annotations

import os

import amanda
from amanda.cli.common import (
    Command,
    MissingPiece,
    UsageError,
    _add_model_argument,
    _add_out_argument,
    _bits,
    _count,
    _jsonable,
    _load,
    _progress,
    _relative_error,
    _sqnr_db,
    _write_json,
    require,
    staged,
)
from amanda.cli.table import print_table


def _calibration_batches(work, count):
    """The workload's inputs, then ``count - 1`` random variants of its
    floating-point inputs (integer inputs such as token ids are reused)."""
    import numpy as np
    rng = np.random.RandomState(1)
    batches = [work.inputs]
    for _ in range(count - 1):
        batch = []
        for value in work.inputs:
            if hasattr(value, "is_floating_point") and value.is_floating_point():
                import torch
                batch.append(torch.from_numpy(rng.rand(*value.shape).astype(np.float32))
                             .to(value.dtype))
            elif isinstance(value, np.ndarray) and value.dtype.kind == "f":
                batch.append(rng.rand(*value.shape).astype(value.dtype))
            else:
                batch.append(value)
        batches.append(tuple(batch))
    return batches


def _qat_steps(work, tool, reference, steps, lr):
    """Fine-tune the quantized PyTorch model towards the float model's
    outputs (mean squared error): the loss QAT lowers."""
    import torch

    from amanda.models import first_tensor
    parameters = [p for p in work.model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=lr)
    target = torch.as_tensor(reference)
    losses = []
    with amanda.apply(tool):
        for _ in _progress(range(steps), steps, "QAT"):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(first_tensor(work.model(*work.inputs)), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def _export_qdq(work, tool, path, eager):
    """Export the quantized PyTorch model and check it under onnxruntime."""
    import numpy as np
    import onnxruntime
    proto = amanda.export(work.model, work.inputs, tool, f=staged(path))
    types = [node.op_type for node in proto.graph.node]
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(proto.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    feeds = {i.name: np.asarray(v.detach().cpu().numpy())
             for i, v in zip(session.get_inputs(), work.inputs)}
    output = session.run(None, feeds)[0]
    return {"path": path, "quantize_linear": types.count("QuantizeLinear"),
            "dequantize_linear": types.count("DequantizeLinear"),
            "max_abs_diff_vs_eager": float(np.abs(np.asarray(output) - eager).max())}


def schemes(args):
    """The weight and activation schemes the options ask for (None: float)."""
    from amanda.tools.quantization import QuantScheme
    weight = None if args.weight_bits == 0 else QuantScheme(
        args.weight_bits, symmetric=not args.asymmetric_weights, per_channel=not args.per_tensor)
    activation = None if args.activation_bits == 0 else QuantScheme(
        args.activation_bits, symmetric=args.symmetric_activations)
    return weight, activation


def calibrate(work, tool, count):
    """Observe activation ranges on ``count`` batches (:func:`_calibration_batches`);
    returns the batches. `amanda demo` calibrates the same way, so both print
    the same error."""
    batches = _calibration_batches(work, max(1, count))
    if tool.activation is not None:
        with amanda.apply(tool.calibration()):
            for batch in _progress(batches, len(batches), "calibrating"):
                work.forward(batch)
    return batches


def default_arguments(spec):
    """The options of ``amanda quantize SPEC`` with nothing else given."""
    import argparse
    parser = argparse.ArgumentParser()
    add_quantize_arguments(parser)
    return parser.parse_args([spec])


def run_quantize(args):
    require("quantize", [args.model], *(["onnx", "onnxruntime"] if args.export else []))
    from amanda.tools.quantization import QuantizationTool
    if args.export and not hasattr(amanda, "export"):
        raise MissingPiece("`amanda quantize --export` needs amanda.export (amanda/export.py), "
                           "which is not installed in this tree")
    work = _load(args.model, "quantize", ("pytorch", "tensorflow"))
    if args.export and work.framework != "pytorch":
        raise UsageError("--export writes ONNX from PyTorch models only")
    if args.qat and work.framework != "pytorch":
        raise UsageError("--qat trains PyTorch models only (TF graphs: calibrate and quantize)")
    weight, activation = schemes(args)
    tool = QuantizationTool(weight=weight, activation=activation, observer=args.observer)
    reference = work.forward()
    batches = calibrate(work, tool, args.calibrate)
    losses = _qat_steps(work, tool, reference, args.qat, args.lr) if args.qat else []
    tool.freeze()
    with amanda.apply(tool):
        quantized = work.forward()
    rows = []
    for row in tool.report():
        w, a = row.get("weight"), row.get("activation")
        scale = (f"{min(w['scale']):.3g}..{max(w['scale']):.3g}"
                 if w and isinstance(w["scale"], list) else (f"{w['scale']:.3g}" if w else "-"))
        rows.append([row["module"] or row["op_id"], row["type"], scale,
                     f"[{a['min']:.3g}, {a['max']:.3g}]" if a else "-"])
    print_table(["op", "type", "weight scale", "activation range"], rows, "<<><",
                 title=f"{args.model}: weights {weight.describe() if weight else 'float'}, "
                       f"activations {activation.describe() if activation else 'float'}")
    error, sqnr = _relative_error(reference, quantized), _sqnr_db(reference, quantized)
    print(f"\n{len(rows)} ops quantized; output vs float: relative error {error:.4f}, "
          f"SQNR {sqnr:.1f} dB")
    if losses:
        print(f"QAT: {len(losses)} steps, distillation loss {losses[0]:.3g} -> {losses[-1]:.3g}")
    result = {"model": args.model, "framework": work.framework,
              "weight": weight.describe() if weight else None,
              "activation": activation.describe() if activation else None,
              "calibration_batches": len(batches) if activation else 0,
              "relative_error": error, "sqnr_db": sqnr, "qat_losses": losses,
              "ops": tool.report()}
    if args.export:
        result["export"] = _export_qdq(work, tool, args.export, quantized)
        e = result["export"]
        print(f"exported {e['path']}: {e['quantize_linear']} QuantizeLinear / "
              f"{e['dequantize_linear']} DequantizeLinear; onnxruntime vs eager fake-quant: "
              f"max |diff| {e['max_abs_diff_vs_eager']:.2g}")
    path = _write_json(args.out, "quantization.json", _jsonable(result))
    print(f"full report: {path}")
    return 0


def add_quantize_arguments(parser):
    _add_model_argument(parser)
    parser.add_argument("--weight-bits", type=_bits, default=8, metavar="B",
                        help="weight bits, 0 = leave weights in float (default: 8)")
    parser.add_argument("--activation-bits", type=_bits, default=8, metavar="B",
                        help="activation bits, 0 = leave activations in float (default: 8)")
    parser.add_argument("--per-tensor", action="store_true",
                        help="one weight scale per tensor (default: per output channel)")
    parser.add_argument("--asymmetric-weights", action="store_true",
                        help="unsigned weight grid with a zero point (default: symmetric)")
    parser.add_argument("--symmetric-activations", action="store_true",
                        help="signed activation grid, zero point 0 (default: asymmetric)")
    parser.add_argument("--observer", choices=("minmax", "moving_average"), default="minmax",
                        help="how activation ranges are observed (default: minmax)")
    parser.add_argument("--calibrate", type=_count(1), default=4, metavar="N",
                        help="calibration batches: the model's inputs, then random variants "
                             "(default: 4)")
    parser.add_argument("--qat", type=_count(0), default=0, metavar="STEPS",
                        help="PyTorch: quantization-aware fine-tuning steps towards the float "
                             "model's outputs before freezing (default: 0, post-training only)")
    parser.add_argument("--lr", type=float, default=3e-5,
                        help="QAT learning rate (Adam; default: 3e-5)")
    parser.add_argument("--export", metavar="FILE.onnx",
                        help="PyTorch: write the quantized model as ONNX with "
                             "QuantizeLinear/DequantizeLinear pairs and check it in onnxruntime")
    _add_out_argument(parser, "quantization.json")


COMMAND = Command("quantize",
    help="fake-quantize weights and activations; calibrate, QAT, QDQ ONNX export",
    description="""\
Quantize the weights and activations of every convolution and linear layer
with the QAT tool (amanda.tools.quantization): calibrate activation ranges on
a few batches (observe only), optionally fine-tune with quantization in the
loop (--qat, straight-through gradients), then run the fake-quantized model
and compare it with the float one (relative error, SQNR). --export writes an
ONNX model with QuantizeLinear/DequantizeLinear pairs and checks it in
onnxruntime. Writes OUT/quantization.json with every op's scales.""",
    example="amanda quantize cnn --weight-bits 4 --qat 20 --export cnn-qdq.onnx",
    add_arguments=add_quantize_arguments, run=run_quantize)
