"""The `autoplan` command line. Every command accepts `--json`; bad input prints one line, never a traceback.

Commands owned by other modules register themselves through a `register(subparsers)` function
(`autoplan.search.cli`, `autoplan.inspect.cli`), so this file stays the one place that lists them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pydantic import ValidationError

from autoplan.cost_models.errors import AutoplanError

# ------------------------------------------------------------------------------------------ shared options


def add_workload_args(p: argparse.ArgumentParser, *, gpus_required: bool = False) -> None:
    """--model --cluster --gpus --global-batch --seq-len --dtype, shared by estimate/search/scaling."""
    p.add_argument("--model", required=True, help="preset name, spec file, HF config.json or module:factory")
    p.add_argument("--cluster", required=True, help="cluster preset or YAML file")
    p.add_argument("--gpus", type=int, required=gpus_required, default=None, help="override the GPU count")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: model max)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32", "fp8"],
                   help="compute dtype (default: the stack's, else fp32 on a CPU (gloo) cluster, bf16 on "
                   "accelerators)")
    p.add_argument("--kernels", default=None, choices=["fused", "torch", "megatron"],
                   help="kernel set (default: the stack's; autoplan's is fused Triton kernels)")
    add_stack_args(p)
    p.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                   help="plan against at most this much memory per GPU (keeps the rest as headroom)")


def add_stack_args(p: argparse.ArgumentParser) -> None:
    """--stack NAME and --stack-set key=value,... (software-stack profile, `autoplan stacks`)."""
    p.add_argument("--stack", default=None, metavar="NAME",
                   help="software stack the prediction assumes (default autoplan; `autoplan stacks` lists them)")
    p.add_argument("--stack-set", default=None, metavar="KEY=VAL,...",
                   help="override single stack knobs, e.g. tp_comm_overlap=false,grad_reduce_dtype=fp32")


def stack_of(args: argparse.Namespace) -> tuple[str | None, dict[str, object]]:
    """(stack name, --stack-set overrides) from the options."""
    from autoplan.cost_models.stacks import get_stack, parse_stack_set

    name = getattr(args, "stack", None)
    if name is not None:
        name = get_stack(name).name
    return name, parse_stack_set(getattr(args, "stack_set", None))


def stack_training(args: argparse.Namespace, training):
    """`training` under the stack of `args`: the stack's knobs, then --stack-set; --dtype and --kernels given
    explicitly win over the stack's."""
    from autoplan.cost_models.stacks import apply_stack

    name, overrides = stack_of(args)
    keep = tuple(k for k in ("dtype", "kernels") if getattr(args, k, None) is not None)
    return apply_stack(training, name, overrides, keep=keep)


def stack_label_of(args: argparse.Namespace) -> str:
    from autoplan.cost_models.stacks import stack_label

    return stack_label(*stack_of(args))


def with_stack(plan, args: argparse.Namespace):
    """The plan recording the stack its prediction assumed (re-sealed)."""
    name, overrides = stack_of(args)
    if name is None and not overrides:
        return plan
    return plan.model_copy(update={"stack": stack_label_of(args)}).sealed()


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def default_dtype(cluster, stack: str | None) -> tuple[str, str | None]:
    """(the compute dtype when --dtype is not given, a note saying why where a user may want the other): bf16 on
    accelerators; fp32 on a CPU cluster (gloo, which the runtime runs on CPU tensors, or one whose
    `cores_per_node` is set) without a --stack, where bf16 is CPU autocast, slower than fp32 (the cpu preset's
    peaks: 0.01 vs 0.05 TF/s), and not what a run on CPU cores is for. A stack brings its own dtype."""
    if (cluster.backend != "gloo" and cluster.cores_per_node is None) or stack is not None:
        return "bf16", None
    return "fp32", f"{cluster.name} runs on CPU cores: training in fp32 (pass --dtype bf16 for CPU autocast)"


