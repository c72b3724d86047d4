"""Check an export with the target framework's own code, when that framework is importable.

`autoplan export --check` and the export tests use it: a Megatron-LM export goes through Megatron's
`parse_args` -> `validate_args` -> `core_transformer_config_from_args` (the same calls `pretrain_gpt.py`
makes before building the model); a torchtitan export is loaded by torchtitan's own config manager. Nothing
here imports a framework at module import time, so the planner stays light; a missing framework is a
`FrameworkUnavailable`, never a pass.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import typing


class FrameworkUnavailable(RuntimeError):
    """The framework (or the part of it the check needs) cannot be imported here."""


def _megatron_training():
    """Megatron-LM's `megatron.training.arguments` (a checkout on PYTHONPATH or $MEGATRON_LM; the
    megatron-core wheel does not ship `megatron.training`)."""
    root = os.environ.get("MEGATRON_LM")
    if root and root not in sys.path:
        sys.path.insert(0, root)
    if not hasattr(typing, "override"):
        # Megatron-LM >= 0.17 imports typing.override (Python 3.12); it is a no-op decorator.
        typing.override = lambda f: f  # type: ignore[attr-defined]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from megatron.training import arguments
            from megatron.training.argument_utils import core_transformer_config_from_args
    except ImportError as e:
        raise FrameworkUnavailable(f"megatron.training is not importable ({e}); put a Megatron-LM checkout on "
                                   "PYTHONPATH or set MEGATRON_LM") from None
    return arguments, core_transformer_config_from_args


def megatron_available() -> bool:
    try:
        _megatron_training()
    except FrameworkUnavailable:
        return False
    return True


@contextlib.contextmanager
def _as_on_gpu(arch_major: int, megatron: bool = True):
    """Answer the frameworks' questions about the machine as the target cluster would: whether there is a GPU
    and its compute capability (torch.cuda queries, which fail on a CPU build), and for Megatron whether
    Transformer Engine's fused RoPE is there (it is in every NVIDIA Megatron container). Nothing else is
    stubbed: every other check is the framework's own."""
    import types

    import torch

    saved = (torch.cuda.get_device_capability, torch.cuda.get_device_properties)
    torch.cuda.get_device_capability = lambda *a, **k: (arch_major, 0)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=arch_major, minor=0)
    rope_utils = rope_saved = float8 = f8_saved = None
    if not megatron:  # torchtitan asks through has_cuda_capability (torchtitan/tools/utils.py)
        from torchtitan.components.quantization import float8

        f8_saved = float8.has_cuda_capability
        float8.has_cuda_capability = lambda major, minor: (arch_major, 0) >= (major, minor)
    else:
        from megatron.core.models.common.embeddings import rope_utils

        rope_saved = rope_utils.fused_apply_rotary_pos_emb
        if rope_saved is None:
            rope_utils.fused_apply_rotary_pos_emb = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.get_device_capability, torch.cuda.get_device_properties = saved
        if float8 is not None:
            float8.has_cuda_capability = f8_saved
        if rope_utils is not None:
            rope_utils.fused_apply_rotary_pos_emb = rope_saved


@contextlib.contextmanager
def _megatron_launch(args: list[str], world_size: int, env: dict[str, str] | None, arch_major: int):
    """Megatron-LM's command line and environment as `pretrain_gpt.py` would see them; yields the sink for its
    output."""
    keys = ("WORLD_SIZE", "RANK", "CUDA_DEVICE_MAX_CONNECTIONS")
    old_argv, old_env = sys.argv, {k: os.environ.get(k) for k in keys}
    # A data source and an iteration count are the training script's business, not the plan's.
    sys.argv = ["pretrain_gpt.py", *args, "--tokenizer-type", "NullTokenizer", "--mock-data",
                "--train-iters", "10", "--lr", "1e-4"]
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", **(env or {}))
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), _as_on_gpu(arch_major):
            yield sink
    finally:
        sys.argv = old_argv
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_megatron(args: list[str], world_size: int, env: dict[str, str] | None = None,
                   arch_major: int = 9) -> str | None:
    """None when Megatron-LM accepts `args` for `world_size` ranks under the launch environment `env`, else
    the first line of its complaint."""
    arguments, to_config = _megatron_training()
    sink = None
    try:
        with _megatron_launch(args, world_size, env, arch_major) as sink:
            ns = arguments.parse_args()
            arguments.validate_args(ns)
            to_config(ns)
    except SystemExit:
        lines = [x for x in sink.getvalue().splitlines() if "error" in x.lower()]
        return (lines[-1] if lines else sink.getvalue().strip().splitlines()[-1]).strip()
    except Exception as e:  # noqa: BLE001 - Megatron validates with assert/ValueError/RuntimeError alike
        msg = str(e).strip().splitlines()
        return f"{type(e).__name__}: {msg[0] if msg else ''}"
    return None


