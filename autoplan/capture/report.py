"""`autoplan inspect-model`: a rich tree of a ModelGraph's layers and a JSON summary. No torch needed."""

from __future__ import annotations

from typing import Any

from autoplan.cost_models.profile import LayerProfile

from .graph import LayerInfo, ModelGraph


def _si(x: float, unit: str = "") -> str:
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.2f}{suf}{unit}"
    return f"{x:.0f}{unit}"


def _bytes(x: float) -> str:
    for div, suf in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= div:
            return f"{x / div:.2f} {suf}"
    return f"{x:.0f} B"


def _act(p: LayerProfile, seq: int) -> float:
    """Saved activation bytes per token, no recomputation, unfused attention scores excluded (flash)."""
    return p.act_tp + p.act_seq


def _layer_entry(g: ModelGraph, info: LayerInfo, p: LayerProfile) -> dict[str, Any]:
    seq = g.seq
    d: dict[str, Any] = {
        "name": info.name,
        "kind": info.kind,
        "params": p.params,
        "flops_per_token": p.model_flops_per_token(seq),
        "act_bytes_per_token": _act(p, seq),
        "act_scores_bytes_per_token": p.act_scores_per_seq * seq,
        "ops": len(info.order),
        "gemms": [{"name": gm.name, "n": gm.n, "k": gm.k, "tp": gm.tp, "expert": gm.expert,
                   "tokens_per_token": gm.tokens_per_token, "count": gm.count} for gm in p.gemms],
    }
    if p.attention is not None:
        a = p.attention
        d["attention"] = {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "causal": a.causal,
                          "dropout": a.dropout}
    if p.moe_experts:
        d["moe"] = {"experts": p.moe_experts, "top_k": p.moe_top_k}
    if info.group is not None:
        d["group"] = info.group
    return d


def graph_summary_json(graph: ModelGraph) -> dict[str, Any]:
    """Machine-readable summary: `num_layers` (transformer blocks), `num_parameters`, `flops_per_token`
    (forward model FLOPs at `seq`), the repeated blocks, and one entry per layer."""
    infos = graph.layer_infos()
    return {
        "name": graph.name,
        "num_layers": graph.num_layers,
        "num_parameters": graph.num_parameters,
        "flops_per_token": graph.flops_per_token(),
        "seq_length": graph.seq,
        "capture": {"method": graph.method, "batch": graph.capture_batch, "seq": graph.capture_seq,
                    "dtype": graph.dtype, "ops": len(graph.ops)},
        "block_groups": [{"members": grp.members, "count": grp.count, "label": grp.label()}
                         for grp in graph.block_groups],
        "layers": [_layer_entry(graph, info, p) for info, p in zip(infos, graph.profiles)],
        "notes": list(graph.notes),
    }


def render_model_tree(graph: ModelGraph, console: Any) -> None:
    """Print the layer tree: params, FLOPs/token and saved activation bytes/token per layer, the repeated
    block shown once with its members' range and count, and totals."""
    from rich.tree import Tree

    seq = graph.seq
    title = (f"[bold]{graph.name}[/bold]  {graph.num_layers} blocks · {_si(graph.num_parameters)} params · "
             f"{_si(graph.flops_per_token())} FLOP/token fwd at seq {seq} "
             f"[dim](captured by {graph.method}, {graph.dtype}, {len(graph.ops)} ops)[/dim]")
    tree = Tree(title)
    infos = graph.layer_infos()
    by_name = dict(zip([i.name for i in infos], graph.profiles))

    def line(info: LayerInfo, p: LayerProfile, label: str) -> str:
        return (f"[cyan]{label}[/cyan]  params {_si(p.params)} · {_si(p.model_flops_per_token(seq))} FLOP/token"
                f" · act {_bytes(_act(p, seq))}/token")

    def add_parts(node: Any, info: LayerInfo, p: LayerProfile) -> None:
        for part, d in sorted(info.parts.items(), key=lambda kv: -kv[1]["params"] - kv[1]["model_flops"]):
            if d["params"] == 0 and d["model_flops"] == 0:
                continue
            node.add(f"{part}  params {_si(d['params'])}")
        for gm in p.gemms:
            extra = f" expert×{gm.count} top-{gm.tokens_per_token:g}" if gm.expert else ""
            extra += " (weight tied, held by an earlier layer)" if gm.count == 0 else ""
            node.add(f"[dim]gemm {gm.name} [{gm.n}×{gm.k}] tp={gm.tp}{extra}[/dim]")
        if p.attention is not None:
            a = p.attention
            node.add(f"[dim]attention heads={a.heads} kv_heads={a.kv_heads} head_dim={a.head_dim}"
                     f"{' causal' if a.causal else ''}{' dropout' if a.dropout else ''}[/dim]")

    for name in graph.pre:
        info = graph.layer(name)
        add_parts(tree.add(line(info, by_name[name], name)), info, by_name[name])
    shown: set[int] = set()
    for name in graph.blocks:
        info = graph.layer(name)
        gi = info.group
        if gi in shown:
            continue
        shown.add(gi)
        grp = graph.block_groups[gi]
        node = tree.add(line(info, by_name[name], grp.label()))
        add_parts(node, info, by_name[name])
    for name in graph.post:
        info = graph.layer(name)
        add_parts(tree.add(line(info, by_name[name], name)), info, by_name[name])
    tot_act = sum(_act(p, seq) for p in graph.profiles)
    tree.add(f"[bold]total[/bold]  params {_si(graph.num_parameters)} ({graph.num_parameters:,}) · "
             f"{_si(graph.flops_per_token())} FLOP/token fwd · act {_bytes(tot_act)}/token "
             f"(no recompute, flash attention)")
    for note in graph.notes:
        tree.add(f"[yellow]note:[/yellow] {note}")
    console.print(tree)
