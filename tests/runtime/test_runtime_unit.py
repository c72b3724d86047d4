"""Runtime pieces that need no second process: launch checks, data, CP chunks, recompute regions, codegen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.api import make_plan
from autoplan.cost_models.errors import PlanError
from autoplan.runtime.parallel_dims import ParallelDims, check_model_matches, check_module_matches
from autoplan.specs import TrainingSpec, load_cluster, load_model
from tests.train_cli import train_env, train_one_process

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
TRAIN = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32")


def plan_for(model="tiny-gpt", gpus=4, config="tp=2,pp=2", kernels="torch", training=TRAIN):
    return make_plan(load_model(model), load_cluster("local-cpu").with_gpus(gpus), training, config, kernels=kernels)


# ----------------------------------------------------------------------------- start-up checks


def test_plan_for_8_ranks_launched_on_4_is_refused():
    plan = plan_for(gpus=8, config="tp=2,pp=2")
    with pytest.raises(PlanError) as e:
        ParallelDims.from_plan(plan, world_size=4)
    msg = str(e.value)
    assert "is for 8 ranks but 4 processes were launched" in msg
    assert "--nnodes 2 --nproc-per-node 4" in msg  # local-cpu has 4 "GPUs" per node: 8 ranks are 2 nodes


def test_inconsistent_degrees_are_refused():
    with pytest.raises(PlanError, match="pp\\*dp\\*cp\\*tp = 2\\*1\\*1\\*2 = 4, but 2 processes"):
        ParallelDims(pp=2, dp=1, cp=1, tp=2, ep=1, world_size=2)
    with pytest.raises(PlanError, match="ep must divide dp"):
        ParallelDims(pp=1, dp=2, cp=1, tp=1, ep=4, world_size=2)


def test_plan_for_another_model_is_refused():
    plan = plan_for("tiny-gpt")
    with pytest.raises(PlanError, match="made for model 'tiny-gpt', not 'tiny-llama'"):
        check_model_matches(plan, load_model("tiny-llama"))
    check_model_matches(plan, load_model("tiny-gpt"))
    from autoplan.zoo import build_model

    with pytest.raises(PlanError, match="does not match plan"):
        check_module_matches(plan, build_model(load_model("tiny-moe")))
    check_module_matches(plan, build_model(load_model("tiny-gpt")))


# ----------------------------------------------------------------------------- data


def test_synthetic_data_is_reproducible_and_sliced_by_rank():
    from autoplan.runtime.data import SyntheticDataset, local_batch
    from autoplan.runtime.parallelize import load_balanced_positions

    ds = SyntheticDataset(128, 64, 8, seed=1)
    assert torch.equal(ds.batch(3), SyntheticDataset(128, 64, 8, seed=1).batch(3))
    assert not torch.equal(ds.batch(3), ds.batch(4))
    full = ds.batch(0)
    parts = [local_batch(full, dp=2, dp_rank=r, cp_positions=None) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full[:, :-1])
    pos = [load_balanced_positions(64, 2, r) for r in range(2)]
    x0, y0 = local_batch(full, dp=1, dp_rank=0, cp_positions=pos[0])
    assert torch.equal(x0, full[:, :-1][:, pos[0]]) and torch.equal(y0, full[:, 1:][:, pos[0]])


def test_load_balanced_chunks_cover_the_sequence():
    from autoplan.runtime.parallelize import load_balanced_positions

    p = [load_balanced_positions(16, 2, r).tolist() for r in range(2)]
    assert p == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert sorted(sum((load_balanced_positions(24, 3, r).tolist() for r in range(3)), [])) == list(range(24))


def test_memmap_dataset(tmp_path):
    from autoplan.runtime.data import MemmapTokenDataset, write_token_file

    path = write_token_file(tmp_path / "tok.bin", list(range(100)) * 5, "uint16")
    ds = MemmapTokenDataset(path, seq_length=8, global_batch=2, vocab_size=128)
    b = ds.batch(0)
    assert b.shape == (2, 9) and b.dtype == torch.int64
    assert b[0].tolist() == list(range(9)) and b[1].tolist() == list(range(8, 17))
    path32 = write_token_file(tmp_path / "tok.i32", list(range(50)), "int32")
    assert MemmapTokenDataset(path32, 8, 1, 128).batch(1)[0, 0].item() == 8
    from autoplan.cost_models.errors import SpecError

    with pytest.raises(SpecError, match="ids up to 499"):
        MemmapTokenDataset(write_token_file(tmp_path / "big.bin", range(500)), 8, 2, vocab_size=128)


# ----------------------------------------------------------------------------- recompute


def _count_ops(fn) -> dict[str, int]:
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket._qualified_op_name).replace("::", ".")
            counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return counts


def test_recompute_regions_rerun_the_right_ops():
    from autoplan.runtime.parallelize import ATTENTION_CORE_OPS, apply_recompute, canonical_name
    from autoplan.zoo import build_model, cross_entropy_loss

    spec = load_model("tiny-llama")
    tokens = torch.randint(0, 128, (1, 16))
    counts, grads = {}, {}
    for mode in ("none", "selective", "full"):
        plan = plan_for("tiny-llama", gpus=1, config=f"recompute={mode}")
        model = build_model(spec)
        apply_recompute(model, plan.stages[0])
        loss = cross_entropy_loss(model(tokens), tokens)
        bwd = _count_ops(loss.backward)
        counts[mode] = (sum(bwd.get(op, 0) for op in ATTENTION_CORE_OPS),
                        bwd.get("aten.mm", 0) + bwd.get("aten.addmm", 0))
        grads[mode] = {canonical_name(n): p.grad for n, p in model.named_parameters()}
    (sdpa0, mm0), (sdpa1, mm1), (sdpa2, mm2) = counts["none"], counts["selective"], counts["full"]
    assert sdpa0 == 0
    assert sdpa1 == 4 and mm1 == mm0  # selective: the attention core's SDPA (the CPU flash op) runs again
    # full: whole blocks re-run: wq wk wv wo w1 w3 in each of 4 blocks; w2, the last op of a block, is not
    # re-run because non-reentrant checkpointing stops once every saved tensor has been recomputed
    assert sdpa2 == 4 and mm2 == mm0 + 4 * 6
    for mode in ("selective", "full"):  # and the gradients do not change
        for n, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][n], g, rtol=1e-5, atol=1e-7)


def test_a_partly_full_stage_recomputes_its_other_blocks_selectively():
    """recompute=full with recompute_layers below the stage's blocks: the first blocks re-run whole and the rest
    re-run their attention core, as the estimate, the counts and the stage ILP (`full_selective`) price it; before
    session 9 the runtime left the rest unwrapped."""
    from autoplan.codegen.program import recompute_regions
    from autoplan.runtime.parallelize import ATTENTION_CORE_OPS, apply_recompute, canonical_name
    from autoplan.zoo import build_model, cross_entropy_loss

    spec = load_model("tiny-llama")
    tokens = torch.randint(0, 128, (1, 16))
    runs = {}
    for config in ("recompute=none", "recompute=full,recompute_layers=2"):
        plan = plan_for("tiny-llama", gpus=1, config=config)
        model = build_model(spec)
        notes = apply_recompute(model, plan.stages[0])
        loss = cross_entropy_loss(model(tokens), tokens)
        bwd = _count_ops(loss.backward)
        runs[config] = (notes, recompute_regions(plan.stages[0]),
                        sum(bwd.get(op, 0) for op in ATTENTION_CORE_OPS),
                        bwd.get("aten.mm", 0) + bwd.get("aten.addmm", 0),
                        {canonical_name(n): p.grad for n, p in model.named_parameters()})
    _, _, sdpa0, mm0, g0 = runs["recompute=none"]
    notes, regions, sdpa, mm, g = runs["recompute=full,recompute_layers=2"]
    assert regions == ["layers.0", "layers.1", "layers.2.attention.core", "layers.3.attention.core"]
    assert notes == ["full: layers ['0', '1']", "selective: layers.2.attention.core",
                     "selective: layers.3.attention.core"]
    # two whole blocks (wq wk wv wo w1 w3 again, w2 not: early stop) and the attention core of all four
    assert sdpa0 == 0 and sdpa == 4 and mm == mm0 + 2 * 6
    for n, grad in g0.items():
        torch.testing.assert_close(g[n], grad, rtol=1e-5, atol=1e-7)


def test_the_block_method_leaves_a_partly_full_stages_other_blocks_plain():
    """partial_recompute=rest-none (Megatron's block method): the first blocks re-run whole, the others not at all;
    the emitted program passes the setting to apply_recompute."""
    from autoplan.codegen.emit import stage_source
    from autoplan.codegen.program import recompute_regions, stage_programs
    from autoplan.runtime.parallelize import ATTENTION_CORE_OPS, apply_recompute
    from autoplan.zoo import build_model, cross_entropy_loss

    spec = load_model("tiny-llama")
    tokens = torch.randint(0, 128, (1, 16))
    train = TRAIN.model_copy(update={"partial_recompute": "rest-none"})
    plan = plan_for("tiny-llama", gpus=1, config="recompute=full,recompute_layers=2", training=train)
    stage = plan.stages[0]
    model = build_model(spec)
    notes = apply_recompute(model, stage, rest=plan.training.partial_rest)
    bwd = _count_ops(cross_entropy_loss(model(tokens), tokens).backward)
    assert notes == ["full: layers ['0', '1']"]
    assert recompute_regions(stage, "none") == ["layers.0", "layers.1"]
    assert sum(bwd.get(op, 0) for op in ATTENTION_CORE_OPS) == 2  # the two whole blocks' attention only
    (program,) = stage_programs(plan)
    assert program.recompute == ["layers.0", "layers.1"]
    assert 'apply_recompute(model, STAGE, rest="none")' in stage_source(program)


# ----------------------------------------------------------------------------- codegen


def test_emitted_program_names_plan_layers_styles_and_kernels(tmp_path):
    from autoplan.codegen.emit import write_program

    plan = plan_for("tiny-llama", gpus=4, config="tp=2,pp=2,recompute=selective", kernels="fused")
    paths = write_program(plan, tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["README.md", "plan.json", "stage_0.py", "stage_1.py"]
    s1 = (tmp_path / "stage_1.py").read_text()
    assert plan.short_hash in s1 and plan.content_hash in s1
    assert "layers 2..3 + final norm + LM head + loss" in s1
    assert "ranks 2, 3" in s1
    assert '"attention.wq": ColwiseParallel(),' in s1
    assert "output_layouts=Shard(-1), use_local_output=False" in s1
    assert "selective: layers.2.attention.core, layers.3.attention.core" in s1
    assert '"layers.2.attention_norm": "FusedRMSNorm"' in s1 and "-> FusedSwiGLU" in s1
    assert 'del model.layers[key]' in s1 and 'for key in ["0", "1"]' in s1
    compile(s1, "stage_1.py", "exec")
    assert json.loads((tmp_path / "plan.json").read_text())["content_hash"] == plan.content_hash
    torch_plan = plan_for("tiny-llama", gpus=4, config="tp=2,pp=2", kernels="torch")
    assert "Fused" not in (write_program(torch_plan, tmp_path / "t")[0]).read_text()


def test_emitted_single_rank_program_builds_the_zoo_model():
    from autoplan.codegen.program import stage_programs
    from autoplan.runtime.parallelize import load_stage_program
    from autoplan.zoo import build_model

    for kernels in ("torch", "fused"):
        plan = plan_for("tiny-gpt", gpus=1, config="tp=1", kernels=kernels)
        (program,) = stage_programs(plan)
        model = load_stage_program(program)(ParallelDims(1, 1, 1, 1, 1, 1), seed=0)
        ref = build_model(plan.model)
        tokens = torch.randint(0, 128, (2, 16))
        torch.testing.assert_close(model(tokens), ref(tokens), rtol=1e-5, atol=1e-5)
        fused = [type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Fused")]
        assert bool(fused) == (kernels == "fused"), fused


def test_substitute_kernels_shares_parameters():
    from autoplan.codegen.fuse import substitute_kernels
    from autoplan.zoo import build_model

    model = build_model(load_model("tiny-llama"))
    w = model.layers["0"].attention_norm.weight
    notes = substitute_kernels(model, "fused")
    assert any("FusedRMSNorm" in n for n in notes)
    assert type(model.layers["0"].attention_norm).__name__ == "FusedRMSNorm"
    assert model.layers["0"].attention_norm.weight is w
    assert substitute_kernels(model, "torch") == []
    assert "not in this model" in substitute_kernels(model, {"layers.9.mlp_norm": "FusedRMSNorm"})[0]


# ----------------------------------------------------------------------------- one-process CLI


def test_train_cli_single_process(tmp_path):
    plan = plan_for("tiny-llama", gpus=1, config="tp=1,mbs=2", training=TrainingSpec(
        global_batch_size=4, seq_length=32, dtype="bf16"))
    _, rows = train_one_process(plan, tmp_path, steps=3, args=("--quiet",), timeout=120)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {"step", "loss", "step_time_s", "tokens_per_s", "peak_memory_gib", "predicted_step_time_s",
                "predicted_memory_gib"} <= set(r)
        assert 3 < r["loss"] < 6 and r["step_time_s"] > 0
        assert r["predicted_step_time_s"] == plan.prediction.step_time_s
    bad = subprocess.run([sys.executable, "-m", "autoplan.runtime.train", "--plan", str(tmp_path / "plan.json"),
                          "--model", "tiny-gpt"], cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "made for model 'tiny-llama', not 'tiny-gpt'" in bad.stderr


# ----------------------------------------------------------------------------- multi-node launch (no processes)


def test_multi_node_command_uses_c10d_rendezvous():
    from autoplan.runtime.launch import torchrun_command

    cmd = torchrun_command("p.json", 8, ["--steps", "5"], python="py", nnodes=16, rdzv_endpoint="node0:29500",
                           rdzv_id="job7")
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    joined = " ".join(cmd)
    assert "--nnodes 16 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id job7 --nproc-per-node 8" in joined
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--") + 1:] == ["--plan", "p.json", "--steps", "5"]
    assert "--standalone" in torchrun_command("p.json", 4)


def test_multi_node_launch_checks():
    from autoplan.runtime.launch import check_launch

    plan = plan_for(gpus=8, config="tp=2,pp=2")  # local-cpu: 4 per node, so 2 nodes
    assert check_launch(plan, None, 2, "h:1") == (4, [])
    nproc, warnings = check_launch(plan, 2, 4, "h:1")  # 4 nodes of 2: runs, but not as planned
    assert nproc == 2 and "made for 4 GPUs per node" in warnings[0]
    with pytest.raises(PlanError, match="needs a rendezvous address"):
        check_launch(plan, None, 2, None)
    with pytest.raises(PlanError, match="not a multiple of --nnodes 3"):
        check_launch(plan, None, 3, "h:1")
    with pytest.raises(PlanError, match="is for 8 ranks but 6 processes"):
        check_launch(plan, 3, 2, "h:1")


def test_print_command_prints_one_line_per_node(tmp_path, capsys, monkeypatch):
    from autoplan.runtime.launch import run

    path = plan_for(gpus=8, config="tp=2,pp=2").save(tmp_path / "p.json")
    assert run(path, nnodes=2, rdzv_endpoint="node0:29500", train_args=["--steps", "3"], print_command=True) == 0
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and "--nnodes 2" in out and "--nproc-per-node 4" in out and str(path) in out
    # a relative plan path is printed absolute: the command may run from another directory
    monkeypatch.chdir(tmp_path)
    assert run("p.json", nnodes=2, rdzv_endpoint="node0:29500", print_command=True) == 0
    words = capsys.readouterr().out.split()
    assert str((tmp_path / "p.json").resolve()) in words and "p.json" not in words


def test_garbage_collection_runs_between_steps_and_restores_the_collector():
    import gc

    from autoplan.runtime.train import GarbageCollection

    seen: list[int] = []

    def on_gc(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    assert gc.isenabled()
    gc.callbacks.append(on_gc)
    try:
        collector = GarbageCollection(every=3)
        assert not gc.isenabled()  # nothing automatic inside the steps
        seen.clear()
        for done in range(7):
            collector.between_steps(done)
        assert seen == [1, 1]  # after steps 3 and 6, generations 0-1
        collector.close()
        assert gc.isenabled()
        off = GarbageCollection(every=0)  # 0: the collector is left as it was
        assert gc.isenabled()
        off.close()
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable()


def test_step_timer_waits_for_the_device_before_every_clock_read():
    """On a GPU the timer's buckets must hold device time: `sync` runs before the first clock read and before
    every boundary's, so work launched inside a region is charged to that region."""
    import torch

    from autoplan.runtime.timing import StepTimer

    calls = []
    w = torch.randn(8, 8, requires_grad=True)
    with StepTimer(sync=lambda: calls.append("sync")) as t:
        calls.append("start")
        loss = (w @ w).sum()
        loss.backward()  # opens and closes the backward phase: two boundaries
    assert calls[0] == "sync" and calls[1] == "start"
    assert calls.count("sync") == 1 + 3  # entering, backward's push and pop, the final flush
    assert set(t.buckets) == {"forward", "backward"}


def test_a_bf16_step_casts_each_weight_once_for_all_its_micro_batches():
    """Autocast keeps one 16-bit copy of each weight for the whole step (Trainer._context's outer region), not one
    per micro-batch: the copies the step's forwards save for backward are one storage per weight."""
    import torch
    import torch.distributed as dist

    from autoplan.api import make_plan
    from autoplan.runtime.data import SyntheticDataset
    from autoplan.runtime.engine import Trainer
    from autoplan.runtime.parallel_dims import ParallelDims
    from autoplan.specs import TrainingSpec, load_cluster, load_model

    model = load_model("tiny-gpt")
    plan = make_plan(model, load_cluster("local-cpu", gpus=1),
                     TrainingSpec(global_batch_size=4, seq_length=32, dtype="bf16", kernels="torch"), "mbs=1")
    assert dist.is_available() and not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dims = ParallelDims.from_plan(plan, 1)
        dims.build_mesh()
        trainer = Trainer(plan, dims, device=torch.device("cpu"), seed=0)
        shapes = {tuple(sorted(p.shape)) for p in trainer.pm.modules[0].parameters() if p.dim() == 2}
        copies: list[int] = []

        def pack(t):
            if t.dtype == torch.bfloat16 and t.dim() == 2 and tuple(sorted(t.shape)) in shapes:
                copies.append(t.untyped_storage().data_ptr())
            return t

        data = SyntheticDataset(model.vocab_size, 32, 4, seed=0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            res = trainer.step(data.batch(0))
    finally:
        dist.destroy_process_group()
    assert trainer.n_micro == 4 and res.loss == res.loss  # four micro-batches, a finite loss
    # tiny-gpt: 4 blocks x (wq, wk, wv, wo, w1, w2) + the tied head = 25 weights, each saved once per micro-batch
    assert len(copies) == 4 * 25
    assert len(set(copies)) == 25


# torchrun's stderr after a worker's start-up error (torch 2.13, trimmed to its shape): the agent's log lines, its
# traceback ending in ChildFailedError, and the failure table between two rules of '='.
_AGENT = "W1128 06:28:47.197000 2062 /x/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 2068 " \
         "closing signal SIGTERM\n"
_TORCHRUN_TB = ["Traceback (most recent call last):\n", '  File "/x/torch/distributed/run.py", line 1032, in <module>\n',
                "    main()\n", "    raise ChildFailedError(\n", f"{'torch.distributed.elastic.multiprocessing.errors'}."
                "ChildFailedError: \n", "=" * 60 + "\n", "autoplan.runtime.train FAILED\n", "-" * 60 + "\n",
                "Failures:\n", "[1]:\n", "  exitcode  : 2 (pid: 838)\n", "-" * 60 + "\n", "Root Cause (first observed "
                "failure):\n", "[0]:\n", "  exitcode  : 2 (pid: 837)\n", "=" * 60 + "\n"]


def _through(lines: list[str]) -> list[str]:
    from autoplan.runtime.launch import TorchrunReport

    r = TorchrunReport()
    out = [x for line in lines for x in r.feed(line)] + r.flush()
    return out


def test_torchruns_report_is_dropped_after_a_workers_one_line_error():
    err = "autoplan run: AutoplanError: --profile-step must name a step of this run: got 99. fix: pass 1-22\n"
    assert _through([err, _AGENT, _AGENT, *_TORCHRUN_TB]) == [err]
    after = "a line written after the report\n"
    assert _through([f"[rank 0] {err}", _AGENT, *_TORCHRUN_TB, after]) == [f"[rank 0] {err}", after]


def test_torchruns_report_stays_without_a_workers_error_and_a_workers_traceback_always_passes():
    # no autoplan error line (a worker killed, a crash): everything passes, warnings do not count as errors
    warn = "autoplan run: warning: skipped a broken checkpoint: x\n"
    assert _through([warn, _AGENT, *_TORCHRUN_TB]) == [warn, _AGENT, *_TORCHRUN_TB]
    # a worker's own Python traceback after another worker's one-line error is held only until its last line
    err = "[rank 0] autoplan run: CheckpointError: checkpoint c is corrupt. fix: resume from an earlier one\n"
    crash = ["Traceback (most recent call last):\n", '  File "/x/train.py", line 3, in step\n', "    f()\n",
             "RuntimeError: boom\n"]
    assert _through([err, *crash, _AGENT, *_TORCHRUN_TB]) == [err, *crash]
    # a traceback cut off by the end of the stream is written out
    assert _through([err, *crash[:2]]) == [err, *crash[:2]]


def test_run_summary_compares_with_the_prediction_and_says_how_to_fix_the_spec():
    from autoplan.runtime.train import RunSummary

    plan = make_plan(load_model("tiny-gpt"), load_cluster("local-cpu", gpus=2),
                     TrainingSpec(global_batch_size=4, seq_length=32, dtype="fp32", kernels="torch"), "dp=2")
    pred = plan.prediction.step_time_s

    def lines(times, peak=None):
        s = RunSummary(plan, 0, "my-plan.json")
        for i, t in enumerate(times):
            s.add({"step": 11 + i, "loss": 5.0 - i, "step_time_s": t, "peak_memory_gib": peak,
                   "memory_measured_step": 13 if peak else None})
        return s.lines()

    assert lines([]) == []
    # the first step of the launch is left out of the median (steps 12-14 here: a resumed run)
    got = lines([50 * pred, 1.4 * pred, 1.0 * pred, 1.45 * pred])
    assert got[0] == (f"done: 14 steps; step time {1.4 * pred * 1e3:.1f} ms (median of steps 12-14) = 1.40 x the "
                      f"predicted {pred * 1e3:.1f} ms; loss 5.0000 -> 2.0000")
    assert len(got) == 1  # within the band: no note, and no memory line before memory was measured
    slow = lines([pred, 2.0 * pred, 2.0 * pred], peak=0.25)
    tensors = plan.prediction.memory_gib["per_stage"][0] - plan.cluster.gpu.calibration.framework_overhead_gib
    assert slow[1].startswith(f"tensor memory 256.0 MiB (step 13) = {0.25 / tensors:.2f} x the "
                              f"{tensors * 1024:.1f} MiB predicted for stage 0")
    big = RunSummary(plan, 0, "my-plan.json")
    big.add({"step": 1, "loss": 5.0, "step_time_s": pred, "peak_memory_gib": 61.5, "memory_measured_step": 1})
    assert f"tensor memory 61.50 GiB (step 1) = {61.5 / tensors:.2f} x the" in big.lines()[1]
    assert slow[2].startswith("note: this machine runs the plan 2.0x slower than cluster spec 'local-cpu'")
    assert "autoplan tune --plan my-plan.json --cluster-out tuned.yaml" in slow[2]
    assert "2.5x faster" in lines([pred, 0.4 * pred])[-1]
