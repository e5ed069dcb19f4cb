"""A synthetic stand-in for the two corpus sources: a few library modules next to everything the
code rules must skip, and a few Globe-edition works next to a folio duplicate (the real build
reads the whole standard library: not for tests)."""

from __future__ import annotations

import random

# Sizes of the session-wide tiny build (conftest.py).
TOKENIZER_VOCAB = 400
SEQ_LEN = 32
WORDS = ("the king queen lord night day sword crown love death heart fair sweet noble gentle speak hear "
         "come go thou thee thy art hath doth shall will not my your our with upon").split()


def _prose(rng: random.Random, lines: int) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() + "."
                     for _ in range(lines)) + "\n"


def _module(rng: random.Random, name: str) -> str:
    funcs = []
    for i in range(rng.randint(2, 4)):
        arg = rng.choice(("x", "items", "value", "path"))
        funcs.append(f"def {name}_{i}({arg}):\n    \"\"\"Return {arg} {rng.choice(WORDS)}.\"\"\"\n"
                     f"    if {arg} is None:\n        return {i}\n    return {arg}\n")
    return "\n\n".join(funcs)


def make_sources(root):
    """(code root, prose texts dir): library files plus everything the code rules must skip, and
    Globe-edition works plus a folio duplicate and a metadata file."""
    rng = random.Random(0)
    code, prose = root / "Lib", root / "texts"
    for rel in ("abc.py", "json/__init__.py", "json/decoder.py", "email/parser.py", "email/header.py", "os.py",
                "shutil.py", "string.py", "queue.py", "heapq.py", "asyncio/base.py", "asyncio/tasks.py"):
        path = code / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_module(rng, path.stem.strip("_") or "init"))
    for rel in ("test/test_os.py", "unittest/tests/test_case.py", "site-packages/pkg/mod.py",
                "idlelib/idle_test/test_x.py", "__phello__/spam.py", "_sysconfigdata__linux.py",
                "pydoc_data/topics.py"):
        path = code / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("SKIPPED = True\n")
    (code / "encodings").mkdir()
    (code / "encodings" / "cp999.py").write_text('""" Python Character Mapping Codec cp999 generated from '
                                                 "'CP999.TXT' with gencodec.py.\n\"\"\"\nSKIPPED = True\n")
    prose.mkdir()
    meta = []
    for stem, title in (("hamlet", "Hamlet"), ("lear", "King Lear"), ("tempest", "The Tempest"),
                        ("macbeth", "Macbeth"), ("othello", "Othello"), ("sonnets", "Sonnets")):
        (prose / f"{stem}_gut.txt").write_bytes(_prose(rng, 40).replace("\n", "\r\n").encode())
        meta.append(f"[{stem}_gut]\ntitle = {title}\ncreator = Shakespeare, William\n")
    (prose / "hamlet_gut_f.txt").write_text("SKIPPED folio\n")
    (prose / "metadata.txt").write_text("\n".join(meta))
    return code, prose
