"""Resolve a `--model` reference into a ModelSpec and, for captured models, their layer profiles.

Presets and spec files are costed analytically (`profile_from_spec`). A Hugging Face `config.json` is mapped
to a ModelSpec (used for validation and by the runtime) and, when `transformers` is installed, captured on
the meta device so the cost model sees the real graph. A `package.module:factory` reference is captured, and
its ModelSpec is derived from the captured layers.
"""

from __future__ import annotations

import sys
from pathlib import Path

from autoplan.cost_models.profile import LayerProfile
from autoplan.cost_models.specs import ModelSpec, MoESpec, moe_layer_spacing

from .specs import _read_mapping, hf_config_name, load_model, model_from_hf_config


def _is_factory(ref: str) -> bool:
    return ":" in ref and not Path(ref).exists() and not ref.endswith(".json")


def _capturing(name: str):
    """A spinner on stderr while torch.export traces the model (seconds; silent where stderr is no terminal)."""
    from rich.console import Console

    return Console(stderr=True).status(f"capturing {name} with torch.export (its graph is what gets priced)")


def resolve_model(ref: str | ModelSpec) -> tuple[ModelSpec, list[LayerProfile] | None]:
    if isinstance(ref, ModelSpec):
        return ref, None
    ref = str(ref)
    if _is_factory(ref):
        from .capture import capture, load_module_factory

        module, inputs = load_module_factory(ref)
        with _capturing(ref):
            graph = capture(module, inputs, name=ref.split(":")[-1])
        # the longest sequence is the learned position table's, not the example input's (which only traces)
        return spec_from_profiles(graph.profiles, name=ref.split(":")[-1], seq=graph.max_positions()), \
            graph.profiles
    path = Path(ref)
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face checkpoint directory
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        data = _read_mapping(path)  # a syntax error is one line naming the file and the position
        if isinstance(data, dict) and ("model_type" in data or "architectures" in data):
            # named by its folder; bad input fails here first
            spec = model_from_hf_config(data, name=hf_config_name(path))
            from .models.source import warn_unsupported

            warn_unsupported(data)
            try:
                from .capture import capture_hf_config

                with _capturing(spec.name):
                    return spec, capture_hf_config(path).profiles
            except ImportError as e:  # transformers missing: the analytic profile of the mapped spec
                print(f"autoplan: note: {e}; costing {spec.name} from its config analytically", file=sys.stderr)
                return spec, None
    return load_model(ref), None


# The max_seq_length of a captured module that has no limit of its own (no learned position table): the CLI asks
# for --seq-len rather than default to it
UNLIMITED_SEQ = 1 << 20


def spec_from_profiles(profiles: list[LayerProfile], name: str, seq: int | None = None) -> ModelSpec:
    """A ModelSpec describing a captured model (sizes for validation: heads, KV heads, FFN, vocab, layers)."""
    blocks = [p for p in profiles if p.kind == "block"]
    head = next((p for p in profiles if p.kind == "head"), None)
    emb = next((p for p in profiles if p.kind == "embedding"), None)
    b0 = blocks[0]
    att = next((b.attention for b in blocks if b.attention is not None), None)
    heads = att.heads if att else 1
    kv = att.kv_heads if att else heads
    dhead = att.head_dim if att else b0.hidden
    attn_sizes = {heads * dhead, kv * dhead, (heads + 2 * kv) * dhead}
    mlp_cols = [g for g in b0.gemms if g.tp == "col" and g.n not in attn_sizes]
    ffn = max((g.n for g in mlp_cols), default=4 * b0.hidden)
    gated = len({g.n for g in mlp_cols}) == 1 and len(mlp_cols) >= 2
    moe = None
    moe_block = next((b for b in blocks if b.moe_experts), None)
    if moe_block is not None:  # the captured blocks' own MoE layers
        moe = MoESpec(num_experts=moe_block.moe_experts, top_k=moe_block.moe_top_k, expert_ffn_hidden_size=ffn,
                      **moe_layer_spacing([bool(b.moe_experts) for b in blocks]))
    return ModelSpec(
        name=name, num_layers=len(blocks), hidden_size=b0.hidden, num_attention_heads=heads, num_kv_heads=kv,
        head_dim=dhead, ffn_hidden_size=ffn, vocab_size=head.logits_per_token if head and head.logits_per_token else 1,
        max_seq_length=seq or UNLIMITED_SEQ, activation="swiglu" if gated else "gelu",
        position="learned" if emb is not None and emb.params_replicated > 0 else "rope", moe=moe,
    )
