"""A plan is data, never code (issue 18): whatever text a plan's strings hold, the emitted stage programs are the
same program, and every value comes back exactly when the program is executed.

The property test puts arbitrary text (biased towards quotes of every kind, triple quotes, backslashes, line
breaks, NUL, lone surrogates, non-ASCII and braces) into every free string field of a plan — found by walking the
plan, so a string field added later is covered without editing this file — and into the keys of its free-form
mappings, then checks each emitted stage:
- it compiles;
- its syntax tree, with every string constant blanked, is the tree of the same plan with harmless names: the
  text changed no statement, expression, call or comment-turned-code anywhere, `build` included;
- executed, it defines exactly the names the harmless program defines, and SPEC, STAGE, PLAN_HASH and the
  module docstring carry the values exactly.
"""

from __future__ import annotations

import ast
import builtins
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from autoplan.api import make_plan
from autoplan.codegen.emit import emit_source, write_program
from autoplan.codegen.program import stage_programs
from autoplan.codegen.quote import comment, docstring, literal, one_line
from autoplan.plan import Plan
from autoplan.specs import TrainingSpec, load_cluster, load_model

pytest.importorskip("torch")

# The exact case of issue 18: closes the module docstring, then one statement.
ISSUE_NAME = 'tiny"""\nimport os; os.system("touch /tmp/autoplan-pwned")\n"""'
# Payloads that would set a marker if any part of them ran, one per way out of a literal or comment.
MARKER = "AUTOPLAN_INJECTED"
PAYLOADS = [
    f'tiny"""\nimport builtins; builtins.{MARKER} = 1\n"""',
    f"tiny'''\nimport builtins; builtins.{MARKER} = 1\n'''",
    f"x'\nimport builtins; builtins.{MARKER} = 1\n'",
    f'x"\nimport builtins; builtins.{MARKER} = 1\n"',
    f'x"]; import builtins; builtins.{MARKER} = 1; ["',
    f"x\\\nimport builtins; builtins.{MARKER} = 1  # ",
    f"x\rimport builtins; builtins.{MARKER} = 1\r",
    f"x\u2028import builtins; builtins.{MARKER} = 1",
    f"{{}}{{0}}{{{MARKER}}}",
]

TRAIN = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32")


def _plan(model: str, gpus: int, config: str, kernels: str) -> Plan:
    return make_plan(load_model(model), load_cluster("local-cpu").with_gpus(gpus), TRAIN, config, kernels=kernels)


# Between them: pipeline cut with deleted layers, TP/SP styles and per-layer targets, fused kernels, selective
# recompute, MoE with EP, CP with its sequence length, ZeRO, and a single-stage program.
BASES = {
    "tp-pp-fused": _plan("tiny-llama", 4, "tp=2,pp=2,sp=1,recompute=selective", "fused"),
    "moe-ep-cp": _plan("tiny-moe", 4, "pp=2,dp=2,ep=2,zero=1,recompute=full", "torch"),
    "cp-dp": _plan("tiny-gpt", 4, "cp=2,dp=2,zero=3", "fused"),
}

# Fields holding free text; the others are literals (dtype, schedule, ...) that reject any other string.
_PROBE = "free text \u2028 probe"


