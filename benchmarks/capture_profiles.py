"""Dump what `autoplan.capture.analyze` derives for every zoo preset and every test model, as one JSON file.

    python benchmarks/capture_profiles.py OUT.json [preset ...]

Why: the analysis has no reference but itself, so a refactor of analyze.py is checked by dumping with the old code
and the new and comparing the files byte for byte (`cmp`). Dumped per capture: every LayerProfile (all fields),
the graph's parameter count, notes, blocks and block groups, each op's kind, FLOPs, bytes and layer, each layer's
parts, signature and group, and the layer edges with their bytes. A capture that fails is dumped as its error.
Takes several minutes (the large presets are exported on the meta device).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the test models (tests/capture/_models.py): (label, factory name or constructor, tokens shape)
FACTORIES = ["tiny_lm", "split_lm", "split_lm4", "hard_heads_lm", "mixed_core_lm", "explicit_core_lm", "softcap_lm",
             "functional_head_lm", "pad_mask_lm", "tied_lm", "root_scale_lm", "hf_llama", "hf_llama_meta"]
CLASSES = [("ExpertLM", {}, (2, 8)), ("SplitLM", {"mixed": True}, (2, 16))]


def dump(g) -> dict:
    return {
        "profiles": [p.model_dump() for p in g.profiles],
        "num_parameters": g.num_parameters, "notes": g.notes, "dtype": g.dtype, "blocks": g.blocks,
        "groups": [(b.members, b.signature) for b in g.block_groups],
        "ops": {n: [o.kind, o.flops, o.bytes_read, o.bytes_written, o.param_bytes, o.layer, o.token_dependent,
                    o.requires_grad] for n, o in g.ops.items()},
        "layers": {n: [d["info"].parts, d["info"].params, d["info"].flops, d["info"].model_flops,
                       d["info"].signature, d["info"].group, d["info"].param_names]
                   for n, d in g.layers.nodes(data=True)},
        "edges": sorted((a, b, d["bytes"], sorted(d["tensors"])) for a, b, d in g.layers.edges(data=True)),
    }


def _attempt(out: dict, key: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        out[key] = dump(fn())
    except Exception as e:  # a capture that fails (on purpose, in the tests) is part of the record
        out[key] = f"error {type(e).__name__}: {e}"
    print(f"{key} {time.perf_counter() - t0:.1f}s", file=sys.stderr)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "capture"))
    import _models

    from autoplan.capture import capture, capture_spec
    from autoplan.presets import MODEL_PRESETS

    out: dict = {}
    for name in argv[1:] or sorted(MODEL_PRESETS):
        _attempt(out, f"spec:{name}", lambda name=name: capture_spec(name))
    if len(argv) == 1:
        for fname in FACTORIES:
            _attempt(out, f"model:{fname}", lambda f=getattr(_models, fname): capture(*f()))
        for cls, kw, shape in CLASSES:
            def build(cls=cls, kw=kw, shape=shape):
                with torch.device("meta"):
                    m = getattr(_models, cls)(**kw)
                return capture(m, (torch.zeros(*shape, dtype=torch.long, device="meta"),))
            _attempt(out, f"model:{cls}{kw or ''}", build)
    Path(argv[0]).write_text(json.dumps(out, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
