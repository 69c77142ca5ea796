"""Models of the background-compile tests: in a module of their own, so a compile worker imports them."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Breaking(nn.Module):
    """A module whose forward breaks the graph in two (a print between its halves)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h * 2)


def shifted(x, w):
    """A function compiled on its own (``torch.compile(shifted)``)."""
    return torch.sigmoid(x @ w + 1).sum(1, keepdim=True)
