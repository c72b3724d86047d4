"""Inspecting plans: show, compare, explain, trace, export and scaling.

Everything here reads a `Plan` (and, where it needs the timeline or a neighbour's cost, re-runs the cost
model on the plan's own stage layout); none of it imports torch. Rendering functions take a rich `Console`
so the tests can render at 80 columns into a string; every command also has a JSON form.
"""

from __future__ import annotations

from .common import InspectError, mesh_info, reestimate
from .compare import compare_json, render_compare
from .explain import explain_json, render_explain, why_not
from .export import export_megatron, export_torchtitan
from .scaling import render_scaling, scaling_rows
from .show import render_show, show_json, timeline_grid
from .trace import trace_events

__all__ = [
    "InspectError", "mesh_info", "reestimate", "render_show", "show_json", "timeline_grid", "compare_json",
    "render_compare", "explain_json", "render_explain", "why_not", "trace_events", "export_megatron",
    "export_torchtitan", "scaling_rows", "render_scaling",
]
