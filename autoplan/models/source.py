"""Which module a plan is for: the record a Plan carries (`Plan.model_source`) so that `autoplan run` builds the
model that was planned, not a summary of it. Torch-free (the planner imports it).

  {"hf_config": {...}}     a Hugging Face config (the raw config.json mapping)
  {"factory": "pkg.mod:fn"} a user module factory
  None                      a preset or spec file: the zoo model of `plan.model`
"""

from __future__ import annotations

import sys
from typing import Any


def source_record(ref: Any) -> dict | None:
    from . import hf_config_of, is_factory

    cfg = hf_config_of(ref)
    if cfg is not None:
        return {"hf_config": cfg}
    if isinstance(ref, str) and is_factory(ref):
        return {"factory": ref}
    return None


# The module:factory reference the user named on the command line of `autoplan run` or `autoplan tune`, passed to
# the workers it launches: a plan's factory is imported only when it equals this (`check_module_trusted`).
TRUSTED_MODULE_ENV = "AUTOPLAN_TRUSTED_MODULE"


def plan_module(plan) -> str | None:
    """The module:factory reference a plan trains (None: a preset, spec file or Hugging Face config, which are
    data)."""
    return (plan.model_source or {}).get("factory")


def same_module(a: str, b: str) -> bool:
    """Whether two module:factory references name the same factory (a file path resolved, a package as written)."""
    from pathlib import Path

    def norm(ref: str) -> tuple[str, str]:
        mod, _, fn = ref.rpartition(":")
        return (str(Path(mod).resolve()) if mod.endswith(".py") else mod), fn

    return norm(a) == norm(b)


def check_module_trusted(plan, trusted: str | None, fix: str) -> None:
    """Refuse to build a plan's module:factory unless the user named that module themselves (`trusted`: their
    --model, or TRUSTED_MODULE_ENV in the workers). A plan file is data (SECURITY.md): one that names Python code
    must not run it because someone shared the file. Nothing to check for other plans."""
    from autoplan.cost_models.errors import PlanError

    module = plan_module(plan)
    if module is None or (trusted and same_module(module, trusted)):
        return
    named = f"; you named {trusted!r}" if trusted else ""
    raise PlanError(f"plan {plan.short_hash} trains the Python module {module!r}",
                    "a plan file is data: autoplan imports the module a plan names only when you name it yourself "
                    f"(SECURITY.md){named}", fix)


def attach(plan, ref: Any, profiles=None):
    """The plan with the model source of `ref` recorded (and re-sealed); for a user's module also the `profiles`
    of its capture that the plan was priced from (Plan.profiles: inspecting the plan re-prices it from them, never
    by importing the module)."""
    record = source_record(ref)
    if record is None:
        return plan
    update = {"model_source": record, "content_hash": ""}
    if "factory" in record and profiles:
        update["profiles"] = list(profiles)
    return plan.model_copy(update=update).sealed()


def with_model_of(plan, other):
    """`plan` (re-sealed) training what `other` trains: its model source and the profiles it was priced from."""
    if other.model_source is None:
        return plan
    return plan.model_copy(update={"model_source": other.model_source, "profiles": other.profiles,
                                   "content_hash": ""}).sealed()


def runtime_source(plan) -> Any:
    """What autoplan.models.build takes for this plan: the HF config dict, the factory reference, or the spec."""
    src = plan.model_source or {}
    if "hf_config" in src:
        return src["hf_config"]
    if "factory" in src:
        return src["factory"]
    return plan.model


def runs_torch_ops(ref: Any) -> str | None:
    """Why the runtime runs `ref` with torch's ops whatever the plan's kernels say, or None. autoplan's fused
    kernels replace the zoo model's norms and activations (codegen.program.kernel_substitutions); a Hugging Face
    family (autoplan.models) and a user's module keep their own modules (session 23: a Llama config.json planned
    with the fused kernels ran torch's RMSNorm and SiLU on an H200, the same kernels as with --kernels torch)."""
    return record_runs_torch_ops(source_record(ref))


def record_runs_torch_ops(record: dict | None) -> str | None:
    """`runs_torch_ops` for a plan's recorded source (`Plan.model_source`)."""
    if not record:
        return None
    return "a Hugging Face config" if "hf_config" in record else "a user's module" if "factory" in record else None


def planner_pins(ref: Any) -> dict[str, str]:
    """Knobs `autoplan search` pins for this model source because the runtime would refuse other values: for a
    module:factory model sp, cp and ep (always), and tp or pp when the capture of the module already shows they
    cannot be applied (autoplan.models.factory.factory_structure; the tp dry run, which depends on tp, is left to
    `autoplan run`). Empty for other sources. `--fix` overrides a pin."""
    from . import is_factory

    if not (isinstance(ref, str) and is_factory(ref)):
        return {}
    from .factory import factory_structure

    st = factory_structure(ref)
    pins = {"sp": "0", "cp": "1", "ep": "1"}
    if st.tp_problems:
        pins["tp"] = "1"
    if st.pp_problems:
        pins["pp"] = "1"
    return pins


def warn_unsupported(ref: Any, *, stream=None) -> list:
    """Planning-time warning for the config fields the runtime will refuse (search/estimate still plan)."""
    from . import check, hf_config_of

    cfg = hf_config_of(ref)
    if cfg is None:
        return []
    from autoplan.cost_models.errors import AutoplanError

    try:
        problems = check(cfg)
    except AutoplanError as e:  # an unknown family or no transformers: planning goes on, the run would not
        print(f"autoplan: warning: {e.rule}; `autoplan run` will refuse this model", file=stream or sys.stderr)
        return []
    except Exception:  # noqa: BLE001 (a config transformers rejects: the planner's own checks report it)
        return []
    for p in problems:
        print(f"autoplan: warning: {cfg.get('model_type')}: config field {p.field}={p.value!r} cannot be honoured "
              f"by the runtime ({p.reason}); `autoplan run` will refuse it", file=stream or sys.stderr)
    return problems
