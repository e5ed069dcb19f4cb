"""Engram n-gram hashing of DeepSeek-V4.1 (deepseek_v41 spec §8.1-§8.3): token ids -> table rows.

    compressed id  c_p = token_map[id_p]                 (DEAD = −1 for image-span tokens)
    look-back      t_k = c_{p−k} for k < N, or `pad` once a shift leaves the sequence or meets DEAD
    products       π_k = t_k · mult[layer, k]            (int64; no overflow: mult < 2⁶³ / vocab)
    order n hash   r_n = π_0 ⊕ π_1 ⊕ … ⊕ π_{n−1}        n = 2 .. N
    column (n, h)  r_n mod prime[layer][n][h] + offset[layer][n][h]

Everything here depends only on token ids, so the table lookups can be issued before layer 0 runs
(prefetching host-resident tables, spec §8.5). `token_map` comes from the tokenizer
(:func:`build_token_map`); the primes and multipliers only from the config.

Shape symbols: S new tokens, L Engram layers, N = max n-gram size, Hh hash heads per order,
C = (N − 1)·Hh hash columns per layer.
"""

from __future__ import annotations

import numpy as np
import torch

DEAD = -1
# Deterministic Miller-Rabin witnesses: correct for every n < 3.3e24.
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Exact primality test for n < 3.3e24 (deterministic Miller-Rabin)."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def table_primes(n_layers: int, max_ngram: int, n_heads: int, vocab_size: int) -> tuple:
    """Prime table sizes [layer][order n = 2..N][head] (spec §8.2).

    One "seen" set spans all layers; per layer and order the search restarts at `vocab_size − 1`
    and takes the next `n_heads` primes not used before. Released (vocab 16 000 000): layer 1
    starts 16000057, 16000079, ...; sums 384 006 168 and 384 016 682.
    """
    seen: set[int] = set()
    layers = []
    for _ in range(n_layers):
        orders = []
        for _ in range(max_ngram - 1):
            current, sizes = vocab_size - 1, []
            for _ in range(n_heads):
                current += 1
                while current in seen or not is_prime(current):
                    current += 1
                seen.add(current)
                sizes.append(current)
            orders.append(tuple(sizes))
        layers.append(tuple(orders))
    return tuple(layers)


def hash_multipliers(layer_ids, max_ngram: int, compressed_vocab_size: int) -> torch.Tensor:
    """Odd multipliers [L, N] int64, one per (layer, look-back shift) (spec §8.2).

    numpy `default_rng(10007 · layer_id).integers(0, bound, N) · 2 + 1` with
    bound = ⌊(2⁶³ − 1) / compressed_vocab_size⌋ // 2, so id · multiplier fits int64.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, max_ngram, dtype=torch.long)


def column_offsets(primes) -> torch.Tensor:
    """[L, C] exclusive cumulative sums of each layer's primes in (order, head) order: every layer's
    table is addressed from row 0, each (order, head) owning a disjoint row range."""
    rows = []
    for layer in primes:
        flat = [p for order in layer for p in order]
        rows.append([sum(flat[:i]) for i in range(len(flat))])
    return torch.tensor(rows, dtype=torch.long)


def _normalizer():
    """NFKC → NFD → strip accents → lower-case → collapse [ \\t\\r\\n]+ to one space → strip, keeping
    a token that is exactly one space (a private-use sentinel protects it from the strip)."""
    from tokenizers import Regex, normalizers  # only needed when a tokenizer is bound

    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])


def build_token_map(tokenizer) -> tuple[list[int], int]:
    """Compressed id of every token id of `tokenizer`, and the number of compressed ids (spec §8.1).

    `tokenizer` is a `tokenizers.Tokenizer` or a transformers fast tokenizer (its Rust backend is
    used). Each id is decoded alone; a decode containing U+FFFD (a partial UTF-8 byte token) is
    keyed by the raw token string, anything else by its normalised text (or the text itself when
    that normalises to nothing). New compressed ids are handed out in first-seen order of keys,
    scanning ids upwards. The released tokenizer gives 99 092 compressed ids.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    normalizer = _normalizer()
    keys: dict[str, int] = {}
    token_map = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map.append(keys.setdefault(key, len(keys)))
    return token_map, len(keys)


def ngram_hashes(history: torch.Tensor, new: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                 offsets: torch.Tensor, pad: int) -> torch.Tensor:
    """Hash columns of the new tokens of one request, for every Engram layer.

    history  [H] long, compressed ids of the H <= N − 1 positions just before the new ones (H is
             smaller only at the start of the sequence); DEAD marks image-span tokens
    new      [S] long, compressed ids of the new tokens (DEAD allowed)
    multipliers [L, N] int64; primes [L, N − 1, Hh] int64; offsets [L, C] int64; pad: compressed id

    Returns [S, L, C] int64 table rows (already offset into each layer's table).
    """
    n_shift = multipliers.shape[1]
    seq = torch.cat((history, new))  # [H + S]
    at = torch.arange(new.shape[0], device=new.device) + history.shape[0]  # index of each new token in seq
    blocked = torch.zeros(new.shape[0], dtype=torch.bool, device=new.device)
    tokens = []
    for shift in range(n_shift):
        j = at - shift
        source = seq[j.clamp(min=0)]
        # A shift that leaves the sequence or meets DEAD blocks itself and every longer shift.
        blocked = blocked | (j < 0) | (source == DEAD)
        tokens.append(torch.where(blocked, torch.full_like(source, pad), source))
    return hash_columns(torch.stack(tokens, dim=-1), multipliers, primes, offsets)


def hash_columns(tokens: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                 offsets: torch.Tensor) -> torch.Tensor:
    """The hashing half of `ngram_hashes`, on look-backs already resolved (pad where blocked).

    tokens [..., N] long, t_k = the compressed id k positions back (k = 0: the token itself);
    multipliers, primes, offsets as in `ngram_hashes`. Returns [..., L, C] int64 table rows. Split
    out so that the static decode step (`static_step.py`), which reads its look-backs from a
    fixed-size ring, hashes with the same code.
    """
    products = tokens.unsqueeze(-2) * multipliers  # [..., L, N]
    rolling, columns = products[..., 0], []
    for order in range(1, multipliers.shape[1]):
        rolling = torch.bitwise_xor(rolling, products[..., order])  # hash of the (order+1)-gram
        columns.append(rolling.unsqueeze(-1) % primes[:, order - 1])  # [..., L, Hh]
    return torch.cat(columns, dim=-1) + offsets
