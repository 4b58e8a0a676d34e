"""Models and steps shared by the tests (the tutorial's CNNs, real
third-party models with random weights, seeded training steps)."""

import torch

from amanda.models import first_tensor as first_output  # noqa: F401  (re-exported)
from amanda.models import tutorial_cnn

nn = torch.nn


def ConvNeuralNet(num_classes=10):
    """The tutorial's CNN (4 convolutions, ReLU as a module)."""
    assert num_classes == 10
    return tutorial_cnn()


def FunctionalReluNet(num_classes=10):
    """The tutorial's variant: ReLU called functionally, no ReLU module."""
    assert num_classes == 10
    return tutorial_cnn(functional_relu=True)


def build_model(name):
    """Real third-party models with random weights (no hub access)."""
    torch.manual_seed(0)
    if name == "cnn":
        return ConvNeuralNet(10), torch.rand(1, 3, 32, 32)
    if name == "resnet50":
        from transformers import ResNetConfig, ResNetModel
        return ResNetModel(ResNetConfig()).eval(), torch.rand(1, 3, 224, 224)
    if name == "bert":
        from transformers import BertConfig, BertModel
        return BertModel(BertConfig()).eval(), torch.randint(0, 1000, (1, 8))
    if name == "gpt2":
        from transformers import GPT2Config, GPT2Model
        return GPT2Model(GPT2Config(n_layer=2)).eval(), torch.randint(0, 1000, (1, 16))
    if name == "rnn":
        return nn.RNN(input_size=128, hidden_size=128, num_layers=4), torch.rand(16, 2, 128)
    raise KeyError(name)


def train_step(model, x, seed=1):
    """Forward, a fixed random upstream gradient, backward. Returns the output
    and a copy of every parameter gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    y = first_output(model(x))
    y.backward(torch.rand_like(y))
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return y.detach().clone(), grads
