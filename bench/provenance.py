"""Which code produced a result: every bench script stamps its JSON with `git_commit()`.

Scripts run as `python bench/<name>.py`, so this folder is on `sys.path` and `from provenance import
git_commit` resolves however the script is launched (the device copies the working tree, `.git` included).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit(dirty: bool = False) -> str:
    """HEAD's short hash, "unknown" outside a checkout. With `dirty`, "+dirty" is appended when a tracked
    file differs from HEAD (what actually ran; untracked files such as fresh results do not count)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD") or "unknown"
        return head + ("+dirty" if dirty and git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