def _note_foreign_knobs(name: str | None, overrides: dict[str, object]) -> None:
    """On autoplan's stack, `--stack-set` knobs the runtime does not have (all but kernels: launch.RUNTIME_KNOBS)
    price another program: said when planning, as `autoplan run` refuses the plan wherever the knob changes its
    prediction (launch.check_stack; a knob that prices nothing in the layout, e.g. p2p_scatter_gather without a
    pipeline, passes there)."""
    from autoplan.cost_models.stacks import DEFAULT_STACK, stack_knobs
    from autoplan.runtime.launch import RUNTIME_KNOBS

    own = stack_knobs(DEFAULT_STACK)
    foreign = [f"{k}={str(v).lower()}" for k, v in overrides.items() if k not in RUNTIME_KNOBS and own.get(k) != v]
    if name in (None, "autoplan") and foreign:
        print(f"autoplan: note: --stack-set {','.join(foreign)} prices software autoplan's runtime does not have "
              "(`autoplan run` refuses a plan where that changes the prediction): the prediction is for comparison "
              "and export", file=sys.stderr)


def load_workload(args: argparse.Namespace):
    """(model, cluster, training, profiles-or-None) from the shared options."""
    from autoplan.cost_models.errors import SpecError
    from autoplan.cost_models.specs import TrainingSpec

    from .specs import load_cluster
    from .workload import resolve_model

    for flag, value in (("--gpus", args.gpus), ("--seq-len", args.seq_len), ("--global-batch", args.global_batch)):
        if value is not None and value <= 0:  # 0 must not fall back to a default
            raise SpecError(f"{flag} must be positive", f"got {flag} {value}", f"pass {flag} N with N >= 1")
    model, profiles = resolve_model(args.model)
    notes: list[str] = []
    cluster = load_cluster(args.cluster, gpus=args.gpus, notes=notes)
    for note in notes:
        print(f"autoplan: note: {note}", file=sys.stderr)
    limit = getattr(args, "memory_limit", None)
    if limit is not None:
        if not 0 < limit <= cluster.gpu.hbm_gib:
            from autoplan.cost_models.errors import SpecError

            raise SpecError("--memory-limit must be positive and at most the GPU's memory",
                            f"got {limit} GiB, {cluster.gpu.name} has {cluster.gpu.hbm_gib} GiB",
                            f"pass a value in (0, {cluster.gpu.hbm_gib}]")
        cluster = cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"hbm_gib": limit})})
    from .workload import UNLIMITED_SEQ

    if args.seq_len is None and model.max_seq_length >= UNLIMITED_SEQ:
        from autoplan.cost_models.errors import SpecError

        raise SpecError("--seq-len is needed", f"{model.name} states no maximum sequence length to default to (a "
                        "module without a learned position table)", "pass --seq-len N, the length you will train at")
    seq = model.max_seq_length if args.seq_len is None else args.seq_len
    # a learned table refuses a longer sequence (check_config); rotary positions (or none) run past it
    if model.position != "learned" and model.max_seq_length < seq and model.max_seq_length < UNLIMITED_SEQ:
        print(f"autoplan: note: --seq-len {seq} is longer than {model.name} was made for (max_seq_length "
              f"{model.max_seq_length}, a Hugging Face config's max_position_embeddings): its {model.position} "
              "positions go past what it was trained on; planned as asked", file=sys.stderr)
    stack, overrides = stack_of(args)
    dtype = getattr(args, "dtype", None)
    if dtype is None:
        dtype, note = default_dtype(cluster, stack)
        if note:  # said on stderr, so a user can pick the other
            print(f"autoplan: note: {note}", file=sys.stderr)
    if dtype == "fp8" and stack in (None, "autoplan"):
        print("autoplan: note: autoplan's runtime does not train in fp8 (`autoplan run` refuses this plan): the "
              "prediction is for Float8 linears as other stacks run them; plan with --stack torchtitan or "
              "megatron-core and `autoplan export` it, or pass --dtype bf16 to run it here", file=sys.stderr)
    _note_foreign_knobs(stack, overrides)
    try:
        training = TrainingSpec(global_batch_size=args.global_batch, seq_length=seq, dtype=dtype,
                                kernels=getattr(args, "kernels", None) or "fused")
    except Exception as e:  # pydantic validation -> one line naming the field
        from autoplan.cost_models.errors import SpecError

        errs = e.errors() if hasattr(e, "errors") else []
        detail = (f"{'.'.join(str(x) for x in errs[0]['loc'])} {errs[0]['msg'].lower()}, got {errs[0].get('input')!r}"
                  if errs else str(e).splitlines()[0])
        raise SpecError("invalid training setup", detail, "check --global-batch, --seq-len and --dtype") from None
    return model, cluster, own_kernels(args, stack_training(args, training)), profiles


