"""Every refusal a step script can print is a row of TROUBLESHOOTING.md, and every row is a refusal
the code can print.

Collected from the source, nothing run: UserError(...) and LaunchError(...) messages in app/,
openjev/ and sglang_openjev/, the few messages built before the error that prints them
(PY_TARGETS, SH_MESSAGE_VARS), and `die "..."` / `usage_error "..."` in app/*.sh, deploy/*.sh and
openjev/common.sh. A message becomes a pattern: its fixed text, with each f-string field or shell
expansion (a variable, ${...}, $(...) with its own quotes inside) a wildcard. A row's message (the
first cell, in backticks; `<name>` marks a variable part) must be one whole message: a pattern
matches it from start to end, so a row may write a wildcard as a placeholder or as a concrete
value, but never change the fixed text.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from conftest import REPO

DOC = REPO / "TROUBLESHOOTING.md"
WILD = "\0"  # a variable part in a message taken from the code
MIN_FIXED = 10  # fewer fixed characters than this cannot identify a message

PY_SOURCES = ("app/*.py", "openjev/**/*.py", "sglang_openjev/*.py")
SH_SOURCES = ("app/*.sh", "deploy/*.sh", "openjev/common.sh")
ERRORS = {"UserError", "LaunchError"}
# Messages built before the error that prints them: (file, Python target assigned or called).
PY_TARGETS = {
    ("app/v100_preflight.py", "result['reason']"),  # printed as its error line, then by the installer
    ("app/check_dynamic_paged.py", "failures.append"),  # joined with "; " into one UserError
    ("openjev/engine/scheduler.py", "self.error"),  # serve_transformers.py's load failure
    ("openjev/cuda/download.py", "Interrupted"),  # a transfer that broke off, once the retries are spent
}
# The same in the bash scripts: (file, shell variable) whose assignments are messages.
SH_MESSAGE_VARS = {("app/install_v100_runtime.sh", "GCC_NOTE"), ("app/install_v100_runtime.sh", "reason")}

# Messages with too little fixed text to be a row, each with where its words really come from.
EXEMPT = {
    ("app/install_v100_runtime.sh", WILD): "die \"$GCC_NOTE\": its assignment is collected",
    ("app/serve_sglang_v100.sh", WILD): "die \"$msg\": the port check's bind_listen_socket message (Shared)",
    ("app/check_dynamic_paged.py", WILD): "the failures.append messages, joined",
    ("app/check_dynamic_paged.py", f"{WILD}: {WILD}"): "any other exception, as TYPE: LAST LINE",
    ("app/score_reference.py", WILD): "a worker's UserError (collected) or TYPE: exception",
    ("app/serve_transformers.py", WILD): "the engine's load failure, collected from openjev/engine/scheduler.py",
    ("openjev/cuda/download.py", f"{WILD}; {WILD}"): "an Interrupted message (collected) and a re-run hint",
    ("openjev/cuda/download.py", f"{WILD}: HTTP {WILD}"): "a mirror's 5xx, retried; told in prose beside the table",
    ("openjev/engine/classifier.py", f"{WILD}: {WILD}"): "the checkpoint path and contract.check_label_order's ValueError",
    ("openjev/engine/classifier.py", WILD): "weights.refuse_if_problems' ValueError (the checkpoint's tensors)",
    ("openjev/tune/profiles.py", f"--set {WILD}: {WILD}"): "a set's name before a bench input refusal (openjev/bench/inputs.py)",
    ("deploy/openjev_certs.sh", f"{WILD} failed: {WILD}"): "run(): `openssl failed: OUTPUT`, told in prose beside the table",
}


@dataclass(frozen=True)
class Message:
    file: str
    line: int
    text: str  # fixed text with WILD for each variable part

    def fixed_len(self) -> int:
        return len(self.text.replace(WILD, ""))

    def pattern(self) -> re.Pattern:
        parts = re.split(f"{WILD}+", self.text)
        return re.compile(".+?".join(re.escape(p) for p in parts), re.S)

    def shown(self) -> str:
        return f"{self.file}:{self.line}: {self.text.replace(WILD, '<...>')}"


# ---------------------------------------------------------------- Python
def _text(node: ast.AST) -> str:
    """A message expression as fixed text and wildcards."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    return WILD  # a formatted field, a variable, a call


def _error_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def python_messages() -> list[Message]:
    out = []
    files = sorted({p for pat in PY_SOURCES for p in REPO.glob(pat)})
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text(), rel)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and _error_name(node.func) in ERRORS and node.args):
                out.append(Message(rel, node.lineno, _text(node.args[0])))
            elif (isinstance(node, ast.Call) and node.args
                    and (rel, ast.unparse(node.func)) in PY_TARGETS):
                out.append(Message(rel, node.lineno, _text(node.args[0])))
            elif (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and (rel, ast.unparse(node.targets[0])) in PY_TARGETS):
                out.append(Message(rel, node.lineno, _text(node.value)))
            elif (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                  and isinstance(node.value, ast.Tuple)):  # self.state, self.error = "failed", f"..."
                for target, value in zip(node.targets[0].elts, node.value.elts):
                    if (rel, ast.unparse(target)) in PY_TARGETS:
                        out.append(Message(rel, node.lineno, _text(value)))
    return out


# ---------------------------------------------------------------- shell
SH_CALL = re.compile(r'\b(die|usage_error)\s+"')
SH_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9#@*?]")


