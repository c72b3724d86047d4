"""Read the training command out of a launch script without running it.

Megatron-LM's own examples (examples/gpt3/train_gpt3_175b_distributed.sh, examples/llama/train_llama3_8b_h100_fp8.sh)
build the command from shell variables and arrays: `NUM_LAYERS=32`, `MODEL_ARGS=(--num-layers $NUM_LAYERS ...)`,
`torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]}`. Running the script to see the command would
launch the training and whatever else the script does (mkdir, rm, srun), so it is read instead, expanded as bash
expands it, for the subset such scripts use: scalar and array assignments (`=`, `+=`, `export`, `declare`, `local`),
`$NAME`, `${NAME}`, `${NAME:-word}`, `${NAME-word}`, `${NAME:=word}`, `${NAME[@]}`, `${NAME[*]}`, `$((arithmetic))`,
quotes, comments and line continuations. Names the script does not set come from the environment, as in bash.

Nothing is run. Other files are read, never run, where the script itself would read them: a sourced file (`.`,
`source`: NVIDIA's SC21 scripts keep the flags in CONFIG.sh), the batch script `sbatch` submits (read in the
environment sbatch passes it: the exported variables, or its --export list, and the allocation's node count), and
a here-document the script writes to a file with `cat` / `tee` (Megatron-DeepSpeed's scripts write their DeepSpeed
JSON so) is kept for the reader of that file. A few commands whose output is a path are computed, not run: `pwd`,
`dirname`, `basename`, `realpath`, `readlink -f`, `cd DIR && pwd`; `cd DIR` moves the directory they see. Any other
command substitution (`$(...)`, backquotes) and a positional parameter (`$1`) stay as written, and the Megatron
reader refuses a flag it reads that holds one, naming it. An if whose test compares strings or integers takes the
branch bash would take in the given environment (an unset name is "", and the note says which were); one whose test
needs running (a file test, a command) is read as if its branch ran, and a variable the command uses that it sets
is reported. `exit` ends the reading where bash would end the script.
"""

from __future__ import annotations

import ast
import contextlib
import operator
import os
import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from autoplan.cost_models.errors import ConfigError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"(?:(?:export|declare|typeset|local|readonly)(?:\s+-\w+)*\s+)?([A-Za-z_]\w*)(\+?)=(.*)", re.S)
# Environment names whose values are the user's shell's, never a training setting: not reported when used
_QUIET_ENV = {"PWD", "HOME", "USER", "PATH", "HOSTNAME", "SHELL", "TMPDIR"}


@dataclass
class ScriptCommand:
    """The training command a script runs, as words, and what the reading assumed."""

    words: list[str]
    notes: list[str] = field(default_factory=list)
    gpus: int | None = None  # Slurm's task count where srun starts one process per GPU (srun / #SBATCH options)
    files: dict[str, str] = field(default_factory=dict)  # what the script writes with here-documents, by path


# How deep sourced files and submitted batch scripts are followed (a file that sources itself stops here)
_MAX_DEPTH = 8


class _Exit(Exception):
    """`exit` met where it runs: bash stops reading the script (or the sourced file's caller) there."""


class _Return(Exception):
    """`return` at the top of a sourced file: bash stops reading that file."""


@dataclass
class _Context:
    """Where a training command was met: the file's text (its #SBATCH lines), the environment it runs in and the
    options its allocation was made with (sbatch's command line), for `_slurm_tasks`."""

    text: str
    env: Mapping[str, str]
    options: list[str] = field(default_factory=list)


@dataclass
class _State:
    env: Mapping[str, str]
    scalars: dict[str, str] = field(default_factory=dict)
    arrays: dict[str, list[str]] = field(default_factory=dict)
    branch_values: dict[str, set[str]] = field(default_factory=dict)  # values set inside if/case/for/while
    feeds: dict[str, set[str]] = field(default_factory=dict)  # names whose values went into this one
    used: set[str] = field(default_factory=set)  # names read by the expansion in progress
    from_env: set[str] = field(default_factory=set)
    empty_unset: bool = False  # an if-test is being read: an unset name is "" as in bash
    unset_tested: set[str] = field(default_factory=set)  # unset names if-tests read
    tested: set[str] = field(default_factory=set)  # names the decided if-tests read
    sourced: list[str] = field(default_factory=list)  # files the script sources, not read
    cwd: str | None = None  # the directory `pwd` prints, where known
    reading: list[str] = field(default_factory=list)  # the files being read, outermost first ($0, BASH_SOURCE)
    followed: list[str] = field(default_factory=list)  # files read besides the script, with how
    files: dict[str, str] = field(default_factory=dict)  # here-documents written to files, by path as expanded
    exported: set[str] = field(default_factory=set)  # names `export` marks (sbatch and child shells see them)
    passed: set[str] = field(default_factory=set)  # names a submitting script passed in (not the user's env)
    context: _Context | None = None  # the file being read, for the commands met in it
    allocation_notes: list[str] = field(default_factory=list)  # Slurm variables set from the allocation
    function_next: bool = False  # a function's name was read: the `{` that follows opens its body
    shells: int = 0  # the submitting shells above this one (sbatch), for _MAX_DEPTH
    args_used: bool = False  # the script reads its own arguments ($@, $*, $#): taken as none
    flagless: list[str] = field(default_factory=list)  # a .py command met without --flags (they did not expand)

    def lookup(self, name: str) -> str | None:
        self.used.add(name)
        if name == "0" and self.reading:
            return self.reading[0]
        if name == "BASH_SOURCE" and self.reading:
            return self.reading[-1]
        if name in self.arrays:
            return self.arrays[name][0] if self.arrays[name] else ""
        if name in self.scalars:
            return self.scalars[name]
        if not name.isdigit() and name in self.env:
            self.from_env.add(name)
            return self.env[name]
        return None

    def elements(self, name: str) -> list[str] | None:
        self.used.add(name)
        if name == "BASH_SOURCE" and self.reading:
            return self.reading[::-1]
        if name in self.arrays:
            return list(self.arrays[name])
        value = self.lookup(name)
        return None if value is None else [value]