def megatron_config(args: list[str], world_size: int, env: dict[str, str] | None = None, arch_major: int = 9):
    """Megatron-LM's validated arguments and the TransformerConfig it builds from them, for `args` (what
    `autoplan from-megatron` reads is checked against it). Raises what Megatron raises."""
    arguments, to_config = _megatron_training()
    with _megatron_launch(args, world_size, env, arch_major):
        ns = arguments.parse_args()
        arguments.validate_args(ns)
        return ns, to_config(ns)


def megatron_stage_layers(args: list[str], world_size: int, env: dict[str, str] | None = None,
                          arch_major: int = 9) -> list[int]:
    """The transformer layers Megatron-LM builds on each (virtual) stage for `args`, in model order (stage k on
    pipeline rank k mod pp), from its own get_num_layers_to_build. Raises what Megatron raises."""
    arguments, to_config = _megatron_training()
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    with _megatron_launch(args, world_size, env, arch_major):
        ns = arguments.parse_args()
        arguments.validate_args(ns)
        config = to_config(ns)
    pp = config.pipeline_model_parallel_size
    vp = config.virtual_pipeline_model_parallel_size or 1
    return [get_num_layers_to_build(config, vp_stage=(k // pp if vp > 1 else None), pp_rank=k % pp)
            for k in range(pp * vp)]


def _torchtitan_config_manager():
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from torchtitan.config.manager import ConfigManager
            from torchtitan.distributed import pipeline_parallel
            from torchtitan.distributed.parallel_dims import ParallelDims
    except ImportError as e:
        raise FrameworkUnavailable(f"torchtitan is not importable ({e}); pip install torchtitan") from None
    return ConfigManager, ParallelDims, pipeline_parallel


def torchtitan_available() -> bool:
    try:
        _torchtitan_config_manager()
    except FrameworkUnavailable:
        return False
    return True


def load_torchtitan_export(plan, workdir: str):
    """The `Trainer.Config` torchtitan's own ConfigManager builds from the 0.3 export (written to workdir)."""
    import importlib
    import logging

    from .export import export_torchtitan

    ConfigManager, _, _ = _torchtitan_config_manager()
    d = export_torchtitan(plan, "0.3")
    with open(os.path.join(workdir, d["module"] + ".py"), "w") as f:
        f.write(d["python"])
    sys.path.insert(0, workdir)
    logging.getLogger("torchtitan").setLevel(logging.ERROR)
    try:
        importlib.invalidate_caches()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return ConfigManager().parse_args(["--module", d["module"], "--config", "autoplan_config"])
    finally:
        sys.path.remove(workdir)
        sys.modules.pop(d["module"], None)


def check_torchtitan(plan) -> str | None:
    """None when torchtitan (>= 0.3) loads the export with its ConfigManager (tyro parse plus Trainer.Config's
    own checks), accepts the mesh (ParallelDims), splits the pipeline exactly as the plan does (its own
    _get_pipeline_metadata / _generate_llm_fqn_per_model_part) and can accumulate to the global batch; else
    what it objected to."""
    import tempfile
    import types

    _, ParallelDims, pp_mod = _torchtitan_config_manager()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            from .export import megatron_arch

            with _as_on_gpu(megatron_arch(plan), megatron=False):
                cfg = load_torchtitan_export(plan, tmp)
            par, tr = cfg.parallelism, cfg.training
            dims = ParallelDims.from_config(par, plan.cluster.num_gpus)
            if plan.model.name in _registered_titan_models():
                model_cfg = cfg.model_spec.model
            else:  # the user registers the plan's shape (a warning says so); count the plan's layers
                model_cfg = types.SimpleNamespace(layers=[None] * plan.model.num_layers)
            if len(model_cfg.layers) != plan.model.num_layers:
                return f"torchtitan's model has {len(model_cfg.layers)} layers, the plan {plan.model.num_layers}"
            if par.pipeline_parallel_degree > 1:
                nvs, nl, iw, ow = pp_mod._get_pipeline_metadata(dims, par, model_cfg)
                parts = par.module_fqns_per_model_part or pp_mod._generate_llm_fqn_per_model_part(nvs, nl, iw, ow)
                got = [sum(x.startswith("layers.") for x in p) for p in parts]
                want = [s.num_layers for s in plan.stages]
                if got != want:
                    return f"torchtitan splits the layers {got}, the plan {want}"
                if len(parts) % dims.pp:
                    return f"{len(parts)} stages do not divide over pp={dims.pp}"
            dp = dims.dp_replicate * dims.dp_shard
            if tr.global_batch_size % (tr.local_batch_size * dp):
                return (f"global_batch_size {tr.global_batch_size} is not a multiple of local_batch_size "
                        f"{tr.local_batch_size} x dp {dp}")
        except SystemExit as e:
            return f"torchtitan's config parser exited ({e.code})"
        except Exception as e:  # noqa: BLE001 - torchtitan validates with assert/ValueError alike
            msg = str(e).strip().splitlines()
            return f"{type(e).__name__}: {msg[0] if msg else ''}"
    return None


def _registered_titan_models() -> set[str]:
    from .export import _TITAN_CONFIGS

    return set(_TITAN_CONFIGS)


# Megatron-LM flag -> megatron.core TransformerConfig field, as megatron/training/argument_utils.py's
# core_transformer_config_from_args copies them (same names, with these renames).
_CORE_FIELDS = {
    "--num-layers": "num_layers", "--hidden-size": "hidden_size", "--num-attention-heads": "num_attention_heads",
    "--ffn-hidden-size": "ffn_hidden_size", "--num-query-groups": "num_query_groups", "--kv-channels": "kv_channels",
    "--tensor-model-parallel-size": "tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "pipeline_model_parallel_size",
    "--context-parallel-size": "context_parallel_size", "--expert-model-parallel-size": "expert_model_parallel_size",
    "--sequence-parallel": "sequence_parallel", "--num-experts": "num_moe_experts",
    "--moe-router-topk": "moe_router_topk", "--moe-ffn-hidden-size": "moe_ffn_hidden_size",
    "--moe-token-dispatcher-type": "moe_token_dispatcher_type",
    "--recompute-granularity": "recompute_granularity", "--recompute-method": "recompute_method",
    "--recompute-num-layers": "recompute_num_layers", "--bf16": "bf16", "--fp16": "fp16",
    "--decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
    "--decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
    "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size",
    "--normalization": "normalization", "--hidden-dropout": "hidden_dropout",
    "--attention-dropout": "attention_dropout", "--norm-epsilon": "layernorm_epsilon",
    "--add-qkv-bias": "add_qkv_bias", "--apply-layernorm-1p": "layernorm_zero_centered_gamma",
    "--moe-router-pre-softmax": "moe_router_pre_softmax",
    "--moe-shared-expert-intermediate-size": "moe_shared_expert_intermediate_size",
    "--moe-shared-expert-gate": "moe_shared_expert_gate",
}
# Flags whose value Megatron-LM's argparse types evaluate: a "(left,right)" tuple, a "[0,1,...]*k" list.
_CORE_EXPR_FIELDS = {"--window-size": "window_size", "--window-attn-skip-freq": "window_attn_skip_freq",
                     "--moe-layer-freq": "moe_layer_freq"}


def _literal(value: object) -> object:
    """A tuple or a per-layer list expression flag as the value Megatron's argument types produce (without eval)."""
    import ast

    from .export_numerics import pattern_bits

    if not isinstance(value, str):
        return value
    bits = pattern_bits(value)
    if bits is not None:
        return bits
    out = ast.literal_eval(value)
    return list(out) if isinstance(out, list) else out


def check_megatron_core(export: dict) -> str | None:
    """The part of the Megatron check the megatron-core wheel can run: the export's flags become a
    `TransformerConfig` (whose __post_init__ validates parallel sizes, MoE, recomputation and the pipeline
    layout) and the layout string is parsed by `PipelineParallelLayerLayout`. Needs only `pip install
    megatron-core`; the full parse_args/validate_args check needs Megatron-LM (check_megatron)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            import torch
            import torch.nn.functional as F
            from megatron.core.transformer import TransformerConfig
            from megatron.core.transformer.enums import AttnBackend
            from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    except ImportError as e:
        raise FrameworkUnavailable(f"megatron.core is not importable ({e}); pip install megatron-core") from None
    flags = export["flags"]
    kw: dict = {field: flags[flag] for flag, field in _CORE_FIELDS.items() if flag in flags}
    kw.update({field: _literal(flags[flag]) for flag, field in _CORE_EXPR_FIELDS.items() if flag in flags})
    pp = flags["--pipeline-model-parallel-size"]
    if "--num-layers-per-virtual-pipeline-stage" in flags:
        kw["virtual_pipeline_model_parallel_size"] = flags["--num-layers"] // (
            pp * flags["--num-layers-per-virtual-pipeline-stage"])
    if "--swiglu" in flags:
        kw.update(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    if "--disable-bias-linear" in flags:
        kw["add_bias_linear"] = False
    if "--attention-backend" in flags:
        kw["attention_backend"] = AttnBackend[flags["--attention-backend"]]
    if pp > 1:
        kw["pipeline_dtype"] = torch.bfloat16 if flags.get("--bf16") else (
            torch.float16 if flags.get("--fp16") else torch.float32)
    if kw.get("moe_ffn_hidden_size") is None and "num_moe_experts" in kw:
        kw["moe_ffn_hidden_size"] = kw.get("ffn_hidden_size")
    try:
        layout = flags.get("--pipeline-model-parallel-layout")
        if layout is not None:
            parsed = PipelineParallelLayerLayout(layout, pp)
            kw["pipeline_model_parallel_layout"] = parsed
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                TransformerConfig(**kw)
    except Exception as e:  # noqa: BLE001 - megatron.core validates with assert/ValueError alike
        msg = str(e).strip().splitlines()
        return f"{type(e).__name__}: {msg[0] if msg else ''}"
    return None
