"""The validated mesh object: which parallel degrees, which ranks, which groups. No process-group globals.

`ParallelDims.from_plan(plan, world_size)` checks the launch against the plan *before* any process group
exists (so a mismatch never hangs in a collective); `build_mesh()` then makes the DeviceMesh

    ("pp", "dp", "cp", "tp")       tp innermost (fastest-varying rank), pp outermost

and the derived views the techniques need: "dp_cp" (gradient reduction: data and context parallel ranks see
different tokens of the same parameters), and, for expert parallelism, "ep" carved out of dp as in
Megatron-LM (dp = edp x ep, ep inner) with "edp_cp" (the ranks that hold the same experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autoplan.cost_models.errors import PlanError

if TYPE_CHECKING:  # torch is imported lazily: validating a launch must not need it
    from torch.distributed.device_mesh import DeviceMesh

    from autoplan.plan import Plan


@dataclass
class ParallelDims:
    pp: int
    dp: int
    cp: int
    tp: int
    ep: int
    world_size: int
    device_type: str = "cpu"
    mesh: DeviceMesh | None = field(default=None, repr=False)
    ep_mesh: DeviceMesh | None = field(default=None, repr=False)
    _views: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "cp", "tp", "ep"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be >= 1", f"{name}={getattr(self, name)}", "fix the plan")
        product = self.pp * self.dp * self.cp * self.tp
        if product != self.world_size:
            raise PlanError(
                "the plan's layout needs a different number of processes than were launched",
                f"pp*dp*cp*tp = {self.pp}*{self.dp}*{self.cp}*{self.tp} = {product}, "
                f"but {self.world_size} processes were started",
                f"launch with {product} processes (torchrun --nproc-per-node {product}, or "
                f"`autoplan run --nproc-per-node {product}`), or make a plan for {self.world_size} ranks",
            )
        if self.dp % self.ep:
            raise PlanError("ep must divide dp (experts are carved out of data parallelism)",
                            f"dp={self.dp}, ep={self.ep}", "choose ep dividing dp")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_plan(cls, plan: Plan, world_size: int, device_type: str = "cpu") -> ParallelDims:
        """Check the launch against the plan: the world size and the plan's own consistency."""
        cfg = plan.parallel
        if plan.world_size != world_size:
            gpn = plan.cluster.gpus_per_node
            if plan.world_size > gpn and plan.world_size % gpn == 0:
                launch = f"--nnodes {plan.world_size // gpn} --nproc-per-node {gpn}"
            else:
                launch = f"--nproc-per-node {plan.world_size}"
            raise PlanError(
                f"plan {plan.short_hash} is for {plan.world_size} ranks but {world_size} processes were launched",
                f"{plan.model.name} on {plan.cluster.name} with {cfg.to_string()}",
                f"launch with {launch}, or re-plan with --gpus {world_size}",
            )
        return cls(pp=cfg.pp, dp=cfg.dp or 1, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, world_size=world_size,
                   device_type=device_type)

    def build_mesh(self) -> ParallelDims:
        """Create the DeviceMesh (collective: every rank calls it). Returns self for chaining."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device_type, (self.pp, self.dp, self.cp, self.tp),
                                mesh_dim_names=("pp", "dp", "cp", "tp"))
        self.mesh = mesh
        self._views = {name: mesh[name] for name in ("pp", "dp", "cp", "tp")}
        self._views["dp_cp"] = mesh["dp", "cp"]._flatten("dp_cp")
        if self.ep > 1:
            ep_mesh = mesh._unflatten("dp", (self.dp // self.ep, self.ep), ("edp", "ep"))
            self._views.update(ep=ep_mesh["ep"], edp=ep_mesh["edp"])
            self._views["edp_cp"] = ep_mesh["edp", "cp"]._flatten("edp_cp")
            self.ep_mesh = ep_mesh
        return self

    # ------------------------------------------------------------------ views

    def _need(self) -> DeviceMesh:
        if self.mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self.mesh

    def __getitem__(self, name: str) -> DeviceMesh:
        """A 1-D sub-mesh by name: pp, dp, cp, tp, dp_cp; ep, edp, edp_cp when ep > 1."""
        self._need()
        if name not in self._views:
            raise KeyError(f"no {name!r} mesh in {self.describe()} (ep, edp, edp_cp exist only with ep>1)")
        return self._views[name]

    def rank(self, name: str) -> int:
        """This process's coordinate along an axis (0 when the axis has size 1)."""
        return self[name].get_local_rank()

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp * self.cp > 1

    def describe(self) -> str:
        return f"pp={self.pp} dp={self.dp} cp={self.cp} tp={self.tp} ep={self.ep} (world {self.world_size})"


def check_model_matches(plan: Plan, model_spec_or_name) -> None:
    """A plan made for another model must not run: compare the spec the user asked for with the plan's."""
    from autoplan.cost_models.specs import ModelSpec

    name = model_spec_or_name.name if isinstance(model_spec_or_name, ModelSpec) else str(model_spec_or_name)
    if isinstance(model_spec_or_name, ModelSpec):
        same = model_spec_or_name == plan.model
    else:
        same = name == plan.model.name
    if not same:
        raise PlanError(
            f"plan {plan.short_hash} was made for model {plan.model.name!r}, not {name!r}",
            f"the plan's layout (stages, TP splits of {plan.model.num_attention_heads} heads) only fits its model",
            f"make a plan for {name} (`autoplan search --model {name} ...`), or drop --model to train "
            f"{plan.model.name}",
        )


def check_module_matches(plan: Plan, module) -> None:
    """A user module must have the plan's structure (layers, width, vocabulary)."""
    spec = plan.model
    layers = getattr(module, "layers", None)
    got = {
        "num_layers": len(layers) if layers is not None else None,
        "hidden_size": getattr(getattr(module, "tok_embeddings", None), "embedding_dim", None),
        "vocab_size": getattr(getattr(module, "tok_embeddings", None), "num_embeddings", None),
    }
    want = {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size}
    if hasattr(module, "parameters"):  # the parameter count of the zoo model the plan describes (meta: free)
        from autoplan.zoo import build_model, num_parameters

        got["num_parameters"] = num_parameters(module)
        want["num_parameters"] = num_parameters(build_model(spec, device="meta"))
    bad = [f"{k}: model {got[k]} vs plan {want[k]}" for k in want if got[k] != want[k]]
    if bad:
        raise PlanError(f"the model does not match plan {plan.short_hash} (made for {spec.name})", "; ".join(bad),
                        "make a plan for this model, or pass the model the plan was made for")
