"""Hugging Face tensor names and layouts <-> autoplan's, per family, both ways.

A `Rule` ties one HF tensor to one or more of ours and says how the layouts relate:
  copy       the same tensor
  t          transposed (GPT-2's Conv1D stores (in, out))
  cat        ours concatenated on dim 0 (Phi-3 qkv_proj = [q; k; v], gate_up_proj = [gate; up])
  cat_t      cat, then transposed (GPT-2 c_attn weight)
  heads3     GPT-NeoX query_key_value: rows interleaved per head [q_0 k_0 v_0 q_1 ...]
  stack_cat  fused experts (E, 2F, h) = stack over e of [w1_e; w3_e] (transformers 5 Mixtral/Qwen2-MoE)
  stack      fused experts (E, h, F) = stack over e of w2_e
`to_hf(state_dict)` and `from_hf(tensors)` apply them; both are exact (only views, copies and concatenations),
so HF -> autoplan -> HF is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arch import Arch


@dataclass(frozen=True)
class Rule:
    hf: str
    ours: tuple[str, ...]
    kind: str = "copy"


def _llama_layer(arch: Arch, i: int, disk: bool) -> list[Rule]:
    p, o = f"model.layers.{i}.", f"layers.{i}."
    rules = [Rule(p + "input_layernorm.weight", (o + "attention_norm.weight",)),
             Rule(p + "post_attention_layernorm.weight", (o + "mlp_norm.weight",))]
    if arch.family == "gemma2":  # sandwich norms: HF's post_attention_layernorm is the attention branch's
        rules = [Rule(p + "input_layernorm.weight", (o + "attention_norm.weight",)),
                 Rule(p + "post_attention_layernorm.weight", (o + "post_attention_norm.weight",)),
                 Rule(p + "pre_feedforward_layernorm.weight", (o + "mlp_norm.weight",)),
                 Rule(p + "post_feedforward_layernorm.weight", (o + "post_mlp_norm.weight",))]
    if arch.family == "phi3":
        rules.append(Rule(p + "self_attn.qkv_proj.weight",
                          tuple(o + f"attention.{w}.weight" for w in ("wq", "wk", "wv")), "cat"))
    else:
        for hf, w in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv")):
            rules.append(Rule(p + f"self_attn.{hf}.weight", (o + f"attention.{w}.weight",)))
            if arch.qkv_bias:
                rules.append(Rule(p + f"self_attn.{hf}.bias", (o + f"attention.{w}.bias",)))
    rules.append(Rule(p + "self_attn.o_proj.weight", (o + "attention.wo.weight",)))
    if arch.o_bias:
        rules.append(Rule(p + "self_attn.o_proj.bias", (o + "attention.wo.bias",)))
    if arch.is_moe_layer(i) and disk:  # checkpoint files keep one tensor per expert (Hub and save_pretrained)
        m = arch.moe
        mixtral = arch.family == "mixtral"
        moe = p + ("block_sparse_moe." if mixtral else "mlp.")
        rules.append(Rule(moe + "gate.weight", (o + "mlp.router.weight",)))
        names = (("w1", "w1"), ("w3", "w3"), ("w2", "w2")) if mixtral else \
            (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
        for e in range(m.num_experts):
            for hf, w in names:
                rules.append(Rule(moe + f"experts.{e}.{hf}.weight", (o + f"mlp.experts.{e}.{w}.weight",)))
        if m.shared_ffn:
            for hf, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                rules.append(Rule(p + f"mlp.shared_expert.{hf}.weight", (o + f"mlp.shared_expert.{w}.weight",)))
            rules.append(Rule(p + "mlp.shared_expert_gate.weight", (o + "mlp.shared_expert_gate.weight",)))
    elif arch.is_moe_layer(i):  # transformers 5 modules: experts fused into 3-D tensors
        m = arch.moe
        rules.append(Rule(p + "mlp.gate.weight", (o + "mlp.router.weight",)))
        rules.append(Rule(p + "mlp.experts.gate_up_proj",
                          tuple(o + f"mlp.experts.{e}.{w}.weight" for e in range(m.num_experts) for w in ("w1", "w3")),
                          "stack_cat"))
        rules.append(Rule(p + "mlp.experts.down_proj",
                          tuple(o + f"mlp.experts.{e}.w2.weight" for e in range(m.num_experts)), "stack"))
        if m.shared_ffn:
            for hf, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                rules.append(Rule(p + f"mlp.shared_expert.{hf}.weight", (o + f"mlp.shared_expert.{w}.weight",)))
            rules.append(Rule(p + "mlp.shared_expert_gate.weight", (o + "mlp.shared_expert_gate.weight",)))
    elif arch.family == "phi3":
        rules.append(Rule(p + "mlp.gate_up_proj.weight", (o + "mlp.w1.weight", o + "mlp.w3.weight"), "cat"))
        rules.append(Rule(p + "mlp.down_proj.weight", (o + "mlp.w2.weight",)))
    else:
        for hf, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            rules.append(Rule(p + f"mlp.{hf}.weight", (o + f"mlp.{w}.weight",)))
            if arch.mlp_bias:
                rules.append(Rule(p + f"mlp.{hf}.bias", (o + f"mlp.{w}.bias",)))
    return rules


def _llama(arch: Arch, disk: bool) -> list[Rule]:
    rules = [Rule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
             Rule("model.norm.weight", ("norm.weight",))]
    for i in range(arch.num_layers):
        rules += _llama_layer(arch, i, disk)
    return rules


def _ln(hf: str, ours: str, arch: Arch) -> list[Rule]:
    if not arch.norm_affine:
        return []
    rules = [Rule(hf + ".weight", (ours + ".weight",))]
    return rules + [Rule(hf + ".bias", (ours + ".bias",))] if arch.norm_bias else rules


def _linear(hf: str, ours: str, bias: bool, kind: str = "copy") -> list[Rule]:
    rules = [Rule(hf + ".weight", (ours + ".weight",), kind)]
    return rules + [Rule(hf + ".bias", (ours + ".bias",))] if bias else rules


def _gpt2(arch: Arch) -> list[Rule]:
    rules = [Rule("transformer.wte.weight", ("tok_embeddings.weight",)),
             Rule("transformer.wpe.weight", ("pos_embeddings.weight",)), *_ln("transformer.ln_f", "norm", arch)]
    for i in range(arch.num_layers):
        p, o = f"transformer.h.{i}.", f"layers.{i}."
        rules += _ln(p + "ln_1", o + "attention_norm", arch) + _ln(p + "ln_2", o + "mlp_norm", arch)
        qkv = tuple(o + f"attention.{w}" for w in ("wq", "wk", "wv"))
        rules.append(Rule(p + "attn.c_attn.weight", tuple(n + ".weight" for n in qkv), "cat_t"))
        rules.append(Rule(p + "attn.c_attn.bias", tuple(n + ".bias" for n in qkv), "cat"))
        rules += _linear(p + "attn.c_proj", o + "attention.wo", True, "t")
        rules += _linear(p + "mlp.c_fc", o + "mlp.w1", True, "t")
        rules += _linear(p + "mlp.c_proj", o + "mlp.w2", True, "t")
    return rules


def _gpt_neox(arch: Arch) -> list[Rule]:
    rules = [Rule("gpt_neox.embed_in.weight", ("tok_embeddings.weight",)),
             *_ln("gpt_neox.final_layer_norm", "norm", arch)]
    for i in range(arch.num_layers):
        p, o = f"gpt_neox.layers.{i}.", f"layers.{i}."
        rules += _ln(p + "input_layernorm", o + "attention_norm", arch)
        rules += _ln(p + "post_attention_layernorm", o + "mlp_norm", arch)
        qkv = tuple(o + f"attention.{w}" for w in ("wq", "wk", "wv"))
        rules.append(Rule(p + "attention.query_key_value.weight", tuple(n + ".weight" for n in qkv), "heads3"))
        if arch.qkv_bias:
            rules.append(Rule(p + "attention.query_key_value.bias", tuple(n + ".bias" for n in qkv), "heads3"))
        rules += _linear(p + "attention.dense", o + "attention.wo", arch.o_bias)
        rules += _linear(p + "mlp.dense_h_to_4h", o + "mlp.w1", True)
        rules += _linear(p + "mlp.dense_4h_to_h", o + "mlp.w2", True)
    return rules


def _opt(arch: Arch) -> list[Rule]:
    d = "model.decoder."
    rules = [Rule(d + "embed_tokens.weight", ("tok_embeddings.weight",)),
             Rule(d + "embed_positions.weight", ("pos_embeddings.weight",))]
    if arch.final_norm:
        rules += _ln(d + "final_layer_norm", "norm", arch)
    for i in range(arch.num_layers):
        p, o = f"{d}layers.{i}.", f"layers.{i}."
        rules += _ln(p + "self_attn_layer_norm", o + "attention_norm", arch)
        rules += _ln(p + "final_layer_norm", o + "mlp_norm", arch)
        for hf, w in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("out_proj", "wo")):
            rules += _linear(p + f"self_attn.{hf}", o + f"attention.{w}", arch.qkv_bias)
        rules += _linear(p + "fc1", o + "mlp.w1", arch.mlp_bias) + _linear(p + "fc2", o + "mlp.w2", arch.mlp_bias)
    return rules


_FAMILY_RULES = {"gpt2": _gpt2, "gpt_neox": _gpt_neox, "opt": _opt}


def rules(arch: Arch, *, disk: bool = True) -> list[Rule]:
    """The family's rules. disk=True: the names in checkpoint files (what save_pretrained writes and the Hub
    holds); disk=False: the names of transformers' modules (state_dict), which differ for MoE experts only."""
    out = _FAMILY_RULES[arch.family](arch) if arch.family in _FAMILY_RULES else _llama(arch, disk)
    if not arch.tie_embeddings:  # GPT-NeoX files name the head embed_out (its module: lm_head)
        head = "embed_out.weight" if disk and arch.family == "gpt_neox" else "lm_head.weight"
        out.append(Rule(head, ("output.weight",)))
    return out


