"""A launch script read, not run: `autoplan from-megatron --script` expands the shell the way bash would for the
subset Megatron launch scripts use (variables, arrays, defaults, arithmetic, string tests), and says or refuses
what only running the script could tell."""

from __future__ import annotations

import json

import pytest

from autoplan.cli import main
from autoplan.cost_models.errors import ConfigError
from autoplan.inspect.launch_script import read_script
from autoplan.inspect.megatron_import import read_megatron

# Written in the style of Megatron-LM's examples/*/train_*.sh: settings as variables, flag groups as arrays
# (with comments inside), the world size by arithmetic, environment defaults, a mock-data branch, a pipe to tee.
SCRIPT = r"""#!/bin/bash
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
CHECKPOINT_PATH=${1:-"checkpoints/run"}   # positional, with a default
GPUS_PER_NODE=8
NUM_NODES=${NUM_NODES:-2}
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))
TP=2; PP=2
LAYERS=24
mkdir -p "$(dirname "$CHECKPOINT_PATH")"

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES   # nodes (see above)
)
MODEL_ARGS=(
    --num-layers ${LAYERS}
    --hidden-size 2048 --num-attention-heads 16
    --seq-length 2048 --max-position-embeddings 2048
    --swiglu   # gated MLP
)
TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size $(( WORLD_SIZE / (TP * PP) * 2 * 4 ))
    --bf16
    --lr 1e-4
)
PARALLEL_ARGS=(--tensor-model-parallel-size $TP --pipeline-model-parallel-size "$PP")
if [ "${USE_FSDP:-0}" = 1 ]; then
    PARALLEL_ARGS+=(--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params)
else
    PARALLEL_ARGS+=(--use-distributed-optimizer)
fi
if [[ "$DATA" == "" ]] || [[ "$DATA" == "MOCK" ]]; then
    DATA_ARGS="--mock-data --vocab-size 32000"
else
    DATA_ARGS="--data-path $DATA --vocab-size 128256"
fi
torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    ${MODEL_ARGS[@]} ${TRAINING_ARGS[@]} \
    "${PARALLEL_ARGS[@]}" $DATA_ARGS \
    --save $CHECKPOINT_PATH 2>&1 | tee log.txt
"""


def _flag(words, name):
    return words[words.index(name) + 1]


def test_variables_arrays_arithmetic_and_string_tests_expand_as_bash_would():
    cmd = read_script(SCRIPT, env={})
    w = cmd.words
    assert w[:5] == ["torchrun", "--nproc_per_node", "8", "--nnodes", "2"] and w[5] == "pretrain_gpt.py"
    assert _flag(w, "--num-layers") == "24" and "--swiglu" in w
    assert _flag(w, "--global-batch-size") == "32"  # 16 GPUs / (2 x 2) x 2 x 4
    assert _flag(w, "--pipeline-model-parallel-size") == "2"
    assert "--use-distributed-optimizer" in w and "--use-megatron-fsdp" not in w  # USE_FSDP unset: the else
    assert "--mock-data" in w and _flag(w, "--vocab-size") == "32000"  # DATA unset: the first branch
    assert _flag(w, "--save") == "checkpoints/run"  # ${1:-default}: no positional parameters
    assert "tee" not in w and "2>&1" not in w and "log.txt" not in w
    # every branch was decided; what decided them in this environment is said
    assert cmd.notes == ["if-tests read as in this environment, where DATA is unset; set them to read the script "
                         "as it runs elsewhere"]


def test_the_environment_is_the_one_the_script_would_run_in():
    cmd = read_script(SCRIPT, env={"NUM_NODES": "4", "USE_FSDP": "1", "DATA": "/data/corpus", "HOME": "/root"})
    w = cmd.words
    assert _flag(w, "--nnodes") == "4" and _flag(w, "--global-batch-size") == "64"
    assert "--use-megatron-fsdp" in w and "--use-distributed-optimizer" not in w
    assert _flag(w, "--data-path") == "/data/corpus" and _flag(w, "--vocab-size") == "128256"
    note = " ".join(cmd.notes)
    assert "from the environment: DATA=/data/corpus, NUM_NODES=4, USE_FSDP=1" in note and "HOME" not in note
    run = read_megatron(w)
    assert run.gpus == 32 and run.parallel.zero == 3 and run.global_batch == 64


