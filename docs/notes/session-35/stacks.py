import time

from autoplan.cost_models.stacks import apply_stack
from autoplan.search.core import search
from autoplan.specs import TrainingSpec, load_cluster, load_model

cases = [("gpt3-175b", "dgx-a100-80g", 384, 1536, 2048, "megatron-2021"),
         ("gpt3-175b", "dgx-a100-80g", 384, 1536, 2048, "megatron-deepspeed"),
         ("gpt3-175b", "dgx-a100-80g", 384, 1536, 2048, "deepspeed-zero3"),
         ("gpt3-175b", "dgx-a100-80g", 64, 512, 2048, "megatron-2022"),
         ("gpt3-175b", "dgx-h100", 128, 256, 2048, "megatron-core"),
         ("llama2-70b", "dgx-h100", 16, 64, 4096, "torchtitan"),
         ("llama3-70b", "dgx-h100", 64, 512, 8192, "megatron-2022"),
         ("llama2-70b", "dgx-h100", 64, 512, 4096, "megatron-core")]
for name, cl, gpus, gbs, seq, stack in cases:
    tr = apply_stack(TrainingSpec(global_batch_size=gbs, seq_length=seq), stack, {})
    t = time.time()
    p = search(load_model(name), load_cluster(cl, gpus=gpus), tr, top=3).plan
    st = sorted({(s.recompute, s.recompute_layers) for s in p.stages})
    print(f"{name} {gpus} {stack}: {p.parallel.to_string()} {st} {p.prediction.step_time_s:.3f} s "
          f"peak {p.prediction.memory_gib['peak']:.1f} GiB ({time.time() - t:.1f} s)")