def own_kernels(args: argparse.Namespace, training):
    """`training` with the kernels autoplan's runtime will run for --model: torch's for a Hugging Face config or a
    user's module, which keep their own modules (models.source.runs_torch_ops). Asked for explicitly, the fused
    kernels are refused; left to the stack, torch's are priced and a note says so. Other stacks' kernels (a
    published run's) are theirs to price."""
    from autoplan.cost_models.errors import SpecError

    from .models.source import runs_torch_ops

    what = runs_torch_ops(args.model) if training.runtime_memory and training.kernels == "fused" else None
    if what is None:
        return training
    if getattr(args, "kernels", None) == "fused":
        raise SpecError("autoplan's fused kernels replace its own zoo models' norms and activations only",
                        f"--model {args.model} is {what}: the runtime runs it with torch's ops",
                        "drop --kernels fused (torch's kernels are priced), or plan a preset or spec file")
    print(f"autoplan: note: {args.model} is {what}, which the runtime runs with torch's ops: priced with "
          "torch's kernels", file=sys.stderr)
    if hasattr(args, "kernels"):
        args.kernels = "torch"  # the plan records what runs, and search does not weigh the fused set
    return training.model_copy(update={"kernels": "torch"})


def console(width: int | None = None):
    from rich.console import Console

    return Console(width=width or int(os.environ.get("COLUMNS", "0") or 0) or None, highlight=False)


def print_json(obj) -> None:
    """Every JSON object autoplan prints carries the plan's `schema_version` (one vocabulary: the plan's
    field names)."""
    if isinstance(obj, dict) and "schema_version" not in obj:
        from .plan import SCHEMA_VERSION

        obj = {"schema_version": SCHEMA_VERSION, **obj}
    print(json.dumps(obj, indent=1, default=float))


# -------------------------------------------------------------------------------------------- commands


def parallel_of(args: argparse.Namespace, model):
    """The configuration of --parallel, with the stage layout of --layout or --uneven (one of them) applied."""
    from autoplan.cost_models.errors import ConfigError
    from autoplan.cost_models.layout import normalize, parse_uneven, uneven
    from autoplan.cost_models.specs import ParallelConfig

    cfg = ParallelConfig.parse(args.parallel)
    given = [f for f in ("layout", "uneven") if getattr(args, f, None)]
    if cfg.layout is not None:
        given.insert(0, "layout= in --parallel")
    if len(given) > 1:
        raise ConfigError("give the stage layout once", f"got {' and '.join(given)}",
                          "use one of --layout, --uneven or layout= in --parallel")
    if getattr(args, "layout", None):
        cfg = cfg.model_copy(update={"layout": normalize(args.layout)})
    elif getattr(args, "uneven", None):
        first, last = parse_uneven(args.uneven)
        cfg = cfg.model_copy(update={"layout": uneven(model.num_layers, cfg.pp, cfg.vp, first, last)})
    return cfg