def _closing(text: str, i: int, open_: str, close: str) -> int:
    """Index of the `close` matching the `open_` just before text[i], skipping quoted text; -1 if none."""
    depth, quote = 1, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == _KEEP:
            i = max(text.find(_KEPT, i), i)
        elif c == "\\":
            i += 1
        elif text.startswith(open_, i):
            depth += 1
        elif text.startswith(close, i):
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.Pow: operator.pow}


def _arith(expr: str, st: _State) -> int | None:
    """bash's $(( )) on integers: names are variables (unset: 0, as in bash), + - * / % ** and parentheses."""
    def name(m: re.Match) -> str:
        v = st.lookup(m.group(0))
        return "0" if v in (None, "") else v
    text = _NAME.sub(name, re.sub(r"\$\{?([A-Za-z_]\w*)\}?", r"\1", expr)).replace("/", "//")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(node)
    try:
        return ev(tree)
    except (ValueError, ZeroDivisionError, TypeError):
        return None


def _braced(inner: str, st: _State, quoted: bool) -> str | list[str] | None:
    """The value of ${inner}: a string, a list of words (an array's [@] / [*] unquoted or [@] quoted), or None
    where this reader does not know it (left as written)."""
    m = re.fullmatch(r"([A-Za-z_]\w*)\[([@*])\]", inner)
    if m:
        elems = st.elements(m.group(1))
        if elems is None:
            return []
        return " ".join(elems) if (m.group(2) == "*" and quoted) else elems
    m = re.fullmatch(r"([A-Za-z_]\w*)\[(\d+)\]", inner)
    if m:
        elems = st.elements(m.group(1))
        k = int(m.group(2))
        return elems[k] if elems is not None and k < len(elems) else ""
    if inner in ("@", "*", "#"):
        st.args_used = True
        return "0" if inner == "#" else ""
    m = re.fullmatch(r"([A-Za-z_]\w*|\d+)(?:(:?)([-=+])(.*))?", inner, re.S)
    if not m:
        return None
    name, colon, op, word = m.groups()
    value = st.lookup(name)
    if op is None:
        return value
    unset = value is None or (colon == ":" and value == "")
    word_value = " ".join(_words(_expand(word, st)[0]) or []) if word else ""
    if op == "+":
        return "" if unset else word_value
    if unset:
        if op == "=" and not name.isdigit():
            st.scalars[name] = word_value
        return word_value
    return value


# What the reading leaves as written is marked, so that it stays one opaque piece wherever its value goes next (a
# variable expanded unquoted, `eval`, `bash -c "$CMD"`): bash would have the command's output there, one word and no
# shell syntax. read_script takes the marks off what it returns.
_KEEP, _KEPT = "\x02", "\x03"
_MARKED = re.compile("\x02[^\x03]*\x03")


def _as_written(raw: str, double: bool) -> str:
    """A shell word left as written (nothing is run to know it), marked and kept one word for the reader to name."""
    marked = raw if raw.startswith(_KEEP) else _KEEP + raw + _KEPT
    return marked if double else shlex.quote(marked)


def _unquoted(value: str) -> str:
    """A value where it is expanded unquoted: split at its spaces as bash splits it, but not inside what the
    reading left as written."""
    return _MARKED.sub(lambda m: shlex.quote(m.group(0)), value)


def _unmark(text: str) -> str:
    return text.replace(_KEEP, "").replace(_KEPT, "")


def _quote_in_double(value: str) -> str:
    """`value` inside a double-quoted word, for shlex: only `"` and `\\` are escaped, the two shlex unescapes there
    (an escaped `$` would keep its backslash, doubling on every re-reading: `bash -c "$CMD"`)."""
    return re.sub(r'(["\\])', r"\\\1", value)


def _joined(st: _State, path: str) -> str | None:
    """`path` as seen from the directory the script is in now (None where that directory is not known)."""
    if posixpath.isabs(path):
        return posixpath.normpath(path)
    return None if st.cwd is None else posixpath.normpath(posixpath.join(st.cwd, path))


def _computed(inner: str, st: _State) -> str | None:
    """The output of a command substitution whose command only prints a path computed from its words (`pwd`,
    `dirname X`, `basename X [SUFFIX]`, `realpath X`, `readlink -f X`, `cd X && pwd`): computed, not run. None
    for any other command, or where a word or the directory is not known."""
    expanded, kept = _expand(inner, st)
    words = _words(expanded)
    if kept or not words:
        return None
    out: str | None = None
    if words == ["pwd"]:
        out = st.cwd
    elif len(words) == 2 and words[0] == "dirname":
        out = posixpath.dirname(words[1].rstrip("/")) or ("/" if words[1].startswith("/") else ".")
    elif len(words) in (2, 3) and words[0] == "basename":
        out = posixpath.basename(words[1].rstrip("/"))
        if len(words) == 3 and out.endswith(words[2]) and out != words[2]:
            out = out[:-len(words[2])]
    elif (len(words) == 2 and words[0] == "realpath") or (len(words) == 3 and words[:2] == ["readlink", "-f"]):
        out = _joined(st, words[-1])
    elif len(words) == 4 and words[0] == "cd" and words[2:] == ["&&", "pwd"]:
        out = _joined(st, words[1])
    if out is not None:
        st.used.add(f"`{words[0]}`")  # marks what the value came from, as a name would (feeds, the notes)
    return out


