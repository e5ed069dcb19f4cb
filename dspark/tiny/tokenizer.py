"""The dspark-tiny tokenizer: byte-level BPE with four special tokens, trained on the train split.

    id 0 <|bos|>   id 1 <|eos|>   id 2 <|pad|>   id 3 <|noise|>   ids 4.. bytes and merges

The special ids follow the DeepSeek-V4.1 release (bos 0, eos 1, pad 2 = `engram_pad_token_id`);
`<|noise|>` fills the DSpark drafter's mask slots (`dspark_noise_token_id`). Byte-level
pre-tokenisation with no normaliser makes every string round-trip exactly; runs of spaces stay
one pre-token, which keeps Python indentation cheap.

Files (`save_tokenizer`): `tokenizer.json` (the `tokenizers` model) and `tokenizer_config.json`,
from which transformers' `PreTrainedTokenizerFast.from_pretrained` (what `dspark.load_model`
uses) learns the special tokens.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dspark.tiny.corpus import DOMAINS, read_documents

BOS, EOS, PAD, NOISE = "<|bos|>", "<|eos|>", "<|pad|>", "<|noise|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, NOISE)
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_MIN_FREQUENCY = 2
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILES = (TOKENIZER_FILE, CONFIG_FILE)
DEFAULT_MAX_LENGTH = 4096


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE,
                    min_frequency: int = DEFAULT_MIN_FREQUENCY) -> Tokenizer:
    """Byte-level BPE of `vocab_size` ids (specials and the 256 byte symbols included).

    Deterministic: pair counts do not depend on the order texts arrive in, and the trainer breaks
    count ties by the pair itself.
    """
    n_base = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size <= n_base or vocab_size > 1 << 16:
        raise ValueError(f"vocab_size: {vocab_size} must be in ({n_base}, 65536] (uint16 token files)")
    if min_frequency < 1:
        raise ValueError(f"min_frequency: {min_frequency} must be >= 1")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    check_special_tokens(tok)
    return tok


def check_special_tokens(tok: Tokenizer) -> None:
    """ValueError unless the four specials sit at ids 0..3 (every config and packed file assumes it)."""
    got = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    if got != {name: i for i, name in enumerate(SPECIAL_TOKENS)}:
        raise ValueError(f"special token ids {got}; expected {BOS} 0, {EOS} 1, {PAD} 2, {NOISE} 3")


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """{"bos", "eos", "pad", "noise"} -> id."""
    check_special_tokens(tok)
    return dict(zip(("bos", "eos", "pad", "noise"), range(len(SPECIAL_TOKENS))))


def save_tokenizer(tok: Tokenizer, out: Path, model_max_length: int = DEFAULT_MAX_LENGTH) -> None:
    """Write `tokenizer.json` and the `tokenizer_config.json` transformers reads its specials from."""
    check_special_tokens(tok)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_FILE))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        # The name both transformers 4.x and 5.x read (5.x also accepts `extra_special_tokens`).
        "additional_special_tokens": [NOISE],
        "model_max_length": model_max_length,
        # Byte-level BPE already restores spaces exactly; the clean-up would alter code.
        "clean_up_tokenization_spaces": False,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")


def load_tokenizer(path: Path) -> Tokenizer:
    """The `tokenizers` object of a tokenizer (or checkpoint) directory."""
    file = Path(path) / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{str(file)!r} does not exist; build it with python -m dspark.tiny.tokenizer")
    tok = Tokenizer.from_file(str(file))
    check_special_tokens(tok)
    return tok


def bytes_per_token(tok: Tokenizer, texts: list[str]) -> float:
    """UTF-8 bytes per token over `texts` (specials not added): the compression the model sees."""
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    return sum(len(t.encode("utf-8")) for t in texts) / max(n_tokens, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.tiny.tokenizer", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=Path("tiny-data/corpus"))
    p.add_argument("--out", type=Path, default=Path("tiny-data/tokenizer"))
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--min-frequency", type=int, default=DEFAULT_MIN_FREQUENCY)
    args = p.parse_args(argv)
    texts = [t for domain in DOMAINS for t in read_documents(args.corpus, domain, "train")]
    tok = train_tokenizer(texts, args.vocab_size, args.min_frequency)
    save_tokenizer(tok, args.out)
    stats = {"vocab_size": tok.get_vocab_size(), "special_tokens": list(SPECIAL_TOKENS),
             "bytes_per_token": {f"{domain}.{split}": round(bytes_per_token(tok, read_documents(args.corpus, domain,
                                                                                                  split)), 4)
                                 for domain in DOMAINS for split in ("train", "heldout")}}
    (args.out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
