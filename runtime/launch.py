"""Launch `autoplan.runtime.train` under torchrun for a plan: what `autoplan run plan.json --nproc-per-node N -- ARGS` calls.

    from autoplan.runtime.launch import run
    rc = run("plan.json", nproc_per_node=4, train_args=["--steps", "10", "--log", "log.jsonl"])

One node: `--standalone` rendezvous on a free local port. Several nodes: the same command on every node,
`--nnodes N --rdzv-endpoint HOST:PORT` (torchrun's c10d rendezvous; the first node to arrive hosts it), e.g.
from a SLURM script; `--print-command` prints it instead of running it.

Long runs: `--max-restarts N` lets torchrun restart every worker when one fails (up to N times); each restart
resumes from the newest checkpoint in --save that verifies (`--auto-resume`). SIGTERM/SIGINT to `autoplan run`
are forwarded to torchrun, which forwards them to every worker; the workers save and exit, and whatever is
still alive after --term-timeout seconds is killed (the whole process group: no orphans). The plan is checked
against this machine (`check_machine`): too many processes for the cores or GPUs, another GPU type, a plan
predicted not to fit, or one priced for another software stack (`check_stack`) is an error, or a warning with
--force.

The launch is checked against the plan first (same check and message as the runtime's start-up), so a wrong
process count fails in the parent without starting torchrun. Training arguments are passed after `--`, which
keeps torchrun from taking `--log` for its own `--log-dir`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun_command(plan_path: str | Path, nproc_per_node: int, train_args: Sequence[str] = (),
                     python: str | None = None, *, nnodes: int = 1, rdzv_endpoint: str | None = None,
                     rdzv_id: str = "autoplan", max_restarts: int = 0) -> list[str]:
    """The command line: single node with a local rendezvous, or one node of `nnodes` meeting at `rdzv_endpoint`."""
    python = python or sys.executable
    args = list(train_args)
    if args[:1] == ["--"]:
        args = args[1:]
    if nnodes == 1 and rdzv_endpoint is None:
        rendezvous = ["--standalone"]
    else:
        rendezvous = ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", str(rdzv_endpoint),
                      "--rdzv-id", rdzv_id]
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    return [python, "-m", "torch.distributed.run", *rendezvous, *restarts, "--nproc-per-node", str(nproc_per_node),
            "-m", "autoplan.runtime.train", "--", "--plan", str(plan_path), *args]


def check_launch(plan, nproc_per_node: int | None, nnodes: int, rdzv_endpoint: str | None) -> tuple[int, list[str]]:
    """The processes per node to start, and warnings; raises PlanError for a launch the plan cannot run."""
    from autoplan.cost_models.errors import PlanError

    from .parallel_dims import ParallelDims

    if nnodes < 1:
        raise PlanError("--nnodes must be at least 1", f"got {nnodes}", "pass --nnodes N")
    if nnodes > 1 and not rdzv_endpoint:
        raise PlanError(f"--nnodes {nnodes} needs a rendezvous address", "every node must meet at one HOST:PORT",
                        "pass --rdzv-endpoint HOST:PORT (the same on every node, e.g. the first node's address)")
    if nproc_per_node is None:
        if plan.world_size % nnodes:
            raise PlanError(f"plan {plan.short_hash} has {plan.world_size} ranks, not a multiple of --nnodes {nnodes}",
                            "", "pass --nproc-per-node explicitly or another --nnodes")
        nproc_per_node = plan.world_size // nnodes
    ParallelDims.from_plan(plan, nnodes * nproc_per_node)
    warnings = []
    gpn = plan.cluster.gpus_per_node
    if nnodes > 1 and nproc_per_node != gpn:
        warnings.append(f"the plan was made for {gpn} GPUs per node ({plan.cluster.name}) but {nproc_per_node} are "
                        "launched per node: groups it placed inside a node may now cross nodes, and its predicted "
                        "step time no longer applies")
    return nproc_per_node, warnings


# Processes per core above which a CPU (gloo) run is refused: 4 ranks on this 2-core machine run the dist tests
# (2 per core); 64 on 2 cores spends its time in the scheduler, not training.
MAX_PROCS_PER_CORE = 2


def check_machine(plan, nproc_per_node: int) -> list[str]:
    """What about this machine contradicts the plan: too many processes for the cores or GPUs, another GPU type,
    a plan predicted not to fit. Each item is a one-line problem (errors unless --force)."""
    problems = check_stack(plan)
    if not plan.prediction.fits:
        peak = plan.prediction.memory_gib.get("peak")
        problems.append(f"plan {plan.short_hash} is predicted not to fit: peak {peak} GiB per GPU on "
                        f"{plan.cluster.gpu.name}")
    if plan.cluster.backend == "gloo":
        cores = os.cpu_count() or 1
        if nproc_per_node > MAX_PROCS_PER_CORE * cores:
            problems.append(f"{nproc_per_node} processes on {cores} CPU cores (more than {MAX_PROCS_PER_CORE} per "
                            "core): the run would crawl")
        return problems
    gpus, names = _local_gpus()
    if gpus == 0:
        problems.append(f"the plan is for {plan.cluster.gpu.name} GPUs (nccl) but this machine has none")
    elif nproc_per_node > gpus:
        problems.append(f"{nproc_per_node} processes per node but {gpus} GPUs here")
    elif names and not any(_same_gpu(plan.cluster.gpu.name, n) for n in names):
        problems.append(f"the plan was made for {plan.cluster.gpu.name} but this machine has {names[0]}")
    return problems


# Stack knobs (`autoplan stacks`, `--stack-set`) autoplan's runtime honours: it runs its fused Triton kernels or
# torch's (runtime.parallelize.apply_fused_kernels). Every other knob of the autoplan stack describes what the
# runtime always does (SDPA attention, FSDP2's overlaps, blocking-free pipeline sends, ...). zero_stages,
# schedules, seq_splits, recompute_modes, recompute_per_stage and uneven_stages price nothing: they narrow the ZeRO
# stages, pipeline schedules, sequence splits, recomputation and stage layouts a plan may take, and the runtime
# runs each of them. partial_recompute prices a partly full stage's other blocks, and the runtime runs each
# setting (apply_recompute's `rest`).
RUNTIME_KNOBS = frozenset({"kernels", "zero_stages", "schedules", "seq_splits", "recompute_modes",
                           "recompute_per_stage", "uneven_stages", "partial_recompute"})


def _knob_prices(plan, knob: str) -> bool:
    """Whether a stack knob can change `plan`'s prediction. p2p_scatter_gather prices only pipeline messages
    under tp > 1 without SP; autoplan's plans set it true until its stack learnt that torch.distributed.pipelining
    sends whole hidden states (session 21), and those plans priced everything else as they do now."""
    if knob == "p2p_scatter_gather":
        par = plan.parallel
        return par.pp > 1 and par.tp > 1 and not par.sp
    if knob == "checkpoint_early_stop":  # None resolves to true on autoplan's stack: only false prices otherwise
        return not plan.training.recompute_stops_early
    if knob == "master_weights":  # prices only 16-bit parameters' master; the runtime's are fp32
        return not plan.training.fp32_params
    if knob == "cp_attention":  # None resolves to the runtime's own; another prices only under cp > 1
        return plan.parallel.cp > 1 and plan.training.cp_style != "all_gather_masked"
    return True


def check_dtype(plan) -> None:
    """PlanError for a dtype the runtime cannot train in, --force or not: autocast has no fp8, so an fp8 plan would
    run in fp32, another program than the one priced (parallelize.autocast_dtype refuses it too)."""
    if plan.training.dtype == "fp8":
        from autoplan.cost_models.errors import PlanError

        raise PlanError(f"plan {plan.short_hash} computes in fp8, which autoplan's runtime does not run",
                        "it trains in bf16, fp16 or fp32 (autocast over fp32 parameters)",
                        "re-plan with --dtype bf16 to run it here, or `autoplan export` it for a stack with Float8 "
                        "linears (--stack torchtitan or megatron-core)")


def check_stack(plan) -> list[str]:
    """The plan must price the program autoplan's runtime executes. One priced for another software stack
    (`--stack megatron-2022`, `deepspeed-zero3`, `torchtitan`, ...: for comparison and for `autoplan export`) or
    with a `--stack-set` knob the runtime does not have predicts another program's step time and memory; run
    as it is, the prediction the run reports against would be silently wrong. Plans of autoplan's stack pass, and
    so do plans that name no stack (written before stacks, or made through the Python API with a TrainingSpec)
    whose knobs are the runtime's: a TrainingSpec(flash_attention=False) prices explicit-softmax attention, which
    the runtime (SDPA) never runs."""
    from autoplan.cost_models.stacks import DEFAULT_STACK, stack_knobs
    from autoplan.models.source import record_runs_torch_ops

    what = record_runs_torch_ops(plan.model_source) if plan.kernels == "fused" else None
    if what is not None:  # written before session 23: priced with kernels its model never runs
        return [f"plan {plan.short_hash} prices autoplan's fused kernels, which its model ({what}) does not run: "
                "the model keeps its own modules and runs torch's ops; re-plan it (estimate and search price "
                "torch's kernels for it)"]
    moe = plan.model.moe
    if moe is not None and moe.routed_scale != 1.0:
        return [f"plan {plan.short_hash} prices experts padded to capacity {moe.capacity_factor:g} "
                "(moe.pad_to_capacity), which autoplan's runtime does not run (it routes dropless, unpadded): "
                "re-plan without pad_to_capacity to run it here, or `autoplan export` it for Megatron"]
    base = DEFAULT_STACK if plan.stack is None else plan.stack.split("+", 1)[0]
    if base != DEFAULT_STACK:
        return [f"plan {plan.short_hash} is priced for the {base} stack, not for autoplan's runtime, which is what "
                f"`autoplan run` trains with: re-plan it with --stack {DEFAULT_STACK} to run it here, or `autoplan "
                f"export` it for {base}"]
    own = stack_knobs(DEFAULT_STACK)
    foreign = [f"{k}={str(getattr(plan.training, k)).lower()}" for k, v in own.items()
               if k not in RUNTIME_KNOBS and getattr(plan.training, k) != v and _knob_prices(plan, k)]
    if foreign:
        return [f"plan {plan.short_hash} sets stack knobs autoplan's runtime does not have ({', '.join(foreign)}): "
                f"its prediction is for another program; re-plan without them (only "
                f"{', '.join(sorted(RUNTIME_KNOBS))} can be set for a run)"]
    return []


def _local_gpus() -> tuple[int, list[str]]:
    """GPU count and names from nvidia-smi (no torch import in the launcher)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, []
    names = [x.strip() for x in out.splitlines() if x.strip()]
    return len(names), names


