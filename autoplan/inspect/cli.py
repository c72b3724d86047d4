"""CLI commands: show, compare, explain, trace, export, from-megatron, from-nemo, scaling (registered by
autoplan/cli.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli import add_json, add_stack_args, add_workload_args, console, load_workload, print_json


def _plan(path: str):
    from ..plan import load_plan

    return load_plan(path)


def restack(plan, args: argparse.Namespace):
    """The plan predicted under the stack of --stack/--stack-set (same configuration and stage layout), or the
    plan itself when neither is given."""
    from ..api import prediction_of
    from ..cli import stack_label_of, stack_of
    from ..cost_models.stacks import apply_stack
    from .common import reestimate

    name, overrides = stack_of(args)
    if name is None and not overrides:
        return plan
    training = apply_stack(plan.training, name or (plan.stack or "autoplan").split("+")[0], overrides)
    plan = plan.model_copy(update={"training": training, "stack": stack_label_of(args)})
    est = reestimate(plan)
    stages = [s.model_copy(update={"forward_s": e.fwd_s, "backward_s": e.bwd_s})
              for s, e in zip(plan.stages, est.stages, strict=True)]
    return plan.model_copy(update={"prediction": prediction_of(est), "stages": stages}).sealed()


def cmd_show(args: argparse.Namespace) -> int:
    from .show import render_show, show_json

    plan = restack(_plan(args.plan), args)
    if args.json:
        d = show_json(plan, timeline=args.timeline)
        if args.timeline and args.microbatches:
            from .show import timeline_grid

            d["timeline"] = timeline_grid(plan, args.microbatches)
        print_json(d)
    else:
        render_show(console(), plan, timeline=args.timeline, max_microbatches=args.microbatches)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .compare import compare_json, render_compare

    a, b = _plan(args.a), _plan(args.b)
    if args.json:
        print_json(compare_json(a, b))
    else:
        render_compare(console(), a, b)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .explain import explain_json, render_explain, render_why_not, why_not

    plan = _plan(args.plan)
    if args.why_not:
        if args.json:
            print_json(why_not(plan, args.why_not))
        else:
            render_why_not(console(), plan, args.why_not)
        return 0
    if args.json:
        print_json(explain_json(plan))
    else:
        render_explain(console(), plan)
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from .trace import slice_counts, trace_events

    plan = _plan(args.plan)
    trace = trace_events(plan)
    out = Path(args.output)
    out.write_text(json.dumps(trace, separators=(",", ":")))
    counts = slice_counts(trace)
    summary = {"output": str(out), "events": len(trace["traceEvents"]),
               "step_time_s": trace["otherData"]["step_time_s"],
               "slices_per_rank": {str(k): v for k, v in sorted(counts.items())}}
    if args.plot:
        from .plots import plot_schedule

        summary["plot"] = str(plot_schedule(plan, args.plot))
    if args.json:
        print_json(summary)
    else:
        con = console()
        con.print(f"wrote {out}: {summary['events']} events, {len(counts)} pipeline rank(s), "
                  f"step {summary['step_time_s']:.3f} s")
        con.print("open it in https://ui.perfetto.dev or chrome://tracing")
    return 0


def _check_export(plan, d: dict, fmt: str) -> str:
    """'accepted by ...', 'refused by ...: why' or 'not checked: ...' (the framework is not importable)."""
    from . import export_check as ec
    from .export import megatron_arch

    try:
        if fmt == "megatron":
            try:
                err, who = ec.check_megatron(d["args"], plan.cluster.num_gpus, d["env"], megatron_arch(plan)), \
                    "Megatron-LM validate_args"
            except ec.FrameworkUnavailable:
                err, who = ec.check_megatron_core(d), "megatron.core TransformerConfig"
        elif d["version"] != "0.3":
            return "not checked: only torchtitan >= 0.3 can be loaded here"
        else:
            err, who = ec.check_torchtitan(plan), "torchtitan ConfigManager"
    except ec.FrameworkUnavailable as e:
        return f"not checked: {e}"
    return f"accepted by {who}" if err is None else f"refused by {who}: {err}"


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_megatron, export_torchtitan

    plan = _plan(args.plan)
    if args.format == "megatron":
        d = export_megatron(plan)
        text = d["command"] + "\n"
    else:
        d = export_torchtitan(plan, args.torchtitan_version)
        text = d["text"]
    if args.check:
        d["check"] = _check_export(plan, d, args.format)
    if args.output:
        Path(args.output).write_text(text)
    if args.json:
        print_json(d)
    else:
        if not args.output:
            sys.stdout.write(text)
        else:
            print(f"wrote {args.output}")
    for w in d["warnings"]:
        print(f"autoplan: warning: {w}", file=sys.stderr)
    if args.check:
        print(f"autoplan: check: {d['check']}", file=sys.stderr)
        if d["check"].startswith("refused"):
            return 1
    return 0


def _gpu_list(text: str) -> list[int]:
    from autoplan.cost_models.errors import SpecError

    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise SpecError("--gpus takes a comma-separated list of GPU counts", f"got {text!r}",
                        "write e.g. --gpus 64,128,256") from None
    if not out or any(n <= 0 for n in out):
        raise SpecError("--gpus takes positive GPU counts", f"got {text!r}", "write e.g. --gpus 64,128,256")
    return out


def cmd_scaling(args: argparse.Namespace) -> int:
    from .scaling import plot_scaling, render_scaling, scaling_rows

    sizes = _gpu_list(args.gpus)
    ns = argparse.Namespace(**{**vars(args), "gpus": None})
    model, cluster, training, profiles = load_workload(ns)
    kw: dict = {"kernels": args.kernels}
    if profiles is not None:
        kw["profiles"] = profiles
    rows = scaling_rows(model, cluster, training, sizes, fix=args.fix or None, **kw)
    from ..cli import stack_label_of

    stack = stack_label_of(args)  # None: the default stack
    title = (f"{model.name} on {cluster.name}, batch {training.global_batch_size} x {training.seq_length}, "
             f"stack {stack or 'autoplan'}")
    if args.plot:
        plot_scaling(rows, args.plot, title=title)
    if args.json:
        print_json({"model": model.name, "cluster": cluster.name, "global_batch_size": training.global_batch_size,
                    "seq_length": training.seq_length, "stack": stack, "rows": rows, "plot": args.plot})
    else:
        con = console()
        render_scaling(con, rows, title=title)
        if args.plot:
            con.print(f"wrote {args.plot}")
    return 0


def _script_text(path: str) -> str:
    """A launch script's text, or a one-line error that names the file."""
    from ..cost_models.errors import SpecError

    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError("cannot read the launch script", f"{path}: {e.strerror if isinstance(e, OSError) else e}",
                        "pass the path of a readable shell script") from None


