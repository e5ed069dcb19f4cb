"""bench/provenance.py: the sources' digest on disk equals the digest of the commit that holds them, so a
result stamped on a device whose `.git` is stale still names the code that ran (`--find`)."""

import subprocess
from pathlib import Path

import provenance  # bench/ is on pytest's pythonpath (pyproject.toml)
import pytest


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "dspark" / "kernels").mkdir(parents=True)
    (tmp_path / "bench").mkdir()
    (tmp_path / "dspark" / "kernels" / "op.py").write_text("x = 1\n")
    (tmp_path / "bench" / "run.py").write_text("print('run')\n")
    (tmp_path / "README.md").write_text("docs\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def test_the_digest_on_disk_is_the_commits_and_ignores_other_files(repo):
    first = provenance.source_digest(repo)
    assert first == provenance.commit_digest("HEAD", repo)
    (repo / "README.md").write_text("other docs\n")  # not a source
    (repo / "bench" / "result.json").write_text("{}")
    assert provenance.source_digest(repo) == first


def test_find_names_the_commit_whatever_head_says(repo):
    first_commit, first = git(repo, "rev-parse", "--short", "HEAD"), provenance.source_digest(repo)
    (repo / "dspark" / "kernels" / "op.py").write_text("x = 2\n")
    second = provenance.source_digest(repo)
    assert second != first and provenance.find(second, root=repo) == []  # not committed yet: no commit has it
    git(repo, "commit", "-q", "-am", "second")
    assert provenance.find(second, root=repo) == [git(repo, "rev-parse", "--short", "HEAD")]
    assert provenance.find(first, root=repo) == [first_commit]
    (repo / "bench" / "scratch.py").write_text("y = 0\n")  # an untracked source counts: it could have run
    assert provenance.source_digest(repo) not in (first, second)


def test_the_stamp_carries_head_and_digest():
    head, src, digest = provenance.git_commit().split(" ")
    assert src == "src" and digest == provenance.source_digest() and len(digest) == 12 and head
