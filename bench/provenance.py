"""Which code produced a result: every bench script stamps its JSON with `git_commit()`.

Scripts run as `python bench/<name>.py`, so this folder is on `sys.path` and `from provenance import
git_commit` resolves however the script is launched (the device copies the working tree, `.git` included).

The device's copy of `.git` can be older than its working tree (it is not refreshed between calls), so
its HEAD may name a commit from before the code that ran. The stamp therefore also carries a digest of
the sources themselves (`source_digest`: the .py files below dspark/ and bench/ as they are on disk),
and `python bench/provenance.py --find DIGEST` names the commits whose tree has exactly those files.

    python bench/provenance.py                     # this tree's stamp
    python bench/provenance.py --find 1a2b3c4d5e6f  # the commits (of the last 200) with that digest
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("dspark", "bench")  # the folders whose .py files make a result


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30).stdout.strip()


def _blob_sha(data: bytes) -> str:
    """git's object id of a file with these bytes (what `git ls-tree` lists for it)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _digest(entries) -> str:
    """12 hex digits over sorted (path, blob id) pairs."""
    h = hashlib.sha256()
    for path, blob in sorted(entries):
        h.update(f"{path} {blob}\n".encode())
    return h.hexdigest()[:12]


def source_digest(root: Path = REPO) -> str:
    """Digest of every .py file below root's SOURCES folders as it is on disk (tracked or not)."""
    return _digest((p.relative_to(root).as_posix(), _blob_sha(p.read_bytes()))
                   for folder in SOURCES for p in (root / folder).rglob("*.py") if p.is_file())


def commit_digest(commit: str, root: Path = REPO) -> str:
    """`source_digest` of the tree of `commit` (from `git ls-tree`, no checkout)."""
    entries = []
    for line in _git("ls-tree", "-r", commit, "--", *SOURCES, cwd=root).splitlines():
        meta, path = line.split("\t", 1)
        if path.endswith(".py"):
            entries.append((path, meta.split()[2]))
    return _digest(entries)


def find(digest: str, last: int = 200, root: Path = REPO) -> list[str]:
    """The short hashes of the last `last` commits (from HEAD) whose sources have `digest`, newest first."""
    commits = _git("log", f"-{last}", "--format=%h", cwd=root).split()
    return [c for c in commits if commit_digest(c, root) == digest]


def git_commit(dirty: bool = False) -> str:
    """HEAD's short hash and the sources' digest, "<hash> src <digest>" ("unknown" for the hash outside a
    checkout). With `dirty`, "+dirty" follows the hash when a tracked file differs from HEAD (untracked
    files such as fresh results do not count). HEAD may be stale on the device: the digest is what ran."""
    try:
        head = _git("rev-parse", "--short", "HEAD") or "unknown"
        if dirty and _git("status", "--porcelain", "--untracked-files=no"):
            head += "+dirty"
    except (OSError, subprocess.SubprocessError):
        head = "unknown"
    return f"{head} src {source_digest()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--find", metavar="DIGEST", help="list the commits whose sources have this digest")
    ap.add_argument("--last", type=int, default=200, help="how many commits back --find looks (default 200)")
    cli = ap.parse_args()
    if cli.find is None:
        print(git_commit(dirty=True))
        return
    if cli.last < 1:
        raise ValueError(f"--last must be positive, got {cli.last}")
    matches = find(cli.find, cli.last)
    print("\n".join(matches) if matches else f"no commit of the last {cli.last} has sources {cli.find}")


if __name__ == "__main__":
    main()