def _substitution(raw: str, inner: str, st: _State, double: bool, heredoc: bool) -> tuple[str, bool]:
    """A command substitution (`raw`, running `inner`) as `_expand` writes it, and whether it stayed as written: a
    path command's output (`_computed`), else the text marked as left unknown."""
    value = _computed(inner, st)
    if value is None:
        return _as_written(raw, double or heredoc), True
    return (value if heredoc else _quote_in_double(value) if double else shlex.quote(value)), False


def _expand(text: str, st: _State, join: bool = False, heredoc: bool = False) -> tuple[str, bool]:
    """`text` with its expansions substituted, as text shlex can split into bash's words; and whether something
    stayed as written (a command substitution, a positional parameter, an unknown form). `join`: an assignment's
    value, where "${A[@]}" is one word, as in bash. `heredoc`: the body of an unquoted here-document, where quotes
    are text and only $, backquotes and backslashes before them are special (the result is the file's text)."""
    out: list[str] = []
    kept = False
    i, single, double = 0, False, False
    while i < len(text):
        c = text[i]
        if c == _KEEP and not single:  # left as written by an earlier reading: one opaque piece
            end = text.find(_KEPT, i)
            end = len(text) - 1 if end < 0 else end
            out.append(_as_written(text[i:end + 1], double or heredoc))
            kept, i = True, end + 1
            continue
        if single:
            out.append(c)
            single = c != "'"
            i += 1
            continue
        if c == "\\" and i + 1 < len(text):
            out.append(text[i + 1] if heredoc and text[i + 1] in "$`\\" else text[i:i + 2])
            i += 2
            continue
        if c == "'" and not double and not heredoc:
            single = True
            out.append(c)
            i += 1
            continue
        if c == '"' and not heredoc:
            double = not double
            out.append(c)
            i += 1
            continue
        if c == "`":
            end = text.find("`", i + 1)
            end = len(text) - 1 if end < 0 else end
            piece, unknown = _substitution(text[i:end + 1], text[i + 1:end], st, double, heredoc)
            out.append(piece)
            kept, i = kept or unknown, end + 1
            continue
        if c != "$" or i + 1 >= len(text):
            out.append(c)
            i += 1
            continue
        if text.startswith("$((", i):
            end = _closing(text, i + 3, "(", ")")
            value = _arith(text[i + 3:end], st) if end >= 0 and text.startswith("))", end) else None
            if value is None:
                out.append(_as_written(text[i:(end + 2 if end >= 0 else len(text))], double or heredoc))
                kept, i = True, (end + 2 if end >= 0 else len(text))
            else:
                out.append(str(value))
                i = end + 2
            continue
        if text.startswith("$(", i):
            end = _closing(text, i + 2, "(", ")")
            end = len(text) - 1 if end < 0 else end
            piece, unknown = _substitution(text[i:end + 1], text[i + 2:end], st, double, heredoc)
            out.append(piece)
            kept, i = kept or unknown, end + 1
            continue
        if text.startswith("${", i):
            end = _closing(text, i + 2, "{", "}")
            if end < 0:
                out.append(text[i:])
                return "".join(out), True
            raw = text[i:end + 1]
            value = _braced(text[i + 2:end], st, double)
            i = end + 1
        else:
            if text[i + 1] in "@*#":  # the script's own arguments: none (flags after -- are appended instead)
                st.args_used = True
                out.append("0" if text[i + 1] == "#" else "")
                i += 2
                continue
            m = _NAME.match(text, i + 1) or re.compile(r"\d").match(text, i + 1)
            if not m:
                out.append(c)
                i += 1
                continue
            raw, value, i = text[i:m.end()], st.lookup(m.group(0)), m.end()
        if value is None and st.empty_unset and re.fullmatch(r"\$\{?[A-Za-z_]\w*\}?", raw):
            st.unset_tested.add(raw.strip("${}"))  # bash's empty expansion, where an if-test reads it
            value = ""
        if value is None:
            out.append(_as_written(raw, double or heredoc))
            kept = True
        elif heredoc:
            out.append(" ".join(value) if isinstance(value, list) else value)
        elif isinstance(value, list) and double and join:
            out.append(_quote_in_double(" ".join(value)))
        elif isinstance(value, list):
            quoted_words = " ".join(shlex.quote(w) for w in value)
            out.append(f'"{quoted_words}"' if double else " ".join(_unquoted(w) for w in value))
        else:
            out.append(_quote_in_double(value) if double else _unquoted(value))
    return "".join(out), kept


_HEREDOC = re.compile(r"<<(-?)[ \t]*(\\?)(['\"]?)([A-Za-z0-9_.-]+)\3")


