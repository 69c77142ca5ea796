import torch
from torch import nn

SCALE = 2.0
USE_GELU = True
ACT = torch.tanh


def helper(x):
    return x * SCALE + 1.0


def halve(x):
    return x * 0.5


def _make_closure():
    k = 3.0

    def scaled(x):
        return x * k

    return scaled


scaled = _make_closure()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.act = nn.ReLU()
        self.scale = 1.5
        self.post = halve  # a function held by the module: Dynamo guards it by identity

    def forward(self, x):
        y = self.act(self.lin(x)) * self.scale
        y = ACT(y)
        if USE_GELU:
            y = torch.nn.functional.gelu(y)
        return helper(self.post(y)).sum(1, keepdim=True)


class Broken(nn.Module):
    """A graph break; the frame after it calls a closure, whose guard cannot be kept."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(scaled(y))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum(1, keepdim=True)
