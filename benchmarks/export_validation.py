"""Export-validation matrix: plans the search chooses, exported, then checked by the frameworks' own code.

    MEGATRON_LM=/path/to/Megatron-LM python benchmarks/export_validation.py

Megatron-LM: `parse_args` -> `validate_args` -> `core_transformer_config_from_args` (needs a Megatron-LM
checkout; the megatron-core wheel lacks `megatron.training`). torchtitan: its config manager loads the export
(needs `pip install torchtitan`). A framework that cannot be imported is reported as `n/a`, never as a pass.
"""

from __future__ import annotations

import sys
import time

# (model, cluster, gpus, global batch, seq, dtype, fixed knobs): a spread of what the search picks on its own
# and what it picks under a constraint users ask for (ZeRO-3, interleaving, context parallelism, fp8, MoE).
MATRIX: list[tuple[str, str, int, int, int, str, dict[str, str]]] = [
    ("gpt3-13b", "dgx-a100-80g", 64, 512, 2048, "bf16", {}),
    ("gpt3-13b", "dgx-a100-80g", 64, 512, 2048, "bf16", {"tp": "4", "pp": "4", "mbs": "1"}),
    ("gpt3-175b", "dgx-a100-80g", 1024, 1536, 2048, "bf16", {}),
    ("gpt3-175b", "dgx-a100-80g", 1024, 1536, 2048, "bf16", {"schedule": "interleaved"}),
    ("llama3-8b", "dgx-h100", 8, 128, 8192, "bf16", {}),
    ("llama3-8b", "dgx-h100", 64, 512, 8192, "bf16", {"zero": "3"}),
    ("llama3-8b", "dgx-h100", 64, 512, 8192, "fp8", {}),
    ("llama3-70b", "dgx-h100", 64, 512, 4096, "bf16", {}),
    ("llama3-70b", "dgx-h100", 256, 1024, 8192, "bf16", {"cp": "2"}),
    ("llama3-70b", "dgx-h100", 128, 512, 4096, "bf16", {"pp": "4", "schedule": "interleaved"}),
    ("llama3-405b", "dgx-h100", 1024, 1024, 8192, "bf16", {}),
    ("llama2-70b", "dgx-a100-80g", 128, 1024, 4096, "fp16", {}),
    ("mixtral-8x7b", "dgx-h100", 64, 512, 4096, "bf16", {}),
    ("mixtral-8x7b", "dgx-h100", 64, 512, 4096, "bf16", {"zero": "3"}),
    ("mlm-h100-70b", "dgx-h100", 64, 1024, 4096, "bf16", {}),
    ("sc21-145.6b", "dgx-a100-80g", 1536, 2304, 2048, "bf16", {}),
    ("gpt3-1.3b", "dgx-a100-80g", 8, 64, 2048, "bf16", {"recompute": "full"}),
]


def searched_plans(matrix=MATRIX):
    """[(label, plan-or-error-string)] for each row of the matrix."""
    from autoplan.cost_models.errors import AutoplanError
    from autoplan.inspect.scaling import default_search, plan_of
    from autoplan.specs import TrainingSpec, load_cluster, load_model

    search = default_search()
    out = []
    for model, cluster, gpus, gb, seq, dtype, fix in matrix:
        label = f"{model} {cluster}x{gpus} gb{gb} s{seq} {dtype}" + "".join(f" {k}={v}" for k, v in fix.items())
        try:
            tr = TrainingSpec(global_batch_size=gb, seq_length=seq, dtype=dtype)
            out.append((label, plan_of(search(load_model(model), load_cluster(cluster, gpus=gpus), tr,
                                              top=1, fix=fix or None))))
        except AutoplanError as e:
            out.append((label, f"no plan: {e.one_line()}"))
    return out


def main() -> int:
    from autoplan.inspect import export_megatron
    from autoplan.inspect.export import megatron_arch
    from autoplan.inspect.export_check import FrameworkUnavailable, check_megatron, check_torchtitan

    t0 = time.perf_counter()
    rows = searched_plans()
    ok = {"megatron": 0, "torchtitan": 0}
    n = 0
    for label, plan in rows:
        if isinstance(plan, str):
            print(f"{label}\n    {plan}")
            continue
        n += 1
        print(f"{label}\n    plan {plan.parallel.to_string()}")
        ex = export_megatron(plan)
        try:
            err = check_megatron(ex["args"], plan.cluster.num_gpus, ex["env"], megatron_arch(plan))
            res = "ok" if err is None else f"FAIL {err}"
        except FrameworkUnavailable:
            res = "n/a"
        ok["megatron"] += res == "ok"
        print(f"    megatron    {res}")
        try:
            err = check_torchtitan(plan)
            res = "ok" if err is None else f"FAIL {err}"
        except FrameworkUnavailable:
            res = "n/a"
        ok["torchtitan"] += res == "ok"
        print(f"    torchtitan  {res}")
    print(f"\n{n} plans: megatron {ok['megatron']}/{n} accepted, torchtitan {ok['torchtitan']}/{n} accepted "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