def _statements(text: str) -> list[tuple[str, list[tuple[str, bool]]]]:
    """The script's statements, in order, each with the bodies of its here-documents (text, whether the delimiter
    was quoted: then nothing in it expands): line continuations joined (not in a comment: a comment ending in a
    backslash ends at its newline, as in bash), comments dropped, split at newlines and `;` outside quotes and
    parentheses (an array's elements stay one statement; `&&`, `||` and pipes stay inside).
    A here-document's body is the lines after the one holding its `<<WORD`, up to the line WORD."""
    out: list[tuple[str, list[tuple[str, bool]]]] = []
    cur: list[str] = []
    docs: list[tuple[str, bool]] = []
    pending: list[tuple[bool, bool, str]] = []  # here-documents opened on the current line: (tabs, quoted, word)
    i, depth, quote = 0, 0, ""
    while i < len(text):
        c = text[i]
        if c == "\n" and not quote and pending:  # the bodies follow this line
            i += 1
            for tabs, quoted, word in pending:
                body: list[str] = []
                while i < len(text):
                    nl = text.find("\n", i)
                    line = text[i:] if nl < 0 else text[i:nl]
                    i = len(text) if nl < 0 else nl + 1
                    if (line.lstrip("\t") if tabs else line) == word:
                        break
                    body.append(line.lstrip("\t") if tabs else line)
                docs.append(("\n".join(body) + ("\n" if body else ""), quoted))
            pending = []
            if depth == 0:
                out.append(("".join(cur).strip(), docs))
                cur, docs = [], []
            else:
                cur.append("\n")
            continue
        if c == _KEEP:  # left as written by an earlier reading: opaque, whatever it holds
            end = text.find(_KEPT, i)
            end = len(text) - 1 if end < 0 else end
            cur.append(text[i:end + 1])
            i = end + 1
            continue
        if c == "\\" and text.startswith("\n", i + 1) and quote != "'":  # a line continuation: both go
            i += 2
            continue
        if quote:
            cur.append(c)
            if c == "\\" and quote == '"' and i + 1 < len(text):
                cur.append(text[i + 1])
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
            cur.append(c)
        elif c == "\\" and i + 1 < len(text):
            cur.append(text[i:i + 2])
            i += 1
        elif c == "#" and (not cur or cur[-1] in " \t\n(;"):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        elif c == "<" and text.startswith("<<", i) and not text.startswith("<<<", i) and _HEREDOC.match(text, i):
            m = _HEREDOC.match(text, i)
            pending.append((m.group(1) == "-", bool(m.group(2) or m.group(3)), m.group(4)))  # \EOF, 'EOF': quoted
            cur.append(f"<<{m.group(4)}")
            i = m.end()
            continue
        elif c == "(":
            depth += 1
            cur.append(c)
        elif c == ")":
            depth = max(0, depth - 1)
            cur.append(c)
        elif depth == 0 and c in "\n;":
            out.append(("".join(cur).strip(), docs))
            cur, docs = [], []
        else:
            cur.append(c)
        i += 1
    out.append(("".join(cur).strip(), docs))
    return [(t, d) for t, d in out if t]


def _test(words: list[str]) -> bool | None:
    """A `[ ]`, `[[ ]]` or `test` expression on strings and integers; None where it needs more than the words
    (files, commands, patterns)."""
    if words and words[0] == "!":
        r = _test(words[1:])
        return None if r is None else not r
    if len(words) == 2 and words[0] in ("-z", "-n"):
        return (words[1] == "") == (words[0] == "-z")
    if len(words) == 1:
        return words[0] != ""
    if len(words) == 3:
        a, op, b = words
        if op in ("=", "=="):
            return None if any(ch in b for ch in "*?[") else a == b
        if op == "!=":
            return None if any(ch in b for ch in "*?[") else a != b
        ints = {"-eq": operator.eq, "-ne": operator.ne, "-lt": operator.lt, "-le": operator.le, "-gt": operator.gt,
                "-ge": operator.ge}
        if op in ints:
            try:
                return ints[op](int(a), int(b))
            except ValueError:
                return None
    return None


def _condition(text: str, st: _State) -> bool | None:
    """An if / elif condition: tests joined by `&&` / `||` (left to right, as bash); None where unknown."""
    used, st.used = st.used, set()
    st.empty_unset = True
    try:
        expanded, kept = _expand(text, st)
    finally:
        st.empty_unset = False
    words = _words(expanded)
    tested, st.used = st.used, used
    if kept or not words:
        return None
    result: bool | None = None
    op = None
    cur: list[str] = []
    for w in [*words, "||"] if words[-1] not in ("||", "&&") else words:
        if w not in ("||", "&&"):
            cur.append(w)
            continue
        if cur and cur[0] in ("[", "[[") and cur[-1] in ("]", "]]"):
            r = _test(cur[1:-1])
        elif cur and cur[0] == "test":
            r = _test(cur[1:])
        elif cur and cur[0] == "!" and len(cur) > 2 and cur[1] in ("[", "[["):
            inner = _test(cur[2:-1])
            r = None if inner is None else not inner
        else:
            r = None  # a command: its status is not known without running it
        if op is None:
            result = r
        elif op == "||":
            result = True if (result is True or r is True) else (False if result is False and r is False else None)
        else:
            result = False if (result is False or r is False) else (True if result is True and r is True else None)
        op, cur = w, []
    if result is not None:
        st.tested |= tested
    return result


@dataclass
class _Block:
    """One open if / case / loop / `{ }` group: whether the statements now read run (None: not known) and whether an
    earlier branch of the same if was taken; `brace`: closed by `}` (a function's body, `cmd || { ...; }`)."""

    active: bool | None
    taken: bool | None
    brace: bool = False


_FUNCTION = re.compile(r"(?:function\s+)?[A-Za-z_][\w.-]*\s*\(\)\s*(\{?)|function\s+[A-Za-z_][\w.-]*\s*(\{?)")
_OR_GROUP = re.compile(r"(\|\||&&)\s*\{(?=\s|$)")


