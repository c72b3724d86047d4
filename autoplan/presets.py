"""Built-in model presets, each number with its source. `autoplan models` lists them."""

from __future__ import annotations

from autoplan.cost_models.specs import ModelSpec, MoESpec


def _gpt(name: str, layers: int, hidden: int, heads: int, *, seq: int = 2048, vocab: int = 51200,
         ffn: int | None = None, dropout: float = 0.1, tied: bool = True) -> ModelSpec:
    """A GPT-3-style model: learned positions, LayerNorm, GeLU 4h MLP, biases, untied embeddings, and
    Megatron-LM's default hidden/attention dropout of 0.1 (arguments.py defaults, used by SC21). Embeddings
    are tied by default as in Megatron-LM's GPT (and SC21 eq. 2, which counts V*h once)."""
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     ffn_hidden_size=ffn or 4 * hidden, vocab_size=vocab, max_seq_length=seq,
                     dropout=dropout, tie_embeddings=tied)


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int,
           rope_theta: float = 10000.0) -> ModelSpec:
    """A Llama-style model: RoPE, RMSNorm, SwiGLU, no biases, untied embeddings."""
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     num_kv_heads=kv, ffn_hidden_size=ffn, vocab_size=vocab, max_seq_length=seq,
                     activation="swiglu", norm="rmsnorm", position="rope", bias=False, rope_theta=rope_theta)


_PRESETS: list[ModelSpec] = [
    # GPT-3 family: Brown et al. 2020, Table 2.1 (layers, d_model, heads; seq 2048). Vocabulary 50,257 padded
    # to 51,200 as Megatron-LM does. Deviations from the table: 1.3B uses 16 heads (the table's 24 heads of
    # 128 do not multiply to 2048; Megatron and Narayanan use 16), 13B uses d_model 5120 (the table's 5140
    # is not a multiple of its 40 heads).
    _gpt("gpt3-125m", 12, 768, 12),
    _gpt("gpt3-350m", 24, 1024, 16),
    _gpt("gpt3-760m", 24, 1536, 16),
    _gpt("gpt3-1.3b", 24, 2048, 16),
    _gpt("gpt3-2.7b", 32, 2560, 32),
    _gpt("gpt3-6.7b", 32, 4096, 32),
    _gpt("gpt3-13b", 40, 5120, 40),
    _gpt("gpt3-175b", 96, 12288, 96),
    # Narayanan et al. SC21, Table 1 (calibration_runs.json): seq 2048, vocab 51,200, ffn 4h.
    _gpt("sc21-1.7b", 24, 2304, 24),
    _gpt("sc21-3.6b", 30, 3072, 32),
    _gpt("sc21-7.5b", 36, 4096, 32),
    _gpt("sc21-18.4b", 40, 6144, 48),
    _gpt("sc21-39.1b", 48, 8192, 64),
    _gpt("sc21-76.1b", 60, 10240, 80),
    _gpt("sc21-145.6b", 80, 12288, 96),
    _gpt("sc21-310.1b", 96, 16384, 128),
    _gpt("sc21-529.6b", 105, 20480, 128),
    _gpt("sc21-1t", 128, 25600, 160),
    # Megatron-LM README H100 table (calibration_runs.json): seq 4096, vocab 131,072, GeLU ffn 4h, untied.
    _gpt("mlm-h100-1.7b", 24, 2048, 16, seq=4096, vocab=131072, tied=False),
    _gpt("mlm-h100-7.1b", 30, 4096, 32, seq=4096, vocab=131072, tied=False),
    _gpt("mlm-h100-16b", 32, 6144, 48, seq=4096, vocab=131072, tied=False),
    _gpt("mlm-h100-32b", 48, 7168, 56, seq=4096, vocab=131072, tied=False),
    _gpt("mlm-h100-70b", 84, 8192, 64, seq=4096, vocab=131072, tied=False),
    _gpt("mlm-h100-119b", 92, 10240, 80, seq=4096, vocab=131072, tied=False),
    _gpt("mlm-h100-177b", 96, 12288, 96, seq=4096, vocab=131072, tied=False),
    _gpt("mlm-h100-314b", 96, 16384, 128, seq=4096, vocab=131072, tied=False),
    _gpt("mlm-h100-462b", 112, 18432, 144, seq=4096, vocab=131072, tied=False),
    # Llama 2: Touvron et al. 2023 (Table 1 and the released config.json files): vocab 32,000, context 4,096,
    # rotary base 10,000 (config.json rope_theta).
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    # Llama 3 / 3.1: Dubey et al. 2024, Table 3 (layers, width, FFN, heads, 8 KV heads, vocab 128,256, "RoPE
    # (theta = 500,000)"); pre-training context 8,192.
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, rope_theta=500000.0),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, rope_theta=500000.0),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, rope_theta=500000.0),
    # Mixtral 8x7B: Jiang et al. 2024 (Table 1): 32 layers, dim 4096, 32 heads, 8 KV heads, expert FFN 14,336,
    # 8 experts, top-2, vocab 32,000, context 32,768; every layer is MoE. Rotary base 1,000,000 (the released
    # Mixtral-8x7B-v0.1 config.json, rope_theta).
    ModelSpec(name="mixtral-8x7b", num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
              ffn_hidden_size=14336, vocab_size=32000, max_seq_length=32768, activation="swiglu",
              norm="rmsnorm", position="rope", bias=False, rope_theta=1e6,
              moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=14336, every_n_layers=1)),
    # Tiny models for this machine: the demo, the tests and the parity runs. Sizes are chosen so that every
    # parallel layout of the tests divides them (heads, KV heads, layers by pp*vp=4, sequence by tp*cp*2).
    _gpt("tiny-gpt", 4, 64, 4, seq=64, vocab=128, dropout=0.0),
    _llama("tiny-llama", 4, 64, 4, 2, 176, 128, 64),
    ModelSpec(name="tiny-moe", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
              ffn_hidden_size=128, vocab_size=128, max_seq_length=64, activation="swiglu", norm="rmsnorm",
              position="rope", bias=False,
              moe=MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=96, every_n_layers=1)),
]

MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in _PRESETS}
