# ruff: noqa
"""Session 21 experiment: a processor-sharing pipeline simulation against the saved tune sets.

The estimate times a pipeline's actions at the all-at-once CPU rates (every process of the node computing). On
an oversubscribed node a rank waiting in a gloo recv uses ~0 CPU (session 20, recv_cpu.py), so the ranks that
do compute get the cores: a stage of g processes runs at min(1, C / active) of a core instead of C / P. This
re-times the refit estimate's stage costs with that rule (work = duration at the all-at-once rate) and compares
the critical stage's wait (makespan - its busy time at all-at-once rates, i.e. the model's `bubble`+`pp_comm`)
with the measured `pp_wait` of every held-out pipeline layout.

    python docs/notes/session-21/ps_probe.py docs/notes/session-20/tune-set-S20b.json.gz ...
"""
import gzip, json, sys
sys.path.insert(0, "benchmarks")
from tune_local import workload
from autoplan.cost_models.fit import with_knobs
from autoplan.cost_models import estimate as E
from autoplan.cost_models.pipeline import _actions
from autoplan.cost_models.specs import ParallelConfig, check_config
from autoplan.cost_models.profile import profile_from_spec


def ps_simulate(schedule, pp, m, vp, fwd, bwd, p2p_s, speed):
    """Time-ordered simulation; speed(k) = rate of a computing rank when k ranks compute (1 = all-at-once)."""
    acts = _actions(schedule, pp, m, vp)
    n = pp * vp
    done = {}
    ptr = [0] * pp
    rem = [None] * pp  # remaining work of the running action (all-at-once seconds), None = not running
    t = 0.0
    wall_busy = [0.0] * pp
    end = [0.0] * pp
    while True:
        # start what can start now
        wake = []
        for r in range(pp):
            if rem[r] is not None or ptr[r] >= len(acts[r]):
                continue
            a = acts[r][ptr[r]]
            if a.kind == "F":
                dep = ("F", a.stage - 1, a.mb) if a.stage > 0 else None
                extra = p2p_s if a.stage > 0 else 0.0
            else:
                dep = ("B", a.stage + 1, a.mb) if a.stage < n - 1 else ("F", a.stage, a.mb)
                extra = p2p_s if a.stage < n - 1 else 0.0
            if dep is None:
                ready = 0.0
            elif dep in done:
                ready = done[dep] + extra
            else:
                continue
            if ready <= t + 1e-15:
                rem[r] = fwd[a.stage] if a.kind == "F" else bwd[a.stage]
            else:
                wake.append(ready)
        running = [r for r in range(pp) if rem[r] is not None]
        if not running:
            if not wake:
                break
            t = min(wake)
            continue
        s = speed(len(running))
        t_done = min(rem[r] / s for r in running)
        dt = min([t_done] + [w - t for w in wake])
        for r in running:
            rem[r] -= dt * s
            wall_busy[r] += dt
        t += dt
        for r in running:
            if rem[r] <= 1e-12:
                a = acts[r][ptr[r]]
                done[(a.kind, a.stage, a.mb)] = t
                rem[r] = None
                ptr[r] += 1
                end[r] = t
    return max(end), wall_busy, end


def main(paths):
    for path in paths:
        d = json.load(gzip.open(path))
        model, cluster, training = workload("tiny-gpt", 4, 8, 64)
        refit = with_knobs(cluster, d["fit_after"]).with_gpus(4)
        t = training.model_copy(update={"kernels": "torch"})
        for h in d["held_out"]:
            cfg = check_config(ParallelConfig.parse(h["parallel"]), model, refit, t)
            if cfg.pp == 1:
                continue
            est = E.estimate(profile_from_spec(model), refit, t, cfg)
            cl = E.crowded(refit, t, cfg)
            p2p, _ = E.pipeline_p2p_parts(cl, t, hidden=model.hidden_size, pp=cfg.pp, tp=cfg.tp, cp=cfg.cp,
                                          dp=cfg.dp, mbs=cfg.mbs, sp=cfg.sp)
            fwd = [s.fwd_s for s in est.stages]
            bwd = [s.bwd_s for s in est.stages]
            m = training.global_batch_size // (cfg.dp * cfg.mbs)
            g = cfg.tp * cfg.cp * cfg.dp
            P, C = 4, 2
            speed = lambda k: min(1.0, C / (k * g)) / min(1.0, C / P)
            span_ps, wall, _ = ps_simulate(cfg.schedule, cfg.pp, m, cfg.vp, fwd, bwd, p2p, speed)
            span_aa, wall_aa, _ = ps_simulate(cfg.schedule, cfg.pp, m, cfg.vp, fwd, bwd, p2p, lambda k: 1.0)
            bd = est.breakdown
            meas = h["components_measured"]
            print(f"{path.split('tune-set-')[1][:-8]:5s} {h['parallel'][:44]:44s} m={m} model wait "
                  f"{(bd['bubble'] + bd['pp_comm']) * 1e3:6.1f} rank-0 wait all-at-once {(span_aa - wall_aa[0]) * 1e3:6.1f} "
                  f"shared {(span_ps - wall[0]) * 1e3:6.1f}; rank-0 busy {wall_aa[0] * 1e3:6.1f} -> {wall[0] * 1e3:6.1f}"
                  f"  | measured pp_wait {meas.get('pp_wait', 0) * 1e3:6.1f} compute+tp {(meas['compute'] + meas['tp_cp_ep_comm']) * 1e3:6.1f}"
                  f"; total measured {h['measured_s'] * 1e3:6.1f} model {est.step_time_s * 1e3:6.1f} "
                  f"model - shared saving {(est.step_time_s - (span_aa - span_ps)) * 1e3:6.1f}")


main(sys.argv[1:])
