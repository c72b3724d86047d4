"""The search space: legal meshes (tp, cp, ep, pp, dp) and knobs (mbs, sp, ZeRO, schedule, vp).

The rules are those of `autoplan.cost_models.specs.check_config` (with `stage_layers=False`: the search places uneven
stages itself), restated as divisor enumeration so that millions of combinations are never built one by one;
`tests/search/test_space.py` checks that every candidate enumerated here passes `check_config`. One rule is
stricter than `check_config`: tp divides the node size, so that a tp group never straddles two nodes (ranks
are placed tp innermost, then cp, dp, pp).

Recomputation is not enumerated here: it is chosen per stage by the stage ILP (`ilp.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from autoplan.cost_models.errors import ConfigError
from autoplan.cost_models.pipeline import interleaved_rounds_fit
from autoplan.cost_models.specs import (
    _ALIASES,
    ClusterSpec,
    ModelSpec,
    ParallelConfig,
    TrainingSpec,
)

FIXABLE = ("tp", "pp", "dp", "cp", "ep", "vp", "mbs", "sp", "zero", "recompute", "recompute_layers", "schedule")


def divisors(n: int) -> list[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def parse_fix(fix: dict[str, str] | None) -> dict[str, object]:
    """`{"tp": "8", "recompute": "full"}` -> typed values, with the aliases and errors of ParallelConfig.parse."""
    out: dict[str, object] = {}
    for raw_key, raw_val in (fix or {}).items():
        key = _ALIASES.get(str(raw_key).lower(), str(raw_key).lower())
        if key not in FIXABLE:
            raise ConfigError(f"--fix cannot pin {raw_key!r}", f"pinnable knobs: {', '.join(FIXABLE)}",
                              "write e.g. --fix tp=8 --fix recompute=selective")
        parsed = ParallelConfig.parse(f"{key}={raw_val}")
        out[key] = getattr(parsed, key)
    if out.get("recompute_layers") is not None and out.setdefault("recompute", "full") != "full":
        raise ConfigError("recompute_layers applies to full recomputation only",
                          f"--fix recompute={out['recompute']} with recompute_layers", "pin recompute=full")
    vp = out.get("vp")
    sched = out.get("schedule")
    if vp is not None and vp > 1 and sched not in (None, "interleaved"):
        raise ConfigError("vp>1 needs the interleaved schedule", f"--fix vp={vp} schedule={sched}",
                          "drop one of the two pins")
    if sched == "interleaved" and vp == 1:
        raise ConfigError("the interleaved schedule needs vp>1", "--fix schedule=interleaved vp=1",
                          "pin vp>=2 or another schedule")
    return out


@dataclass(frozen=True)
class Mesh:
    """Degrees of one mesh and the knobs that change per-layer costs (one cost_models Context)."""

    tp: int
    cp: int
    ep: int
    pp: int
    dp: int
    mbs: int
    sp: bool

    @property
    def ctx_key(self) -> tuple[int, int, bool, int, int]:
        return (self.tp, self.cp, self.sp, self.ep, self.mbs)


@dataclass(frozen=True)
class Knobs:
    """What varies for a fixed mesh without changing per-layer costs."""

    zero: int
    schedule: str
    vp: int


def meshes(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, fix: dict[str, object],
           num_blocks: int | None = None) -> Iterator[Mesh]:
    """Every legal mesh and micro-batch size, in a fixed order."""
    world = cluster.num_gpus
    L = num_blocks if num_blocks is not None else model.num_layers
    B, seq = training.global_batch_size, training.seq_length
    if seq > model.max_seq_length and model.position == "learned":
        return
    for tp in divisors(cluster.gpus_per_node):
        if world % tp or model.num_attention_heads % tp or model.kv_heads % tp or model.ffn % tp:
            continue
        if "tp" in fix and fix["tp"] != tp:
            continue
        for cp in divisors(world // tp):
            if cp > 1 and (seq % (2 * cp) or "cp" not in training.seq_splits):
                continue
            if "cp" in fix and fix["cp"] != cp:
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > L or ("pp" in fix and fix["pp"] != pp) or (L % pp and not training.uneven_stages):
                    continue
                dp = world // (tp * cp * pp)
                if B % dp or ("dp" in fix and fix["dp"] != dp):
                    continue
                eps = [1]
                if model.moe is not None:
                    eps = [e for e in divisors(model.moe.num_experts) if dp % e == 0]
                for ep in eps:
                    if "ep" in fix and fix["ep"] != ep:
                        continue
                    for mbs in divisors(B // dp):
                        if "mbs" in fix and fix["mbs"] != mbs:
                            continue
                        for sp in (False, True):
                            if sp and (tp == 1 or (seq // cp) % tp or "sp" not in training.seq_splits):
                                continue
                            if "sp" in fix and fix["sp"] != sp:
                                continue
                            yield Mesh(tp, cp, ep, pp, dp, mbs, sp)


def knob_options(mesh: Mesh, fix: dict[str, object], num_blocks: int,
                 training: TrainingSpec) -> tuple[list[int], list[tuple[str, int]]]:
    """(ZeRO stages, (schedule, vp) pairs) legal for this mesh; the candidates are their product. From `training`:
    the global batch, whether interleaved rounds may be longer than pp (`flexible_rounds`), the ZeRO stages and
    pipeline schedules the stack runs (`zero_stages`, `schedules`) and whether its stages may be uneven
    (`uneven_stages`: else pp * vp divides the blocks)."""
    zeros = [z for z in (0, 1, 2, 3) if str(z) in training.zero_stages] if mesh.dp * mesh.cp > 1 else [0]
    if "zero" in fix:
        zeros = [z for z in zeros if z == fix["zero"]]
    scheds: list[tuple[str, int]] = []
    if mesh.pp == 1:
        if fix.get("schedule") != "interleaved":
            scheds.append((str(fix.get("schedule", "1f1b")), 1))
    else:
        m = training.global_batch_size // (mesh.dp * mesh.mbs)
        if m >= mesh.pp:  # 1F1B's warm-up needs at least pp micro-batches (torch's Schedule1F1B, Megatron)
            scheds.append(("1f1b", 1))
        scheds.append(("gpipe", 1))
        # equal rounds of at least pp micro-batches (microbatch_group), of exactly pp on older Megatron-LM
        if interleaved_rounds_fit(mesh.pp, m, training.flexible_rounds):
            scheds += [("interleaved", v) for v in range(2, num_blocks // mesh.pp + 1)
                       if training.uneven_stages or num_blocks % (mesh.pp * v) == 0]
    if mesh.pp > 1:
        runs = training.schedules.split("+")
        scheds = [s for s in scheds if s[0] in runs]
    if "schedule" in fix:
        scheds = [s for s in scheds if s[0] == fix["schedule"]]
    if "vp" in fix:
        scheds = [s for s in scheds if s[1] == fix["vp"]]
    return zeros, scheds


def knobs(mesh: Mesh, fix: dict[str, object], num_blocks: int, training: TrainingSpec) -> list[Knobs]:
    """ZeRO stages x schedules x virtual stages legal for this mesh."""
    zeros, scheds = knob_options(mesh, fix, num_blocks, training)
    return [Knobs(z, s, v) for z in zeros for s, v in scheds]


def to_config(mesh: Mesh, kn: Knobs, recompute: str = "none", recompute_layers: int | None = None) -> ParallelConfig:
    return ParallelConfig(tp=mesh.tp, pp=mesh.pp, dp=mesh.dp, cp=mesh.cp, ep=mesh.ep, vp=kn.vp, mbs=mesh.mbs,
                          sp=mesh.sp, zero=kn.zero, recompute=recompute, recompute_layers=recompute_layers,
                          schedule=kn.schedule)


def all_configs(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                fix: dict[str, object] | None = None) -> Iterator[ParallelConfig]:
    """Every enumerated candidate as a ParallelConfig (for tests and small brute-force searches)."""
    fix = fix or {}
    for mesh in meshes(model, cluster, training, fix):
        for kn in knobs(mesh, fix, model.num_layers, training):
            yield to_config(mesh, kn)