def cmd_from_megatron(args: argparse.Namespace) -> int:
    """Estimate a Megatron-LM command line as it stands: its flags read into a model, a parallel configuration and
    stack knobs (`megatron_import.read_megatron`), then `autoplan estimate` with them."""
    import os

    from ..cost_models.errors import ConfigError
    from .launch_script import read_script
    from .megatron_import import read_megatron

    script = read_script(_script_text(args.script), os.environ, path=args.script, cwd=os.getcwd()) \
        if args.script else None
    tokens = [*(script.words if script else []), *(getattr(args, "extra_args", None) or [])]
    if not tokens:
        raise ConfigError("no Megatron flags given", "nothing after -- and no --script",
                          "pass the flags after --, or the launch script with --script FILE")
    from ..workload import resolve_model

    run = read_megatron(tokens, resolve_model(args.model)[0] if args.model else None,
                        files=script.files if script else None)
    if args.stack is None:
        args.stack = run.stack or "megatron-core"
        if run.stack:
            run.notes.insert(0, f"--deepspeed: Megatron-DeepSpeed, priced on the {run.stack} stack (--stack chooses "
                                "another)")
    if script is not None:
        run.notes[:0] = [f"--script {args.script}: {n}" for n in script.notes]
        if run.gpus is None and script.gpus is not None:
            run.gpus = script.gpus
            run.notes.insert(0, f"--script {args.script}: {script.gpus} processes, as srun starts them (its own "
                                "options, else the #SBATCH lines)")
    return _estimate_read(args, run, "from_megatron", "the command", "no torchrun --nnodes/--nproc-per-node",
                          "pass --gpus N (Megatron's world size)")