def _control(stmt: str, st: _State, blocks: list[_Block]) -> str:
    """Apply the statement's leading reserved words to the open blocks; what is left to run (may be "")."""
    while stmt:
        word, _, rest = stmt.partition(" ")
        rest = rest.strip()
        if word == "if":
            r = _condition(rest, st)
            blocks.append(_Block(active=r, taken=r))
            return ""
        if word == "elif" and blocks:
            top = blocks[-1]
            if top.taken is True:
                top.active = False
            else:
                r = _condition(rest, st)
                top.active = r if top.taken is False else (False if r is False else None)
                top.taken = r if top.taken is False else top.taken
            return ""
        if word == "else" and blocks:
            top = blocks[-1]
            top.active = None if top.taken is None else not top.taken
        elif word in ("while", "until"):  # a loop whose test is decided false (true for until) never runs
            r = _condition(rest, st)
            runs = None if r is None else (r if word == "while" else not r)
            blocks.append(_Block(active=False if runs is False else None, taken=None))
            return ""
        elif word in ("case", "for", "select"):
            blocks.append(_Block(active=None, taken=None))
            return ""
        elif word in ("fi", "esac", "done"):
            if blocks:
                blocks.pop()
        elif word == "{":  # a group: runs as the statement before it decides (a function's body: undecided)
            blocks.append(_Block(active=None if st.function_next else True, taken=None, brace=True))
            st.function_next = False
        elif word == "}":
            if blocks and blocks[-1].brace:
                blocks.pop()
        elif word not in ("then", "do", "!"):
            return stmt
        stmt = rest
    return ""


def _assign(name: str, value: str | list[str], append: bool, st: _State, depth: int) -> None:
    if depth > 0 and (name in st.scalars or name in st.arrays):  # the value before the branch may stand
        st.branch_values.setdefault(name, set()).add(" ".join(st.arrays[name]) if name in st.arrays
                                                     else st.scalars[name])
    feeds = set(st.used)
    for n in st.used:
        feeds |= st.feeds.get(n, set())
    st.feeds[name] = feeds
    if isinstance(value, list):
        st.arrays[name] = (st.arrays.get(name, []) if append else []) + value
        st.scalars.pop(name, None)
        shown = " ".join(st.arrays[name])
    else:
        if append:
            value = (st.lookup(name) or "") + value
        st.scalars[name] = value
        st.arrays.pop(name, None)
        shown = value
    if depth > 0:
        st.branch_values.setdefault(name, set()).add(shown)


def _words(text: str) -> list[str] | None:
    try:
        return shlex.split(text)
    except ValueError:
        return None


_REDIRECT = re.compile(r"(\d*|&)(>>|>|<<|<)(.*)", re.S)


def _redirects(words: list[str]) -> tuple[list[str], str | None, bool]:
    """The command's words without its redirections (`> f`, `>>f`, `2>&1`, `< f`, `<<WORD`), the file its standard
    output is written to, and whether it is appended to."""
    out: list[str] = []
    target, append = None, False
    k = 0
    while k < len(words):
        m = _REDIRECT.fullmatch(words[k])
        if not m:
            out.append(words[k])
            k += 1
            continue
        fd, op, rest = m.groups()
        if op != "<<" and not rest and k + 1 < len(words):  # the file is the next word
            k += 1
            rest = words[k]
        if op in (">", ">>") and fd in ("", "1", "&") and rest and not rest.startswith("&"):
            target, append = rest, op == ">>"
        k += 1
    return out, target, append


def _locate(target: str, st: _State) -> tuple[str | None, str]:
    """The file a script names (to source or submit), as bash would open it from the directory it runs in; where
    it is not there but beside the script being read, that one and a note saying so. (None, "") where the name
    is not known without running something, or no such file is found."""
    if "$" in target or "`" in target:
        return None, ""
    here = _joined(st, target)
    if here is not None and os.path.isfile(here):
        return here, ""
    if not st.reading:
        return None, ""
    rel = target
    if posixpath.isabs(target):
        if st.cwd is None or not target.startswith(st.cwd.rstrip("/") + "/"):
            return None, ""
        rel = posixpath.relpath(target, st.cwd)
    beside = posixpath.normpath(posixpath.join(posixpath.dirname(st.reading[-1]), rel))
    if os.path.isfile(beside):
        where = st.cwd or "the directory it runs in"
        return beside, f"beside {posixpath.basename(st.reading[-1])}; bash would open it from {where}"
    return None, ""


def _file_text(path: str) -> str | None:
    """A file the script reads (sources, submits), or None where it cannot be read as text."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _follow(path: str, how: str, st: _State, blocks: list[_Block], found: list) -> None:
    """Read a sourced file into the same shell: its variables are the script's."""
    if path in st.reading or st.shells + len(st.reading) >= _MAX_DEPTH:
        st.sourced.append(f"{path} (sourced again while it is read)")
        return
    text = _file_text(path)
    if text is None:
        st.sourced.append(path)
        return
    st.followed.append(f"{path} ({how})" if how else path)
    st.reading.append(path)
    try:
        _read(text, st, list(blocks), found)
    except _Return:
        pass
    finally:
        st.reading.pop()


