"""V100.md's path section against the code, cheaply: every step has its command block, every
script a block runs exists, and every --flag given to it is in that script's --help.
(tests/test_runbook_rehearsal.py runs the blocks themselves.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import lru_cache

import pytest
from _runbook import REPO, commands, script_calls, step_blocks
from test_runbook_rehearsal import REFUSALS, REWRITTEN, SUBSTITUTIONS

BLOCKS = step_blocks()
CALLS = sorted({(script, flag) for blocks in BLOCKS.values() for block in blocks
                for script, flags in script_calls(block) for flag in flags} |
               {(script, None) for blocks in BLOCKS.values() for block in blocks for script, _ in script_calls(block)},
               key=lambda c: (c[0], c[1] or ""))


@lru_cache(maxsize=None)
def help_text(script: str) -> str:
    path = REPO / script
    cmd = ["bash", str(path)] if path.suffix == ".sh" else [sys.executable, str(path)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'app'}"}
    proc = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, f"{script} --help exited {proc.returncode}: {proc.stderr[-500:]}"
    return proc.stdout + proc.stderr


def test_every_step_0_to_10_has_a_command_block():
    assert sorted(BLOCKS) == list(range(11))
    assert all(BLOCKS[n] for n in BLOCKS), [n for n in BLOCKS if not BLOCKS[n]]
    assert all(commands(block) for blocks in BLOCKS.values() for block in blocks)


@pytest.mark.parametrize("script,flag", CALLS, ids=[f"{s}:{f or 'exists'}" for s, f in CALLS])
def test_scripts_exist_and_take_the_flags_the_runbook_gives(script, flag):
    assert (REPO / script).is_file(), f"V100.md's path runs {script}, which does not exist"
    if flag is not None:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text(script)), \
            f"V100.md's path gives {script} {flag}, which its --help does not name"


def test_repository_files_the_blocks_name_exist():
    named = {token for blocks in BLOCKS.values() for block in blocks for cmd in commands(block) for token in cmd
             if token.startswith(("data/", "app/", "deploy/")) and "*" not in token}
    assert named and all((REPO / t).exists() for t in named), sorted(t for t in named if not (REPO / t).exists())


def test_the_rehearsals_substitutions_name_text_the_runbook_has():
    """tests/test_runbook_rehearsal.py replaces only text that is there, each time saying why."""
    for step, old, _, why in SUBSTITUTIONS:
        assert why and old in "".join(BLOCKS[step]), (step, old)
    assert all(index < len(BLOCKS[step]) for step, index in REFUSALS)
    assert all(why for _, why in REWRITTEN)
