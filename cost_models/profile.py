"""Per-layer cost inputs: what one layer computes, stores and communicates, per token, before sharding.

A `LayerProfile` is the boundary between "what the model is" and "what it costs": the analytic path
(`profile_from_spec`) and the captured-graph path (`autoplan.capture`) both produce a list of them, and every
cost function below works on that list. So a heterogeneous model (MoE every other layer, different widths)
is costed layer by layer, and a capture of a spec-built model gives the same estimate as the spec.

Quantities are per token of one sequence (the sequence length enters through the attention term), in
elements or bytes as named, for the *unsharded* layer; the cost model divides by tp/cp/ep as the roles say.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .specs import ModelSpec

TpRole = Literal["col", "row", "vocab", "replicated"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Gemm(_Frozen):
    """A weight matmul y = x W^T with W of shape [n, k], applied to `tokens_per_token` rows per input token."""

    name: str
    n: int = Field(description="Output features.")
    k: int = Field(description="Input features.")
    tp: TpRole = Field(description="How tensor parallelism splits it: col splits n, row splits k, vocab splits n.")
    expert: bool = Field(default=False, description="An expert's weight: split across ep, not replicated.")
    tokens_per_token: float = Field(default=1.0, description="Rows per input token (top_k for experts).")
    count: int = Field(default=1, description="Identical copies of the weight held (experts per layer).")

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.n * self.k * self.tokens_per_token

    @property
    def params(self) -> int:
        return self.n * self.k * self.count


class Attention(_Frozen):
    """The attention core (scores, softmax, context) of one layer."""

    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = True
    dropout: bool = Field(default=False, description="Dropout on the attention probabilities.")
    score_bias: bool = Field(
        default=False, description="A bias (ALiBi) is added to the raw scores: unfused, the QK^T GEMM "
        "accumulates onto a copy of it (baddbmm with beta=1), one more write and read of the s x s scores.")

    def flops_per_token(self, seq: int) -> float:
        """Model FLOPs per token, forward: QK^T and AV, causal counted in full (Korthikanti eq. 7)."""
        return 4.0 * seq * self.heads * self.head_dim


class LayerProfile(_Frozen):
    """One layer (a transformer block, the embedding, or the head with its loss)."""

    name: str
    kind: Literal["embedding", "block", "head"]
    gemms: tuple[Gemm, ...] = Field(default=())
    attention: Attention | None = None
    hidden: int = Field(description="Width of the residual stream h.")
    params_replicated: int = Field(default=0, description="Parameters copied on every tp rank (norms, biases of row layers).")
    params_sharded: int = Field(default=0, description="Non-GEMM parameters split across tp (col biases, embeddings).")
    param_tensors: int = Field(
        default=0, ge=0,
        description="Parameter tensors the layer owns (weights, biases, norm scales; a tied head's weight is the "
        "embedding's): the optimizer's host work goes per tensor. 0 = not recorded (a plan written before the field "
        "existed): `tensors()` estimates it.")
    # Memory-bound work, elements read+written per token in the forward pass, split by where it runs.
    elementwise_tp: float = Field(default=0.0, description="Inside the TP region (divided by tp).")
    elementwise_seq: float = Field(default=0.0, description="On the residual stream (divided by tp only with sp).")
    kernels_fwd: int = Field(default=0, description="Kernel launches in the forward pass (eager).")
    # Activations saved for backward, bytes per token at 2-byte activations, no recompute.
    act_tp: float = Field(default=0.0, description="Saved inside the TP region (divided by tp).")
    act_seq: float = Field(default=0.0, description="Saved on the residual stream (divided by tp only with sp).")
    act_scores_per_seq: float = Field(
        default=0.0, description="Attention-score bytes per token per sequence position (x seq; unfused attention)."
    )
    act_input: float = Field(default=0.0, description="Bytes of the layer input (what full recompute keeps).")
    tp_allreduces: int = Field(default=0, description="h-wide activation all-reduces per forward (2 per block).")
    moe_top_k: int = Field(default=0, description="Experts per token (0 = dense).")
    moe_experts: int = Field(default=0, description="Experts in the layer.")
    moe_capacity: float = Field(default=1.0, description="Rows each expert processes relative to the balanced load "
                                "(MoESpec.routed_scale: the capacity factor where inputs are padded to it).")
    logits_per_token: int = Field(default=0, description="Vocabulary size of the logits (head only).")
    logits_gathered: bool = Field(
        default=False, description="Head only: the forward transforms the vocabulary-parallel head's logits "
        "(soft-capping, scaling), so under tp the runtime gathers them whole on every rank and runs a plain loss "
        "instead of the vocab-parallel one (`vocab_split`).")
    saves_after_last_gemm: bool = Field(
        default=False, description="Blocks: an op after the last GEMM keeps a tensor for the backward (a dropout's "
        "mask, a post-norm's input), so a checkpoint that stops its re-run early still runs that GEMM again "
        "(compute.early_stop_skips_last_gemm).")
    # What the fusable ops process, so the kernel set (fused / eager torch / Megatron) can be costed.
    norm_kind: Literal["layernorm", "rmsnorm"] | None = Field(default=None, description="Normalisation op.")
    norm_elems: float = Field(default=0.0, description="Elements per token through norms (residual stream).")
    act_kind: Literal["gelu", "swiglu", "relu", "relu2"] | None = Field(default=None,
                                                                          description="MLP activation op.")
    act_elems: float = Field(default=0.0, description="Activation output elements per token (TP region).")
    rope_elems: float = Field(default=0.0, description="Elements of q and k rotated per token (TP region).")

    @property
    def routed_per_token(self) -> float:
        """Expert rows (dispatched tokens) per input token: top_k, times the capacity where inputs are padded."""
        return self.moe_top_k * self.moe_capacity

    def vocab_split(self, tp: int) -> int:
        """Over how many ranks the logits reach the loss split: tp for a vocabulary-parallel head whose logits the
        forward returns as they are (the runtime's loss_parallel), else 1 (a replicated head, tp 1, or logits
        gathered because the forward transforms them). Head only."""
        return tp if tp > 1 and self.tp_allreduces and not self.logits_gathered else 1

    @property
    def params(self) -> int:
        return sum(g.params for g in self.gemms) + self.params_replicated + self.params_sharded

    def tensors(self) -> int:
        """Parameter tensors of the layer (`param_tensors`), or for a profile that did not record them one per
        GEMM weight held, embedding table and norm scale or shift (biases unknown: an undercount)."""
        if self.param_tensors:
            return self.param_tensors
        tables = (self.params_sharded > 0) + (self.params_replicated > 0) if self.kind == "embedding" else 0
        return sum(g.count for g in self.gemms) + tables + self._norm_tensors()

    def tp_plain_tensors(self) -> int:
        """Of `tensors()`, those tensor parallelism alone leaves plain rather than DTensor (runtime.parallelize.
        apply_tp): the norms' scales and shifts and a learned position table (the embedding's replicated
        elements); GEMM weights and biases and the token table become DTensors."""
        return self._norm_tensors() + (1 if self.kind == "embedding" and self.params_replicated > 0 else 0)

    def norms(self) -> int:
        """The layer's normalisations: one per `hidden` elements of `norm_elems`."""
        return round(self.norm_elems / self.hidden) if self.norm_kind and self.hidden else 0

    def _norm_tensors(self) -> int:
        """The norms' scales (and LayerNorm's shifts)."""
        return self.norms() * (2 if self.norm_kind == "layernorm" else 1)

    def model_flops_per_token(self, seq: int) -> float:
        """Forward model FLOPs per token (no recompute)."""
        f = sum(g.flops_per_token for g in self.gemms)
        if self.attention is not None:
            f += self.attention.flops_per_token(seq)
        return f


