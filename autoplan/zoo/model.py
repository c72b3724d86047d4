"""One decoder-only transformer LM covering GPT, Llama and Mixtral-style MoE models.

Built from a `ModelSpec`. The structure is chosen for parallelism (the torchtitan layout):

    model.tok_embeddings      nn.Embedding(V, h)
    model.pos_embeddings      nn.Embedding(S, h)          learned positions only, else None
    model.layers              nn.ModuleDict {"0": Block, ..., "L-1": Block}
        block.attention_norm  LayerNorm | RMSNorm           (swappable: codegen.fuse substitutes fused kernels)
        block.attention       Attention: wq, wk, wv, wo linears and `core` (the attention core: GQA + SDPA)
        block.mlp_norm        LayerNorm | RMSNorm
        block.mlp             MLP (w1, w2[, w3]) or MoE (router, experts {"0": MLP, ...})
    model.norm                final norm
    model.output              nn.Linear(h, V, bias=False) (the LM head)

A pipeline stage deletes the layers it does not run (keys keep their global names) and sets the parts it
does not hold to None; `forward` then runs the slice: tokens or hidden states in, hidden states or logits out.

Shapes in comments: b = batch, s = (local) sequence, h = hidden, nh/nkv = (local) query/KV heads, dh = head
dim, V = vocab, E = experts, k = top-k. Under tensor parallelism the linears hold a slice of the heads, so
the code reshapes with -1 heads and never assumes the global count.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.cost_models.specs import ModelSpec

# torch's RMSNorm (Zhang & Sennrich 2019); kernels.modules.fuse_module knows it, DTensor shards it under SP.
RMSNorm = nn.RMSNorm


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.hidden_size, eps=1e-5)
    return nn.LayerNorm(spec.hidden_size, eps=1e-5, bias=spec.has_bias)


def rope_cos_sin(positions: torch.Tensor, dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of rotary embeddings (Su et al. 2021) for integer positions (s,) -> (s, dim/2) each.

    Computed on the fly (cheap) rather than stored, so the model has no buffers to re-initialise after a
    meta-device build and context parallelism only has to hand in its chunk's positions.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (s, dim/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by the position angle. x: (b, s, n, dh); cos/sin: (s, dh/2)."""
    xf = x.float().unflatten(-1, (-1, 2))  # (b, s, n, dh/2, 2)
    x1, x2 = xf[..., 0], xf[..., 1]
    c, s_ = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * c - x2 * s_, x1 * s_ + x2 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(dh)) v with a causal mask, GQA by repeating KV heads.

    Its own module so that selective recomputation can checkpoint exactly this region and context
    parallelism can replace it (see runtime.parallelize.apply_cp). Inputs (b, s, n, dh); output (b, s, nh*dh).
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, n, s, dh)
        if rep > 1:  # GQA: query head i reads KV head i // rep
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)  # (b, nh, s, dh)
        return out.transpose(1, 2).flatten(2)  # (b, s, nh*dh)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, dh, bias = spec.hidden_size, spec.dhead, spec.has_bias
        self.head_dim, self.rope_theta = dh, spec.rope_theta
        self.rope = spec.position == "rope"
        if spec.position == "alibi":
            raise NotImplementedError(f"{spec.name}: autoplan's runtime has no ALiBi attention (position=alibi is "
                                      "for cost estimates of runs such as BLOOM); use rope or learned positions")
        self.wq = nn.Linear(h, spec.num_attention_heads * dh, bias=bias)
        self.wk = nn.Linear(h, spec.kv_heads * dh, bias=bias)
        self.wv = nn.Linear(h, spec.kv_heads * dh, bias=bias)
        self.wo = nn.Linear(spec.num_attention_heads * dh, h, bias=bias)
        self.core = AttentionCore(spec.dropout)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]  # x: (b, s, h)
        q = self.wq(x).view(b, s, -1, self.head_dim)  # (b, s, nh, dh)
        k = self.wk(x).view(b, s, -1, self.head_dim)  # (b, s, nkv, dh)
        v = self.wv(x).view(b, s, -1, self.head_dim)  # (b, s, nkv, dh)
        if self.rope:
            if positions is None:
                positions = torch.arange(s, device=q.device)
            cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.wo(self.core(q, k, v))  # (b, s, nh*dh) -> (b, s, h)


