"""``amanda models``: the model specs every command accepts."""

from __future__ import annotations

from amanda.cli.common import Command
from amanda.cli.table import print_table


OTHER_SPECS = [
    ("keras:cnn", "the tutorial CNN in Keras, tf.compat.v1 graph; input (1, 32, 32, 3)"),
    ("keras:NAME[:SIZE]", ("a tf.keras.applications model (keras:resnet50, "
                           "keras:mobilenetv2:96), weights=None, input (1, SIZE, SIZE, 3), "
                           "SIZE 224 by default")),
    ("path/to/model.onnx", "an ONNX model, run with onnxruntime (random inputs)"),
    ("path/to/file.py:factory", "factory() returns (model, inputs) for a PyTorch model"),
]


def run_models(args):
    from amanda import models
    rows = [[name, description] for name, description in models.available().items()]
    rows += [list(entry) for entry in OTHER_SPECS]
    print_table(["model", "description"], rows, "<<")
    return 0


COMMAND = Command("models",
    help="list the built-in models",
    description="""\
List the built-in models every subcommand accepts, and the other kinds of
model spec: keras:NAME[:SIZE], path/to/model.onnx, path/to/file.py:factory.""",
    example="amanda models",
    add_arguments=lambda parser: None, run=run_models)
