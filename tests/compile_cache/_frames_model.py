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


class Twin(nn.Module):
    """Broken's layout with another ending: traced first, its resume function gets the name the
    producer gave Broken's."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(scaled(y)) * 2.0


STEP = lambda x: (torch._dynamo.graph_break(), torch.cos(x))[1]  # noqa: E731  (no name leads to it)


class Callee(nn.Module):
    """Calls a function that graph-breaks and that no qualified name leads to: Dynamo compiles that
    function's frame on its own, and torch cannot record where to find it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 1)

    def forward(self, x):
        return self.lin(STEP(x * 2.0))
