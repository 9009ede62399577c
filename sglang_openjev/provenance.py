"""Which bundle revision is running: shared by the adapter's /server_info and the app/ scripts'
receipts (stdlib only, importable anywhere)."""

from __future__ import annotations

import subprocess
from pathlib import Path

BUNDLE_ROOT = Path(__file__).resolve().parents[1]


def git_revision(root: Path = BUNDLE_ROOT) -> dict:
    """{"commit", "dirty"} of the git checkout at `root` (None where it is not a checkout)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}