def test_a_branch_that_needs_running_is_read_as_if_taken_and_said():
    script = ("LAYERS=24\nif [ -f /etc/big-model ]; then\n  LAYERS=48\nfi\n"
              "torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers $LAYERS --seq-length 2048\n")
    cmd = read_script(script, env={})
    assert _flag(cmd.words, "--num-layers") == "48"
    assert len(cmd.notes) == 1 and "cannot evaluate without running" in cmd.notes[0] and "LAYERS" in cmd.notes[0]
    # an if whose test is decided drops the branch not taken, and says nothing
    decided = script.replace("[ -f /etc/big-model ]", '[ "$SIZE" = big ]')
    assert _flag(read_script(decided, env={}).words, "--num-layers") == "24"
    assert _flag(read_script(decided, env={"SIZE": "big"}).words, "--num-layers") == "48"


def test_what_only_running_could_tell_is_refused_where_autoplan_reads_it():
    base = "torchrun --nproc-per-node 8 pretrain_gpt.py --hidden-size 2048 --num-attention-heads 16 "
    words = read_script(base + "--num-layers $(cat layers.txt) --seq-length 2048 --vocab-size 32000\n").words
    with pytest.raises(ConfigError, match=r"--num-layers is \$\(cat layers.txt\).*command substitution"):
        read_megatron(words)
    words = read_script(base + "--num-layers $1 --seq-length 2048 --vocab-size 32000\n").words
    with pytest.raises(ConfigError, match="positional parameter"):
        read_megatron(words)
    words = read_script(base + "--num-layers $LAYERS --seq-length 2048 --vocab-size 32000\n", env={}).words
    with pytest.raises(ConfigError, match="set neither in the script nor in the environment"):
        read_megatron(words)
    # where no flag autoplan reads depends on it, it is harmless
    ok = read_script(base + "--num-layers 4 --seq-length 2048 --vocab-size 32000 --save $1 --load `pwd`\n").words
    assert read_megatron(ok).model.num_layers == 4


def test_a_command_inside_bash_c_and_a_heredoc_is_found():
    script = ('ARGS=(--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --vocab-size 1000)\n'
              'CMD="cd /workspace; export PYTHONPATH=/workspace; python /workspace/pretrain_gpt.py ${ARGS[@]}"\n'
              'sbatch <<EOF\nsrun --container-image=img bash -x -c "${CMD}" 2>&1 | tee out.log\nEOF\n')
    w = read_script(script, env={}).words
    assert w[:2] == ["srun", "--container-image=img"] and "python" in w  # srun stays the launcher
    assert _flag(w, "--num-layers") == "4" and _flag(w, "--vocab-size") == "1000"


def test_an_argument_loop_does_not_run_without_arguments():
    """`while [[ $# -gt 0 ]]; do case $1 in ...` (Megatron-LM's gpt-oss example): the script has no arguments
    here, so the loop never runs and its assignments are not read as if they had."""
    script = ('CKPT=ckpt\nwhile [[ $# -gt 0 ]]; do\n  case $1 in\n    --ckpt)\n      CKPT="$2"\n      shift 2\n'
              '      ;;\n  esac\ndone\npython pretrain_gpt.py --num-layers 2 --save $CKPT\n')
    cmd = read_script(script, env={})
    assert _flag(cmd.words, "--save") == "ckpt"
    assert not any("branch" in n for n in cmd.notes)


def test_a_sourced_file_is_said_not_followed():
    script = ". `pwd`/CONFIG.sh\nsource ./env.sh\npython pretrain_gpt.py --num-layers 4 --seq-length 128\n"
    note = " ".join(read_script(script, env={}).notes)
    assert "not read: the file(s) the script sources (`pwd`/CONFIG.sh, ./env.sh)" in note


def test_a_script_without_a_training_command_is_a_clear_error():
    with pytest.raises(ConfigError, match="no training command in the script"):
        read_script("echo hello\nNUM_LAYERS=4\n")