# sbatch's options that take a value as the next word (a long one may also be written --name=value)
_SBATCH_VALUED = {"-A", "-a", "-b", "-C", "-c", "-D", "-d", "-e", "-G", "-i", "-J", "-L", "-M", "-m", "-N", "-n",
                  "-o", "-p", "-q", "-S", "-t", "-w", "-x", "--account", "--array", "--begin", "--chdir",
                  "--constraint", "--cpus-per-task", "--dependency", "--error", "--export", "--gpus",
                  "--gpus-per-node", "--gres", "--job-name", "--mem", "--nodelist", "--nodes", "--ntasks",
                  "--ntasks-per-node", "--output", "--partition", "--qos", "--reservation", "--time", "--wrap",
                  "--exclude"}


def _sbatch_args(words: list[str]) -> tuple[list[str], str | None, str | None]:
    """sbatch's words after the command: its options (as `--name=value` or `-x value` pairs), the batch script it
    submits (None: none named) and its --wrap command."""
    opts: list[str] = []
    wrap = None
    k = 0
    while k < len(words):
        w = words[k]
        if not w.startswith("-") or w == "-":
            return opts, w, wrap
        name, eq, value = w.partition("=")
        if not eq and w in _SBATCH_VALUED and k + 1 < len(words):
            k += 1
            value = words[k]
            opts += [w, value]
        else:
            opts.append(w)
        if name == "--wrap":
            wrap = value
        k += 1
    return opts, None, wrap


