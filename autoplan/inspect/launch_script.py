"""Read the training command out of a launch script without running it.

Megatron-LM's own examples (examples/gpt3/train_gpt3_175b_distributed.sh, examples/llama/train_llama3_8b_h100_fp8.sh)
build the command from shell variables and arrays: `NUM_LAYERS=32`, `MODEL_ARGS=(--num-layers $NUM_LAYERS ...)`,
`torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]}`. Running the script to see the command would
launch the training and whatever else the script does (mkdir, rm, srun), so it is read instead, expanded as bash
expands it, for the subset such scripts use: scalar and array assignments (`=`, `+=`, `export`, `declare`, `local`),
`$NAME`, `${NAME}`, `${NAME:-word}`, `${NAME-word}`, `${NAME:=word}`, `${NAME[@]}`, `${NAME[*]}`, `$((arithmetic))`,
quotes, comments and line continuations. Names the script does not set come from the environment, as in bash.

Nothing is run and no other file is read (a sourced config is said, not followed): a command substitution
(`$(...)`, backquotes) and a positional parameter (`$1`) stay as written, and the Megatron reader refuses a flag it
reads that holds one, naming it. An if whose test compares strings or integers takes the branch bash would take in
the given environment (an unset name is "", and the note says which were); one whose test needs running (a file
test, a command) is read as if its branch ran, and a variable the command uses that it sets is reported.
"""

from __future__ import annotations

import ast
import operator
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

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
    args_used: bool = False  # the script reads its own arguments ($@, $*, $#): taken as none
    flagless: list[str] = field(default_factory=list)  # a .py command met without --flags (they did not expand)

    def lookup(self, name: str) -> str | None:
        self.used.add(name)
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


def _as_written(raw: str, double: bool) -> str:
    """A shell word left as written (nothing is run to know it), kept one word for the reader to name."""
    return raw if double else shlex.quote(raw)


def _quote_in_double(value: str) -> str:
    return re.sub(r'(["\\$`])', r"\\\1", value)


def _expand(text: str, st: _State, join: bool = False) -> tuple[str, bool]:
    """`text` with its expansions substituted, as text shlex can split into bash's words; and whether something
    stayed as written (a command substitution, a positional parameter, an unknown form). `join`: an assignment's
    value, where "${A[@]}" is one word, as in bash."""
    out: list[str] = []
    kept = False
    i, single, double = 0, False, False
    while i < len(text):
        c = text[i]
        if single:
            out.append(c)
            single = c != "'"
            i += 1
            continue
        if c == "\\" and i + 1 < len(text):
            out.append(text[i:i + 2])
            i += 2
            continue
        if c == "'" and not double:
            single = True
            out.append(c)
            i += 1
            continue
        if c == '"':
            double = not double
            out.append(c)
            i += 1
            continue
        if c == "`":
            end = text.find("`", i + 1)
            end = len(text) - 1 if end < 0 else end
            out.append(_as_written(text[i:end + 1], double))
            kept, i = True, end + 1
            continue
        if c != "$" or i + 1 >= len(text):
            out.append(c)
            i += 1
            continue
        if text.startswith("$((", i):
            end = _closing(text, i + 3, "(", ")")
            value = _arith(text[i + 3:end], st) if end >= 0 and text.startswith("))", end) else None
            if value is None:
                out.append(_as_written(text[i:(end + 2 if end >= 0 else len(text))], double))
                kept, i = True, (end + 2 if end >= 0 else len(text))
            else:
                out.append(str(value))
                i = end + 2
            continue
        if text.startswith("$(", i):
            end = _closing(text, i + 2, "(", ")")
            end = len(text) - 1 if end < 0 else end
            out.append(_as_written(text[i:end + 1], double))
            kept, i = True, end + 1
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
            out.append(_as_written(raw, double))
            kept = True
        elif isinstance(value, list) and double and join:
            out.append(_quote_in_double(" ".join(value)))
        elif isinstance(value, list):
            quoted_words = " ".join(shlex.quote(w) for w in value)
            out.append(f'"{quoted_words}"' if double else " ".join(value))
        else:
            out.append(_quote_in_double(value) if double else value)
    return "".join(out), kept


def _statements(text: str) -> list[str]:
    """The script's statements, in order: line continuations joined, comments dropped, split at newlines and `;`
    outside quotes and parentheses (an array's elements stay one statement; `&&`, `||` and pipes stay inside)."""
    text = text.replace("\\\n", " ")
    out, cur = [], []
    i, depth, quote = 0, 0, ""
    while i < len(text):
        c = text[i]
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
        elif c == "(":
            depth += 1
            cur.append(c)
        elif c == ")":
            depth = max(0, depth - 1)
            cur.append(c)
        elif depth == 0 and c in "\n;":
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    out.append("".join(cur).strip())
    return [s for s in out if s]


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
    """One open if / case / loop: whether the statements now read run (None: not known) and whether an earlier
    branch of the same if was taken."""

    active: bool | None
    taken: bool | None


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
        elif word not in ("then", "do", "{", "}", "!"):
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