def cmd_from_nemo(args: argparse.Namespace) -> int:
    """Estimate a NeMo training config as it stands: its `model` keys written as the Megatron flags that set the
    same fields (`nemo_import.nemo_words`), then read as `from-megatron` reads a command line."""
    import shlex

    from .megatron_import import read_megatron
    from .nemo_import import load_nemo, nemo_words

    nemo = nemo_words(load_nemo(args.config, args.set), args.vocab_size)
    run = read_megatron(nemo.words)
    run.gpus, run.notes, run.unpriced = nemo.gpus, [*nemo.notes, *run.notes], nemo.unpriced
    run.stack_set.update(nemo.stack_set)
    print(f"autoplan: read as the Megatron flags: {shlex.join(nemo.words)}", file=sys.stderr)
    return _estimate_read(args, run, "from_nemo", "the config", "no trainer.num_nodes and trainer.devices",
                          "pass --gpus N")


def cmd_from_torchtitan(args: argparse.Namespace) -> int:
    """Estimate a torchtitan job config as it stands: its sections read as torchtitan 0.2 reads them
    (`titan_import.read_titan`), then `autoplan estimate` with them on the torchtitan stack."""
    from ..cost_models.errors import ConfigError
    from ..workload import resolve_model
    from .titan_import import load_titan, read_titan

    if args.gpus is None or args.gpus < 1:
        raise ConfigError("--gpus must be a positive world size", f"got {args.gpus}", "pass --gpus N")
    cfg = load_titan(args.config, args.set)
    given = resolve_model(args.model)[0] if args.model else None
    run, preset = read_titan(cfg, args.gpus, given.num_layers if given else None)
    if args.model is None:
        if preset is None:
            model = cfg.get("model") or {}
            raise ConfigError("the torchtitan model has no autoplan preset",
                              f"[model] name {model.get('name', 'llama3')!r}, flavor "
                              f"{model.get('flavor', 'debugmodel')!r}", "pass --model PRESET or FILE with its shape")
        args.model = preset
    return _estimate_read(args, run, "from_torchtitan", "the config", "", "pass --gpus N")


def _estimate_read(args: argparse.Namespace, run, key: str, source: str, no_gpus: str, gpus_fix: str) -> int:
    """`autoplan estimate` of what a Megatron command line or a NeMo config (`source`) says (`run`, a MegatronRun),
    printing the equivalent estimate command, the notes and what is not priced; the JSON gains `key`. `no_gpus`
    and `gpus_fix`: the refusal's detail and fix where `source` gives no world size."""
    import shlex
    import tempfile

    from ..cli import build_parser, cmd_estimate
    from ..cost_models.errors import ConfigError, SpecError

    gpus = args.gpus or run.gpus
    if gpus is None:
        raise ConfigError(f"the number of GPUs is not in {source}", no_gpus, gpus_fix)
    cfg = run.parallel
    notes = list(run.notes)
    if cfg.zero and gpus == cfg.tp * cfg.pp:  # dp x cp = 1: Megatron and DeepSpeed run their sharded optimizers there
        notes.append(f"zero={cfg.zero} over one data-parallel rank shards nothing: priced as zero=0")
        cfg = cfg.model_copy(update={"zero": 0})
    batch = run.global_batch
    if batch is None:  # Megatron's default: one micro-batch per data-parallel rank
        dp = gpus // (cfg.tp * cfg.pp * cfg.cp)
        batch = cfg.mbs * max(dp, 1)
        notes.append(f"no --global-batch-size: Megatron's default, micro-batch x data-parallel size = {batch}")
    if run.model is not None and args.model:
        raise SpecError("the flags describe the model and --model names one", f"--num-layers "
                        f"{run.model.num_layers} in the flags, --model {args.model}", "drop --model, or the shape flags")
    if run.model is None and not args.model:
        raise SpecError("the flags give no model shape", "no --num-layers", "pass --model PRESET or FILE, or the "
                        "shape flags (--num-layers, --hidden-size, --num-attention-heads, --vocab-size, ...)")
    model_path = args.model
    if run.model is not None:
        model_path = args.model_out or str(Path(tempfile.mkdtemp(prefix="autoplan-megatron-")) / "model.json")
        Path(model_path).write_text(run.model.model_dump_json(indent=2, exclude_none=True))
    knobs = {**run.stack_set}
    knobs_text = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in knobs.items())
    if args.stack_set:
        knobs_text += "," + args.stack_set  # the user's own overrides come last and win
    argv = ["estimate", "--model", model_path, "--cluster", args.cluster, "--gpus", str(gpus), "--global-batch",
            str(batch), "--seq-len", str(run.seq_len), "--dtype", run.dtype, "--stack", args.stack, "--stack-set",
            knobs_text, "--parallel", cfg.model_copy(update={"layout": None}).to_string()]
    if cfg.layout is not None:
        argv += ["--layout", cfg.layout]
    shown = ["autoplan", *argv]
    if run.model is not None and not args.model_out:
        shown[shown.index(model_path)] = "MODEL.json"
    for note in notes:
        print(f"autoplan: note: {note}", file=sys.stderr)
    if run.unpriced:
        print(f"autoplan: not read, priced as if absent: {' '.join(run.unpriced)}", file=sys.stderr)
    print(f"autoplan: the same as: {shlex.join(shown)}"
          + ("" if run.model is None or args.model_out else "  (--model-out FILE writes MODEL.json)"),
          file=sys.stderr)
    ns = build_parser().parse_args(argv + (["-o", args.output] if args.output else [])
                                   + (["--json"] if args.json else []))
    info = {"parallel": cfg.to_string(), "stack": args.stack, "stack_set": knobs,
            "model": run.model.model_dump(exclude_none=True) if run.model else args.model,
            "notes": notes, "unpriced": run.unpriced}
    if args.search:
        info["search"] = _search_instead(ns)
    ns.extra_json = {key: info}
    rc = cmd_estimate(ns)
    if rc == 0 and args.search and not args.json:
        print(info["search"]["summary"])
    return rc