def _same_gpu(plan_gpu: str, device_name: str) -> bool:
    """'h100-sxm' vs 'NVIDIA H100 80GB HBM3': the model number must appear in the device name."""
    key = plan_gpu.split("-")[0].lower()
    return key in device_name.lower().replace(" ", "")


def restart_args(train_args: list[str], max_restarts: int) -> list[str]:
    """With restarts, every attempt resumes from the newest complete checkpoint in --save (--auto-resume)."""
    from autoplan.cost_models.errors import PlanError

    args = list(train_args)
    if args[:1] == ["--"]:
        args = args[1:]
    if not max_restarts:
        return args
    save = _value(args, "--save")
    if save is None:
        raise PlanError(f"--max-restarts {max_restarts} needs checkpoints to restart from", "no --save DIR",
                        "pass -- --save DIR --save-every K")
    resume = _value(args, "--resume")
    if resume is not None:
        r, s = Path(resume).resolve(), Path(save).resolve()
        if r != s and r.parent != s:
            raise PlanError(f"--max-restarts resumes from --save {save}, but --resume names {resume}",
                            "a restart could not find that run's checkpoints", "pass --resume with the --save DIR")
        i = args.index("--resume") if "--resume" in args else next(
            k for k, a in enumerate(args) if a.startswith("--resume="))
        del args[i: i + (2 if args[i] == "--resume" else 1)]
    if "--auto-resume" not in args:
        args.append("--auto-resume")
    return args