def _allocation(text: str, options: list[str], env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """The environment a batch script runs in: SLURM_NNODES (and SLURM_JOB_NUM_NODES), which Slurm sets from the
    allocation's node count, here from sbatch's options, else the script's #SBATCH lines, unless already set."""
    env = dict(env)
    nodes = {**_slurm_options(_directives(text)), **_slurm_options(options)}.get("nodes")
    if nodes is None or "SLURM_NNODES" in env:
        return env, None
    env["SLURM_NNODES"] = env["SLURM_JOB_NUM_NODES"] = str(nodes)
    return env, f"SLURM_NNODES={nodes}: the job's node count ({'sbatch' if options else '#SBATCH'} --nodes), as " \
                "Slurm sets it"


def _submit(text: str, label: str, path: str | None, options: list[str], st: _State, found: list) -> None:
    """Read a batch script `sbatch` submits (`path`: its file, None for a --wrap command or a here-document):
    another shell, in the environment sbatch passes it (--export: ALL, the default, is the submitting shell's
    environment with its exported variables; a list, only those; NONE, nothing), its allocation's node count, and
    the directory sbatch runs it in (the submitting one, SLURM_SUBMIT_DIR, or --chdir)."""
    if st.shells + len(st.reading) >= _MAX_DEPTH:
        st.sourced.append(f"{label} (submitted too deep)")
        return
    visible = dict(st.env)
    from_script = {n for n in st.exported if n in st.scalars}
    visible.update({n: st.scalars[n] for n in from_script})
    export = "ALL"
    for k, w in enumerate(options):
        if w.startswith("--export="):
            export = w.partition("=")[2]
        elif w == "--export" and k + 1 < len(options):
            export = options[k + 1]
    parts = export.split(",")
    env = {} if "NONE" in parts else dict(visible) if "ALL" in parts else {}
    passed = set(from_script) & set(env)
    for part in parts:
        name, eq, value = part.partition("=")
        if name in ("ALL", "NONE", "NIL", ""):
            continue
        if eq:
            env[name] = value
            passed.add(name)
        elif name in visible:
            env[name] = visible[name]
            if name in from_script:
                passed.add(name)
    env, note = _allocation(text, options, env)
    if st.cwd is not None:
        env.setdefault("SLURM_SUBMIT_DIR", st.cwd)
    chdir = next((options[k + 1] for k, w in enumerate(options[:-1]) if w in ("-D", "--chdir")),
                 next((w.partition("=")[2] for w in options if w.startswith("--chdir=")), None))
    child = _State(env=env, cwd=st.cwd if chdir is None else _joined(st, chdir), reading=[path] if path else [],
                   shells=st.shells + len(st.reading) + 1,
                   passed=passed | {"SLURM_SUBMIT_DIR"} | ({"SLURM_NNODES", "SLURM_JOB_NUM_NODES"} if note else set()))
    child.context = _Context(text, env, options)
    before = len(found)
    with contextlib.suppress(_Exit):
        _read(text, child, [], found)
    for j in range(before, len(found)):  # a passed variable's value came from the submitting script's names
        words, used, ctx = found[j]
        found[j] = (words, used | {f for n in used & passed for f in st.feeds.get(n, {n})}, ctx)
    st.followed.append(f"{label} (the batch script sbatch submits, in the environment it passes)")
    st.followed += child.followed
    st.sourced += child.sourced
    st.files.update(child.files)
    st.from_env |= child.from_env - child.passed
    st.tested |= child.tested - child.passed
    st.unset_tested |= child.unset_tested
    st.args_used |= child.args_used
    st.flagless += child.flagless
    st.allocation_notes += [*([note] if note else []), *child.allocation_notes]
    for name, values in child.branch_values.items():
        st.branch_values.setdefault(name, set()).update(values)


def _heredoc_text(docs: list[tuple[str, bool]], st: _State) -> str:
    """The text the statement's here-documents hand its command: expanded by this shell unless the delimiter was
    quoted."""
    return "".join(body if quoted else _expand(body, st, heredoc=True)[0] for body, quoted in docs)


def _read(text: str, st: _State, blocks: list[_Block], found: list) -> None:
    """Read the statements of `text` into `st`; each training command met is appended to `found` as (words, the
    names its expansion used, the `_Context` it runs in)."""
    for stmt, docs in _statements(text):
        st.used = set()
        stmt = _control(stmt, st, blocks)
        fn = _FUNCTION.match(stmt) if stmt else None
        if fn:  # a function's body runs only where it is called: read as a branch autoplan cannot decide
            if fn.group(1) or fn.group(2):
                blocks.append(_Block(active=None, taken=None, brace=True))
            else:
                st.function_next = True
            stmt = _control(stmt[fn.end():].strip(), st, blocks)  # `f() { body; }` on one line
        if not stmt or re.fullmatch(r"[^\s()]+\)", stmt):
            continue  # a case pattern
        group = _OR_GROUP.search(stmt)
        if group:  # `cmd || { ...`: cmd runs; the group as cmd's status decides, not known here
            _statement(stmt[:group.start()].strip(), docs, st, blocks, found)
            blocks.append(_Block(active=None, taken=None, brace=True))
            stmt, docs = _control(stmt[group.end():].strip(), st, blocks), []
            st.used = set()
        if stmt:
            _statement(stmt, docs, st, blocks, found)


def _statement(stmt: str, docs: list[tuple[str, bool]], st: _State, blocks: list[_Block], found: list) -> None:
    """Read one simple statement (its control words applied): an assignment, or a command."""
    if any(b.active is False for b in blocks):
        return
    depth = sum(b.active is None for b in blocks)
    exporting = re.match(r"(export|declare\s+-\w*x\w*|typeset\s+-\w*x\w*)\s", stmt) is not None
    m = _ASSIGN.fullmatch(stmt)
    if m and m.group(3).startswith("(") and m.group(3).rstrip().endswith(")"):
        inner = m.group(3).strip()[1:-1]
        words = _words(_expand(inner, st)[0])
        if words is not None:
            _assign(m.group(1), words, m.group(2) == "+", st, depth)
        return
    if m:
        value = _words(_expand(m.group(3), st, join=True)[0])
        if value is not None and len(value) <= 1:
            _assign(m.group(1), value[0] if value else "", m.group(2) == "+", st, depth)
            if exporting:
                st.exported.add(m.group(1))
            return
    words = _words(_expand(stmt, st)[0])
    if not words:
        return
    if words[0] in ("export", "declare", "typeset", "local", "readonly"):
        words = [w for w in words[1:] if not w.startswith("-")]
        if exporting:
            st.exported |= {w.partition("=")[0].rstrip("+") for w in words if _NAME.fullmatch(
                w.partition("=")[0].rstrip("+"))}
    k = 0
    while k < len(words) and re.match(r"[A-Za-z_]\w*\+?=", words[k]):
        k += 1
    if k == len(words):  # assignments only (a prefix before a command sets the command's environment alone)
        for w in words:
            name, _, value = w.partition("=")
            _assign(name.rstrip("+"), value, name.endswith("+"), st, depth)
        return
    command = words[k:]
    for j, w in enumerate(command):  # the command ends at a pipe or a list operator
        if w in ("|", "||", "&&", "&"):
            command = command[:j]
            break
    command, out_file, append = _redirects([w for w in command if w != ""])
    if not command:
        return
    name = command[0].rsplit("/", 1)[-1]
    if name in ("exit", "return"):
        if depth == 0 and name == "exit":
            raise _Exit
        if depth == 0 and len(st.reading) > 1:
            raise _Return
        return
    if name == "cd":
        target = command[1] if len(command) > 1 else st.lookup("HOME")
        st.cwd = None if target is None or "$" in target or "`" in target or target == "-" \
            else _joined(st, target)
        return
    if name in (".", "source"):  # another file's settings: read into this shell, never run
        if len(command) > 1:
            path, how = _locate(command[1], st)
            if path is None:
                st.sourced.append(command[1])
            else:
                _follow(path, how, st, blocks, found)
        return
    if docs and name in ("cat", "tee"):  # a file the script writes: kept for the reader that opens it
        body = _heredoc_text(docs, st)
        for path in [*([out_file] if out_file else []),
                     *(w for w in command[1:] if name == "tee" and not w.startswith("-"))]:
            st.files[path] = (st.files.get(path, "") if append or name == "tee" and "-a" in command else "") + body
        return
    if name == "sbatch":
        opts, script, wrap = _sbatch_args(command[1:])
        if wrap is not None:
            _submit(wrap, "sbatch --wrap", None, opts, st, found)
        elif script is not None:
            path, how = _locate(script, st)
            batch = _file_text(path) if path else None
            if batch is None:
                st.sourced.append(f"{script} (the batch script sbatch submits)")
            else:
                _submit(batch, path + (f" ({how})" if how else ""), path, opts, st, found)
        elif docs:
            _submit(_heredoc_text(docs, st), "sbatch's here-document", None, opts, st, found)
        return
    if name == "eval":  # its words joined are shell code: read (never run) as a statement of this shell
        _read(" ".join(command[1:]), st, blocks, found)
        return
    if command[0] == "unset":
        for n in command[1:]:
            st.scalars.pop(n, None)
            st.arrays.pop(n, None)
        return
    used = set(st.used)
    for n in st.used:
        used |= st.feeds.get(n, set())
    if docs and name in ("bash", "sh") and len(command) == 1:  # `bash <<EOF`: the here-document is a script
        _read(_heredoc_text(docs, st), st, blocks, found)
        return
    shell = next((j for j, w in enumerate(command) if w in ("bash", "sh")), None)
    if shell is not None and "-c" in command[shell:] and command.index("-c", shell) + 1 < len(command):
        before = len(found)  # `bash -c "STRING"` (an srun or a container's shell): STRING is a script
        with contextlib.suppress(_Exit):
            _read(command[command.index("-c", shell) + 1], st, blocks, found)
        found[before:] = [(command[:shell] + w, u | used, c) for w, u, c in found[before:]]  # srun ... stays
        return
    script_at = next((j for j, w in enumerate(command) if w.endswith(".py")), None)
    if script_at is not None and any(w.startswith("--") for w in command[script_at + 1:]):
        found.append((command, used, st.context))
    elif script_at is not None:
        st.flagless.append(" ".join(command))


def read_script(text: str, env: Mapping[str, str] | None = None, path: str | None = None,
                cwd: str | None = None) -> ScriptCommand:
    """The training command of a launch script (the last statement that runs a `.py` file with `--flags`), its
    variables expanded; `env` stands for the environment the script would run in, `path` for the script's own path
    (`$0`, and where files beside it are found) and `cwd` for the directory it is run from (what `pwd` prints;
    None: not known, `pwd` stays as written)."""
    env_in, note = _allocation(text, [], env or {})
    st = _State(env=env_in, cwd=posixpath.normpath(cwd) if cwd else None, reading=[path] if path else [],
                passed={"SLURM_NNODES", "SLURM_JOB_NUM_NODES"} if note else set())
    st.allocation_notes = [note] if note else []
    st.context = _Context(text, env_in)
    found: list[tuple[list[str], set[str], _Context]] = []
    with contextlib.suppress(_Exit):
        _read(text, st, [], found)
    if not found and st.flagless:
        raise ConfigError("the script's training command has no --flags here", _unmark(st.flagless[-1]),
                          "set what holds them in the environment (VAR=\"--num-layers ...\" autoplan from-megatron "
                          "--script ...), or pass the flags after --")
    if not found:
        raise ConfigError("no training command in the script", "no statement runs a .py file with --flags "
                          "(torchrun ... pretrain_gpt.py --num-layers ...)", "pass the flags after -- instead")
    words, used, ctx = found[-1]
    notes = []
    if st.followed:
        notes.append("read, not run: " + "; ".join(st.followed))
    branched = sorted(n for n in used if len(st.branch_values.get(n, ())) > 1)
    if branched:
        notes.append("set in a branch whose condition autoplan cannot evaluate without running the script, read "
                     "as if the branch ran (the last assignment winning): " + ", ".join(branched)
                     + "; flags after -- override the script's")
    from_env = sorted(n for n in st.from_env & (used | st.tested) if n not in _QUIET_ENV and n not in st.passed)
    if from_env:
        notes.append("from the environment: " + ", ".join(f"{n}={(env or {})[n]}" for n in from_env
                                                          if n in (env or {})))
    notes += st.allocation_notes
    computed = sorted(n for n in used if n.startswith("`"))
    if computed:
        notes.append("computed, not run: " + ", ".join(computed)
                     + (f" (autoplan's directory, {posixpath.normpath(cwd)}, as the one the script runs in)"
                        if "`pwd`" in computed and cwd else ""))
    if st.args_used:
        notes.append("the script's own arguments ($@) read as none: flags after -- are appended to its command")
    if st.sourced:
        notes.append("not read: " + ", ".join(st.sourced) + " (a name known only by running something, or no "
                     "such file here); pass what they set as flags after --, or in the environment")
    unset = sorted(st.unset_tested)
    if unset:
        notes.append("if-tests read as in this environment, where " + ", ".join(unset) + (" is" if len(unset) == 1
                     else " are") + " unset; set them to read the script as it runs elsewhere")
    words = [_unmark(w) for w in words]
    return ScriptCommand(words=words, notes=[_unmark(n) for n in notes], gpus=_slurm_tasks(ctx, words),
                         files={_unmark(k): _unmark(v) for k, v in st.files.items()})


_SLURM_OPTS = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks",
               "--ntasks-per-node": "ntasks-per-node"}