def _block(model: ModelSpec, i: int, dropout: bool) -> LayerProfile:
    h, a, kv, d = model.hidden_size, model.num_attention_heads, model.kv_heads, model.dhead
    bias = model.has_bias
    moe = model.is_moe_layer(i)
    ffn = (model.moe.expert_ffn_hidden_size or model.ffn) if moe else model.ffn
    gated = model.activation == "swiglu"
    gemms = [
        Gemm(name="wq", n=a * d, k=h, tp="col"),
        Gemm(name="wk", n=kv * d, k=h, tp="col"),
        Gemm(name="wv", n=kv * d, k=h, tp="col"),
        Gemm(name="wo", n=h, k=a * d, tp="row"),
    ]
    top_k = model.moe.top_k if moe else 0
    n_exp = model.moe.num_experts if moe else 0
    cap = model.moe.routed_scale if moe else 1.0  # padded expert inputs: capacity x the balanced rows
    routed = top_k * cap  # expert rows per token (LayerProfile.routed_per_token)
    mlp_kw = dict(expert=True, tokens_per_token=float(routed), count=n_exp) if moe else {}
    if gated:
        gemms += [Gemm(name="w1", n=ffn, k=h, tp="col", **mlp_kw), Gemm(name="w3", n=ffn, k=h, tp="col", **mlp_kw)]
    else:
        gemms += [Gemm(name="w1", n=ffn, k=h, tp="col", **mlp_kw)]
    gemms += [Gemm(name="w2", n=h, k=ffn, tp="row", **mlp_kw)]
    if moe:
        gemms.insert(4, Gemm(name="router", n=n_exp, k=h, tp="replicated"))
    qkv_out = (a + 2 * kv) * d
    mult = max(routed, 1)
    ffn_tot = ffn * mult * (2 if gated else 1)  # fc1 output elements per token
    # Parameters outside GEMMs: two norms (weight, +bias for LayerNorm); biases of col layers are sharded,
    # biases of row layers replicated.
    norm_p = 2 * h * (2 if model.norm == "layernorm" else 1)
    col_bias = (qkv_out + (ffn * (2 if gated else 1)) * (n_exp or 1)) if bias else 0
    row_bias = (h + h * (n_exp or 1)) if bias else 0
    # the tensors the optimizer steps: each weight (experts are separate modules, autoplan.zoo.model.MoE) with its
    # bias (none on the router), and the two norms' scales (+ shifts for LayerNorm)
    tensors = sum(gm.count * (1 + (bias and gm.name != "router")) for gm in gemms) \
        + 2 * (2 if model.norm == "layernorm" else 1)
    # Elementwise traffic (elements per token, forward), counting what eager Megatron-style kernels read and
    # write: 2 norms (read x, write y), 2 bias+dropout+residual adds (read 2, write 1, +mask), activation
    # (read fc1 output, write fc2 input), RoPE on q and k (read+write).
    ew_seq = 2 * 2 * h + 2 * (3 * h + (0.5 * h if dropout else 0))
    ew_tp = ffn_tot + ffn * mult  # activation: read fc1 out(s), write its result
    if model.position == "rope":
        ew_tp += 2 * (a + kv) * d
    if moe:
        ew_tp += 2 * h * routed  # dispatch and combine permutations
    # Saved activations (Korthikanti et al. 2022, sec. 4.1, generalised to GQA, SwiGLU and no-dropout):
    # norm inputs 2*2h, QKV input 2h, MLP input 2h, dropout masks 1 byte each: replicated across TP w/o SP.
    act_seq = 2 * 2 * h + 2 * h + 2 * h + (2 * h if dropout else 0)
    act_tp = 2 * qkv_out + 2 * a * d + 2 * ffn_tot * 1 + 2 * ffn * mult  # Q,K,V; proj input; fc1 out; fc2 in
    if moe:
        act_tp += 2 * h * routed + 4 * n_exp  # dispatched tokens, router probabilities (fp32)
    # Unfused attention stores softmax output (2 bytes), dropout mask (1) and dropout output (2) per score.
    scores = a * (2 + (3 if dropout else 0))
    return LayerProfile(
        name=f"layers.{i}", kind="block", gemms=tuple(gemms),
        attention=Attention(heads=a, kv_heads=kv, head_dim=d, causal=True, dropout=dropout,
                            score_bias=model.position == "alibi"),
        hidden=h, params_replicated=norm_p + row_bias, params_sharded=col_bias, param_tensors=tensors,
        elementwise_tp=ew_tp, elementwise_seq=ew_seq,
        # one kernel per GEMM, the attention core, 2 norms, the activation and 2 residual adds, RoPE on q and k,
        # and for MoE the router's softmax/top-k, dispatch, combine and its auxiliary loss
        # (ALiBi: the copy of the bias into the scores)
        kernels_fwd=len(gemms) + 6 + (2 if model.position == "rope" else 0) + (1 if model.position == "alibi" else 0)
        + (4 if moe else 0),
        act_tp=act_tp, act_seq=act_seq, act_scores_per_seq=scores, act_input=2 * h,
        tp_allreduces=2, moe_top_k=top_k, moe_experts=n_exp, moe_capacity=cap,
        saves_after_last_gemm=dropout,  # the hidden dropout after w2 keeps its mask (autoplan.zoo.model.Block)
        norm_kind=model.norm, norm_elems=2 * h, act_kind=model.activation, act_elems=ffn * mult,
        rope_elems=(a + kv) * d if model.position == "rope" else 0,
    )