def cmd_estimate(args: argparse.Namespace) -> int:
    from .api import plan_from_estimate
    from .cost_models.compute import fused_host_priced
    from .estimate_api import estimate_config
    from .report import render_estimate

    model, cluster, training, profiles = load_workload(args)
    cfg = parallel_of(args, model)
    est = estimate_config(model, cluster, training, cfg, profiles=profiles)
    faster = None  # torch's kernels, where the stack's fused ones were left to it and cost more host time
    if args.kernels is None and fused_host_priced(training, cluster):
        alt = estimate_config(model, cluster, training.model_copy(update={"kernels": "torch"}), cfg,
                              profiles=profiles)
        faster = alt if alt.step_time_s < est.step_time_s else None
    if args.output:
        from .models.source import attach

        plan = plan_from_estimate(model, cluster, training, est, kernels=args.kernels,
                                  command=" ".join(sys.argv))
        attach(with_stack(plan, args), args.model, profiles).save(args.output)
    if args.json:
        d = est.as_dict()
        d["memory_breakdown_gib"] = [m.gib() for m in est.memory]
        d["kernels_assumed"] = training.kernels
        d["stack"] = stack_label_of(args)
        if faster is not None:
            d["faster_kernels"] = {"kernels": "torch", "step_time_s": faster.step_time_s}
        d.update(getattr(args, "extra_json", None) or {})  # e.g. what `from-megatron` read
        print_json(d)
    else:
        con = console()
        render_estimate(con, model, cluster, training, est)
        if faster is not None:
            gain = 100 * (1 - faster.step_time_s / est.step_time_s)
            con.print(f"note: with torch's kernels this plan is predicted {faster.step_time_s:.4f} s a step "
                      f"({gain:.1f}% faster): autoplan's fused modules cost host time the step cannot hide here; "
                      "add --kernels torch")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from autoplan.cost_models.profile import profile_from_spec

    from .presets import MODEL_PRESETS

    rows = []
    for m in MODEL_PRESETS.values():
        params = sum(p.params for p in profile_from_spec(m))
        # the model spec's own field names (one vocabulary with plans and spec files)
        rows.append({"name": m.name, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                     "num_attention_heads": m.num_attention_heads, "num_kv_heads": m.kv_heads,
                     "ffn_hidden_size": m.ffn, "vocab_size": m.vocab_size, "max_seq_length": m.max_seq_length,
                     "num_parameters": params, "moe": m.moe.model_dump() if m.moe else None})
    if args.json:
        print_json(rows)
        return 0
    cells = [[r["name"], _human(r["num_parameters"]), str(r["num_layers"]), str(r["hidden_size"]),
              f"{r['num_attention_heads']}/{r['num_kv_heads']}", str(r["ffn_hidden_size"]),
              str(r["vocab_size"]), str(r["max_seq_length"]), f"{m.moe.num_experts}x top-{m.moe.top_k}" if m.moe else ""]
             for r, m in zip(rows, MODEL_PRESETS.values())]
    console().print(_table("Model presets", ("name", "params", "layers", "hidden", "heads\n/kv", "ffn", "vocab",
                                             "seq", "moe"), cells))
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    from autoplan.cost_models.hardware import CLUSTER_PRESETS

    rows = []
    for c in CLUSTER_PRESETS.values():
        rows.append({"name": c.name, "gpu": c.gpu.name, "gpus_per_node": c.gpus_per_node, "num_nodes": c.num_nodes,
                     "peak_bf16_tflops": c.gpu.peak_tflops.bf16, "hbm_gib": c.gpu.hbm_gib,
                     "hbm_gbps": c.gpu.hbm_gbps, "intra_node_gbps": c.intra_node.bandwidth_gbps,
                     "inter_node_gbps": c.inter_node.bandwidth_gbps, "backend": c.backend})
    if args.json:
        print_json(rows)
        return 0
    cells = [[r["name"], r["gpu"], str(r["gpus_per_node"]), str(r["num_nodes"]), f"{r['peak_bf16_tflops']:g}",
              f"{r['hbm_gib']:g}", f"{r['hbm_gbps']:g}", f"{r['intra_node_gbps']:g}", f"{r['inter_node_gbps']:g}"]
             for r in rows]
    console().print(_table("Cluster presets (bandwidth per GPU per direction)",
                           ("name", "gpu", "GPUs/\nnode", "nodes", "bf16\nTF/s", "HBM\nGiB", "HBM\nGB/s",
                            "intra\nGB/s", "inter\nGB/s"), cells))
    return 0


def _table(title: str, columns: tuple[str, ...], cells: list[list[str]]):
    """A compact rich table whose cells are never cut or folded: each column is as wide as its widest cell
    (headers wrap instead), so the names users type stay whole at 80 columns."""
    from rich.table import Table

    t = Table(title=title, box=None, padding=(0, 1), pad_edge=False, header_style="bold")
    for k, c in enumerate(columns):
        width = max([len(row[k]) for row in cells] + [len(line) for line in c.split("\n")])
        t.add_column(c, justify="left" if k == 0 or c in ("gpu", "moe") else "right", no_wrap=True,
                     min_width=width)
    for row in cells:
        t.add_row(*row)
    return t


