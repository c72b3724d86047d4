"""Explicit pipeline stage layouts: Megatron-Core's layout string, lists of layer counts, `--uneven`.

Published runs place their layers unevenly: fewer blocks on the first and last pipeline ranks (which also
hold the embedding and the LM head and loss), or (virtual) stages that hold only the embedding or only the
output layer. One syntax writes any of these down, Megatron-Core's `--pipeline-model-parallel-layout`:

    E  the input embedding        t  one transformer block        L  the LM head and loss
    |  a stage boundary           X*N  X repeated N times; X is a letter or a (group)
    ,  and spaces are ignored     stage k runs on pipeline rank k mod pp (virtual stages in model order)

e.g. `Et*3|(tt|)*29,t|L` is 32 stages of 61 blocks: the embedding with 3 blocks, 29 stages of 2, one of 1,
and a last stage holding only the loss. A list of layer counts (`5,8,8,7`) means the same with the embedding
on the first stage and the loss on the last. The canonical form, stored in the plan and printed in the
configuration string as `layout=...`, is the expanded string with each stage's blocks as `t*N`.

Rules (checked by `check_layout`, each error naming the stage): the embedding is on stage 0 and the loss on
the last stage, each exactly once; a stage without blocks must hold the embedding or the loss; the blocks add
up to the model's; there are pp*vp stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

_HELP = "write e.g. layout=Et*3|t*4|t*4|t*3L or --layout 3,4,4,3 (see `autoplan estimate --help`)"


@dataclass(frozen=True)
class LayoutStage:
    """One (virtual) stage of an explicit layout."""

    blocks: int
    embedding: bool = False
    loss: bool = False


# --------------------------------------------------------------------------------------------- parsing


def _expand(text: str, i: int = 0, depth: int = 0) -> tuple[str, int]:
    """Expand `X*N` and `(group)*N` in text[i:] up to the matching `)`; returns (expanded, next index)."""
    out: list[str] = []
    while i < len(text):
        c = text[i]
        if c == "(":
            inner, i = _expand(text, i + 1, depth + 1)
            out.append(inner)
            continue
        if c == ")":
            if depth == 0:
                raise ConfigError("pipeline layout has an unmatched ')'", f"in {text!r}", _HELP)
            return "".join(out), i + 1
        if c == "*":
            j = i + 1
            while j < len(text) and text[j].isdigit():
                j += 1
            if j == i + 1 or not out:
                raise ConfigError("pipeline layout: '*' needs something before it and a count after it",
                                  f"in {text!r}", _HELP)
            out[-1] = out[-1] * int(text[i + 1:j])
            i = j
            continue
        if c in "EtL|":
            out.append(c)
        elif c not in ", ":
            raise ConfigError(f"pipeline layout: unknown symbol {c!r}", f"in {text!r}",
                              "use E (embedding), t (block), L (loss), | (stage boundary), *N, ( ); "
                              "multi-token prediction (m) is not modelled")
        i += 1
    if depth:
        raise ConfigError("pipeline layout has an unmatched '('", f"in {text!r}", _HELP)
    return "".join(out), i


def parse_layout(text: str) -> list[LayoutStage]:
    """A Megatron layout string or a comma/slash-separated list of block counts -> stages (not yet checked
    against a model: `check_layout` does that)."""
    text = str(text).strip()
    if not text:
        raise ConfigError("pipeline layout is empty", "", _HELP)
    digits = text.replace(",", " ").replace("/", " ").split()
    if all(d.isdigit() for d in digits):
        counts = [int(d) for d in digits]
        return [LayoutStage(n, embedding=k == 0, loss=k == len(counts) - 1) for k, n in enumerate(counts)]
    flat, _ = _expand(text)
    stages = []
    for k, part in enumerate(flat.split("|")):
        for sym, what in (("E", "embedding"), ("L", "loss")):
            if part.count(sym) > 1:
                raise ConfigError(f"pipeline layout: the {what} ({sym}) appears more than once in stage {k}",
                                  f"stage {k} is {part!r}", _HELP)
        stages.append(LayoutStage(part.count("t"), "E" in part, "L" in part))
    return stages


def canonical(stages: list[LayoutStage]) -> str:
    """`Et*3|(t*2|)*29t|L`: the form stored in plans (no commas, so it sits in the configuration string); runs of
    two or more equal stages are written as one repeated group."""
    bodies = []
    for s in stages:
        body = "t" if s.blocks == 1 else (f"t*{s.blocks}" if s.blocks else "")
        bodies.append(("E" if s.embedding else "") + body + ("L" if s.loss else ""))
    out, i = [], 0
    while i < len(bodies):
        j = i
        while j + 1 < len(bodies) - 1 and bodies[j + 1] == bodies[i]:  # the last stage is never grouped
            j += 1
        n = j - i + 1
        is_last = j == len(bodies) - 1
        out.append(bodies[i] if is_last else (f"({bodies[i]}|)*{n}" if n > 1 else bodies[i] + "|"))
        i = j + 1
    return "".join(out)


def normalize(text: str) -> str:
    return canonical(parse_layout(text))


def counts(text: str) -> list[int]:
    """Blocks per (virtual) stage, in model order."""
    return [s.blocks for s in parse_layout(text)]


def uneven(num_layers: int, pp: int, vp: int, first: int | None, last: int | None) -> str:
    """The layout with `first` blocks on the first pipeline rank and `last` on the last (None: as the others), the
    rest spread evenly over the middle ranks: Megatron-Core's --decoder-first-pipeline-num-layers and
    --decoder-last-pipeline-num-layers, which count a pipeline rank's blocks over all its virtual stages
    (megatron/core/transformer/transformer_block.py, get_num_layers_to_build). Megatron requires each count to be
    a multiple of vp and the middle ranks' share to divide evenly; here a remainder is placed instead: on the first
    rank toward its later virtual stages (away from the embedding), on the last rank toward its earlier ones (away
    from the loss), over the middle ranks' virtual stages on the earliest in model order (as `even_layout` does).
    With pp=16, vp=8, 126 blocks, first=7, last=7 this is Llama 3 405B's `E|(t|)*126L`."""
    if pp < 2:
        raise ConfigError("--uneven needs at least two pipeline ranks", f"pp={pp}", "set pp>1, or drop --uneven")
    for name, v in (("first", first), ("last", last)):
        if v is not None and v < 0:
            raise ConfigError(f"--uneven {name} must be >= 0", f"got {name}={v}", "give a block count")
    fixed = (first or 0) + (last or 0)
    free_ranks = pp - (first is not None) - (last is not None)
    rest = num_layers - fixed
    if rest < 0 or (free_ranks == 0 and rest != 0):
        raise ConfigError("--uneven leaves the wrong number of blocks for the other pipeline ranks",
                          f"{num_layers} blocks, first={first}, last={last}, {free_ranks} other rank(s)",
                          f"make first+last{' equal' if free_ranks == 0 else ' at most'} {num_layers}")
    n = pp * vp
    cs = [0] * n

    def spread(total: int, stages: list[int], late: bool) -> None:
        base, extra = divmod(total, len(stages))
        for j, k in enumerate(stages):
            cs[k] = base + (1 if (j >= len(stages) - extra if late else j < extra) else 0)

    rank_stages = [list(range(r, n, pp)) for r in range(pp)]  # stage k runs on rank k mod pp
    if first is not None:
        spread(first, rank_stages[0], late=True)
    if last is not None:
        spread(last, rank_stages[-1], late=False)
    held = {0} if first is not None else set()
    held |= {pp - 1} if last is not None else set()
    free = [k for k in range(n) if k % pp not in held]
    if free:
        spread(rest, free, late=False)
    return canonical([LayoutStage(c, embedding=k == 0, loss=k == n - 1) for k, c in enumerate(cs)])


