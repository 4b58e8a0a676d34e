"""Models and steps shared by the tests (the tutorial's CNNs, real
third-party models with random weights, seeded training steps)."""

import torch

nn = torch.nn
class ConvNeuralNet(nn.Module):
    """The tutorial's CNN (4 convolutions, ReLU as a module)."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv_layer1 = nn.Conv2d(in_channels=3, out_channels=32, kernel_size=3)
        self.conv_layer2 = nn.Conv2d(in_channels=32, out_channels=32, kernel_size=3)
        self.max_pool1 = nn.MaxPool2d(kernel_size=2, stride=2)
        self.conv_layer3 = nn.Conv2d(in_channels=32, out_channels=64, kernel_size=3)
        self.conv_layer4 = nn.Conv2d(in_channels=64, out_channels=64, kernel_size=3)
        self.max_pool2 = nn.MaxPool2d(kernel_size=2, stride=2)
        self.fc1 = nn.Linear(1600, 128)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        out = self.conv_layer1(x)
        out = self.conv_layer2(out)
        out = self.max_pool1(out)
        out = self.conv_layer3(out)
        out = self.conv_layer4(out)
        out = self.max_pool2(out)
        out = out.reshape(out.size(0), -1)
        out = self.fc1(out)
        out = self.relu1(out)
        return self.fc2(out)


class FunctionalReluNet(ConvNeuralNet):
    """The tutorial's variant: ReLU called functionally, no ReLU module."""

    def __init__(self, num_classes=10):
        super().__init__(num_classes)
        del self.relu1

    def forward(self, x):
        out = self.conv_layer1(x)
        out = self.conv_layer2(out)
        out = self.max_pool1(out)
        out = self.conv_layer3(out)
        out = self.conv_layer4(out)
        out = self.max_pool2(out)
        out = out.reshape(out.size(0), -1)
        out = self.fc1(out)
        out = torch.relu(out)
        return self.fc2(out)




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


def first_output(out):
    """The main output tensor of a torch or transformers model call."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return out[0]


def train_step(model, x, seed=1):
    """Forward, a fixed random upstream gradient, backward. Returns the output
    and a copy of every parameter gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    y = first_output(model(x))
    y.backward(torch.rand_like(y))
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return y.detach().clone(), grads
