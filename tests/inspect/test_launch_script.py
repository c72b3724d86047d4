"""A launch script read, not run: `autoplan from-megatron --script` expands the shell the way bash would for the
subset Megatron launch scripts use (variables, arrays, defaults, arithmetic, string tests), and says or refuses
what only running the script could tell."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_a_sourced_file_is_read_not_run_and_one_that_cannot_be_found_is_said(tmp_path):
    """`.` / `source` read the file into the same shell (its variables are the script's), from the directory the
    script runs in; a name only running could give (`$(cmd)`, an unset variable), or no such file, is said."""
    (tmp_path / "CONFIG.sh").write_text("LAYERS=12\nexport PARAMS=\"--num-layers $LAYERS --seq-length 128\"\n"
                                        "return\nLAYERS=99\n")  # `return` ends a sourced file
    (tmp_path / "loop.sh").write_text(". ./loop.sh\nHIDDEN=256\n")  # sources itself: read once
    script = (". `pwd`/CONFIG.sh\nsource ./loop.sh\nsource ./env.sh\nsource $SITE/env.sh\n"
              "python pretrain_gpt.py $PARAMS --hidden-size $HIDDEN\n")
    cmd = read_script(script, env={}, path=str(tmp_path / "run.sh"), cwd=str(tmp_path))
    assert _flag(cmd.words, "--num-layers") == "12" and _flag(cmd.words, "--hidden-size") == "256"
    note = " ".join(cmd.notes)
    assert f"read, not run: {tmp_path}/CONFIG.sh; {tmp_path}/loop.sh" in note
    assert "not read:" in note and "./env.sh" in note and "$SITE/env.sh" in note and "loop.sh (sourced again" in note
    # without a directory `pwd` is not known, and nothing is read
    unknown = read_script(script.replace("$PARAMS", "--num-layers 2 --seq-length 8"), env={})
    assert "`pwd`/CONFIG.sh" in " ".join(unknown.notes) and _flag(unknown.words, "--hidden-size") == "$HIDDEN"
    # run from elsewhere: bash would miss CONFIG.sh; the one beside the script is read, and that is said
    elsewhere = read_script(script, env={}, path=str(tmp_path / "run.sh"), cwd="/nonexistent/dir")
    assert _flag(elsewhere.words, "--num-layers") == "12"
    assert "beside run.sh; bash would open it from /nonexistent/dir" in " ".join(elsewhere.notes)


def test_bash_ends_comments_scripts_and_continuations_as_bash_does():
    """A comment ending in a backslash does not continue (BLOOM's script has one just before its command); `exit`
    where it runs ends the script; a line continuation inside double quotes joins the lines."""
    script = ('A="--num-layers 2 \\\n  --seq-length 128"\n#  --old-flag \\\nB="--hidden-size 64"\n'
              'python pretrain_gpt.py $A $B\nexit 0\npython pretrain_gpt.py --num-layers 99\n')
    words = read_script(script, env={}).words
    assert _flag(words, "--num-layers") == "2" and _flag(words, "--hidden-size") == "64"
    assert "--old-flag" not in words
    # an exit inside a branch autoplan cannot decide does not end the reading: an if on a file, a function's body
    # (it runs where called), a group after || or && (Megatron-LM's DeepSeek-V3 FSDP script: `mkdir ... || {`)
    for undecided in ("if [ -f /x ]; then exit 1; fi\n", "usage() { echo use; exit 1; }\n",
                      "function die {\n  exit 1\n}\n", "die()\n{\n  exit 2\n}\n", "mkdir -p logs || {\n  exit 1\n}\n",
                      "mkdir x || { echo no; exit 1; }\n"):
        assert _flag(read_script(undecided + "python t.py --num-layers 3\n", env={}).words, "--num-layers") == "3"
    # a command before `|| {` still runs; a plain group runs
    assert read_script("torchrun t.py --num-layers 4 || { echo failed; exit 1; }\n", env={}).words[0] == "torchrun"
    with pytest.raises(ConfigError, match="no training command"):
        read_script("{ echo stop; exit 0; }\npython t.py --num-layers 9\n", env={})


def test_path_commands_are_computed_not_run(tmp_path):
    script = ('HERE=$(cd "$(dirname "$0")" && pwd)\nNAME=$(basename $HERE)\nOUT=`realpath ../out`\n'
              'TS=$(date +%s)\npython $HERE/train.py --save $OUT/$NAME --load "$TS"\n')
    cmd = read_script(script, env={}, path=str(tmp_path / "sub" / "run.sh"), cwd=str(tmp_path / "sub"))
    assert cmd.words[1] == f"{tmp_path}/sub/train.py"
    assert _flag(cmd.words, "--save") == f"{tmp_path}/out/sub"
    assert _flag(cmd.words, "--load") == "$(date +%s)"  # any other command stays as written
    # a value that is one such construct stays one word where it is expanded unquoted (bash gives one word too)
    words = read_script("N=$(nvidia-smi -L | wc -l)\nB=$(( 512 / ${N} ))\npython t.py --micro-batch-size $B "
                        "--nnodes $N\n", env={}).words
    assert _flag(words, "--micro-batch-size") == "$(( 512 / ${N} ))"
    assert _flag(words, "--nnodes") == "$(nvidia-smi -L | wc -l)"
    # ... through any later reading, too: `eval $CMD` (Megatron-DeepSpeed's examples) and `bash -c "$CMD"`
    script = ('N=$(nvidia-smi -L | wc -l)\nNAME="run-$N-x"\nCMD="python t.py --save $NAME --num-layers 2"\n'
              'eval ${CMD} &> out.log\n')
    for text in (script, script.replace("eval ${CMD}", 'srun bash -c "$CMD"')):
        run = read_script(text, env={}).words
        assert _flag(run, "--save") == "run-$(nvidia-smi -L | wc -l)-x" and _flag(run, "--num-layers") == "2"
    with pytest.raises(ConfigError, match="--micro-batch-size is .*command substitution"):
        read_megatron(words + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                               "--seq-length", "8", "--vocab-size", "100"])
    assert any(n.startswith("computed, not run: `basename`, `cd`, `dirname`") for n in cmd.notes)


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


# NVIDIA's SC21 reproduction set as a whole (examples/academic_paper_scripts/sc21): the run script picks a size in an
# if-chain and sources CONFIG.sh (which exports the flags) and SBATCH.sh (which submits SRUN.sh with --nodes and an
# --export list, then exits the run script); SRUN.sh's #SBATCH line gives the tasks per node.
SC21_RUN = """#!/bin/bash
MODEL_SIZE=${MODEL_SIZE:-1.7B}
if [ ${MODEL_SIZE} == "1.7B" ]; then
    TP=1; PP=1; MBS=16; GBS=512; NLS=24; HS=2304; NAH=24; DDP=torch; NNODES=4
    EXTRA="--activations-checkpoint-method uniform "
elif [ ${MODEL_SIZE} == "18B" ]; then
    TP=8; PP=1; MBS=8; GBS=1024; NLS=40; HS=6144; NAH=48; DDP=torch; NNODES=32
    EXTRA="--activations-checkpoint-method uniform "
else
    echo "unknown size"; exit 1
fi
export JOB_NAME=table_1_${MODEL_SIZE}
. `pwd`/CONFIG.sh
. `pwd`/SBATCH.sh
echo never reached
python pretrain_gpt.py --num-layers 1
"""
SC21_CONFIG = """export CODE_DIR=/opt/megatron
VOCAB=gpt2-vocab.json
export MEGATRON_PARAMS=" ${EXTRA} --tensor-model-parallel-size ${TP} --pipeline-model-parallel-size ${PP} \\
    --micro-batch-size ${MBS} --global-batch-size ${GBS} --num-layers ${NLS} --hidden-size ${HS} \\
    --num-attention-heads ${NAH} --DDP-impl ${DDP} --seq-length 2048 --max-position-embeddings 2048 \\
    --vocab-file ${VOCAB} --fp16 --loss-scale 8192 "
"""
SC21_SBATCH = """sbatch -p ${PARTITION} --job-name=${JOB_NAME} --nodes=${NNODES} --export=CODE_DIR,MEGATRON_PARAMS SRUN.sh
exit 0
"""


def _sc21_files(tmp_path):
    for name, text in (("run.sh", SC21_RUN), ("CONFIG.sh", SC21_CONFIG), ("SBATCH.sh", SC21_SBATCH),
                       ("SRUN.sh", SRUN.replace("${CODE_DIR}", "${CODE_DIR}"))):
        (tmp_path / name).write_text(text)


def test_the_sc21_set_reads_through_source_and_sbatch_as_its_fidelity_row(tmp_path, capsys, monkeypatch):
    """The run script alone gives the 18B run: the flags from the sourced CONFIG.sh, the batch script sbatch
    submits read in the environment its --export list passes, 32 nodes x 8 tasks from sbatch's --nodes and SRUN.sh's
    #SBATCH line; it prices as the fidelity row of the same run, to the digit."""
    from benchmarks.fidelity import DEFAULT_REF, evaluate

    _sc21_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MODEL_SIZE", "18B")
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    monkeypatch.delenv("MEGATRON_PARAMS", raising=False)
    assert main(["from-megatron", "--cluster", "dgx-a100-80g", "--stack", "megatron-2021", "--script", "run.sh",
                 "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "256 processes, as srun starts them" in captured.err
    assert "SLURM_NNODES=32: the job's node count (sbatch --nodes)" in captured.err
    assert f"{tmp_path}/SRUN.sh (the batch script sbatch submits" in captured.err
    assert "from the environment: MODEL_SIZE=18B" in captured.err
    assert out["from_megatron"]["parallel"] == "tp=8,pp=1,cp=1,ep=1,vp=1,mbs=8,sp=0,zero=0,recompute=full,schedule=1f1b"
    if DEFAULT_REF.exists():
        row = next(r for r in evaluate(DEFAULT_REF) if r["model"] == "GPT-18.4B")
        assert out["step_time_s"] == pytest.approx(row["predicted_step_s"], rel=1e-9)
    # the default size, and the script's `exit 0` (in the sourced SBATCH.sh) ends the reading before the last line
    monkeypatch.delenv("MODEL_SIZE")
    cmd = read_script(SC21_RUN, env={}, path=str(tmp_path / "run.sh"), cwd=str(tmp_path))
    assert cmd.gpus == 32 and _flag(cmd.words, "--num-layers") == "24"


def test_sbatch_passes_only_what_it_exports(tmp_path):
    """A batch script runs in another shell: it sees the submitting script's exported variables (sbatch's
    --export=ALL, the default), only the listed ones under a list, and none of its unexported ones."""
    (tmp_path / "job.sh").write_text("#SBATCH --ntasks-per-node=4\nsrun python pretrain_gpt.py --num-layers "
                                     "$LAYERS --hidden-size $HIDDEN\n")
    base = "export LAYERS=6\nHIDDEN=128\n"
    cmd = read_script(base + "sbatch -N 2 job.sh\n", env={}, path=str(tmp_path / "submit.sh"), cwd=str(tmp_path))
    assert _flag(cmd.words, "--num-layers") == "6" and _flag(cmd.words, "--hidden-size") == "$HIDDEN"
    assert cmd.gpus == 8  # sbatch's -N over the #SBATCH line's tasks per node
    listed = read_script(base + "sbatch --nodes 2 --export=HIDDEN,EXTRA=1 job.sh\n", env={}, cwd=str(tmp_path))
    assert _flag(listed.words, "--num-layers") == "$LAYERS"  # exported, but not in the list
    assert _flag(listed.words, "--hidden-size") == "$HIDDEN"  # listed, but never exported: sbatch cannot see it
    # a batch script in a here-document, and one that cannot be found
    inline = read_script(base + "sbatch --nodes=3 <<EOF\n#!/bin/bash\n#SBATCH --ntasks-per-node=8\nsrun python "
                         "train.py --num-layers \\$LAYERS --seq-length 64\nEOF\n", env={})
    assert _flag(inline.words, "--num-layers") == "6" and inline.gpus == 24
    missing = read_script(base + "sbatch job2.sh\npython pretrain_gpt.py --num-layers 2\n", env={}, cwd=str(tmp_path))
    assert any("job2.sh (the batch script sbatch submits)" in n for n in missing.notes)
    # the batch script's own $0, the directory sbatch ran in (SLURM_SUBMIT_DIR) and --chdir's
    (tmp_path / "job3.sh").write_text("srun python t.py --num-layers 2 --save $SLURM_SUBMIT_DIR/ckpt --load "
                                      "$(dirname $0) --data `pwd`/data\n")
    words = read_script("sbatch -D /scratch job3.sh\n", env={}, path=str(tmp_path / "s.sh"), cwd=str(tmp_path)).words
    assert _flag(words, "--save") == f"{tmp_path}/ckpt" and _flag(words, "--load") == str(tmp_path)
    assert _flag(words, "--data") == "/scratch/data"
    # a quoted delimiter (\EOF, 'EOF') keeps the here-document as written
    quoted = read_script("X=5\ncat <<\\EOF > a.json\n$X\nEOF\npython t.py --num-layers 2\n", env={})
    assert quoted.files == {"a.json": "$X\n"}


# The shape of BigScience's BLOOM launch script (train/tr11-176B-ml/tr11-176B-ml.slurm): an sbatch script whose
# node count Slurm gives it, the flags in double-quoted strings (a quoted partition method inside), the DeepSpeed JSON
# written by a here-document to a name holding $SLURM_JOB_ID, and the command run by srun through `bash -c`.
BLOOM = r"""#!/bin/bash
#SBATCH --nodes=48
#SBATCH --ntasks-per-node=1          # one launcher per node
set -x -e
source $WORK/start-env
cd $WORK/Megatron-DeepSpeed
MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
GPUS_PER_NODE=8
NNODES=$SLURM_NNODES
MICRO_BATCH_SIZE=2
GLOBAL_BATCH_SIZE=2048
GPT_ARGS=" \
    --pp-partition-method 'type:transformer|embedding' \
    --num-layers 70 --hidden-size 14336 --num-attention-heads 112 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size $MICRO_BATCH_SIZE --global-batch-size $GLOBAL_BATCH_SIZE \
    --tokenizer-type PretrainedFromHF --embed-layernorm --bf16 \
    --position-embedding-type alibi --checkpoint-activations --pad-vocab-size-to 250880 \
    "
ZERO_STAGE=0
config_json="./ds_config.$SLURM_JOB_ID.json"
cat <<EOT > $config_json
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "zero_optimization": {"stage": $ZERO_STAGE},
  "bf16": {"enabled": true}
}
EOT
DEEPSPEED_ARGS=" --deepspeed --deepspeed_config ${config_json} --zero-stage ${ZERO_STAGE} "
export LAUNCHER="python -u -m torch.distributed.run --nproc_per_node $GPUS_PER_NODE --nnodes $NNODES \
    --rdzv_endpoint $MASTER_ADDR:6000"
#    --universal-checkpoint \
export CMD=" `pwd`/pretrain_gpt.py --tensor-model-parallel-size 4 --pipeline-model-parallel-size 12 \
    $GPT_ARGS $DEEPSPEED_ARGS "
srun --wait=60 --jobid $SLURM_JOB_ID bash -c "$LAUNCHER --node_rank \$SLURM_PROCID $CMD" 2>&1 | tee -a log.txt
"""


def test_a_deepspeed_config_written_by_the_script_is_read_as_it_writes_it(tmp_path, capsys, monkeypatch):
    """BLOOM's script read as it stands prices as BLOOM's fidelity row, to the digit: 48 nodes from its #SBATCH
    line (as Slurm sets SLURM_NNODES), the batch and ZeRO stage from the JSON its here-document writes, the
    vocabulary from --pad-vocab-size-to, ALiBi, and stage 0 with bf16 as DeepSpeed's own sharded optimizer."""
    from benchmarks.fidelity import evaluate_heldout

    path = tmp_path / "train.slurm"
    path.write_text(BLOOM)
    monkeypatch.chdir(tmp_path)
    for name in ("SLURM_NNODES", "SLURM_JOB_ID", "WORK"):
        monkeypatch.delenv(name, raising=False)
    cmd = read_script(BLOOM, env={}, path=str(path), cwd=str(tmp_path))
    config = json.loads(cmd.files["./ds_config.$SLURM_JOB_ID.json"])
    assert config == {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2048, "zero_optimization": {"stage": 0},
                      "bf16": {"enabled": True}}
    assert _flag(cmd.words, "--pp-partition-method") == "type:transformer|embedding"
    cluster = str(Path(__file__).resolve().parents[2] / "benchmarks" / "published" / "jean-zay.yaml")
    assert main(["from-megatron", "--cluster", cluster, "--script", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "SLURM_NNODES=48: the job's node count (#SBATCH --nodes)" in captured.err
    assert "as the script writes it (a here-document)" in captured.err
    assert "priced as zero=1" in captured.err
    row = next(r for r in evaluate_heldout() if r["model"] == "BLOOM 176B")
    assert out["from_megatron"]["parallel"] == row["config"].replace(",dp=8", "")
    assert out["step_time_s"] == pytest.approx(row["predicted_step_s"], rel=1e-9)
    assert out["memory_gib"]["peak"] == pytest.approx(row["peak_memory_gib"], rel=1e-9)


def test_the_scripts_nvidia_ships_read(monkeypatch, tmp_path):
    """Opt-in, against a Megatron-LM checkout (MEGATRON_LM): SC21's run_table_1.sh as NVIDIA ships it, run from its
    folder, is the 1.7B run on 4 nodes x 8 GPUs."""
    import os

    root = os.environ.get("MEGATRON_LM")
    folder = Path(root or "/nonexistent") / "examples" / "academic_paper_scripts" / "sc21"
    if not (folder / "run_table_1.sh").exists():
        pytest.skip("set MEGATRON_LM to a Megatron-LM checkout")
    cmd = read_script((folder / "run_table_1.sh").read_text(), env={}, path=str(folder / "run_table_1.sh"),
                      cwd=str(folder))
    run = read_megatron(cmd.words)
    assert cmd.gpus == 32 and run.parallel.tp == 1 and run.parallel.mbs == 16 and run.global_batch == 512
