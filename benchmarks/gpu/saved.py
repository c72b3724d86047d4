"""What one micro-batch keeps for backward under the runtime's mixed precision, by module and dtype.

    python benchmarks/gpu/saved.py MODEL SEQ [--dtype bf16|fp32] [--kernels fused|torch] [--device cuda]

Runs the zoo model's forward as the runtime does (fp32 parameters, `torch.autocast` around the forward:
runtime.parallelize.apply_mixed_precision) under a saved-tensor hook and counts every distinct storage autograd
keeps: the bf16 copies autocast makes of the weights (its cast cache, one per micro-batch), and the activations,
attributed to the module whose forward saved them (a block, the embedding, the head and loss), in bytes per token
per hidden unit (the units of the cost model's profiles). The cast-copy rule is the device's autocast policy, so
the numbers that matter are CUDA's; on the CPU it runs for testing this script.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch


def census(model_name: str, seq: int, mbs: int, dtype: str, kernels: str, device: str) -> dict:
    from autoplan.codegen.fuse import substitute_kernels
    from autoplan.specs import load_model
    from autoplan.zoo import build_model
    from autoplan.zoo.model import cross_entropy_loss

    spec = load_model(model_name)
    model = build_model(spec, device=device, dtype=torch.float32, seed=0)
    if kernels == "fused":
        substitute_kernels(model, "fused")
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    param_shapes = {tuple(sorted(p.shape)) for p in model.parameters()}  # a linear saves w or w.t()
    where: list[str] = ["top"]
    for name, mod in model.named_modules():
        if name.count(".") == 1 and name.startswith("layers.") or name in ("embed", "tok_embeddings", "norm", "head",
                                                                            "output", "lm_head", "final_norm"):
            mod.register_forward_pre_hook(lambda m, a, n=name: where.append(n) and None)
            mod.register_forward_hook(lambda m, a, o: where.pop() and None)  # a hook's return replaces the output
    seen: dict[int, tuple[str, str, int, bool]] = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in params or ptr in seen:
            return t
        # autocast's cast of a weight: a parameter's shape in the low precision (activations are (b, s, ...))
        is_weight_copy = t.dtype != torch.float32 and tuple(sorted(t.shape)) in param_shapes and t.dim() >= 1
        seen[ptr] = (where[-1], str(t.dtype).removeprefix("torch."), st.nbytes(), is_weight_copy)
        return t

    tokens = torch.randint(0, spec.vocab_size, (mbs, seq + 1), device=device)
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=dtype == "bf16")
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with amp:
            logits = model(tokens[:, :-1])
        where.append("loss")
        loss = cross_entropy_loss(logits, tokens[:, 1:])
        where.pop()
    del logits
    out = {"model": model_name, "seq": seq, "mbs": mbs, "dtype": dtype, "kernels": kernels, "device": device}
    if device == "cuda":
        torch.cuda.synchronize()
        out["allocated_after_forward_gib"] = (torch.cuda.memory_allocated() - base) / 2**30
        out["peak_forward_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        out["peak_step_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    tok, h, n = mbs * seq, spec.hidden_size, spec.num_layers
    by: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    weights = 0.0
    for site, dt, nbytes, is_weight in seen.values():
        if is_weight:
            weights += nbytes
            continue
        group = "block" if site.startswith("layers.") else site
        by[group][dt] += nbytes
    out["weight_copies_gib"] = weights / 2**30
    out["weight_copies_bytes_per_param"] = weights / sum(p.numel() for p in model.parameters())
    out["saved_bytes_per_token_h"] = {g: {dt: v / tok / h / (n if g == "block" else 1) for dt, v in d.items()}
                                      for g, d in by.items()}
    out["saved_gib"] = {g: sum(d.values()) / 2**30 for g, d in by.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("seq", type=int)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--kernels", default="torch", choices=["torch", "fused"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    print(json.dumps(census(a.model, a.seq, a.mbs, a.dtype, a.kernels, a.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
