"""The pruning projects' small workloads: :mod:`amanda.pruning_models` (a
model zoo, so it lives beside :mod:`amanda.models`, where a framework may be
imported), re-exported here for ``from amanda.tools.pruning_projects import
models``. Importing this module imports torch (through the zoo).
"""

from __future__ import annotations

from amanda.pruning_models import (BERT_FAMILY, BasicBlock, Fire, ResNetStyle, SqueezeNetStyle,
                                   VGGStyle, bert_family, keras_vgg_style_graph, resnet_style,
                                   squeezenet_style, vgg_style)

__all__ = ["vgg_style", "squeezenet_style", "resnet_style", "bert_family", "BERT_FAMILY",
           "keras_vgg_style_graph", "VGGStyle", "Fire", "SqueezeNetStyle", "BasicBlock",
           "ResNetStyle"]
