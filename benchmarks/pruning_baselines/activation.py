"""Activation pruning the original's way: the ResNet-style model's source
edited so that every ReLU's output goes through a pruning call."""

import torch
from torch import nn


def prune_activation(x, sparsity):
    """Zero each sample's values not above its round(sparsity*n)-th smallest magnitude."""
    flat = x.detach().abs().flatten(1)
    k = round(sparsity * flat.shape[1])
    if k < 1:
        return x
    threshold = flat.kthvalue(k, dim=1, keepdim=True).values
    return x * (flat > threshold).to(x.dtype).view_as(x)


class PrunedBasicBlock(nn.Module):
    def __init__(self, channels, sparsity):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu, self.sparsity = nn.ReLU(), sparsity

    def forward(self, x):
        out = prune_activation(self.relu(self.bn1(self.conv1(x))), self.sparsity)
        return prune_activation(self.relu(self.bn2(self.conv2(out)) + x), self.sparsity)


class PrunedResNet(nn.Module):
    """The ResNet-style model with a pruning call after every activation."""

    def __init__(self, sparsity=0.5, width=16, blocks=2, classes=10):
        super().__init__()
        self.sparsity = sparsity
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(*[PrunedBasicBlock(width, sparsity) for _ in range(blocks)])
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        x = prune_activation(self.stem(x), self.sparsity)
        return self.fc(self.blocks(x).mean((2, 3)))