def cmd_stacks(args: argparse.Namespace) -> int:
    from autoplan.cost_models.stacks import DEFAULT_STACK, STACK_KNOBS, STACKS

    rows = [{"name": s.name, "title": s.title, "default": s.name == DEFAULT_STACK,
             "knobs": {k: s.knobs.get(k) for k in STACK_KNOBS if k in s.knobs}, "assumes": s.assumes,
             "typical": s.typical, "source": s.source} for s in STACKS.values()]
    if args.json:
        print_json(rows)
        return 0
    from rich.table import Table

    t = Table(title="Software stacks (--stack NAME; override one knob with --stack-set KEY=VAL)", show_lines=True)
    for c in ("name", "knobs", "assumes"):
        t.add_column(c, overflow="fold")
    from autoplan.cost_models.stacks import KNOB_ALIASES

    short = {field: alias for alias, field in KNOB_ALIASES.items()}  # --stack-set takes either name
    # what an unset (None) knob resolves to, in words (TrainingSpec's descriptions and resolving properties)
    unset = {"grad_reduce_dtype": "compute", "p2p_overlap": "default (under interleaving only)",
             "master_weights": "default (optimizer_dtype's)", "checkpoint_early_stop": "default (true on autoplan's "
             "runtime, else false)", "cp_attention": "default (all_gather_masked on autoplan's runtime, else ring)"}

    def value(knobs: dict, k: str, v) -> str:
        if v is None and k == "grad_reduce_dtype" and knobs.get("autocast_fp32_params"):
            return "fp32 (the fp32 parameters' own)"  # TrainingSpec.grad_dtype: autocast over fp32 parameters
        return unset.get(k, "default") if v is None else str(v).lower()

    for r in rows:
        knobs = "\n".join(f"{short.get(k, k)}={value(r['knobs'], k, v)}" for k, v in r["knobs"].items())
        about = f"{r['title']}{' (default)' if r['default'] else ''}\n{r['assumes']}"
        if r["typical"]:
            about += f"\ntypically run with: {r['typical']}"
        t.add_row(r["name"], knobs, about + f"\nsource: {r['source']}")
    console().print(t)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from .plan import Plan

    print_json(Plan.model_json_schema())
    return 0


def cmd_inspect_model(args: argparse.Namespace) -> int:
    from .capture import capture_model_ref, capture_spec
    from .capture.report import graph_summary_json, render_model_tree
    from .specs import load_model

    graph = capture_model_ref(args.model, seq=args.seq_len)
    if graph is None:
        graph = capture_spec(load_model(args.model), seq=args.seq_len)
    if args.json:
        print_json(graph_summary_json(graph))
    else:
        render_model_tree(graph, console())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


# ---------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    ap = _JsonArgumentParser(prog="autoplan", description="Plan and run parallel transformer training.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_JsonArgumentParser,
                            help="run `autoplan COMMAND --help` for one command's options")

    p = sub.add_parser("estimate", help="predict one fixed parallel configuration")
    add_workload_args(p)
    p.add_argument("--parallel", required=True, help="e.g. tp=8,pp=8,dp=16,mbs=1,sp=1,recompute=selective")
    p.add_argument("--layout", metavar="LAYOUT",
                   help="explicit stage layout: Megatron-Core's string (E embedding, t block, L loss, | stage "
                        "boundary, X*N repeats; e.g. 'Et*3|(t*4|)*6,t*3L') or blocks per stage ('3,4,4,3')")
    p.add_argument("--uneven", metavar="first=N,last=M",
                   help="N blocks on the first pipeline rank and M on the last (over their virtual stages, as "
                        "Megatron's --decoder-first/last-pipeline-num-layers), the rest spread evenly")
    p.add_argument("-o", "--output", help="also write the configuration as a plan file")
    add_json(p)
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("models", help="list model presets")
    add_json(p)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("clusters", help="list cluster presets")
    add_json(p)
    p.set_defaults(func=cmd_clusters)

    p = sub.add_parser("stacks", help="list software-stack profiles and what each assumes")
    add_json(p)
    p.set_defaults(func=cmd_stacks)

    p = sub.add_parser("schema", help="print the Plan's JSON Schema")
    add_json(p)
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("inspect-model", help="capture a model and show its layers")
    p.add_argument("model", help="preset name, spec file, HF config.json or module:factory")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: model max)")
    add_json(p)
    p.set_defaults(func=cmd_inspect_model)

    p = sub.add_parser("calibrate", help="measure this machine and write a cluster spec")
    p.add_argument("-o", "--output", help="cluster YAML to write")
    p.add_argument("--nproc", type=int, default=4, help="processes (GPUs) per node to measure with")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="precision of the measured matmuls (default fp32)")
    p.add_argument("--bench-out", default=None, metavar="FILE",
                   help="also run micro-benchmarks (GEMMs, collectives per level) into FILE for `tune --bench`")
    p.add_argument("--model", default=None, help="time the attention at this model's shape (heads, head dim, "
                   "--seq-len) and, with --bench-out, the GEMMs at its shapes")
    p.add_argument("--seq-len", type=int, default=2048, help="with --model: tokens per micro-batch sequence")
    p.add_argument("--mbs", type=int, default=1, help="with --model: sequences per micro-batch")
    add_json(p)
    p.set_defaults(func=lambda a: __import__("autoplan.calibrate", fromlist=["cmd_calibrate"]).cmd_calibrate(a))

    p = sub.add_parser("demo", help="the built-in example of the main job")
    p.add_argument("--no-run", action="store_true", help="plan only; do not launch training")
    add_json(p)
    p.set_defaults(func=cmd_demo)

    for mod in ("autoplan.search.cli", "autoplan.inspect.cli", "autoplan.runtime.cli", "autoplan.codegen.cli",
                "autoplan.tune.cli", "autoplan.prepare_data", "autoplan.models.cli"):
        try:
            module = __import__(mod, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):
                continue  # that part is not built yet
            raise
        module.register(sub)
    for name, p in sub.choices.items():  # `autoplan CMD --help` opens with what CMD is for
        if not p.description:
            p.description = next((a.help for a in sub._choices_actions if a.dest == name), None)
    return ap