def _search_instead(ns: argparse.Namespace) -> dict:
    """What autoplan's search chooses for the same model, cluster, batch and stack (the flags' knobs included),
    against the command's own configuration."""
    from ..estimate_api import estimate_config
    from ..search.core import search

    model, cluster, training, profiles = load_workload(ns)
    from ..cli import parallel_of

    mine = estimate_config(model, cluster, training, parallel_of(ns, model), profiles=profiles)
    best = search(model, cluster, training, profiles=profiles, top=1).plan
    t, b = mine.step_time_s, best.prediction.step_time_s
    speed = t / b
    summary = (f"autoplan search on the same stack: {best.parallel.to_string()} at {b:.4f} s a step, "
               f"peak {best.prediction.memory_gib['peak']:.1f} GiB: "
               + (f"{speed:.2f}x the command's speed" if b < t * (1 - 1e-9) else
                  "the command's configuration is as fast as anything the search finds"))
    return {"parallel": best.parallel.to_string(), "step_time_s": b, "peak_memory_gib":
            best.prediction.memory_gib["peak"], "speedup": speed, "summary": summary}


def _add_read_args(p: argparse.ArgumentParser, what: str, stack: str | None = "megatron-core") -> None:
    """The options `from-megatron`, `from-nemo` and `from-torchtitan` share; `what` names their input in the
    help, `stack` the default stack (None: the command's software decides, megatron-core otherwise)."""
    p.add_argument("--stack", default=stack, metavar="NAME",
                   help=f"software stack to price {what} on (default {stack or 'megatron-core, or megatron-deepspeed where the flags say --deepspeed'}; `autoplan stacks`)")
    p.add_argument("--stack-set", default=None, metavar="KEY=VAL,...",
                   help=f"override stack knobs beyond those read from {what}")
    p.add_argument("--model-out", metavar="FILE", help=f"write the model spec read from {what} to FILE")
    p.add_argument("--search", action="store_true",
                   help="also search the same workload and stack: what autoplan would choose instead, and how fast")
    p.add_argument("-o", "--output", help="also write the configuration as a plan file")
    add_json(p)