def _slurm_options(words: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k, w in enumerate(words):
        name, eq, value = w.partition("=")
        if not eq and k + 1 < len(words):
            value = words[k + 1]
        if name in _SLURM_OPTS and re.fullmatch(r"\d+", value or ""):
            out[_SLURM_OPTS[name]] = int(value)
    return out


def _directives(text: str) -> list[str]:
    """The options of a batch script's #SBATCH lines, in order."""
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            try:
                out += shlex.split(line[len("#SBATCH"):], comments=True)
            except ValueError:
                continue
    return out


def _slurm_tasks(ctx: _Context | None, words: list[str]) -> int | None:
    """The number of processes srun starts, where it starts the training script itself (no torchrun under it:
    one process per GPU): srun's -n / -N x --ntasks-per-node, else sbatch's options, else the script's #SBATCH
    lines', the node count else from the allocation's environment (SLURM_NNODES); None where the node count is not
    written down."""
    names = [w.rsplit("/", 1)[-1] for w in words]
    if ctx is None or "srun" not in names or any(w in ("torchrun", "torch.distributed.run",
                                                       "torch.distributed.launch") for w in names):
        return None
    at = names.index("srun")
    end = next((j for j, w in enumerate(words) if w.endswith(".py")), len(words))
    opts = {**_slurm_options(_directives(ctx.text)), **_slurm_options(ctx.options),
            **_slurm_options(words[at + 1:end])}
    if "ntasks" in opts:
        return opts["ntasks"]
    nodes = opts.get("nodes") or next((int(ctx.env[k]) for k in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES")
                                        if str(ctx.env.get(k, "")).isdigit()), None)
    if "ntasks-per-node" in opts and nodes is not None:
        return nodes * opts["ntasks-per-node"]
    return None