def _value(args: list[str], flag: str) -> str | None:
    for k, a in enumerate(args):
        if a == flag and k + 1 < len(args):
            return args[k + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _resume_dir(train_args: Sequence[str]) -> str | None:
    """The DIR of `--resume DIR` / `--resume=DIR` among the training arguments (the last one wins, as argparse)."""
    found = None
    args = list(train_args)
    for i, a in enumerate(args):
        if a == "--resume" and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith("--resume="):
            found = a.split("=", 1)[1]
    return found


def run(plan_path: str | Path, nproc_per_node: int | None = None, train_args: Sequence[str] = (),
        env: dict[str, str] | None = None, *, nnodes: int = 1, rdzv_endpoint: str | None = None,
        rdzv_id: str = "autoplan", print_command: bool = False, max_restarts: int = 0,
        term_timeout: float = 60.0, force: bool = False, trusted_module: str | None = None) -> int:
    """Check the plan, the process count and the machine, then run torchrun in the foreground (or print its
    command); returns its exit code (128+signal after SIGTERM/SIGINT). Raises PlanError (a bad or tampered plan,
    a plan naming a Python module the user did not name as `trusted_module` (--model), a launch the plan was not
    made for, or a machine it does not suit without --force)."""
    import shlex

    from autoplan.cost_models.errors import PlanError
    from autoplan.plan import load_plan

    if max_restarts < 0:
        raise PlanError("--max-restarts must be >= 0", f"got {max_restarts}", "pass --max-restarts 3")
    if not term_timeout > 0:
        raise PlanError("--term-timeout must be > 0 seconds", f"got {term_timeout}", "pass --term-timeout 60")
    plan = load_plan(plan_path)
    from autoplan.models import check_plan_model
    from autoplan.models.source import TRUSTED_MODULE_ENV, check_module_trusted, plan_module

    module = plan_module(plan)
    check_module_trusted(plan, trusted_module, f"if you trust that code, run `autoplan run {plan_path} --model "
                                               f"{module}`")
    check_plan_model(plan)  # the recorded architecture builds as planned: refused before launch, not in torchrun
    check_dtype(plan)
    nproc, warnings = check_launch(plan, nproc_per_node, nnodes, rdzv_endpoint)
    problems = check_machine(plan, nproc)
    if problems and not force and not print_command:
        raise PlanError(f"the plan does not suit this machine: {problems[0]}",
                        "; ".join(problems[1:]), "use a plan made for this machine, or pass --force to run anyway")
    warnings += problems
    for w in warnings:
        print(f"autoplan run: warning: {w}", file=sys.stderr)
    args = restart_args(list(train_args), max_restarts)
    resume = _resume_dir(train_args)
    if resume is not None:  # refuse a foreign checkpoint here, before any rank could unpickle it (SECURITY.md)
        from autoplan.runtime import checkpoint

        # manifest and sizes only: the workers verify every checksum (and fall back on restarts) themselves
        checkpoint.check_trusted(checkpoint.resolve(resume), checksums=False)
    # a printed command is for another shell (a SLURM script, another node) that may start elsewhere: it names the
    # plan checked here by its absolute path (the training arguments are passed as given)
    cmd = torchrun_command(Path(plan_path).resolve() if print_command else plan_path, nproc, args, nnodes=nnodes,
                           rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, max_restarts=max_restarts)
    trust = {TRUSTED_MODULE_ENV: module} if module else {}
    if print_command:
        env_words = {**trust, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env_words.items()) + " " + shlex.join(cmd))
        return 0
    full_env = dict(os.environ if env is None else env)
    full_env.update(trust)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH", "")]))
    return supervise(cmd, full_env, term_timeout)