class Activation(nn.Module):
    """The MLP non-linearity as a module (swappable by a fused kernel). swiglu: silu(a) * b."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "swiglu":
            return F.silu(a) * b
        if self.kind == "relu":
            return F.relu(a)
        if self.kind == "relu2":
            return F.relu(a).square()
        return F.gelu(a, approximate="tanh")

    def extra_repr(self) -> str:
        return self.kind


class MLP(nn.Module):
    """GeLU/ReLU: w2(act(w1 x)); SwiGLU: w2(silu(w1 x) * w3 x). (b, s, h) -> (b, s, h)."""

    def __init__(self, h: int, ffn: int, activation: str, bias: bool) -> None:
        super().__init__()
        self.w1 = nn.Linear(h, ffn, bias=bias)
        self.w3 = nn.Linear(h, ffn, bias=bias) if activation == "swiglu" else None
        self.w2 = nn.Linear(ffn, h, bias=bias)
        self.act = Activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)  # (b, s, ffn)
        hidden = self.act(gate, self.w3(x)) if self.w3 is not None else self.act(gate)
        return self.w2(hidden)


class MoE(nn.Module):
    """Mixtral-style sparse MLP: a softmax over the top-k router logits weights k SwiGLU experts per token.

    Dropless (every routed token is computed; `capacity_factor` is a cost-model input only). Experts are a
    ModuleDict keyed by global expert index so expert parallelism keeps names when it drops non-local experts.
    `dispatch` is the hook expert parallelism replaces: it takes the routed token copies grouped by expert and
    returns the expert outputs in the same order.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        assert spec.moe is not None
        h, moe = spec.hidden_size, spec.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.router = nn.Linear(h, moe.num_experts, bias=False)
        ffn = moe.expert_ffn_hidden_size or spec.ffn
        act = spec.activation
        self.experts = nn.ModuleDict({str(e): MLP(h, ffn, act, spec.has_bias) for e in range(moe.num_experts)})
        self.ep_group = None  # set by runtime.parallelize.apply_ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, h), T = b*s tokens
        logits = self.router(x)  # (T, E)
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)  # (T, k)
        weights = top_logits.softmax(dim=-1, dtype=torch.float32).type_as(x)  # (T, k)
        flat_idx = top_idx.flatten()  # (T*k,) expert of each routed copy
        order = flat_idx.argsort(stable=True)  # copies grouped by expert
        counts = torch.bincount(flat_idx, minlength=self.num_experts)  # (E,)
        routed = x[order // self.top_k]  # (T*k, h) token copies, grouped by expert
        out = self.dispatch(routed, counts)  # (T*k, h)
        # back to (token, slot) order: a gather by the inverse permutation, whose backward keeps only the index
        # (index_copy into an empty tensor computes the same but saves `out` for its backward)
        combined = out.index_select(0, order.argsort())
        combined = (combined.view(-1, self.top_k, shape[-1]) * weights[..., None]).sum(1)  # (T, h)
        return combined.view(shape)

    def dispatch(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run each expert on its contiguous group of routed tokens (local: all experts here)."""
        return run_experts(self.experts, routed, counts.tolist(), first_expert=0)


def run_experts(experts: nn.ModuleDict, routed: torch.Tensor, counts: list[int], first_expert: int) -> torch.Tensor:
    """Apply experts first_expert, first_expert+1, ... to consecutive groups of `counts` rows of `routed`."""
    outs, start = [], 0
    for i, n in enumerate(counts):
        chunk = routed[start : start + n]
        outs.append(experts[str(first_expert + i)](chunk) if n else chunk * 0)
        start += n
    return torch.cat(outs) if outs else routed


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec, index: int) -> None:
        super().__init__()
        self.index = index
        self.attention_norm = make_norm(spec)
        self.attention = Attention(spec)
        self.mlp_norm = make_norm(spec)
        self.mlp = MoE(spec) if spec.is_moe_layer(index) else MLP(spec.hidden_size, spec.ffn, spec.activation,
                                                                   spec.has_bias)
        # Hidden dropout on both residual branches (Megatron's GPT uses 0.1; 0 = identity, no RNG drawn).
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        a = self.attention(self.attention_norm(x), positions)  # (b, s, h)
        x = x + (self.dropout(a) if self.dropout is not None else a)
        m = self.mlp(self.mlp_norm(x))
        return x + (self.dropout(m) if self.dropout is not None else m)


class TransformerLM(nn.Module):
    """Decoder-only LM; see the module docstring for the layout."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.tok_embeddings: nn.Module | None = nn.Embedding(spec.vocab_size, h)
        self.pos_embeddings: nn.Module | None = (
            nn.Embedding(spec.max_seq_length, h) if spec.position == "learned" else None
        )
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.num_layers)})
        self.norm: nn.Module | None = make_norm(spec)
        self.output: nn.Module | None = nn.Linear(h, spec.vocab_size, bias=False)
        if spec.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Positions of this rank's tokens in the full sequence; None = 0..s-1. Context parallelism sets the
        # load-balanced chunk positions here (a plain attribute: not a parameter, not in the state dict).
        self.positions: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b, s) int64 -> logits (b, s, V); a pipeline stage: tokens|hidden -> hidden|logits."""
        h = tokens
        pos = self.positions
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)  # (b, s, h)
            if self.pos_embeddings is not None:
                p = pos if pos is not None else torch.arange(tokens.shape[1], device=tokens.device)
                h = h + self.pos_embeddings(p)  # (s, h) broadcast over b
        for layer in self.layers.values():
            h = layer(h, pos)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)  # (b, s, V)
        return h


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all tokens. logits (b, s, V), labels (b, s) (already shifted)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


# ---------------------------------------------------------------------------------------------- init


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic init, one generator per parameter seeded by (seed, name).

    A parameter's value depends only on the seed and its name, so every device, dtype-free layout and pipeline
    stage (which builds only some layers) gets identical weights. GPT-2 scheme: N(0, 0.02) for linears and
    embeddings, output projections (wo, w2) scaled by 1/sqrt(2L), biases 0, norm weights 1.
    """
    spec: ModelSpec = model.spec
    out_std = std / math.sqrt(2 * spec.num_layers)
    seen: set[int] = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in seen or p.is_meta:
                continue
            seen.add(id(p))
            if spec.tie_embeddings and name == "output.weight":  # a pipeline stage holding only the tied head
                name = "tok_embeddings.weight"
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                s = out_std if name.endswith(("wo.weight", "w2.weight")) else std
                g = torch.Generator().manual_seed(_param_seed(seed, name))
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(s))


def build_model(spec: ModelSpec, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> TransformerLM:
    """Build and initialise the zoo model for `spec`. On device="meta" nothing is allocated or initialised."""
    with torch.device(device):
        model = TransformerLM(spec)
    if torch.device(device).type != "meta":
        init_weights(model, seed)
    return model.to(dtype=dtype)