def _sh_close(s: str, i: int, close: str) -> int:
    """Just past the `close` that ends an expansion whose body starts at s[i] ($(...), ${...})."""
    opener, depth = {")": "(", "}": "{"}[close], 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == "'":
            i = s.index("'", i + 1) + 1
            continue
        if c == '"':
            i = _sh_double_quoted(s, i + 1)[1]
            continue
        depth += (c == opener) - (c == close)
        i += 1
        if depth == 0:
            return i
    raise ValueError(f"unterminated expansion in {s[:80]!r}...")


def _sh_double_quoted(s: str, i: int) -> tuple[str, int]:
    """A bash double-quoted string whose body starts at s[i]: its fixed text, with WILD for each
    expansion (a variable, ${...}, $(...) with its own quotes, $((...)), `...`), and the index just
    past its closing quote."""
    out = []
    while s[i] != '"':
        c = s[i]
        if c == "\\":
            nxt = s[i + 1]
            out.append(nxt if nxt in '\\"$`' else "" if nxt == "\n" else c + nxt)
            i += 2
        elif c == "$" and s[i + 1] in "({":
            i = _sh_close(s, i + 2, ")" if s[i + 1] == "(" else "}")
            out.append(WILD)
        elif c == "$" and (m := SH_NAME.match(s, i + 1)):
            i = m.end()
            out.append(WILD)
        elif c == "`":
            i = s.index("`", i + 1) + 1
            out.append(WILD)
        else:
            out.append(c)
            i += 1
    return "".join(out), i + 1


def shell_messages() -> list[Message]:
    out = []
    files = sorted({p for pat in SH_SOURCES for p in REPO.glob(pat)})
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        source = path.read_text()
        line_of = lambda pos: source.count("\n", 0, pos) + 1  # noqa: E731
        for m in SH_CALL.finditer(source):
            if source[: m.start()].rsplit("\n", 1)[-1].lstrip().startswith("#"):
                continue  # a comment
            text = _sh_double_quoted(source, m.end())[0]
            text += " (see --help)" if m.group(1) == "usage_error" else ""
            out.append(Message(rel, line_of(m.start()), text))
        for file, var in SH_MESSAGE_VARS:
            if file == rel:
                for m in re.finditer(rf'\b{var}="', source):
                    text = _sh_double_quoted(source, m.end())[0]
                    if text:  # not the reset to ""
                        out.append(Message(rel, line_of(m.start()), text))
    return out


def code_messages() -> list[Message]:
    return python_messages() + shell_messages()


# ---------------------------------------------------------------- the document
ROW = re.compile(r"^\|\s*`(.+?)`\s*\|")


def doc_rows() -> list[tuple[int, str]]:
    rows = []
    for n, line in enumerate(DOC.read_text().splitlines(), 1):
        m = ROW.match(line)
        if m:
            rows.append((n, m.group(1).replace("\\|", "|")))
    return rows


def _checked(messages: list[Message]) -> list[Message]:
    return [m for m in messages if (m.file, m.text) not in EXEMPT]


# ---------------------------------------------------------------- tests
def test_the_collection_finds_the_refusals():
    messages = code_messages()
    files = {m.file for m in messages}
    assert len(messages) > 150, len(messages)
    for f in ("app/prepare_v100_cuda.py", "app/install_v100_runtime.sh", "app/serve_sglang_v100.sh",
              "openjev/common.py", "openjev/common.sh", "sglang_openjev/launch_server.py", "app/v100_preflight.py",
              "deploy/install_units.sh", "deploy/install_units_multihost.sh", "deploy/openjev_certs.sh"):
        assert f in files, f


def test_a_shell_message_is_read_whole_through_nested_quotes_and_expansions():
    source = 'die "$(readlink -f -- "$d/$f") has mode ${m:+${m} }$((8#$m)): `id -un`, \\$x" rest'
    text, end = _sh_double_quoted(source, len('die "'))
    assert text == f"{WILD} has mode {WILD}{WILD}: {WILD}, $x" and source[end:] == " rest"


def test_every_exemption_is_a_message_too_short_to_identify():
    messages = {(m.file, m.text) for m in code_messages()}
    for key, reason in EXEMPT.items():
        assert key in messages, f"exemption matches no message: {key}"
        assert len(key[1].replace(WILD, "")) < MIN_FIXED and reason


def test_every_message_identifies_itself():
    short = [m.shown() for m in _checked(code_messages()) if m.fixed_len() < MIN_FIXED]
    assert short == [], "too little fixed text to be a row: exempt it in EXEMPT with a reason, or reword it"


def test_every_refusal_is_in_the_table():
    rows = [text for _, text in doc_rows()]
    missing = [m.shown() for m in _checked(code_messages())
               if not any(m.pattern().fullmatch(r) for r in rows)]
    assert missing == [], f"{len(missing)} refusal(s) missing from TROUBLESHOOTING.md:\n" + "\n".join(missing)


def test_every_row_is_a_refusal_of_the_code():
    patterns = [m.pattern() for m in _checked(code_messages())]
    stale = [f"TROUBLESHOOTING.md:{n}: {text}" for n, text in doc_rows()
             if not any(p.fullmatch(text) for p in patterns)]
    assert stale == [], "rows the code cannot print (reworded or removed?):\n" + "\n".join(stale)


def test_no_row_is_listed_twice():
    texts = [text for _, text in doc_rows()]
    assert sorted({t for t in texts if texts.count(t) > 1}) == []


def test_every_shell_refusal_is_a_double_quoted_string():
    # Anything else (single quotes, an unquoted word) would escape the collection above.
    odd = []
    for path in sorted({p for pat in SH_SOURCES for p in REPO.glob(pat)}):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
            for m in re.finditer(r"\b(die|usage_error)\b(?!\s*\(\))\s*(\S?)", code):
                if m.group(2) != '"':
                    odd.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert odd == []