# ------------------------------------------------------------------------------------------ conversion


def join(rule: Rule, parts: list[torch.Tensor], arch: Arch) -> torch.Tensor:
    """Our tensors of `rule` -> the HF tensor."""
    k = rule.kind
    if k == "copy":
        return parts[0]
    if k == "t":
        return parts[0].t().contiguous()
    if k == "cat":
        return torch.cat(parts, 0)
    if k == "cat_t":
        return torch.cat(parts, 0).t().contiguous()
    if k == "heads3":
        nh = arch.num_heads
        return torch.stack([t.reshape(nh, -1, *t.shape[1:]) for t in parts], 1).reshape(-1, *parts[0].shape[1:])
    if k == "stack_cat":
        return torch.stack([torch.cat(parts[i : i + 2], 0) for i in range(0, len(parts), 2)])
    if k == "stack":
        return torch.stack(parts)
    raise ValueError(k)


def split(rule: Rule, t: torch.Tensor, shapes: list[torch.Size], arch: Arch) -> list[torch.Tensor]:
    """The HF tensor of `rule` -> our tensors (with the given shapes)."""
    k = rule.kind
    if k == "copy":
        return [t]
    if k == "t":
        return [t.t().contiguous()]
    if k in ("cat", "cat_t"):
        src = t.t() if k == "cat_t" else t
        return [c.contiguous() for c in src.split([s[0] for s in shapes], 0)]
    if k == "heads3":
        nh = arch.num_heads
        v = t.reshape(nh, 3, -1, *t.shape[1:])
        return [v[:, j].reshape(shapes[j]).contiguous() for j in range(3)]
    if k == "stack_cat":
        out = []
        for e in range(t.shape[0]):
            out += [c.contiguous() for c in t[e].split([shapes[2 * e][0], shapes[2 * e + 1][0]], 0)]
        return out
    if k == "stack":
        return [t[e].contiguous() for e in range(t.shape[0])]
    raise ValueError(k)


