"""Helpers of the inspect tests (a uniquely named module: `conftest` is ambiguous across test folders)."""

from __future__ import annotations

import argparse
import io

from rich.console import Console

from autoplan.inspect import export_megatron


def render(fn, *args, width: int = 80, **kw) -> str:
    """Run a render function into a string at `width` columns (no colour)."""
    buf = io.StringIO()
    con = Console(width=width, file=buf, color_system=None, force_terminal=False, highlight=False)
    fn(con, *args, **kw)
    return buf.getvalue()


def assert_fits_width(text: str, width: int = 80) -> None:
    long = [line for line in text.splitlines() if len(line.rstrip()) > width]
    assert not long, f"{len(long)} lines exceed {width} columns, e.g. {long[0]!r}"


def megatron_parser() -> argparse.ArgumentParser:
    """The subset of Megatron-LM's arguments (megatron/training/arguments.py) that export writes."""
    ap = argparse.ArgumentParser()
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                 "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                 "--context-parallel-size", "--expert-model-parallel-size", "--micro-batch-size",
                 "--global-batch-size", "--recompute-num-layers", "--num-layers", "--hidden-size",
                 "--num-attention-heads", "--ffn-hidden-size", "--seq-length", "--max-position-embeddings",
                 "--vocab-size", "--num-query-groups", "--kv-channels", "--num-experts", "--moe-router-topk",
                 "--moe-ffn-hidden-size", "--moe-layer-freq", "--rotary-base"):
        ap.add_argument(flag, type=int)
    for flag in ("--recompute-granularity", "--recompute-method", "--normalization", "--position-embedding-type",
                 "--pipeline-model-parallel-layout", "--fp8-format", "--ckpt-format", "--attention-backend",
                 "--moe-token-dispatcher-type", "--data-parallel-sharding-strategy"):
        ap.add_argument(flag)
    for flag in ("--hidden-dropout", "--attention-dropout", "--moe-expert-capacity-factor"):
        ap.add_argument(flag, type=float)
    for flag in ("--sequence-parallel", "--use-distributed-optimizer", "--bf16", "--fp16", "--use-flash-attn",
                 "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap", "--swiglu",
                 "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention",
                 "--accumulate-allreduce-grads-in-fp32", "--use-torch-fsdp2", "--squared-relu",
                 "--grad-reduce-in-bf16", "--use-megatron-fsdp", "--no-align-grad-reduce", "--no-overlap-p2p-communication",
                 "--cross-entropy-loss-fusion", "--no-gradient-accumulation-fusion",
                 "--moe-pad-expert-input-to-capacity"):
        ap.add_argument(flag, action="store_true")
    return ap


def parse(plan) -> argparse.Namespace:
    d = export_megatron(plan)
    return megatron_parser().parse_args(d["args"])  # unknown flags would make argparse exit


def vp_of(ns: argparse.Namespace) -> int:
    if ns.pipeline_model_parallel_layout:  # the layout string implies the virtual stage count
        return len(ns.pipeline_model_parallel_layout.split("|")) // ns.pipeline_model_parallel_size
    if ns.num_layers_per_virtual_pipeline_stage:
        return ns.num_layers // (ns.pipeline_model_parallel_size * ns.num_layers_per_virtual_pipeline_stage)
    return ns.num_virtual_stages_per_pipeline_rank or 1


def check_published(run: dict, plan) -> None:
    """The exported flags give back the published tp, pp, vp, micro-batch, global batch (and dp)."""
    ns = parse(plan)
    pub, batch = run["parallel"], run["batch"]
    tag = f"{run['model']['name']} on {plan.cluster.num_gpus}"
    assert ns.tensor_model_parallel_size == pub["tp"], tag
    assert ns.pipeline_model_parallel_size == pub["pp"], tag
    assert vp_of(ns) == (pub["vp"] or 1), tag
    if batch["micro"] is not None:
        assert ns.micro_batch_size == batch["micro"], tag
    assert ns.global_batch_size == batch["global"], tag
    dp = plan.cluster.num_gpus // (ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size)
    assert dp == pub["dp"], tag
    assert ns.num_layers == run["model"]["layers"] and ns.hidden_size == run["model"]["hidden"], tag
    if "SC21" in run["source"]:
        # "full (--activations-checkpoint-method uniform)", fp16
        assert (ns.recompute_granularity, ns.recompute_method) == ("full", "uniform"), tag
        assert ns.fp16 and not ns.bf16, tag
