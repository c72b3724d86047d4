"""Read a torchtitan job config (the TOML of torchtitan 0.1-0.2, `train_configs/*.toml`) into autoplan's terms.

The inverse of `autoplan export --format torchtitan --torchtitan-version 0.2`, as `from-megatron` is of the Megatron
export: a user with a torchtitan config asks what autoplan predicts for exactly that run. Each section is read as
torchtitan 0.2.2 reads it (torchtitan/config/job_config.py defaults where a key is absent): the data-parallel
degrees (-1: the rest of the world), FSDP2's resharding ("default": reshard after forward unless pipelining), the
pipeline's stages (`module_fqns_per_model_part`, else `generate_llm_fqn_per_model_part` with the first / last stage
one block lighter), the activation checkpointing (full, per-op selective, every n-th layer, early stop), the
Float8 converter and torch.compile. torchtitan 0.3 configs are Python modules: never run here, refused.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

from pydantic import ValidationError

from autoplan.cost_models.errors import ConfigError, SpecError
from autoplan.cost_models.layout import normalize
from autoplan.cost_models.specs import ParallelConfig

from .megatron_import import MegatronRun

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (pyproject: tomli there)
    import tomli as tomllib

# torchtitan model (name, flavor) -> autoplan preset (the inverse of export._TITAN_CONFIGS)
_PRESETS = {("llama3", "8B"): "llama3-8b", ("llama3", "70B"): "llama3-70b", ("llama3", "405B"): "llama3-405b"}
_SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved"}
_SINGLE_STAGE = {"1F1B", "GPipe"}  # torch's PipelineScheduleSingle subclasses among those read
# What is read, per section; every other key is listed as not read (priced as if absent), but for _QUIET_KEYS
_READ = {
    "model": {"name", "flavor", "converters"},
    "training": {"local_batch_size", "batch_size", "global_batch_size", "seq_len", "mixed_precision_param",
                 "mixed_precision_reduce", "compile"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "enable_async_tensor_parallel", "pipeline_parallel_degree",
                    "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_layers_per_stage", "module_fqns_per_model_part",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "context_parallel_degree", "expert_parallel_degree", "enable_compiled_autograd"},
    "activation_checkpoint": {"mode", "selective_ac_option", "early_stop"},
    "compile": {"enable", "components", "backend"},
}
# Keys of read sections that change nothing a step's cost is made of (paths, data, the run's length, clipping)
_QUIET_KEYS = {"model": {"hf_assets_path", "tokenizer_path"},
               "training": {"steps", "dataset", "dataset_path", "max_norm"}}
# Sections that change nothing a step's cost is made of (logging, checkpoints, data, the optimizer's numerics)
_QUIET = {"job", "profiling", "metrics", "optimizer", "lr_scheduler", "checkpoint", "validation", "comm",
          "fault_tolerance", "experimental", "memory_estimation", "debug", "dataloader"}


def load_titan(path: str | Path, sets: list[str] | None = None) -> dict:
    """The TOML at `path` with `sets` (`parallelism.tensor_parallel_degree=8`, torchtitan's own override form
    without the dashes) applied; a Python config (torchtitan 0.3) is refused, never run."""
    p = Path(path)
    if p.suffix == ".py":
        raise SpecError("torchtitan 0.3 configs are Python modules, which autoplan never runs", f"{path}",
                        "pass a TOML job config (torchtitan 0.1-0.2), or the same settings with `autoplan estimate "
                        "--stack torchtitan`")
    try:
        cfg = tomllib.loads(p.read_text())
    except OSError as e:
        raise SpecError("cannot read the torchtitan config", f"{path}: {e.strerror}",
                        "pass an existing TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SpecError("the torchtitan config is not valid TOML", f"{path}: {e}", "fix the TOML") from None
    if not isinstance(cfg.get("model"), dict) and not isinstance(cfg.get("parallelism"), dict):
        raise SpecError("not a torchtitan job config", f"{path} has neither [model] nor [parallelism]",
                        "pass a torchtitan train_configs/*.toml")
    for item in sets or []:
        key, sep, raw = item.partition("=")
        section, dot, leaf = key.strip().lstrip("-").partition(".")
        if not sep or not dot or not leaf:
            raise ConfigError("--set takes SECTION.KEY=VALUE", f"got {item!r}",
                              "write e.g. --set parallelism.tensor_parallel_degree=8")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()  # a bare word: a string, as torchtitan's CLI takes it
        cfg.setdefault(section, {})[leaf] = value
    return cfg


def _table(cfg: dict, name: str) -> dict:
    """Section `name` of the config ({} where absent); one that is not a table is refused naming it."""
    sec = cfg.get(name, {})
    if not isinstance(sec, dict):
        raise ConfigError(f"[{name}] must be a table in a torchtitan config", f"{name} = {sec!r}",
                          f"write it as a [{name}] section")
    return sec


def _int(sec: dict, key: str, default: int, where: str) -> int:
    v = sec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where}.{key} takes an integer", f"got {v!r}", f"write {key} = N")
    return v


def stage_modules(num_stages: int, num_layers: int, first_less: int = 1, last_less: int = 1) -> list[list[str]]:
    """torchtitan's default split (generate_llm_fqn_per_model_part at v0.2.2): the embedding counts as `first_less`
    blocks and the norm + output as `last_less`, the effective blocks are split evenly with the remainder on the
    first stages, and each end stage holds that many blocks fewer."""
    if num_stages == 1:
        return [["tok_embeddings", *[f"layers.{i}" for i in range(num_layers)], "norm", "output"]]
    effective = num_layers + first_less + last_less
    per, extra = divmod(effective, num_stages)
    if per == 0 or first_less > per or last_less > per:
        raise ConfigError("torchtitan refuses this pipeline split", f"{num_stages} stages over {num_layers} blocks "
                          f"(+{first_less} for the embedding, +{last_less} for the output)",
                          "use fewer stages or set pipeline_parallel_first/last_stage_less_layers")
    out, layer = [], 0
    for k in range(num_stages):
        n = per + (1 if k < extra else 0) - (first_less if k == 0 else last_less if k == num_stages - 1 else 0)
        blocks = [f"layers.{i}" for i in range(layer, min(layer + n, num_layers))]
        layer += len(blocks)
        out.append((["tok_embeddings"] if k == 0 else []) + blocks + (["norm", "output"] if k == num_stages - 1 else []))
    return out


def _layout(parts: list[list[str]], num_layers: int) -> str:
    """The stages' module lists as autoplan's layout string (E, t*N, L; | between stages, in model order)."""
    seen: list[int] = []
    stages = []
    for p in parts:
        blocks = [int(m.split(".")[1]) for m in p if re.fullmatch(r"layers\.\d+", m)]
        seen += blocks
        stages.append(("E" if "tok_embeddings" in p else "") + (f"t*{len(blocks)}" if blocks else "")
                      + ("L" if "output" in p else ""))
    if seen != list(range(num_layers)):
        raise ConfigError("module_fqns_per_model_part must place every block once, in order",
                          f"blocks {seen[:8]}{'...' if len(seen) > 8 else ''} of {num_layers}",
                          "list layers.0 ... layers.N-1 across the stages in order")
    return normalize("|".join(stages))


def _layer_sac(n: int, parts: list[list[str]], pp: int) -> int:
    """The blocks torchtitan 0.2's layer-selective AC checkpoints on each pipeline rank (`export.titan_sac_counts`,
    stage k on rank k mod pp): each rank's count must be the same to be one recompute_layers."""
    from .export import titan_sac_counts

    chunks = [(k % pp, sum(1 for m in p if m.startswith("layers."))) for k, p in enumerate(parts)]
    per_rank: dict[int, int] = {}
    for (rank, _), count in zip(chunks, titan_sac_counts(n, chunks), strict=True):
        per_rank[rank] = per_rank.get(rank, 0) + count
    if len(set(per_rank.values())) != 1:
        raise ConfigError("layer-selective AC checkpoints a different number of blocks on each pipeline rank",
                          f"selective_ac_option {n}: " + ", ".join(f"rank {r}: {v}" for r, v in per_rank.items()),
                          "autoplan prices one count per rank: pick an n that divides every rank's blocks")
    return next(iter(per_rank.values()))