def parse_uneven(text: str) -> tuple[int | None, int | None]:
    """`first=N,last=M` (either may be left out)."""
    out: dict[str, int] = {}
    for raw in str(text).split(","):
        raw = raw.strip()
        if not raw:
            continue
        key, _, val = raw.partition("=")
        key = key.strip().lower()
        if key not in ("first", "last") or not val.strip().lstrip("-").isdigit():
            raise ConfigError("--uneven takes first=N,last=M", f"got {raw!r}", "write e.g. --uneven first=3,last=2")
        if key in out:
            raise ConfigError(f"--uneven {key} given twice", f"in {text!r}", "give it once")
        out[key] = int(val)
    if not out:
        raise ConfigError("--uneven takes first=N,last=M", f"got {text!r}", "write e.g. --uneven first=3,last=2")
    return out.get("first"), out.get("last")


# -------------------------------------------------------------------------------------------- checking


def check_layout(text: str, *, num_layers: int, pp: int, vp: int) -> list[LayoutStage]:
    """The stages of `text`, or a ConfigError naming the stage and what is wrong with it."""
    stages = parse_layout(text)
    n = pp * vp
    if len(stages) != n:
        raise ConfigError("the pipeline layout must have pp*vp stages",
                          f"{len(stages)} stage(s) in {text!r}, pp={pp}, vp={vp}",
                          f"write {n} stages separated by '|' (or change pp/vp)")
    last = n - 1
    for k, s in enumerate(stages):
        where = f"stage {k} (pipeline rank {k % pp}{f', virtual stage {k // pp}' if vp > 1 else ''})"
        if s.embedding and k != 0:
            raise ConfigError("the embedding (E) must be on the first stage", f"{where} holds it",
                              "move E to the start of the layout")
        if s.loss and k != last:
            raise ConfigError("the loss (L) must be on the last stage", f"{where} holds it",
                              "move L to the end of the layout")
        if s.blocks == 0 and not (s.embedding or s.loss):
            raise ConfigError("a stage without transformer blocks must hold the embedding or the loss",
                              f"{where} is empty", "give it at least one block (t) or drop it")
    if not stages[0].embedding:
        raise ConfigError("the embedding (E) must be on the first stage", f"stage 0 is {canonical(stages[:1])!r}",
                          "start the layout with E")
    if not stages[last].loss:
        raise ConfigError("the loss (L) must be on the last stage",
                          f"stage {last} is {canonical(stages[last:])!r}", "end the layout with L")
    total = sum(s.blocks for s in stages)
    if total != num_layers:
        raise ConfigError("the pipeline layout's blocks must add up to the model's",
                          f"{total} block(s) in the layout, the model has {num_layers}",
                          f"{'add' if total < num_layers else 'remove'} {abs(num_layers - total)} t")
    return stages
