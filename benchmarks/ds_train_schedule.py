"""DeepSpeed's pipeline TrainSchedule executed with blocking, paired sends: is it slower than 1F1B?

    python benchmarks/ds_train_schedule.py [--fwd S] [--bwd S] [--p2p S] [--pp P] M [M ...]

DeepSpeed's PipelineEngine (deepspeed/runtime/pipe/schedule.py, TrainSchedule) runs 2(m + p - 1) steps per stage;
at each step a stage either runs a forward or a backward (even stages forward at even steps, odd stages at odd
steps) and first exchanges with a neighbour: SendGrad/RecvActivation before a forward, RecvGrad/SendActivation
before a backward. "The communication is blocking and must be paired": a transfer starts when both ends have
posted it, and both wait until it is done. This replays those instruction lists (the step-to-micro-batch mapping is
DeepSpeed's) with per-stage forward/backward times and prints the makespan beside the 1F1B ideal (m + p - 1)(f + b),
and the line T = a*m + b through the micro-batch counts given. Defaults: MT-NLG 530B's middle stage as
`benchmarks/fidelity.py --decompose` prices it (3 blocks, full recomputation), 35 stages.
Result: within 2% of 1F1B, so the schedule does not explain MT-NLG's missing per-step time (docs/cost_model.md).
"""

from __future__ import annotations

import argparse


def _micro_batch(stages: int, sid: int, step: int) -> tuple[int, bool]:
    """TrainSchedule._step_to_micro_batch: (micro-batch, is_forward) of stage `sid` at `step`."""
    even_step, even_stage = step % 2 == 0, sid % 2 == 0
    if even_step and even_stage:
        return step // 2 - sid // 2, True
    if not even_step and not even_stage:
        return (step - 1) // 2 - sid // 2, True
    if even_step:
        return step // 2 - stages + (sid + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + sid // 2, False


def instructions(m: int, p: int, sid: int) -> list[tuple[str, int]]:
    """TrainSchedule.steps() of one stage, as (instruction, micro-batch); SA/RA/SG/RG = send/recv act./grad."""
    out, prev = [], -1
    for step in range(2 * (m + p - 1)):
        mb, fwd = _micro_batch(p, sid, step)
        ok_prev, ok_mb = 0 <= prev < m, 0 <= mb < m
        if fwd:
            out += [("SG", prev)] if ok_prev and sid > 0 else []
            out += [("RA", mb)] if ok_mb and sid > 0 else []
        else:
            out += [("RG", mb)] if ok_mb and sid < p - 1 else []
            out += [("SA", prev)] if ok_prev and sid < p - 1 else []
        if ok_mb:
            out.append(("F" if fwd else "B", mb))
        prev = mb
    return out


_PARTNER = {"SA": ("RA", 1), "RA": ("SA", -1), "SG": ("RG", -1), "RG": ("SG", 1)}


def makespan(m: int, p: int, f: float, b: float, c: float) -> float:
    """Run every stage's instruction list; a paired send/receive completes at max(both posts) + c."""
    lists = [instructions(m, p, s) for s in range(p)]
    ptr, clock = [0] * p, [0.0] * p
    posted: dict[tuple, float] = {}
    done: dict[tuple, float] = {}
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while ptr[s] < len(lists[s]):
                kind, mb = lists[s][ptr[s]]
                if kind in ("F", "B"):
                    clock[s] += f if kind == "F" else b
                elif (kind, s, mb) in done:
                    clock[s] = done.pop((kind, s, mb))
                else:
                    pk, d = _PARTNER[kind]
                    mate = (pk, s + d, mb)
                    if mate not in posted:
                        posted.setdefault((kind, s, mb), clock[s])
                        break
                    t = max(clock[s], posted.pop(mate)) + c
                    clock[s], done[mate] = t, t
                ptr[s] += 1
                moved = True
    if any(ptr[s] < len(lists[s]) for s in range(p)):
        raise RuntimeError("TrainSchedule replay deadlocked")
    return max(clock)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("m", type=int, nargs="*", default=[240, 192, 160], help="micro-batches per step")
    ap.add_argument("--fwd", type=float, default=0.0448, help="forward of one stage, one micro-batch (s)")
    ap.add_argument("--bwd", type=float, default=0.1398, help="backward with recomputation (s)")
    ap.add_argument("--p2p", type=float, default=0.00083, help="one stage-to-stage message (s)")
    ap.add_argument("--pp", type=int, default=35)
    args = ap.parse_args(argv)
    pts = []
    for m in args.m:
        t = makespan(m, args.pp, args.fwd, args.bwd, args.p2p)
        ideal = (m + args.pp - 1) * (args.fwd + args.bwd)
        pts.append((m, t))
        print(f"m={m:4d}  DeepSpeed TrainSchedule {t:8.2f} s   1F1B ideal {ideal:8.2f} s   ({100 * (t / ideal - 1):+.1f}%)")
    if len(pts) >= 2:
        (m1, t1), (m2, t2) = pts[0], pts[-1]
        a = (t1 - t2) / (m1 - m2)
        print(f"T = a*m + b: a = {1e3 * a:.1f} ms per micro-batch, b = {t1 - a * m1:.2f} s per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
