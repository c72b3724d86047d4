"""Composable blocks of the Hugging Face families, built from an `Arch` (autoplan.models.arch).

The layout is the zoo's (autoplan.zoo.model.TransformerLM), so every apply_* of the runtime finds the same names:

    model.tok_embeddings      nn.Embedding(V, h)                 (x sqrt(h) for Gemma: model.embed_scale)
    model.pos_embeddings      nn.Embedding(S + offset, h)        learned positions (GPT-2, OPT), else None
    model.layers              nn.ModuleDict {"0": Block, ...}
        block.attention_norm  RMSNorm | GemmaRMSNorm | LayerNorm
        block.attention       wq, wk, wv, wo linears; rotary (partial, scaled) applied to q/k; `core`
        block.mlp_norm
        block.mlp             MLP (w1 = gate/fc1, w3 = up when gated, w2 = down/fc2) or SparseMoE
        block.post_attention_norm / post_mlp_norm   Gemma 2 only ("sandwich" norms), else None
    model.norm                final norm (None for OPT without final norm)
    model.output              LM head (tied to tok_embeddings when the config says so)

What differs between families is data in the Arch (residual "pre" | "parallel" | "post", the norm kind, the
activation and whether the MLP is gated, rotary fraction and scaling, window, soft-caps, biases); each block
reads only the switches it needs. Fused HF tensors (Phi-3 qkv_proj/gate_up_proj, GPT-NeoX query_key_value,
GPT-2 c_attn) are split into the separate linears here, so tensor parallelism's column/row pairs are plain
nn.Linear modules; autoplan.models.hf_weights maps the names and layouts both ways.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.cost_models.specs import ModelSpec, MoESpec, moe_layer_spacing
from autoplan.zoo.model import MoE as _ZooMoE
from autoplan.zoo.model import run_experts

from .arch import Arch, spec_activation

# ------------------------------------------------------------------------------------------------ norms


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), computed in fp32, weight stored as the offset from one."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def make_norm(arch: Arch) -> nn.Module:
    h = arch.hidden_size
    if arch.norm == "rmsnorm":
        return nn.RMSNorm(h, eps=arch.norm_eps)
    if arch.norm == "rmsnorm_plus1":
        return GemmaRMSNorm(h, arch.norm_eps)
    return nn.LayerNorm(h, eps=arch.norm_eps, elementwise_affine=arch.norm_affine,
                        bias=arch.norm_bias and arch.norm_affine)


# ---------------------------------------------------------------------------------------------- rotary


def rope_inv_freq(arch: Arch, device=None) -> torch.Tensor:
    """Inverse frequencies of the rotated dims, with the config's scaling (HF's rope init functions)."""
    dim = arch.rot_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if arch.rope_type == "linear":
        return inv / arch.rope_factor
    if arch.rope_type == "llama3":  # Llama 3.1: low frequencies divided by factor, a smooth ramp in between
        factor, lo, hi, old = arch.rope_factor, arch.rope_low_freq_factor, arch.rope_high_freq_factor, \
            arch.rope_original_max
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    return inv


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half convention on the first cos.shape[-1] dims. x (b, s, n, dh); cos/sin (s, rot)."""
    rot = cos.shape[-1]
    c, s_ = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    xr, xp = x[..., :rot], x[..., rot:]
    out = xr * c + rotate_half(xr) * s_
    return torch.cat((out, xp), dim=-1) if xp.shape[-1] else out


# ------------------------------------------------------------------------------------------- attention


class AttentionCore(nn.Module):
    """softmax(scale q k^T [soft-capped]) v, causal, optionally within a sliding window; GQA by repeating KV.

    Same signature as the zoo's core (selective recompute checkpoints it; context parallelism replaces it).
    Inputs (b, s, n, dh), output (b, s, nh*dh). Without soft-capping SDPA runs (with a boolean mask for a
    window); with it the scores are materialised, as in transformers' eager path.
    """

    def __init__(self, scale: float, window: int | None = None, softcap: float | None = None,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.scale, self.window, self.softcap, self.dropout = scale, window, softcap, dropout

    def _mask(self, s_q: int, s_k: int, device) -> torch.Tensor:
        q = torch.arange(s_k - s_q, s_k, device=device)[:, None]
        k = torch.arange(s_k, device=device)[None, :]
        mask = k <= q
        if self.window:  # transformers: key visible when q - window < k <= q
            mask &= k > q - self.window
        return mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, n, s, dh)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        p = self.dropout if self.training else 0.0
        if self.softcap is None:
            if self.window:
                mask = self._mask(q.shape[2], k.shape[2], q.device)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=self.scale)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, scale=self.scale)
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
            scores = torch.tanh(scores / self.softcap) * self.softcap
            scores = scores.masked_fill(~self._mask(q.shape[2], k.shape[2], q.device), float("-inf"))
            probs = F.dropout(scores.softmax(-1, dtype=torch.float32).to(q.dtype), p=p, training=self.training)
            out = torch.matmul(probs, v)
        return out.transpose(1, 2).flatten(2)  # (b, s, nh*dh)


