"""Search exactness: the search's best plan against brute force over every legal plan, on random small instances.

    python benchmarks/search_exactness.py [--seed 1] [--instances 60]

Brute force: every configuration of `space.all_configs`, each with its stage problem solved exhaustively
(`problem.brute_force`, the closed-form objective), then estimated with the simulated pipeline. The search is
exact for the closed form; this counts where the simulation ranks a plan the search did not return as faster
(see the shortcuts in `autoplan/search/core.py`) and prints each miss with its gap.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoplan.cost_models.errors import DoesNotFitError  # noqa: E402
from autoplan.cost_models.estimate import StageLayout, estimate  # noqa: E402
from autoplan.cost_models.profile import profile_from_spec  # noqa: E402
from autoplan.search.core import _Searcher, search  # noqa: E402
from autoplan.search.problem import brute_force  # noqa: E402
from autoplan.search.space import Knobs, Mesh, all_configs  # noqa: E402
from autoplan.specs import ModelSpec, TrainingSpec, load_cluster  # noqa: E402


def brute_force_best(model: ModelSpec, cluster, training: TrainingSpec) -> tuple[float, str]:
    profiles = profile_from_spec(model)
    s = _Searcher(model, cluster, training, profiles, {}, 1, None)
    best, best_cfg = float("inf"), ""
    for cfg in all_configs(model, cluster, training):
        sol = brute_force(s.problem(Mesh(cfg.tp, cfg.cp, cfg.ep, cfg.pp, cfg.dp, cfg.mbs, cfg.sp),
                                    Knobs(cfg.zero, cfg.schedule, cfg.vp)))
        if sol is None:
            continue
        layout = [StageLayout((c.start, c.stop), c.recompute, c.recompute_layers) for c in sol.stages]
        est = estimate(profiles, cluster, training, cfg, layout)
        if est.fits and est.step_time_s < best:
            best, best_cfg = est.step_time_s, cfg.to_string()
    return best, best_cfg


def instance(rng: random.Random):
    """The strategy of tests/search/test_search.py::test_search_equals_brute_force_on_small_instances."""
    layers, hidden = rng.randint(2, 4), rng.choice([64, 128])
    gpus, batch, hbm, backend = rng.choice([2, 4]), rng.choice([4, 8]), rng.choice([0.6, 0.75, 2.0]), \
        rng.choice(["gloo", "nccl"])
    model = ModelSpec(name="t", num_layers=layers, hidden_size=hidden, num_attention_heads=4, vocab_size=256,
                      max_seq_length=128)
    base = load_cluster("local-cpu")
    cluster = base.model_copy(update={"gpus_per_node": gpus, "backend": backend,
                                      "gpu": base.gpu.model_copy(update={"hbm_gib": hbm})})
    desc = f"layers={layers} hidden={hidden} gpus={gpus} batch={batch} hbm={hbm} {backend}"
    return model, cluster, TrainingSpec(global_batch_size=batch, seq_length=128, dtype="fp32"), desc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--instances", type=int, default=60)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    misses, worst = 0, 0.0
    for _ in range(args.instances):
        model, cluster, training, desc = instance(rng)
        bf, bf_cfg = brute_force_best(model, cluster, training)
        try:
            got = search(model, cluster, training, top=3).best
        except DoesNotFitError:
            if bf != float("inf"):
                misses += 1
                print(f"MISS {desc}: search found nothing, brute force {bf_cfg} {bf * 1e3:.3f} ms")
            continue
        gap = got.step_time_s / bf - 1
        if gap > 1e-9:
            misses += 1
            worst = max(worst, gap)
            print(f"MISS {desc}: search {got.config.to_string()} {got.step_time_s * 1e3:.3f} ms, brute force "
                  f"{bf_cfg} {bf * 1e3:.3f} ms ({gap:+.2%})")
    print(f"{args.instances - misses}/{args.instances} exact, worst gap {worst:.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
