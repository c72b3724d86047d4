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


def attach(plan, ref: Any):
    """The plan with the model source of `ref` recorded (and re-sealed)."""
    record = source_record(ref)
    if record is None:
        return plan
    return plan.model_copy(update={"model_source": record, "content_hash": ""}).sealed()


def runtime_source(plan) -> Any:
    """What autoplan.models.build takes for this plan: the HF config dict, the factory reference, or the spec."""
    src = plan.model_source or {}
    if "hf_config" in src:
        return src["hf_config"]
    if "factory" in src:
        return src["factory"]
    return plan.model


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