class Attention(nn.Module):
    def __init__(self, arch: Arch, layer: int) -> None:
        super().__init__()
        h, dh = arch.hidden_size, arch.head_dim
        self.head_dim = dh
        self.wq = nn.Linear(h, arch.num_heads * dh, bias=arch.qkv_bias)
        self.wk = nn.Linear(h, arch.num_kv_heads * dh, bias=arch.qkv_bias)
        self.wv = nn.Linear(h, arch.num_kv_heads * dh, bias=arch.qkv_bias)
        self.wo = nn.Linear(arch.num_heads * dh, h, bias=arch.o_bias)
        self.arch = arch
        self.rope = arch.position == "rope"
        scale = arch.attn_scale if arch.attn_scale is not None else dh ** -0.5
        self.core = AttentionCore(scale, arch.sliding_window if arch.is_sliding(layer) else None,
                                  arch.attn_softcap, arch.attn_dropout)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.rope:
            if positions is None:
                positions = torch.arange(s, device=x.device)
            freqs = positions.float()[:, None] * rope_inv_freq(self.arch, x.device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # (s, rot)
            q, k = apply_rotary(q, emb.cos(), emb.sin()), apply_rotary(k, emb.cos(), emb.sin())
        return self.wo(self.core(q, k, v))


# ------------------------------------------------------------------------------------------------- MLP


class Activation(nn.Module):
    """act(a) [* b]: swappable module (fused kernels substitute it); `gated` when the MLP has w3."""

    _FN = {"silu": F.silu, "relu": F.relu, "relu2": lambda t: F.relu(t).square(), "gelu": F.gelu,
           "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = self._FN[self.kind](a)
        return out * b if b is not None else out

    def extra_repr(self) -> str:
        return self.kind


class MLP(nn.Module):
    """Gated: w2(act(w1 x) * w3 x) (SwiGLU, GeGLU); plain: w2(act(w1 x)). (b, s, h) -> (b, s, h)."""

    def __init__(self, h: int, ffn: int, act: str, gated: bool, bias: bool) -> None:
        super().__init__()
        self.w1 = nn.Linear(h, ffn, bias=bias)
        self.w3 = nn.Linear(h, ffn, bias=bias) if gated else None
        self.w2 = nn.Linear(ffn, h, bias=bias)
        self.act = Activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x) if self.w3 is not None else None))


