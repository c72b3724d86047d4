"""The search: enumerate legal parallel configurations, bound and prune them, solve the stage ILP for the
best, re-estimate the finalists with the cost model and return a Plan.

    from autoplan.search import search
    result = search(model, cluster, training, fix={"tp": "8"}, top=5)
    result.plan.save("plan.json"); result.best; result.runners_up; result.stats; result.as_json()

`core.py` has the procedure, `ilp.py` the mathematics, `space.py` the legal space, `problem.py` the stage
sub-problem (with an exhaustive solver used by the tests). Importing this package does not import torch.
"""

from __future__ import annotations

__all__ = ["search", "SearchResult", "SearchStats"]


def __getattr__(name: str):  # lazy: `autoplan --help` should not pay for pulp
    if name in __all__:
        from . import core

        return getattr(core, name)
    raise AttributeError(name)
