"""The only ways a value from a plan or spec becomes part of emitted Python source.

A plan is data that people share; the runtime compiles and executes the source codegen renders from it. So no
plan or spec string may ever be spliced into source text as it is: a model named `x\"\"\"` + newline + `import os`
would close a docstring and add a statement. Everything that codegen renders goes through one of three
functions, each of which cannot produce anything but what it says:

    literal(value)    a Python expression that evaluates to exactly `value` (str, int, float, bool, None, and
                      tuples, lists and dicts of those); strings via repr(), which escapes quotes, backslashes,
                      newlines, NUL, surrogates and every other non-printable character
    docstring(text)   a triple-quoted string literal whose value is exactly `text` (readable: newlines stay
                      newlines, every quote, backslash and control character is escaped)
    comment(text)     `# ` + `text` on one line: line breaks and control characters shown as escapes

tests/unit/test_codegen_quoting.py puts arbitrary text into every string field of a plan and checks that the
emitted source parses to the same program and that the values come back exactly.
"""

from __future__ import annotations

import math

# Characters kept as they are inside a docstring or comment: printable, and not a line break. str.isprintable()
# is False for every control character, line/paragraph separator (U+2028/9, which str.splitlines() and some
# editors treat as line breaks) and lone surrogate (which UTF-8 cannot encode).


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if ch == "\n":
        return "\\n"
    if ch == "\t":
        return "\\t"
    if ch == "\r":
        return "\\r"
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def literal(value: object) -> str:
    """Python source for `value`; `eval(literal(v)) == v` (floats: also inf and nan, by their float() form)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(int(value))  # int(): an IntEnum's repr is not a literal
    if isinstance(value, float):
        if math.isfinite(value):
            return repr(float(value))
        return f"float({repr(str(value))})"
    if isinstance(value, str):
        return _str_literal(str(value))
    if isinstance(value, tuple):
        inner = ", ".join(literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"codegen.quote.literal: cannot render {type(value).__name__} as source")


def _str_literal(s: str) -> str:
    """repr(s), which escapes quotes, backslashes and every non-printable character, in double quotes where s
    has none (the project's style): a single-quoted repr of such a string has no escaped quote to undo."""
    r = repr(s)
    if r[0] == "'" and '"' not in s:
        return '"' + r[1:-1] + '"'
    return r


def docstring(text: str) -> str:
    """A triple-quoted literal whose value is exactly `text` (newlines kept for readability)."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')  # every double quote: no run of three can close the literal
        elif ch == "\n":
            out.append("\n")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(_escape_char(ch))
    return '"""' + "".join(out) + '"""'


def one_line(text: str) -> str:
    """`text` as one printable line: line breaks, control characters and lone surrogates shown as escapes, so
    that it can follow `#` or sit in a Markdown table row. (Backslashes are kept: a comment is not evaluated.)"""
    return "".join(ch if ch.isprintable() else _escape_char(ch) for ch in text)


def comment(text: str) -> str:
    """A comment line's text after the indentation: `# ` + one_line(text)."""
    return "# " + one_line(text)
