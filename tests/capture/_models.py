"""Small hand-written modules for capture tests (and a factory for `module:factory` references)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, h: int, heads: int, branchy: bool = False) -> None:
        super().__init__()
        self.heads, self.branchy = heads, branchy
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        if self.branchy and x.sum() > 0:  # data-dependent control flow: not capturable
            x = x * 2
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 96, h: int = 32, heads: int = 4, layers: int = 3, branchy: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h, heads, branchy) for _ in range(layers))
        self.norm = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


def tiny_lm():
    """A `module:factory` factory: (module, example_inputs) on the meta device."""
    with torch.device("meta"):
        model = TinyLM()
    return model, (torch.zeros(2, 8, dtype=torch.long, device="meta"),)


def not_a_pair():
    return TinyLM()


class ExpertBlock(nn.Module):
    """Batched experts with 3-D weights: einsum up, bmm down (tokens already split evenly over experts)."""

    def __init__(self, h: int, f: int, experts: int) -> None:
        super().__init__()
        self.e = experts
        self.norm = nn.LayerNorm(h)
        self.w_up = nn.Parameter(torch.empty(experts, h, f))
        self.w_down = nn.Parameter(torch.empty(experts, f, h))
        self.q = nn.Parameter(torch.empty(h, h))
        self.o = nn.Parameter(torch.empty(h, h))

    def forward(self, x):
        b, s, h = x.shape
        y = self.norm(x)
        x = x + F.linear(F.linear(y, self.q).relu(), self.o)  # two weights applied in one module
        t = self.norm(x).reshape(self.e, b * s // self.e, h)  # (E, T/E, h)
        up = torch.einsum("eth,ehf->etf", t, self.w_up)
        down = torch.bmm(F.gelu(up), self.w_down)
        return x + down.reshape(b, s, h)


class ExpertLM(nn.Module):
    def __init__(self, vocab: int = 64, h: int = 16, f: int = 24, experts: int = 4, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(ExpertBlock(h, f, experts) for _ in range(layers))
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.layers:
            x = blk(x)
        return self.head(x)
