"""Small hand-written modules for capture tests (and a factory for `module:factory` references)."""

from __future__ import annotations

import math

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


class PostNormBlock(Block):
    """Post-norm (x = norm(x + f(x)): OPT with do_layer_norm_before=False): the norm after fc2 keeps its input
    for the backward, so a checkpoint's early stop still re-runs fc2."""

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = self.ln1(x + self.proj(a))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 96, h: int = 32, heads: int = 4, layers: int = 3, branchy: bool = False,
                 block: type[Block] = Block):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(block(h, heads, branchy) for _ in range(layers))
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


def post_norm_lm():
    """`tiny_lm` with post-norm blocks."""
    with torch.device("meta"):
        model = TinyLM(block=PostNormBlock)
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


# ------------------------------------------------- module:factory models for tensor / pipeline parallelism


class Attention(nn.Module):
    """Separate q/k/v projections, grouped KV heads; the reshape reads the head counts from attributes
    (`n_heads`, `n_kv_heads`), so a rank holding 1/tp of the projections' columns sets them to 1/tp.
    `hard_heads` reshapes by a literal head count instead; `explicit_core` writes the core as
    matmul-softmax-matmul (no scaled_dot_product_attention)."""

    def __init__(self, h: int, heads: int, kv_heads: int, hard_heads: bool = False, explicit_core: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, h // heads
        self.hard_heads, self.explicit_core = hard_heads, explicit_core
        self.wq = nn.Linear(h, heads * self.head_dim)
        self.wk = nn.Linear(h, kv_heads * self.head_dim, bias=False)  # a key bias has no gradient (softmax)
        self.wv = nn.Linear(h, kv_heads * self.head_dim)
        self.wo = nn.Linear(heads * self.head_dim, h)

    def forward(self, x):
        b, s, _ = x.shape
        if self.hard_heads:
            q = self.wq(x).view(b, s, 4, -1).transpose(1, 2)
            k = self.wk(x).view(b, s, 2, -1).transpose(1, 2)
            v = self.wv(x).view(b, s, 2, -1).transpose(1, 2)
        else:
            q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
            k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
            v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.explicit_core:
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            a = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, s, -1))


class GatedMLP(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(f, h)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SplitBlock(nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, **attn) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = Attention(h, heads, kv_heads, **attn)
        self.mlp = GatedMLP(h, 3 * h)

    def forward(self, x, keep=None):
        x = x + self.attn(self.attn_norm(x))
        x = x + self.mlp(self.mlp_norm(x))
        return x if keep is None else x * keep


class Embeddings(nn.Module):
    """Token + learned position embeddings in one module (what a pipeline's first stage keeps)."""

    def __init__(self, vocab: int, h: int, max_seq: int, viewed_ids: bool = False) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, h), nn.Embedding(max_seq, h)
        self.viewed_ids = viewed_ids

    def forward(self, tokens):
        if self.viewed_ids:  # GPT-2's `input_ids.view(-1, input_shape[-1])` before the lookup
            tokens = tokens.view(-1, tokens.shape[-1])
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


class SplitLM(nn.Module):
    """A user's decoder: embeddings -> blocks -> norm -> head, with separate q/k/v projections.
    `root_scale` scales the embeddings in the model's own forward (outside any module), which a pipeline stage
    cannot skip; `softcap` soft-caps the logits there (the head's output is not the model's); `tied` shares the
    head's weight with the token embedding; `functional_head` computes the logits with F.linear on the token
    embedding's weight (and has no `head` module); `viewed_ids` views the ids before the lookup."""

    def __init__(self, vocab: int = 96, h: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 3,
                 max_seq: int = 64, root_scale: bool = False, softcap: float | None = None, tied: bool = False,
                 functional_head: bool = False, pad_mask: bool = False, viewed_ids: bool = False, **attn) -> None:
        super().__init__()
        self.root_scale, self.softcap, self.functional_head = root_scale, softcap, functional_head
        self.pad_mask = pad_mask
        self.embed = Embeddings(vocab, h, max_seq, viewed_ids)
        mixed = attn.pop("mixed", False)  # alternate SDPA and explicit attention cores
        self.layers = nn.ModuleList(SplitBlock(h, heads, kv_heads, **attn, **({"explicit_core": i % 2 == 1}
                                                                              if mixed else {}))
                                    for i in range(layers))
        self.norm = nn.LayerNorm(h)
        self.head = None if functional_head else nn.Linear(h, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.tok.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.root_scale:
            x = x * 2.0
        keep = (tokens != 0).unsqueeze(-1) if self.pad_mask else None  # padding tokens (id 0) zeroed by every block
        for blk in self.layers:
            x = blk(x) if keep is None else blk(x, keep)
        if self.functional_head:  # GPT-2 style: the embedding's weight applied with F.linear in the root forward
            logits = F.linear(self.norm(x), self.embed.tok.weight)
        else:
            logits = self.head(self.norm(x))
        if self.softcap is not None:  # Gemma 2's final soft-capping, in the root forward
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits


def _meta_factory(**kw):
    with torch.device("meta"):
        model = SplitLM(**kw)
    return model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),)


def split_lm():
    """Shardable by tp and pp: separate q/k/v linears, head counts read from attributes."""
    return _meta_factory()


def split_lm4():
    """split_lm with 4 blocks (one per virtual pipeline stage at pp=2, vp=2)."""
    return _meta_factory(layers=4)


def hard_heads_lm():
    """Its attention reshapes by literal head counts: not shardable by tp."""
    return _meta_factory(hard_heads=True)


def mixed_core_lm():
    """Blocks alternate SDPA and matmul/softmax cores: not all alike, the same linears (tp applies; selective
    recompute is refused, naming block 1)."""
    return _meta_factory(mixed=True)


def explicit_core_lm():
    """Attention written as matmul-softmax-matmul: no selective recomputation."""
    return _meta_factory(explicit_core=True)


def softcap_lm():
    """Soft-caps its logits in the root forward: tp gathers the logits; not cut into pipeline stages."""
    return _meta_factory(softcap=3.0)


def functional_head_lm():
    """Logits by F.linear on the embedding's weight: tp leaves the vocabulary replicated; not pipelined."""
    return _meta_factory(functional_head=True)


def pad_mask_lm():
    """Its blocks zero padding positions with a mask the root forward computes from the token ids: not pipelined
    (a later stage sees only the hidden state)."""
    return _meta_factory(pad_mask=True)


def viewed_ids_lm():
    """Views the token ids before the lookup (as GPT-2 does): the embedding is still split over the vocabulary."""
    return _meta_factory(viewed_ids=True)


def tied_lm():
    """Head tied to the token embedding."""
    return _meta_factory(tied=True)


def root_scale_lm():
    """Scales the embeddings in the root forward: not cut into pipeline stages."""
    return _meta_factory(root_scale=True)


def hf_llama():
    """transformers' own LlamaForCausalLM (tiny config, sdpa attention) as a user's module, built and initialised
    on the CPU by transformers (its RMSNorm and rotary tables have no reset_parameters for a meta build)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  tie_word_embeddings=False, use_cache=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model, (torch.zeros(2, 16, dtype=torch.long),)


def hf_llama_meta():
    """The same on the meta device: refused (RMSNorm and the rotary table cannot be initialised)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),)