def read_titan(cfg: dict, gpus: int, num_layers: int | None = None) -> tuple[MegatronRun, str | None]:
    """A torchtitan job config on `gpus` GPUs in autoplan's terms, and the model preset its [model] names (None:
    no preset; `num_layers`, from --model, places the pipeline stages then)."""
    notes: list[str] = []
    model = _table(cfg, "model")
    name, flavor = model.get("name", "llama3"), str(model.get("flavor", "debugmodel"))
    preset = _PRESETS.get((name, flavor))
    if preset is not None:
        from autoplan.specs import load_model

        num_layers = num_layers or load_model(preset).num_layers
    tr, par = _table(cfg, "training"), _table(cfg, "parallelism")
    ac, comp = _table(cfg, "activation_checkpoint"), _table(cfg, "compile")
    rep = _int(par, "data_parallel_replicate_degree", 1, "parallelism")
    tp = _int(par, "tensor_parallel_degree", 1, "parallelism")
    pp = _int(par, "pipeline_parallel_degree", 1, "parallelism")
    cp = _int(par, "context_parallel_degree", 1, "parallelism")
    ep = _int(par, "expert_parallel_degree", 1, "parallelism")
    shard = _int(par, "data_parallel_shard_degree", -1, "parallelism")
    if shard == -1:  # torchtitan: the rest of the world
        if gpus % (rep * tp * pp * cp):
            raise ConfigError("the GPUs do not divide into the config's degrees", f"{gpus} GPUs, replicate {rep} x "
                              f"tp {tp} x pp {pp} x cp {cp}", "pass --gpus a multiple of their product")
        shard = gpus // (rep * tp * pp * cp)
    if rep > 1 and shard > 1:
        raise ConfigError("HSDP (replicate and shard degrees both above 1) is not expressible",
                          f"data_parallel_replicate_degree {rep}, data_parallel_shard_degree {shard}",
                          "price it as FSDP over all of them: --set parallelism.data_parallel_replicate_degree=1")
    dp = rep * shard
    reshard = str(par.get("fsdp_reshard_after_forward", "default"))
    if reshard not in ("default", "always", "never"):
        raise ConfigError("unknown parallelism.fsdp_reshard_after_forward", f"got {reshard!r}",
                          "use default, always or never")
    zero = 0 if shard == 1 else 3 if reshard == "always" or (reshard == "default" and pp == 1) else 2
    sched_name = str(par.get("pipeline_parallel_schedule", "1F1B"))
    if pp > 1 and sched_name not in _SCHEDULES:
        raise ConfigError("pipeline schedule autoplan does not price", f"{sched_name}",
                          "use 1F1B, GPipe or Interleaved1F1B")
    local = _int(tr, "local_batch_size", _int(tr, "batch_size", 8, "training"), "training")
    glob = _int(tr, "global_batch_size", -1, "training")
    global_batch = glob if glob > 0 else local * dp
    mbs = _int(par, "pipeline_parallel_microbatch_size", 1, "parallelism") if pp > 1 else local
    layout, vp = None, 1
    parts: list[list[str]] = [[]]
    if pp > 1:
        if num_layers is None:
            raise ConfigError("the pipeline's stages need the model's block count",
                              f"model {name} {flavor} has no autoplan preset", "pass --model PRESET or FILE")
        parts = par.get("module_fqns_per_model_part")
        if parts is None:
            first, last = (_int(par, f"pipeline_parallel_{k}_stage_less_layers", 1, "parallelism")
                           for k in ("first", "last"))
            per = par.get("pipeline_parallel_layers_per_stage")
            stages = pp * (1 if sched_name in _SINGLE_STAGE else 2) if per is None else \
                math.ceil((num_layers + first + last) / int(per))
            parts = stage_modules(stages, num_layers, first, last)
        if len(parts) % pp:
            raise ConfigError("the pipeline stages do not divide over the ranks", f"{len(parts)} stages, pp={pp}",
                              "torchtitan refuses it too: adjust the stages")
        vp = len(parts) // pp
        if sched_name in _SINGLE_STAGE and vp != 1:
            raise ConfigError(f"{sched_name} runs one stage per rank", f"{len(parts)} stages on pp={pp}",
                              "use Interleaved1F1B, or one stage per rank")
        layout = _layout(parts, num_layers)
    mode = str(ac.get("mode", "selective"))
    option = str(ac.get("selective_ac_option", "2"))
    recompute: dict[str, object] = {}
    if mode == "full":
        recompute = {"recompute": "full"}
    elif mode == "selective" and option == "op":
        recompute = {"recompute": "selective"}
    elif mode == "selective" and option.isdigit() and int(option) >= 1:
        n = int(option)
        if n == 1:
            recompute = {"recompute": "full"}
        else:
            if num_layers is None:
                raise ConfigError("layer-selective AC needs the model's block count",
                                  f"model {name} {flavor} has no autoplan preset", "pass --model PRESET or FILE")
            if pp == 1:
                parts = [[f"layers.{i}" for i in range(num_layers)]]
            k = _layer_sac(n, parts, pp)
            recompute = {"recompute": "full", "recompute_layers": k} if k else {}
            notes.append(f"selective_ac_option {n}: every {n}th block checkpointed whole ({k} per rank), the others "
                         "plain")
    elif mode != "none":
        raise ConfigError("activation_checkpoint mode autoplan does not price", f"mode {mode!r}, option {option!r}",
                          "use none, full, or selective with op or an integer")
    converters = [str(c) for c in model.get("converters", [])]
    dtype = "fp32" if tr.get("mixed_precision_param", "bfloat16") == "float32" else "bf16"
    if any(c in ("float8", "quantize.linear.float8") for c in converters):
        dtype = "fp8"
    for c in converters:
        if c not in ("float8", "quantize.linear.float8"):
            notes.append(f"model converter {c!r} is not priced")
    f8 = ((cfg.get("quantize") or {}).get("linear") or {}).get("float8") or cfg.get("float8") or {}
    if dtype == "fp8" and f8.get("enable_fsdp_float8_all_gather"):
        notes.append("enable_fsdp_float8_all_gather: FSDP2 gathers the Float8 linears' weights in fp8, priced as "
                     "16-bit gathers (more gather traffic than runs)")
    compiled = bool(comp.get("enable", tr.get("compile", False))) and "model" in comp.get("components", ["model"])
    knobs: dict[str, object] = {"kernels": "fused" if compiled else "torch",
                                "tp_comm_overlap": bool(par.get("enable_async_tensor_parallel", False)) and tp > 1,
                                "checkpoint_early_stop": bool(ac.get("early_stop", False))}
    if knobs["tp_comm_overlap"] and not compiled:
        notes.append("enable_async_tensor_parallel without compile: torchtitan 0.2 runs async TP through "
                     "torch.compile only; priced as asked")
    if layout is not None:
        knobs["uneven_stages"] = True
    try:
        parallel = ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, vp=vp, mbs=mbs, sp=tp > 1, zero=zero,
                                  schedule=_SCHEDULES.get(sched_name, "1f1b") if pp > 1 else "1f1b", layout=layout,
                                  **recompute)
    except ValidationError as e:
        first = e.errors()[0]
        raise ConfigError("the torchtitan config gives an invalid configuration",
                          f"{first['loc'][0] if first['loc'] else ''}: {first['msg'].lower()}",
                          "correct the [parallelism] or [activation_checkpoint] value") from None
    if tp > 1:
        notes.append("sequence parallelism with tp: torchtitan 0.2 always shards the norms' sequence with TP")
    unpriced = sorted(f"{s}.{k}" for s, sec in cfg.items() if isinstance(sec, dict) and s in _READ
                      for k in sec if k not in _READ[s] and k not in _QUIET_KEYS.get(s, ()))
    unpriced += sorted(s for s in cfg if s not in _READ and s not in _QUIET and s not in ("float8", "quantize"))
    if preset is None:
        notes.append(f"model {name} {flavor}: no autoplan preset (the llama3 8B / 70B / 405B flavours have one)")
    run = MegatronRun(parallel=parallel, seq_len=_int(tr, "seq_len", 2048, "training"), dtype=dtype,
                      stack_set=knobs, global_batch=global_batch, model=None, gpus=gpus, notes=notes,
                      unpriced=unpriced)
    return run, preset
