"""Tiny random configs of every supported Hugging Face family, shared by the parity tests and the benchmark.

Each exercises its family's switches: GQA, sliding windows shorter than the test sequence, biases, partial
rotary, rope scaling, soft-caps, parallel residual, post-norm, tied and untied heads, MoE routing."""

from __future__ import annotations

_IDS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
_LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, **_IDS)

CONFIGS: dict[str, dict] = {
    "llama": dict(_LLAMA, model_type="llama", rope_theta=5000.0, attention_bias=True, mlp_bias=True,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama-linear": dict(_LLAMA, model_type="llama", rope_scaling={"rope_type": "linear", "factor": 2.0},
                         tie_word_embeddings=True, head_dim=16),
    "mistral": dict(_LLAMA, model_type="mistral", sliding_window=5, rope_theta=1e6),
    "mixtral": dict(_LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
    "qwen2": dict(_LLAMA, model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen2_moe": dict(_LLAMA, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[1],
                      norm_topk_prob=False),
    "gemma": dict(_LLAMA, model_type="gemma", head_dim=8, hidden_activation="gelu_pytorch_tanh"),
    "gemma2": dict(_LLAMA, model_type="gemma2", head_dim=8, query_pre_attn_scalar=12, sliding_window=5,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "phi3": dict(_LLAMA, model_type="phi3", partial_rotary_factor=0.5, num_key_value_heads=2),
    "gpt2": dict(model_type="gpt2", vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                 activation_function="gelu_new", layer_norm_epsilon=1e-5, **_IDS),
    "gpt_neox": dict(model_type="gpt_neox", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.25, use_parallel_residual=True,
                     **_IDS),
    "gpt_neox-seq": dict(model_type="gpt_neox", vocab_size=96, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                         use_parallel_residual=False, hidden_act="gelu_new", **_IDS),
    "opt": dict(model_type="opt", vocab_size=96, hidden_size=32, ffn_dim=48, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32, **_IDS),
    "opt-postnorm": dict(model_type="opt", vocab_size=96, hidden_size=32, ffn_dim=48, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                         do_layer_norm_before=False, **_IDS),
}


def hf_model(cfg: dict, seed: int = 0):
    """transformers' own model for `cfg`, eager attention, random weights (biases and norms randomised too)."""
    import copy

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = copy.deepcopy({k: v for k, v in cfg.items() if k != "model_type"})  # transformers edits nested dicts
    config = AutoConfig.for_model(cfg["model_type"], **kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # HF zero-inits biases and sets norms to 1: randomise so that they are tested
        for n, p in model.named_parameters():
            if p.dim() == 1 or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model
