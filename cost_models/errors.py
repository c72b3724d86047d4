"""Typed errors shared by every package.

They live here because `cost_models` may import nothing else of ours, and every other package may import
`cost_models`. Each error carries the rule that was broken, the offending values and a way out, so the CLI
can print one line instead of a traceback.
"""

from __future__ import annotations


class AutoplanError(Exception):
    """Base class: `rule` names the rule, `detail` the values, `hint` what to do about it."""

    kind = "error"

    def __init__(self, rule: str, detail: str = "", hint: str = "") -> None:
        self.rule = rule
        self.detail = detail
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        parts = [self.rule]
        if self.detail:
            parts[0] += f": {self.detail}"
        if self.hint:
            parts.append(f"fix: {self.hint}")
        return ". ".join(parts)


class SpecError(AutoplanError):
    """A model, cluster or training spec is malformed or cannot be found."""

    kind = "bad spec"


class ConfigError(AutoplanError):
    """A parallel configuration is impossible for this model, cluster and training setup."""

    kind = "impossible configuration"


class DoesNotFitError(AutoplanError):
    """No configuration fits in memory."""

    kind = "does not fit"


class PlanError(AutoplanError):
    """A plan file is corrupt, tampered with, or of an unknown schema version."""

    kind = "bad plan"