# The cross-entropy's traffic per logit on fp32 logits. Eager (PyTorch; Megatron's vocab_parallel_cross_entropy):
# upcast (read 2, write 4 bytes), max (read 4), subtract and exp (read 8, write 8), sum (read 4), normalise for
# backward (read 4, write 4) = 38. Megatron-Core's fused one (megatron/core/fusions/fused_cross_entropy.py,
# core_r0.8.0: `jit_fuser` is torch.compile on torch >= 2.2) runs each of its three functions as one pass:
# upcast + max (read 2, write 4), in-place subtract + exp + sum (read 4, write 4), in-place normalise (read 4,
# write 4) = 22. (Should inductor split a reduction from its pointwise producer, a pass reads its input twice:
# up to 26.) TrainingSpec.loss_fusion picks the fused count.
EAGER_CE_BYTES = 38
FUSED_CE_BYTES = 22


def profile_from_spec(model: ModelSpec, dropout: bool | None = None) -> list[LayerProfile]:
    """Embedding, the blocks, and the head (final norm, LM head, loss) of a ModelSpec."""
    h, v = model.hidden_size, model.vocab_size
    drop = model.dropout > 0 if dropout is None else dropout
    emb_params = v * h + (model.max_seq_length * h if model.position == "learned" else 0)
    embedding = LayerProfile(
        name="embedding", kind="embedding", hidden=h,
        params_sharded=v * h, params_replicated=emb_params - v * h,
        param_tensors=1 + (model.position == "learned"),
        elementwise_seq=2 * h + (0.5 * h if drop else 0), kernels_fwd=3,
        act_seq=(1 * h if drop else 0), tp_allreduces=1,  # vocab-parallel lookup ends in an all-reduce
    )
    head_gemm = Gemm(name="output", n=v, k=h, tp="vocab")
    norm_p = h * (2 if model.norm == "layernorm" else 1)
    head = LayerProfile(
        name="head", kind="head", gemms=(head_gemm,), hidden=h,
        params_replicated=norm_p,
        param_tensors=(2 if model.norm == "layernorm" else 1) + (not model.tie_embeddings),
        # final norm (read, write h); cross-entropy as eager PyTorch / Megatron runs it on fp32 logits:
        # EAGER_CE_BYTES = 38 bytes = 19 two-byte elements per logit.
        elementwise_seq=2 * h, elementwise_tp=EAGER_CE_BYTES // 2 * v, kernels_fwd=10,
        act_seq=2 * h + 2 * h,  # final-norm input and LM-head input
        act_tp=4 * v,  # fp32 softmax of the vocab-parallel cross-entropy (Megatron keeps it for backward)
        logits_per_token=v, norm_kind=model.norm, norm_elems=h,
        # The LM head is column-parallel over the vocabulary, so its input's gradient is summed over tp in the
        # backward, as a column-parallel linear's in a block (counts.layer_comm counts it: n_b = 1 for the head).
        # Megatron-LM 2021 (50a4b5fa) `parallel_lm_logits`: "input_parallel = mpu.copy_to_tensor_model_parallel_
        # region(input_)", whose backward all-reduces, synchronously; 2022 (de593298): `LinearWithGradAccumulation
        # AndAsyncCommunication`, "handle = torch.distributed.all_reduce(grad_input, ..., async_op=True)" before the
        # wgrad GEMM (tp_bwd_comm_overlap hides it), and with sp an all-gather of the input (synchronous in the
        # forward, async again in the backward) and "_reduce_scatter_base(sub_grad_input, grad_input, ...,
        # async_op=True)" beside the wgrad GEMM. compute._tp_comm prices one such collective in the backward
        # (kind "head": none in the forward), the same exposed total as sp's forward all-gather.
        tp_allreduces=1,
    )
    if model.tie_embeddings:
        head = head.model_copy(update={"gemms": (head_gemm.model_copy(update={"count": 0}),)})
    return [embedding] + [_block(model, i, drop) for i in range(model.num_layers)] + [head]