def _read(text: str, st: _State, blocks: list[_Block], found: list) -> None:
    """Read the statements of `text` into `st`; each training command met is appended to `found` as (words, the
    names its expansion used)."""
    for stmt in _statements(text):
        st.used = set()
        stmt = _control(stmt, st, blocks)
        if not stmt or re.fullmatch(r"[^\s()]+\)", stmt) or re.match(r"(function\s+)?\w+\s*\(\)", stmt):
            continue  # a case pattern or a function's name
        if any(b.active is False for b in blocks):
            continue
        depth = sum(b.active is None for b in blocks)
        m = _ASSIGN.fullmatch(stmt)
        if m and m.group(3).startswith("(") and m.group(3).rstrip().endswith(")"):
            inner = m.group(3).strip()[1:-1]
            words = _words(_expand(inner, st)[0])
            if words is not None:
                _assign(m.group(1), words, m.group(2) == "+", st, depth)
            continue
        if m:
            value = _words(_expand(m.group(3), st, join=True)[0])
            if value is not None and len(value) <= 1:
                _assign(m.group(1), value[0] if value else "", m.group(2) == "+", st, depth)
                continue
        words = _words(_expand(stmt, st)[0])
        if not words:
            continue
        if words[0] in ("export", "declare", "typeset", "local", "readonly"):
            words = [w for w in words[1:] if not w.startswith("-")]
        k = 0
        while k < len(words) and re.match(r"[A-Za-z_]\w*\+?=", words[k]):
            k += 1
        if k == len(words):  # assignments only (a prefix before a command sets the command's environment alone)
            for w in words:
                name, _, value = w.partition("=")
                _assign(name.rstrip("+"), value, name.endswith("+"), st, depth)
            continue
        command = words[k:]
        for j, w in enumerate(command):  # the command ends at a pipe or a list operator; redirections dropped
            if w in ("|", "||", "&&", "&"):
                command = command[:j]
                break
        command = [w for w in command if w != "" and not re.fullmatch(r"\d*[<>]+&?\S*", w)]
        if not command:
            continue
        if command[0] in (".", "source"):  # another file's settings: not followed (it may run anything)
            st.sourced.append(" ".join(command[1:2]) or command[0])
            continue
        if command[0] == "unset":
            for n in command[1:]:
                st.scalars.pop(n, None)
                st.arrays.pop(n, None)
            continue
        used = set(st.used)
        for n in st.used:
            used |= st.feeds.get(n, set())
        shell = next((j for j, w in enumerate(command) if w in ("bash", "sh")), None)
        if shell is not None and "-c" in command[shell:] and command.index("-c", shell) + 1 < len(command):
            before = len(found)  # `bash -c "STRING"` (an srun or a container's shell): STRING is a script
            _read(command[command.index("-c", shell) + 1], st, blocks, found)
            found[before:] = [(command[:shell] + w, u | used) for w, u in found[before:]]  # srun ... stays
            continue
        script_at = next((j for j, w in enumerate(command) if w.endswith(".py")), None)
        if script_at is not None and any(w.startswith("--") for w in command[script_at + 1:]):
            found.append((command, used))
        elif script_at is not None:
            st.flagless.append(" ".join(command))


def read_script(text: str, env: Mapping[str, str] | None = None) -> ScriptCommand:
    """The training command of a launch script (the last statement that runs a `.py` file with `--flags`), its
    variables expanded; `env` stands for the environment the script would run in."""
    st = _State(env=dict(env or {}))
    found: list[tuple[list[str], set[str]]] = []
    _read(text, st, [], found)
    if not found and st.flagless:
        raise ConfigError("the script's training command has no --flags here", st.flagless[-1], "set what holds "
                          "them in the environment (VAR=\"--num-layers ...\" autoplan from-megatron --script ...), "
                          "or pass the flags after --")
    if not found:
        raise ConfigError("no training command in the script", "no statement runs a .py file with --flags "
                          "(torchrun ... pretrain_gpt.py --num-layers ...)", "pass the flags after -- instead")
    words, used = found[-1]
    notes = []
    branched = sorted(n for n in used if len(st.branch_values.get(n, ())) > 1)
    if branched:
        notes.append("set in a branch whose condition autoplan cannot evaluate without running the script, read "
                     "as if the branch ran (the last assignment winning): " + ", ".join(branched)
                     + "; flags after -- override the script's")
    from_env = sorted(n for n in st.from_env & (used | st.tested) if n not in _QUIET_ENV)
    if from_env:
        notes.append("from the environment: " + ", ".join(f"{n}={st.env[n]}" for n in from_env))
    if st.args_used:
        notes.append("the script's own arguments ($@) read as none: flags after -- are appended to its command")
    if st.sourced:
        notes.append("not read: the file(s) the script sources (" + ", ".join(st.sourced) + "); pass what they "
                     "set as flags after --, or in the environment")
    unset = sorted(st.unset_tested)
    if unset:
        notes.append("if-tests read as in this environment, where " + ", ".join(unset) + (" is" if len(unset) == 1
                     else " are") + " unset; set them to read the script as it runs elsewhere")
    return ScriptCommand(words=words, notes=notes, gpus=_slurm_tasks(text, words, st.env))


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


def _slurm_tasks(text: str, words: list[str], env: Mapping[str, str]) -> int | None:
    """The number of processes srun starts, where it starts the training script itself (no torchrun under it:
    one process per GPU): srun's -n / -N x --ntasks-per-node, else the script's #SBATCH lines', the node count
    else from the allocation's environment (SLURM_NNODES); None where the node count is not written down."""
    names = [w.rsplit("/", 1)[-1] for w in words]
    if "srun" not in names or any(w in ("torchrun", "torch.distributed.run", "torch.distributed.launch")
                                  for w in names):
        return None
    directives: list[str] = []
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            directives += shlex.split(line[len("#SBATCH"):], comments=True)
    at = names.index("srun")
    end = next((j for j, w in enumerate(words) if w.endswith(".py")), len(words))
    opts = {**_slurm_options(directives), **_slurm_options(words[at + 1:end])}
    if "ntasks" in opts:
        return opts["ntasks"]
    nodes = opts.get("nodes") or next((int(env[k]) for k in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES")
                                        if str(env.get(k, "")).isdigit()), None)
    if "ntasks-per-node" in opts and nodes is not None:
        return nodes * opts["ntasks-per-node"]
    return None