_AGENT_LINE = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ \S*torch/distributed/elastic/")
_CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
VERBOSE_LAUNCH_ENV = "AUTOPLAN_TORCHRUN_REPORT"  # =1: keep torchrun's own failure report


class TorchrunReport:
    """Drops torchrun's failure report once a worker has said in one line what went wrong.

    A worker that stops on an autoplan error prints `autoplan run: <Error>: what. fix: ...` and exits 2; torchrun
    then adds its agent's log lines (`E1128 ... torch/distributed/elastic/... failed (exitcode: 2)`, `Sending
    process N closing signal SIGTERM`), its own traceback ending in ChildFailedError and a table of the failed
    ranks: ~50 lines under the one that matters. Once an autoplan error line has been seen, those three are
    dropped (a traceback is held until its last line shows whose it is: a worker's own traceback still passes).
    Before that, and for any other output, every line passes."""

    def __init__(self) -> None:
        self.explained = False
        self.dropped = 0
        self._held: list[str] = []
        self._rules = 0  # "=====" lines of the failure table dropped so far (it ends with the second)
        self._in_report = False

    def feed(self, line: str) -> list[str]:
        """The lines to write now for one line read (none, this one, or a held traceback)."""
        if self._in_report:
            self.dropped += 1
            if line.strip() and set(line.strip()) == {"="}:
                self._rules += 1
                self._in_report = self._rules < 2
            return []
        if line.startswith("autoplan run:") or "] autoplan run:" in line:
            self.explained = self.explained or "warning:" not in line
            return [line]
        if not self.explained:
            return [line]
        if self._held:
            self._held.append(line)
            if line.startswith(_CHILD_FAILED):
                self.dropped += len(self._held)
                self._held, self._in_report, self._rules = [], True, 0
                return []
            if line[:1] in (" ", "\t") or line.startswith("Traceback"):
                return []
            out, self._held = self._held, []
            return out
        if line.startswith("Traceback (most recent call last):"):
            self._held = [line]
            return []
        if _AGENT_LINE.match(line):
            self.dropped += 1
            return []
        return [line]

    def flush(self) -> list[str]:
        out, self._held = self._held, []
        return out