def _walk(data, path=()):
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _walk(v, (*path, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _walk(v, (*path, i))
    else:
        yield path, data


def _set(data, path, value):
    for k in path[:-1]:
        data = data[k]
    data[path[-1]] = value


def _free_string_paths(plan: Plan) -> list[tuple]:
    """Paths of the plan's string leaves that accept any text."""
    base = plan.model_dump(mode="python")
    free = []
    for path, v in _walk(base):
        if not isinstance(v, str) and v is not None:  # None: an optional field that may hold text
            continue
        trial = plan.model_dump(mode="python")
        _set(trial, path, _PROBE)
        try:
            Plan.model_validate(trial)
        except Exception:  # a Literal field: it cannot carry the text
            continue
        free.append(path)
    return free


FREE = {k: _free_string_paths(p) for k, p in BASES.items()}
# Mappings with free keys (they reach no program today; they must stay harmless if they ever do).
FREE_KEYED = [("prediction", "breakdown"), ("prediction", "memory_gib")]


def test_every_string_field_is_probed():
    """The walk finds the fields that matter, so the property test cannot silently cover nothing."""
    paths = {p for ps in FREE.values() for p in ps}
    for need in [("model", "name"), ("cluster", "name"), ("cluster", "gpu", "name"), ("content_hash",),
                 ("provenance", "command"), ("provenance", "inputs_hash")]:
        assert need in paths, need


def _with_text(plan: Plan, paths: list[tuple], text: str) -> Plan:
    data = plan.model_dump(mode="python")
    for p in paths:
        _set(data, p, text)
    for p in FREE_KEYED:
        m = data
        for k in p:
            m = m[k]
        m[text] = 0.0
    for r in data["runners_up"]:
        r["note"] = text
    return Plan.model_validate(data)


def _skeleton(src: str) -> str:
    """The program with every string constant blanked (structure, names, numbers and calls stay)."""
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.dump(tree)


def _run(src: str) -> dict:
    ns: dict = {"__name__": "autoplan_stage_under_test"}
    exec(compile(src, "<stage under test>", "exec"), ns)  # noqa: S102 - the point of the test
    return ns


HARMLESS = {k: emit_source(_with_text(p, FREE[k], "harmless")) for k, p in BASES.items()}
HARMLESS_NAMES = {k: {f: set(_run(s)) for f, s in srcs.items()} for k, srcs in HARMLESS.items()}

HOSTILE_PIECES = ['"""', "'''", '"', "'", "\\", "\\n", "\n", "\r", "\r\n", "\x00", "\x0b", "\x0c", "\x1b[31m",
                  "\ud800", "\udfff", "\u2028", "\u2029", "\ufeff", "é", "日本語", "𝔘", "{", "}", "{}", "{0}",
                  "#", "\t", "f'{x}'", "\\N{BULLET}", "\\x00", "import os; os.system('true')", ")]}", "\\\n"]
TEXT = st.lists(st.one_of(st.sampled_from(HOSTILE_PIECES),
                          st.text(st.characters(exclude_categories=()), max_size=8)), max_size=12).map("".join)


def _check(key: str, text: str) -> None:
    plan = _with_text(BASES[key], FREE[key], text)
    assert plan.model.name == text
    sources = emit_source(plan)
    assert sources.keys() == HARMLESS[key].keys()
    for fname, src in sources.items():
        src.encode("utf-8")  # writable as a file (no lone surrogate in the source itself)
        assert _skeleton(src) == _skeleton(HARMLESS[key][fname]), fname
        ns = _run(src)
        assert set(ns) == HARMLESS_NAMES[key][fname]
        assert not hasattr(builtins, MARKER)
        index = int(fname[len("stage_"):-len(".py")])
        assert ns["SPEC"] == plan.model and ns["SPEC"].name == text
        assert ns["STAGE"] == plan.stages[index]
        assert ns["PLAN_HASH"] == plan.short_hash == (text or plan.compute_hash())[:12]
        assert one_line(text) in ns["__doc__"]  # the header shows the name on its own line, escaped
        assert ns["__doc__"].count("\n") == ast.get_docstring(ast.parse(HARMLESS[key][fname]), clean=False).count("\n")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(BASES)), text=TEXT)
@example(key="tp-pp-fused", text=ISSUE_NAME)
@example(key="moe-ep-cp", text=ISSUE_NAME)
def test_plan_strings_never_become_code(key, text):
    _check(key, text)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_injection_payloads_stay_data(payload):
    for key in BASES:
        _check(key, payload)
    assert not hasattr(builtins, MARKER)


def test_issue_18_case_in_the_written_program(tmp_path):
    """`autoplan codegen` of a plan whose model is named as in the issue: line 6 of stage_0.py is a docstring line,
    the program imports nothing but its own imports, and the name comes back from SPEC."""
    plan = _with_text(BASES["tp-pp-fused"], [("model", "name")], ISSUE_NAME)
    write_program(plan, tmp_path)
    src = (tmp_path / "stage_0.py").read_text()
    tree = ast.parse(src)
    doc = ast.get_docstring(tree, clean=False)
    assert "os.system" in doc and tree.body[0].end_lineno > 6  # the payload is inside the docstring
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert "os" not in imported and not any(isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "system"
                                            for n in ast.walk(tree))
    assert _run(src)["SPEC"].name == ISSUE_NAME
    readme = (tmp_path / "README.md").read_text()
    assert one_line(ISSUE_NAME) in readme and "\nimport os" not in readme


def test_program_runtime_executes_is_the_quoted_one():
    """runtime.parallelize.load_stage_program compiles exactly emit's source (no second renderer)."""
    from autoplan.runtime.parallelize import load_stage_program

    plan = _with_text(BASES["cp-dp"], FREE["cp-dp"], ISSUE_NAME)
    build = load_stage_program(stage_programs(plan)[0])
    assert build.__globals__["SPEC"].name == ISSUE_NAME


# ----------------------------------------------------------------------------- the quoting functions


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(st.characters(exclude_categories=())),
                    lambda kids: st.lists(kids, max_size=3) | st.tuples(kids) | st.tuples(kids, kids)
                    | st.dictionaries(st.text(max_size=4), kids, max_size=3), max_leaves=8))
@settings(max_examples=60, deadline=None)
def test_literal_round_trips(value):
    back = eval(literal(value), {"__builtins__": {"float": float}})  # noqa: S307 - float() only, for inf/nan
    assert _same(back, value)


def _same(a, b) -> bool:
    if isinstance(b, float) and math.isnan(b):
        return isinstance(a, float) and math.isnan(a)
    if type(a) is not type(b):
        return False
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    return a == b


@given(st.text(st.characters(exclude_categories=())))
@settings(max_examples=200, deadline=None)
def test_docstring_and_comment_are_exact_and_single_line(text):
    src = docstring(text)
    tree = ast.parse(src)
    assert len(tree.body) == 1 and tree.body[0].value.value == text
    src.encode("utf-8")
    c = comment(text)
    assert "\n" not in c and ast.parse(c).body == [] and len(c.splitlines()) == 1


def test_literal_refuses_what_it_cannot_render():
    with pytest.raises(TypeError, match="cannot render"):
        literal(object())
    assert literal("a") == '"a"' and literal('a"b') == repr('a"b') and literal(float("inf")) == "float('inf')"
