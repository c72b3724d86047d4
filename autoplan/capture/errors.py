"""The error capture raises: which op or construct stopped it, and what to do about it."""

from __future__ import annotations

from autoplan.cost_models.errors import AutoplanError


class CaptureError(AutoplanError):
    """A model could not be captured into a ModelGraph.

    `rule` names the construct that stopped the capture (an op, data-dependent control flow, a missing
    transformer block stack, a missing optional dependency), `detail` the values and where in the user's
    code it happened, `hint` a way out.
    """

    kind = "capture failed"