def supervise(cmd: list[str], env: dict[str, str], term_timeout: float) -> int:
    """Run torchrun in its own process group; forward SIGTERM/SIGINT to it (it forwards them to the workers,
    which save and exit); after `term_timeout` seconds kill the whole group. While stopping, torchrun's own
    shutdown traceback is dropped: the workers' one-line messages say what happened and how to resume; after a
    worker's one-line error, torchrun's failure report is dropped too (`TorchrunReport`; keep it with
    AUTOPLAN_TORCHRUN_REPORT=1)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True, bufsize=1)
    got: list[int] = []  # signals received
    since: list[float] = []  # when the first one came

    def forward(signum, frame):
        if not got:
            print(f"autoplan run: {signal.Signals(signum).name}: asking every worker to save and stop (at most "
                  f"{term_timeout:g} s)", file=sys.stderr, flush=True)
        got.append(signum)
        since.append(time.monotonic())
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)

    report = None if env.get(VERBOSE_LAUNCH_ENV) == "1" else TorchrunReport()

    def pump():
        for line in proc.stderr:
            if got and not (line.startswith("autoplan") or "] autoplan run:" in line):
                continue
            for out in report.feed(line) if report else [line]:
                sys.stderr.write(out)
            sys.stderr.flush()
        for out in report.flush() if report else []:
            sys.stderr.write(out)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if since and time.monotonic() - since[0] > term_timeout:
                print(f"autoplan run: the workers did not stop within --term-timeout {term_timeout:g} s; killing "
                      "them", file=sys.stderr, flush=True)
                _kill_group(proc.pid)
                rc = proc.wait()
                break
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc.poll() is None:  # interrupted ourselves: nothing of this job outlives the launcher
            _kill_group(proc.pid)
        reader.join(timeout=5)
    if report and report.dropped and not got:
        print(f"autoplan run: the job stopped (torchrun exit {rc}); the workers' lines above say why "
              f"({report.dropped} lines of torchrun's own report left out: {VERBOSE_LAUNCH_ENV}=1 shows them)",
              file=sys.stderr, flush=True)
    return 128 + got[0] if got else rc


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc): torchrun starts each worker in a session of its own, so killing
    torchrun's process group would miss them."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_group(pid: int) -> None:
    """SIGKILL torchrun and everything it started (a stopped or hung worker included): no orphans."""
    victims = _descendants(pid) if Path("/proc").is_dir() else []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for v in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(v, signal.SIGKILL)
