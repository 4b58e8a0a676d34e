"""Feature boosting and suppression the original's way: the VGG-style
model's source edited so that every convolution is a gated convolution with
its own saliency predictor."""

import torch
from torch import nn


class GatedConv2d(nn.Module):
    """A convolution whose output channels are gated by a winner-take-all of
    predicted saliencies (edit made to every conv of the network)."""

    def __init__(self, in_channels, out_channels, index, density, seed=0):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.predictor = nn.Linear(in_channels, out_channels)
        self.density, self.mask = density, None
        generator = torch.Generator().manual_seed(seed + index)
        bound = in_channels ** -0.5
        with torch.no_grad():
            self.predictor.weight.copy_(torch.rand(out_channels, in_channels,
                                                   generator=generator) * 2 * bound - bound)
            self.predictor.bias.fill_(1.0)

    def forward(self, x):
        saliency = torch.relu(self.predictor(x.mean((2, 3))))
        keep = max(1, round(self.density * saliency.shape[1]))
        top = saliency.topk(keep, dim=1).indices
        self.mask = torch.zeros_like(saliency).scatter_(1, top, 1.0)
        return self.conv(x) * (saliency * self.mask)[:, :, None, None]


class GatedVGG(nn.Module):
    """The VGG-style model with gated convolutions."""

    def __init__(self, density=0.5, widths=(16, 16, "M", 32, 32, "M"), classes=10):
        super().__init__()
        layers, channels, index = [], 1, 0
        for width in widths:
            if width == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            layers += [GatedConv2d(channels, width, index, density), nn.ReLU()]
            channels, index = width, index + 1
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels * 4, classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))

    def load_dense(self, dense):
        """Copy the weights of a dense VGG-style model into the gated one."""
        state = {}
        for name, value in dense.state_dict().items():
            parts = name.split(".")
            if parts[0] == "features":
                name = ".".join(parts[:2] + ["conv"] + parts[2:])
            state[name] = value
        self.load_state_dict(state, strict=False)
        return self