def register(sub) -> None:
    p = sub.add_parser("show", help="show a plan: mesh, stages, memory, step time, runners-up")
    p.add_argument("plan", help="plan file (from `autoplan search -o` or `estimate -o`)")
    p.add_argument("--timeline", action="store_true", help="also print the step x rank grid of the schedule")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches in the timeline (default 2*pp)")
    add_stack_args(p)
    add_json(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("compare", help="compare two plans: what differs and what it costs")
    p.add_argument("a", help="first plan file")
    p.add_argument("b", help="second plan file")
    add_json(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("explain", help="why this plan: bottleneck, neighbouring choices, what rules them out")
    p.add_argument("plan", help="plan file (from `autoplan search -o` or `estimate -o`)")
    p.add_argument("--why-not", metavar="CONFIG", help='a configuration you had in mind, e.g. "tp=4,pp=16"')
    add_json(p)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("trace", help="write the simulated schedule as a Chrome/Perfetto trace")
    p.add_argument("plan", help="plan file (from `autoplan search -o` or `estimate -o`)")
    p.add_argument("-o", "--output", default="trace.json", help="trace file (default trace.json)")
    p.add_argument("--plot", metavar="FILE", help="also draw the schedule into FILE (.png, .svg or .pdf)")
    add_json(p)
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("export", help="Megatron-LM flags or a torchtitan config for a plan")
    p.add_argument("plan", help="plan file (from `autoplan search -o` or `estimate -o`)")
    p.add_argument("--format", choices=["megatron", "torchtitan"], default="megatron",
                   help="target framework (default megatron)")
    p.add_argument("--torchtitan-version", choices=["0.3", "0.2"], default="0.3",
                   help="torchtitan config form: 0.3 a Python config module (--module/--config), "
                        "0.2 a TOML file (--job.config_file)")
    p.add_argument("--check", action="store_true",
                   help="load the export with the framework's own argument/config code when it is importable "
                        "(Megatron-LM via $MEGATRON_LM or megatron-core; torchtitan); exit 1 if refused")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    add_json(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("from-megatron", help="estimate a Megatron-LM command line as it stands (the inverse of "
                       "export): autoplan from-megatron --cluster C -- FLAGS...")
    p.add_argument("--cluster", required=True, help="cluster preset or YAML file (the flags do not say)")
    p.add_argument("--gpus", type=int, default=None,
                   help="world size (default: torchrun's --nnodes x --nproc-per-node in the command)")
    p.add_argument("--model", default=None,
                   help="model preset or spec file, when the flags give no shape (--num-layers, ...)")
    p.add_argument("--script", metavar="FILE", help="read the command from a launch script, never running it: its "
                   "variables, arrays and string if-tests expanded as bash would in this environment and directory, "
                   "sourced files and the batch script sbatch submits followed, a DeepSpeed JSON its here-document "
                   "writes read; run it from where the job is launched")
    _add_read_args(p, "the flags", stack=None)
    p.set_defaults(func=cmd_from_megatron)

    p = sub.add_parser("from-nemo", help="estimate a NeMo training config as it stands (a NeMo-Framework-Launcher "
                       "conf/training/<family>/<model>.yaml): autoplan from-nemo CONFIG --cluster C")
    p.add_argument("config", help="the NeMo YAML (a mapping with `model:`; `trainer:` gives the GPUs)")
    p.add_argument("--cluster", required=True, help="cluster preset or YAML file (the config does not say)")
    p.add_argument("--gpus", type=int, default=None,
                   help="world size (default: trainer.num_nodes x trainer.devices)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the tokenizer's vocabulary, where the config names a tokenizer file (Llama, Nemotron)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key first, as a Hydra override: --set model.fp8=true, "
                        "--set model.optim.grad_sync_dtype=bf16 (repeatable)")
    _add_read_args(p, "the config")
    p.set_defaults(func=cmd_from_nemo, model=None)  # (the config gives the shape: no --model)

    p = sub.add_parser("from-torchtitan", help="estimate a torchtitan job config as it stands (a 0.1-0.2 "
                       "train_configs/*.toml): autoplan from-torchtitan CONFIG --cluster C --gpus N")
    p.add_argument("config", help="the torchtitan TOML (0.3's Python configs are never run: refused)")
    p.add_argument("--cluster", required=True, help="cluster preset or YAML file (the config does not say)")
    p.add_argument("--gpus", type=int, required=True, help="world size (torchrun's nodes x NGPU; the config does "
                   "not say, and data_parallel_shard_degree = -1 takes the rest of it)")
    p.add_argument("--model", default=None, help="model preset or spec file, where [model] names no autoplan "
                   "preset (the llama3 8B / 70B / 405B flavours have one)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key first, as torchtitan's command line does: --set "
                        "parallelism.tensor_parallel_degree=8 (repeatable)")
    _add_read_args(p, "the config", stack="torchtitan")
    p.set_defaults(func=cmd_from_torchtitan)

    p = sub.add_parser("scaling", help="the best plan at each GPU count", conflict_handler="resolve")
    add_workload_args(p)
    p.add_argument("--gpus", required=True, help="comma-separated GPU counts, e.g. 64,128,256")
    p.add_argument("--fix", action="append", metavar="KEY=VAL", help="pin part of the configuration (repeatable)")
    p.add_argument("--plot", metavar="FILE", help="also draw tokens/s against GPUs into FILE (.png, .svg or .pdf)")
    add_json(p)
    p.set_defaults(func=cmd_scaling)
