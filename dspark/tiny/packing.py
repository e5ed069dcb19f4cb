"""Token packing: the corpus as fixed-length rows of token ids, small enough to carry to a GPU.

Each document becomes `<|bos|> ids <|eos|>`; a domain's documents are concatenated in corpus order
into one stream, cut into rows of `seq_len + 1` tokens with stride `seq_len` (row i holds stream
positions [i·L, i·L + L]; the last token of a row is the first of the next, so every stream token
is a target exactly once). Inputs are `row[:-1]`, targets `row[1:]`; the tail shorter than a row is
dropped.

Files (`pack_corpus`), all uint16 `.npy` of shape [rows, seq_len + 1]:

    train.npy                 both domains' train rows (code rows, then prose rows)
    heldout.{domain}.npy      each domain's held-out rows
    packing.json              seq_len, vocab, rows and tokens per file, SHA-256 of every file

When a domain's train stream exceeds its share of `max_train_tokens` (shares proportional to the
streams' sizes), a seeded choice of rows is kept, in stream order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from dspark.tiny.corpus import DOMAINS, read_documents
from dspark.tiny.tokenizer import load_tokenizer, special_ids

DEFAULT_SEQ_LEN = 512
DEFAULT_MAX_TRAIN_TOKENS = 16_000_000  # 32 MB of uint16: carried to the GPU with the working tree
DEFAULT_MAX_HELDOUT_ROWS = 512
PACKING_FILE = "packing.json"
TRAIN_FILE = "train.npy"


def heldout_file(domain: str) -> str:
    return f"heldout.{domain}.npy"


def token_stream(tok: Tokenizer, texts: Iterable[str]) -> np.ndarray:
    """uint16 [T]: every text as `<|bos|> ids <|eos|>`, concatenated."""
    ids = special_ids(tok)
    if tok.get_vocab_size() > 1 << 16:
        raise ValueError(f"vocab size {tok.get_vocab_size()} does not fit uint16 token files")
    parts = [np.array([ids["bos"], *e.ids, ids["eos"]], dtype=np.uint16)
             for e in tok.encode_batch(list(texts), add_special_tokens=False)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def pack_rows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """[T] -> [n, seq_len + 1] with stride seq_len; n = (T − 1) // seq_len (a view, no copy)."""
    if seq_len < 2:
        raise ValueError(f"seq_len: {seq_len} must be >= 2")
    n = max(0, (len(stream) - 1) // seq_len)
    return np.lib.stride_tricks.as_strided(stream, (n, seq_len + 1), (seq_len * stream.itemsize, stream.itemsize),
                                           writeable=False)


def choose_rows(n: int, keep: int, seed: int) -> np.ndarray:
    """Sorted indices of `min(keep, n)` rows drawn without replacement by a seeded generator."""
    if keep >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).permutation(n)[:keep])


def spaced_rows(n: int, keep: int) -> np.ndarray:
    """`min(keep, n)` evenly spaced row indices (held-out subsets cover every document region)."""
    return np.arange(n) if keep >= n else np.linspace(0, n - 1, keep).round().astype(np.int64)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _save(out: Path, name: str, rows: np.ndarray, info: dict) -> None:
    path = out / name
    np.save(path, np.ascontiguousarray(rows, dtype=np.uint16))
    info[name] = {"rows": int(rows.shape[0]), "tokens": int(rows.shape[0] * (rows.shape[1] - 1)),
                  "bytes": path.stat().st_size, "sha256": _sha256(path)}


def pack_corpus(corpus: Path, tokenizer: Path, out: Path, seq_len: int = DEFAULT_SEQ_LEN,
                max_train_tokens: int = DEFAULT_MAX_TRAIN_TOKENS, max_heldout_rows: int = DEFAULT_MAX_HELDOUT_ROWS,
                seed: int = 0) -> dict:
    """Tokenise the corpus splits with the tokenizer in `tokenizer` and write the packed files."""
    if max_train_tokens < seq_len:
        raise ValueError(f"max_train_tokens: {max_train_tokens} is less than one row of {seq_len}")
    tok = load_tokenizer(tokenizer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    streams = {d: token_stream(tok, read_documents(corpus, d, "train")) for d in DOMAINS}
    total = sum(len(s) for s in streams.values())
    train, files, domains = [], {}, {}
    for i, (domain, stream) in enumerate(streams.items()):
        rows = pack_rows(stream, seq_len)
        share = max_train_tokens * len(stream) // max(total, 1)
        rows = rows[choose_rows(len(rows), share // seq_len, seed + i)]
        train.append(rows)
        domains[domain] = {"train_stream_tokens": int(len(stream)), "train_rows": int(len(rows))}
    _save(out, TRAIN_FILE, np.concatenate(train), files)
    for domain in DOMAINS:
        rows = pack_rows(token_stream(tok, read_documents(corpus, domain, "heldout")), seq_len)
        _save(out, heldout_file(domain), rows[spaced_rows(len(rows), max_heldout_rows)], files)
    info = {"seq_len": seq_len, "vocab_size": tok.get_vocab_size(), "seed": seed,
            "tokenizer_sha256": _sha256(Path(tokenizer) / "tokenizer.json"), "domains": domains, "files": files}
    (out / PACKING_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return info


@dataclass(frozen=True)
class PackedData:
    """A packed directory, read back. train [n, seq_len + 1] and heldout[domain] uint16 arrays."""

    train: np.ndarray
    heldout: dict[str, np.ndarray]
    seq_len: int
    vocab_size: int
    tokenizer_sha256: str


def load_packed(path: Path, tokenizer: Path | None = None) -> PackedData:
    """Read what :func:`pack_corpus` wrote (train memory-mapped). With `tokenizer`, ValueError
    unless its `tokenizer.json` is the one the rows were made with."""
    path = Path(path)
    if not (path / PACKING_FILE).is_file():
        raise FileNotFoundError(f"{str(path)!r} has no {PACKING_FILE}; build it with python -m dspark.tiny.packing")
    info = json.loads((path / PACKING_FILE).read_text())
    if tokenizer is not None:
        sha = _sha256(Path(tokenizer) / "tokenizer.json")
        if sha != info["tokenizer_sha256"]:
            raise ValueError(f"tokenizer {str(tokenizer)!r} (sha256 {sha[:12]}) is not the one {str(path)!r} was "
                             f"packed with (sha256 {info['tokenizer_sha256'][:12]})")
    train = np.load(path / TRAIN_FILE, mmap_mode="r")
    heldout = {d: np.load(path / heldout_file(d)) for d in DOMAINS if (path / heldout_file(d)).is_file()}
    return PackedData(train, heldout, info["seq_len"], info["vocab_size"], info["tokenizer_sha256"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.tiny.packing", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=Path("tiny-data/corpus"))
    p.add_argument("--tokenizer", type=Path, default=Path("tiny-data/tokenizer"))
    p.add_argument("--out", type=Path, default=Path("tiny-data/packed"))
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    p.add_argument("--max-train-tokens", type=int, default=DEFAULT_MAX_TRAIN_TOKENS)
    p.add_argument("--max-heldout-rows", type=int, default=DEFAULT_MAX_HELDOUT_ROWS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    info = pack_corpus(args.corpus, args.tokenizer, args.out, args.seq_len, args.max_train_tokens,
                       args.max_heldout_rows, args.seed)
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
