"""The command blocks of V100.md's path section ("The path, in order"), by step number.

Shared by tests/test_runbook_blocks.py (paths and flags exist) and tests/test_runbook_rehearsal.py
(the blocks run in order).
"""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNBOOK = REPO / "V100.md"
SECTION = "## The path, in order"
STEP_RE = re.compile(r"^(\d+)\. \*\*")
FENCE_RE = re.compile(r"^(\s*)```(\w*)\s*$")
SCRIPT_RE = re.compile(r"^(?:app|deploy)/[\w./-]+\.(?:py|sh)$")
SEPARATORS = {"&&", "||", "|", ";", "&", "(", ")"}


def path_section(text: str | None = None) -> str:
    text = RUNBOOK.read_text() if text is None else text
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:end if end != -1 else len(text)]


def step_blocks(text: str | None = None) -> dict[int, list[str]]:
    """{step number: [bash block, ...]} in document order, each block dedented as an operator pastes it."""
    steps: dict[int, list[str]] = {}
    step, block, indent = None, None, ""
    for line in path_section(text).splitlines():
        fence = FENCE_RE.match(line)
        if block is not None:
            if fence and fence.group(1) == indent and not fence.group(2):
                steps[step].append(textwrap.dedent("\n".join(block)) + "\n")
                block = None
            else:
                block.append(line)
            continue
        m = STEP_RE.match(line)
        if m:
            step = int(m.group(1))
            steps.setdefault(step, [])
        elif fence and fence.group(2) == "bash" and step is not None:
            block, indent = [], fence.group(1)
    return steps


def commands(block: str) -> list[list[str]]:
    """Simple commands of a block (continuations joined, comments dropped), split at && || | ; &."""
    out: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token in SEPARATORS or set(token) <= set("<>&|;"):
                if current:
                    out.append(current)
                current = []
            else:
                current.append(token)
        if current:
            out.append(current)
    return out


def script_calls(block: str) -> list[tuple[str, list[str]]]:
    """(script path relative to the bundle, its --flags) for every app/ or deploy/ script a block runs."""
    calls = []
    for cmd in commands(block):
        for i, token in enumerate(cmd):
            if SCRIPT_RE.match(token):
                flags = [t.split("=", 1)[0] for t in cmd[i + 1:] if t.startswith("--")]
                calls.append((token, flags))
                break
    return calls