def test_the_cli_reads_the_script_and_says_what_it_assumed(tmp_path, capsys, monkeypatch):
    path = tmp_path / "train.sh"
    path.write_text(SCRIPT)
    monkeypatch.setenv("NUM_NODES", "4")
    monkeypatch.delenv("USE_FSDP", raising=False)
    monkeypatch.delenv("DATA", raising=False)
    assert main(["from-megatron", "--cluster", "dgx-h100", "--script", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["from_megatron"]["parallel"].startswith("tp=2,pp=2")
    assert "--script" in captured.err and "NUM_NODES=4" in captured.err
    assert main(["from-megatron", "--cluster", "dgx-h100", "--script", str(tmp_path / "missing.sh")]) == 2
    assert "cannot read the launch script" in capsys.readouterr().err


# The shape of NVIDIA's SC21 reproduction scripts (examples/academic_paper_scripts/sc21): the flags come through the
# environment from the submitting script (CONFIG.sh exports MEGATRON_PARAMS), the nodes from `sbatch --nodes`, the
# tasks per node from an #SBATCH line, and srun starts one process per GPU through `sh -c`.
SRUN = """#!/bin/bash
#SBATCH -t 0:30:00 --exclusive --ntasks-per-node=8
HERE=`pwd`
CMD="python -u ${CODE_DIR}/pretrain_gpt.py ${MEGATRON_PARAMS}"
srun -l --container-image "img" --output=${HERE}/logs/%x_%j.log sh -c "${CMD}"
"""
SC21_18B = ("--activations-checkpoint-method uniform --tensor-model-parallel-size 8 --pipeline-model-parallel-size 1 "
            "--micro-batch-size 8 --global-batch-size 1024 --num-layers 40 --hidden-size 6144 --num-attention-heads 48 "
            "--DDP-impl torch --seq-length 2048 --max-position-embeddings 2048 --fp16 --vocab-file gpt2-vocab.json "
            "--loss-scale 8192")


def test_an_srun_script_prices_as_the_fidelity_row_of_the_same_run(tmp_path, capsys, monkeypatch):
    """SC21's 18B run read from its launch script through `from-megatron --stack megatron-2021` is the fidelity
    benchmark's row for it, to the digit: the benchmark prices what a user's own command prices."""
    from benchmarks.fidelity import DEFAULT_REF, evaluate

    path = tmp_path / "SRUN.sh"
    path.write_text(SRUN)
    monkeypatch.setenv("MEGATRON_PARAMS", SC21_18B)
    monkeypatch.setenv("SLURM_NNODES", "32")
    assert main(["from-megatron", "--cluster", "dgx-a100-80g", "--stack", "megatron-2021", "--script", str(path),
                 "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "256 processes, as srun starts them" in captured.err
    assert out["from_megatron"]["parallel"] == "tp=8,pp=1,cp=1,ep=1,vp=1,mbs=8,sp=0,zero=0,recompute=full,schedule=1f1b"
    if not DEFAULT_REF.exists():
        pytest.skip("shared/reference not present")
    row = next(r for r in evaluate(DEFAULT_REF) if r["model"] == "GPT-18.4B")
    assert out["step_time_s"] == pytest.approx(row["predicted_step_s"], rel=1e-9)
    # without the flags in the environment the command has none: said, with what to set
    monkeypatch.delenv("MEGATRON_PARAMS")
    assert main(["from-megatron", "--cluster", "dgx-a100-80g", "--script", str(path)]) == 2
    assert "the script's training command has no --flags here" in capsys.readouterr().err


def test_srun_by_its_path_counts_its_tasks():
    script = "#SBATCH --nodes=4 --ntasks-per-node=8\n/usr/bin/srun python pretrain_gpt.py --num-layers 2\n"
    assert read_script(script, env={}).gpus == 32


def test_a_bare_python_launch_is_one_process():
    words = read_script("python pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                        "--seq-length 128 --vocab-size 100 $@\n", env={}).words
    run = read_megatron(words)
    assert run.gpus == 1