class SparseMoE(_ZooMoE):
    """Top-k routed experts (Mixtral; Qwen2-MoE with its sigmoid-gated shared expert).

    Routing as transformers: softmax over all experts in fp32, top-k, renormalised when `norm_topk`. Subclasses
    the zoo's MoE so expert parallelism (runtime.parallelize.apply_ep) replaces `dispatch` the same way.
    """

    def __init__(self, arch: Arch) -> None:
        nn.Module.__init__(self)
        m, h = arch.moe, arch.hidden_size
        self.num_experts, self.top_k, self.norm_topk = m.num_experts, m.top_k, m.norm_topk
        self.router = nn.Linear(h, m.num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): MLP(h, m.expert_ffn, arch.act, True, False)
                                      for e in range(m.num_experts)})
        self.shared_expert = MLP(h, m.shared_ffn, arch.act, True, False) if m.shared_ffn else None
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if m.shared_ffn else None
        self.ep_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, h)
        probs = self.router(x).softmax(dim=-1, dtype=torch.float32)  # (T, E)
        weights, top_idx = probs.topk(self.top_k, dim=-1)  # (T, k)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_idx = top_idx.flatten()
        order = flat_idx.argsort(stable=True)
        counts = torch.bincount(flat_idx, minlength=self.num_experts)
        out = self.dispatch(x[order // self.top_k], counts)  # (T*k, h)
        combined = out.index_select(0, order.argsort())  # (token, slot) order; see autoplan.zoo.model.MoE
        combined = (combined.view(-1, self.top_k, shape[-1]) * weights[..., None].to(x.dtype)).sum(1)
        if self.shared_expert is not None:
            combined = combined + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return combined.view(shape)

    def dispatch(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return run_experts(self.experts, routed, counts.tolist(), first_expert=0)


# ----------------------------------------------------------------------------------------------- block


class Block(nn.Module):
    """One decoder layer. residual: pre (x + f(norm x)), parallel (x + attn(n1 x) + mlp(n2 x), GPT-NeoX),
    post (norm(x + f(x)), OPT with do_layer_norm_before=False); Gemma 2 adds a norm on each branch's output."""

    def __init__(self, arch: Arch, index: int) -> None:
        super().__init__()
        self.index, self.residual = index, arch.residual
        self.attention_norm = make_norm(arch)
        self.attention = Attention(arch, index)
        self.mlp_norm = make_norm(arch)
        self.mlp = SparseMoE(arch) if arch.is_moe_layer(index) else MLP(
            arch.hidden_size, arch.ffn_size, arch.act, arch.gated_mlp, arch.mlp_bias)
        self.post_attention_norm = make_norm(arch) if arch.sandwich_norms else None
        self.post_mlp_norm = make_norm(arch) if arch.sandwich_norms else None
        self.dropout = nn.Dropout(arch.resid_dropout) if arch.resid_dropout > 0 else None

    def _drop(self, t: torch.Tensor) -> torch.Tensor:
        return self.dropout(t) if self.dropout is not None else t

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.residual == "post":
            x = self.attention_norm(x + self._drop(self.attention(x, positions)))
            return self.mlp_norm(x + self._drop(self.mlp(x)))
        a = self.attention(self.attention_norm(x), positions)
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        if self.residual == "parallel":
            return self._drop(self.mlp(self.mlp_norm(x))) + self._drop(a) + x
        x = x + self._drop(a)
        m = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return x + self._drop(m)


# ----------------------------------------------------------------------------------------------- model


class CausalLM(nn.Module):
    """A Hugging Face causal LM in autoplan's layout (module docstring). tokens (b, s) -> logits (b, s, V);
    a pipeline stage (parts set to None) maps tokens|hidden -> hidden|logits like the zoo model."""

    def __init__(self, arch: Arch) -> None:
        super().__init__()
        self.arch = arch
        self.spec = spec_of(arch)
        h = arch.hidden_size
        self.tok_embeddings: nn.Module | None = nn.Embedding(arch.vocab_size, h, padding_idx=arch.pad_token_id)
        self.pos_offset = arch.pos_offset
        self.pos_embeddings: nn.Module | None = (
            nn.Embedding(arch.max_positions + arch.pos_offset, h) if arch.position == "learned" else None)
        self.embed_dropout = nn.Dropout(arch.embd_dropout) if arch.embd_dropout > 0 else None
        self.layers = nn.ModuleDict({str(i): Block(arch, i) for i in range(arch.num_layers)})
        self.norm: nn.Module | None = make_norm(arch) if arch.final_norm else None
        self.output: nn.Module | None = nn.Linear(h, arch.vocab_size, bias=False)
        if arch.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.positions: torch.Tensor | None = None  # set by context parallelism (see the zoo model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, pos = tokens, self.positions
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.arch.embed_scale != 1.0:  # Gemma: the normaliser is cast to the activation dtype first
                h = h * torch.tensor(self.arch.embed_scale, dtype=h.dtype)
            if self.pos_embeddings is not None:
                p = pos if pos is not None else torch.arange(tokens.shape[1], device=tokens.device)
                h = h + self.pos_embeddings(p + self.pos_offset)
            if self.embed_dropout is not None:
                h = self.embed_dropout(h)
        for layer in self.layers.values():
            h = layer(h, pos)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
            if self.arch.final_softcap:
                h = torch.tanh(h / self.arch.final_softcap) * self.arch.final_softcap
        return h


def spec_of(arch: Arch, name: str | None = None) -> ModelSpec:
    """The planner's summary of an Arch (sizes for the cost model and for validating a plan)."""
    moe = None
    # the model's own MoE layers (Qwen2-MoE's decoder_sparse_step and mlp_only_layers, a dense first layer)
    spacing = moe_layer_spacing(arch.moe.sparse_layers) if arch.moe is not None else None
    if spacing is not None:
        moe = MoESpec(num_experts=arch.moe.num_experts, top_k=arch.moe.top_k, expert_ffn_hidden_size=arch.moe.expert_ffn,
                      **spacing)
    return ModelSpec(
        name=name or str(arch.hf_config.get("_name_or_path") or arch.family), num_layers=arch.num_layers,
        hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, ffn_hidden_size=arch.ffn_size, vocab_size=arch.vocab_size,
        max_seq_length=arch.max_positions, activation=spec_activation(arch.gated_mlp, arch.act),
        norm="layernorm" if arch.norm == "layernorm" else "rmsnorm",
        position=arch.position, tie_embeddings=arch.tie_embeddings, bias=arch.qkv_bias, moe=moe,
        rope_theta=arch.rope_theta if arch.position == "rope" else 10000.0)


# ------------------------------------------------------------------------------------------------ init


def init_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic by (seed, parameter name), like the zoo's init, so every layout and pipeline stage builds
    the same weights: N(0, std) for matrices, zero biases, unit norms (zero for Gemma's 1 + w)."""
    arch: Arch = model.arch
    seen: set[int] = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in seen or p.is_meta:
                continue
            seen.add(id(p))
            if arch.tie_embeddings and name == "output.weight":
                name = "tok_embeddings.weight"
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(0.0 if arch.norm == "rmsnorm_plus1" else 1.0)
            else:
                g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(std))
        if arch.pad_token_id is not None and model.tok_embeddings is not None:
            model.tok_embeddings.weight[arch.pad_token_id].zero_()  # as nn.Embedding(padding_idx) initialises it
