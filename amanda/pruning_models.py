"""Small workloads for the pruning projects (:mod:`amanda.tools.pruning_projects`):
CNNs for 8x8 one-channel images (scikit-learn's digits), the VGG-style one in
Keras too, and tiny random-init BERT-family classifiers.

Every builder seeds torch, so two calls give the same weights. A model zoo
beside :mod:`amanda.models`, so it imports torch (and TensorFlow for its Keras
model), as tests/test_layering.py allows model zoos to;
``amanda.tools.pruning_projects.models`` re-exports it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["vgg_style", "squeezenet_style", "resnet_style", "bert_family", "BERT_FAMILY",
           "keras_vgg_style_graph"]


class VGGStyle(nn.Module):
    """conv-relu stacks and max pools, then a linear classifier (VGG's shape)."""

    def __init__(self, widths=(16, 16, "M", 32, 32, "M"), classes=10):
        super().__init__()
        layers, channels = [], 1
        for width in widths:
            if width == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
                channels = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels * 4, classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


class Fire(nn.Module):
    """SqueezeNet's fire module: a 1x1 squeeze, then 1x1 and 3x3 expands."""

    def __init__(self, channels, squeeze, expand):
        super().__init__()
        self.squeeze = nn.Conv2d(channels, squeeze, 1)
        self.expand1 = nn.Conv2d(squeeze, expand, 1)
        self.expand3 = nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x):
        x = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.expand1(x)), torch.relu(self.expand3(x))], 1)


class SqueezeNetStyle(nn.Module):
    """A stem convolution, fire modules, a 1x1 classifier conv and a global pool."""

    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(1, 32, 3, padding=1)
        self.fire1, self.fire2 = Fire(32, 8, 16), Fire(32, 8, 16)
        self.fire3 = Fire(32, 16, 32)
        self.head = nn.Conv2d(64, classes, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = nn.functional.max_pool2d(self.fire2(self.fire1(x)), 2)
        return self.head(self.fire3(x)).mean((2, 3))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv-BN pairs and an identity shortcut."""

    def __init__(self, channels):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), \
            nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), \
            nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


class ResNetStyle(nn.Module):
    """A conv-BN-relu stem, basic blocks, a global pool and a linear classifier."""

    def __init__(self, width=16, blocks=2, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(*[BasicBlock(width) for _ in range(blocks)])
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


def vgg_style(seed=0, **kwargs):
    """A VGG-style CNN for (N, 1, 8, 8) inputs."""
    torch.manual_seed(seed)
    return VGGStyle(**kwargs)


def squeezenet_style(seed=0, **kwargs):
    """A SqueezeNet-style CNN for (N, 1, 8, 8) inputs."""
    torch.manual_seed(seed)
    return SqueezeNetStyle(**kwargs)


def resnet_style(seed=0, **kwargs):
    """A ResNet-style CNN for (N, 1, 8, 8) inputs."""
    torch.manual_seed(seed)
    return ResNetStyle(**kwargs)


_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64)

#: family -> (transformers config class name, model class name, config overrides)
BERT_FAMILY = {
    "bert": ("BertConfig", "BertForSequenceClassification", _TINY),
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification",
                dict(_TINY, max_position_embeddings=72, pad_token_id=1)),
    "distilbert": ("DistilBertConfig", "DistilBertForSequenceClassification",
                   dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                        max_position_embeddings=64)),
    "albert": ("AlbertConfig", "AlbertForSequenceClassification",
               dict(_TINY, embedding_size=32)),
}


def bert_family(name, vocab_size=512, labels=3, seed=0):
    """A tiny random-init ``*ForSequenceClassification`` of the BERT family
    (no download), with the eager attention (a softmax op per layer) and no
    dropout.

    Args:
        name: one of :data:`BERT_FAMILY`.
        vocab_size, labels: the task's vocabulary and classes.
        seed: torch seed for the initial weights.
    """
    import transformers
    config_name, model_name, overrides = BERT_FAMILY[name]
    config = getattr(transformers, config_name)(vocab_size=vocab_size, num_labels=labels,
                                                **overrides)
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout",
                "attention_dropout", "seq_classif_dropout", "classifier_dropout_prob"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


def keras_vgg_style_graph(batch=32, learning_rate=0.05, seed=0):
    """The VGG-style CNN in Keras, in a ``tf.compat.v1`` graph with a
    cross-entropy loss and a plain SGD training op, for (N, 8, 8, 1) inputs.

    Returns:
        A dict: ``graph``, ``images``, ``labels``, ``logits``, ``loss``,
        ``train``, ``variables`` (trainable, in layer order), ``kernels``
        (the conv and dense kernels), ``init``, and ``assign(session,
        values)`` loading variable values (to start two sessions alike).
    """
    import tensorflow as tf
    layers = tf.keras.layers
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        images = tf.compat.v1.placeholder(tf.float32, [batch, 8, 8, 1])
        labels = tf.compat.v1.placeholder(tf.int64, [batch])
        model = tf.keras.Sequential([
            tf.keras.Input((8, 8, 1)),
            layers.Conv2D(16, 3, padding="same", activation="relu"),
            layers.Conv2D(16, 3, padding="same", activation="relu"), layers.MaxPooling2D(),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.Conv2D(32, 3, padding="same", activation="relu"), layers.MaxPooling2D(),
            layers.Flatten(), layers.Dense(10)])
        logits = model(images)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
        variables = [w.value for w in model.trainable_weights]
        train = tf.compat.v1.train.GradientDescentOptimizer(learning_rate).minimize(
            loss, var_list=variables)
        init = tf.compat.v1.global_variables_initializer()
        inputs = [tf.compat.v1.placeholder(v.dtype, v.shape) for v in variables]
        assigns = [v.assign(i) for v, i in zip(variables, inputs)]

    def assign(session, values):
        session.run(assigns, dict(zip(inputs, values)))

    return dict(graph=graph, images=images, labels=labels, logits=logits, loss=loss,
                train=train, variables=variables, kernels=variables[::2], init=init,
                assign=assign)