def _fail(args_json: bool, kind: str, message: str, fix: str, code: int = 2) -> int:
    """One line on stderr, or under --json one object {"error", "fix"} on stdout; nonzero exit."""
    if args_json:
        from .plan import SCHEMA_VERSION

        print(json.dumps({"schema_version": SCHEMA_VERSION, "error": f"{kind}: {message}", "fix": fix}))
    else:
        print(f"autoplan: {kind}: {message}" + (f". fix: {fix}" if fix else ""), file=sys.stderr)
    return code


class _JsonArgumentParser(argparse.ArgumentParser):
    """Usage errors as JSON when --json is on the command line."""

    def error(self, message: str):  # noqa: D401
        if "--json" in sys.argv[1:] or getattr(self, "_json_wanted", False):
            raise SystemExit(_fail(True, "usage", f"{self.prog}: {message}", f"see `{self.prog} --help`"))
        super().error(message)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:  # shell completion: `eval "$(register-python-argcomplete autoplan)"` (pip install argcomplete)
        import argcomplete

        argcomplete.autocomplete(ap)
    except ImportError:
        pass
    argv = list(sys.argv[1:] if argv is None else argv)
    want_json = "--json" in argv[:argv.index("--")] if "--" in argv else "--json" in argv
    for p in [ap, *next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices.values()]:
        p._json_wanted = want_json
    extra: list[str] = []
    if "--" in argv:  # everything after `--` belongs to the launched program (`autoplan run`, `from-megatron`)
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = ap.parse_args(argv)
    args.extra_args = extra
    if extra and args.command not in ("run", "from-megatron"):
        ap.error(f"arguments after -- are only accepted by `autoplan run` and `autoplan from-megatron`: "
                 f"{' '.join(extra)}")
    try:
        return args.func(args)
    except AutoplanError as e:
        if want_json:
            msg = e.rule + (f": {e.detail}" if e.detail else "")
            return _fail(True, e.kind, msg, e.hint or "")
        print(f"autoplan: {e.kind}: {e.one_line()}", file=sys.stderr)
        return 2
    except ValidationError as e:  # a value no reader turned into its own error: still one line, never a dump
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or e.title
        return _fail(want_json, "invalid value", f"{e.title} {loc}: {first['msg'].lower()} (got "
                     f"{first.get('input')!r})", "correct the value that sets it")
    except OSError as e:  # an unwritable -o/--plot/--log, a missing input file: one line, never a traceback
        if isinstance(e, BrokenPipeError):
            return 0
        where = f" {e.filename}" if getattr(e, "filename", None) else ""
        return _fail(want_json, "io error", f"{e.strerror or e}:{where}",
                     "check the path exists and is writable (or choose another with -o)")
    except KeyboardInterrupt:
        print("autoplan: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