def to_hf(state: dict[str, torch.Tensor], arch: Arch, *, disk: bool = False) -> dict[str, torch.Tensor]:
    """Our full (unsharded) state dict -> HF tensors (tied head omitted, as transformers saves it); disk=False
    gives transformers' module names, disk=True the checkpoint files' names."""
    return {r.hf: join(r, [state[n] for n in r.ours], arch) for r in rules(arch, disk=disk)}


def from_hf(tensors: dict[str, torch.Tensor], arch: Arch, shapes: dict[str, torch.Size], *,
            disk: bool = False) -> dict[str, torch.Tensor]:
    """HF tensors -> our state dict. `shapes`: our parameter shapes (from a meta model)."""
    out: dict[str, torch.Tensor] = {}
    for r in rules(arch, disk=disk):
        out.update(zip(r.ours, split(r, tensors[r.hf], [shapes[n] for n in r.ours], arch), strict=True))
    return out


# ------------------------------------------------------------------------------------------- files


# Tensors that old checkpoints carry but that are buffers, not weights (GPT-2's causal-mask buffers, rotary
# inverse frequencies): skipped when reading.
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


class CheckpointFiles:
    """The safetensors files of a Hugging Face checkpoint directory (one file, or sharded with an index):
    tensor name -> file, opened lazily; `get_slice` reads only the requested rows/columns."""

    def __init__(self, directory) -> None:
        import json
        from pathlib import Path

        from autoplan.cost_models.errors import SpecError

        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.exists():
            self.where = {k: self.dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif single.exists():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                self.where = {k: single for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        else:
            raise SpecError(f"no safetensors weights in {self.dir}",
                            "expected model.safetensors or model.safetensors.index.json",
                            "save the model with save_pretrained(..., safe_serialization=True)")
        self.where = {k: v for k, v in self.where.items() if not k.endswith(_BUFFER_SUFFIXES)}
        self._open: dict = {}

    def _file(self, name: str):
        from safetensors import safe_open

        path = self.where[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def get_slice(self, name: str):
        return self._file(name).get_slice(name)


def check_names(files: CheckpointFiles, arch: Arch) -> None:
    """Every tensor the family needs is present and nothing else is (a mismatch is a different model)."""
    from autoplan.cost_models.errors import SpecError

    want = {r.hf for r in rules(arch)}
    have = set(files.where)
    if arch.tie_embeddings:
        have.discard("lm_head.weight")  # some tied checkpoints store the head anyway
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        raise SpecError(f"checkpoint {files.dir} does not match the {arch.family} model",
                        f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, unexpected "
                        f"{unexpected[:4]}{'...' if len(unexpected) > 4 else ''}",
                        "pass the directory saved for this config")


def load_full(directory, arch: Arch, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Our full state dict from a checkpoint directory (single process)."""
    files = CheckpointFiles(directory)
    check_names(files, arch)
    return from_hf({r.hf: files.get(r.hf) for r in rules(arch)}, arch, shapes, disk=True)


def save(state: dict[str, torch.Tensor], arch: Arch, directory, *, max_shard_bytes: int = 5 << 30) -> list:
    """Write HF safetensors (sharded with an index past max_shard_bytes) + config.json + generation_config.json."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in to_hf(state, arch, disk=True).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    written = []
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
        written.append(out / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata=meta)
            weight_map.update(dict.fromkeys(shard, name))
            written.append(out / name)
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        written.append(out / "model.safetensors.index.json")
    cfg = {k: v for k, v in arch.hf_config.items() if k not in ("transformers_version",)}
    dtypes = {v.dtype for v in tensors.values()}
    cfg["dtype"] = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    written.append(out / "config.json")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    if gen:
        (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
        written.append(out / "generation_config.json")
    return written


# ------------------------------------------------------------------------------------ sliced reading


def rule_index(arch: Arch) -> dict[str, tuple[Rule, int]]:
    """Our parameter name -> (its rule, its position among the rule's tensors); a tied head reads the embedding."""
    out = {n: (r, j) for r in rules(arch) for j, n in enumerate(r.ours)}
    if arch.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def read_box(files: CheckpointFiles, rule: Rule, j: int, shapes: list[torch.Size], offset: tuple[int, ...],
             size: tuple[int, ...], arch: Arch) -> torch.Tensor:
    """The box [offset, offset + size) of our tensor number j of `rule`, read from the HF file with
    safetensors' get_slice: only those rows/columns are read, never the whole tensor (nor the whole model)."""
    sl = files.get_slice(rule.hf)
    box = tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))
    k = rule.kind
    if k == "copy":
        return sl[box] if box else sl[:]
    if k == "t":
        return sl[box[1], box[0]].t().contiguous()
    if k in ("cat", "cat_t"):
        start = sum(s[0] for s in shapes[:j])
        rows = slice(start + box[0].start, start + box[0].stop)
        if k == "cat_t":  # HF (in, out): our rows are its columns
            return sl[box[1], rows].t().contiguous() if len(box) > 1 else sl[rows]
        return sl[(rows, *box[1:])]
    if k == "heads3":  # our row r of part j (head r // dh) is HF row (r // dh) * 3 dh + j dh + r % dh
        dh = arch.head_dim
        pieces, r = [], box[0].start
        while r < box[0].stop:
            head, within = divmod(r, dh)
            n = min(dh - within, box[0].stop - r)
            src = head * 3 * dh + j * dh + within
            pieces.append(sl[(slice(src, src + n), *box[1:])])
            r += n
        return torch.cat(pieces, 0)
    if k == "stack_cat":  # (E, 2F, h): our tensor j is expert j // 2, gate (even) or up (odd) rows
        e, half = divmod(j, 2)
        start = half * shapes[j][0]
        return sl[e, start + box[0].start : start + box[0].stop, box[1]]
    if k == "stack":
        return sl[(j, *box)]
    raise ValueError(k)
