"""V4.1's Engram n-gram rows in one launch (dspark/kernels/engram_rows.py) against its torch reference
(the static step's former code): the same columns, live mask and ring, with look-backs that leave the
sequence, meet image tokens, cross the step's start and wrap the ring; the released hash constants
(int64 products near 2⁶³); arguments are checked (CPU: Triton interpreter; a GPU runs them too)."""

import pytest
import torch

from dspark.kernels import engram_rows as op
from dspark.kernels import triton_available
from dspark.models.deepseek_v41 import engram_hash

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N_GRAM, HEADS, VOCAB, COMPRESSED, IMAGE = 4, 3, 50, 129280, 7


def case(n_slots, n_tok, extra_rows, seed):
    """Random ids (some the image token), starts from 0 on, a ring of earlier compressed ids (some
    DEAD), the hash constants of layers 1 and 4 (the released multiplier rule)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n_slots, n_tok), generator=g)
    ids[0, -1] = IMAGE
    starts = torch.tensor([0, 1, 2, 9, 30][:n_slots])
    positions = starts.unsqueeze(-1) + torch.arange(n_tok)
    ring = torch.randint(0, COMPRESSED, (n_slots + 1, N_GRAM - 1 + n_tok + extra_rows), generator=g)
    ring[ring % 5 == 0] = engram_hash.DEAD
    token_map = torch.randint(0, COMPRESSED, (VOCAB,), generator=g)
    primes = engram_hash.table_primes(2, N_GRAM, HEADS, 1000)
    hashing = (engram_hash.hash_multipliers([1, 4], N_GRAM, COMPRESSED),
               torch.tensor(primes).reshape(2, N_GRAM - 1, HEADS), engram_hash.column_offsets(primes))
    return [t.to(DEVICE) for t in (ids, positions, ring, token_map, *hashing)]


@needs_triton
@pytest.mark.parametrize("n_slots,n_tok,extra_rows", [(3, 1, 0), (4, 4, 0), (2, 3, 5), (5, 2, 1)])
@pytest.mark.parametrize("image", [None, IMAGE])
def test_fused_rows_match_the_reference(n_slots, n_tok, extra_rows, image, poisoned):
    ids, positions, ring, token_map, mult, primes, offsets = case(n_slots, n_tok, extra_rows, seed=n_slots + n_tok)
    ring_ref = ring.clone()
    ref, live_ref = op.engram_rows_ref(ids, positions, ring_ref, token_map, mult, primes, offsets, pad_id=2,
                                       image_token_id=image)
    with poisoned():
        cols, live = op.engram_rows(ids, positions, ring, token_map, mult, primes, offsets, pad_id=2,
                                    image_token_id=image)
    assert cols.shape == (n_slots * n_tok, 2, (N_GRAM - 1) * HEADS) and torch.equal(cols, ref)
    assert torch.equal(ring, ring_ref) and not torch.equal(ring, case(n_slots, n_tok, extra_rows, n_slots + n_tok)[2])
    assert (live is None) == (image is None) and (image is None or torch.equal(live, live_ref))
    assert (ref >= offsets.unsqueeze(0)).all() and (ref < offsets + primes.flatten(1)).all()  # each in its own range


def test_reference_is_the_models_hashing_of_each_request():
    """The batched reference gives `engram_hash.ngram_hashes` of each slot's history and new ids."""
    ids, positions, ring, token_map, mult, primes, offsets = case(2, 3, 0, seed=4)
    ids[1, 0] = IMAGE
    before = ring.clone()
    cols, _ = op.engram_rows_ref(ids, positions, ring, token_map, mult, primes, offsets, pad_id=2, image_token_id=IMAGE)
    pad = int(token_map[2])
    for s in range(2):
        start = int(positions[s, 0])
        first = max(0, start - (N_GRAM - 1))
        history = before[s, torch.arange(first, start) % ring.shape[1]]
        new = token_map[ids[s]].masked_fill(ids[s] == IMAGE, engram_hash.DEAD)
        expected = engram_hash.ngram_hashes(history, new, mult, primes, offsets, pad)
        assert torch.equal(cols.view(2, 3, *cols.shape[1:])[s], expected)


def test_bad_arguments_name_the_value():
    ids, positions, ring, token_map, mult, primes, offsets = case(2, 2, 0, seed=1)
    kw = dict(pad_id=2, image_token_id=None)
    with pytest.raises(ValueError, match="input_ids and positions must be"):
        op.engram_rows_ref(ids, positions[:, :1], ring, token_map, mult, primes, offsets, **kw)
    with pytest.raises(ValueError, match=r"ring must be a contiguous \[S' >= 2, R >= N - 1 \+ T = 5\]"):
        op.engram_rows_ref(ids, positions, ring[:, :4], token_map, mult, primes, offsets, **kw)
    with pytest.raises(ValueError, match="primes must be"):
        op.engram_rows_ref(ids, positions, ring, token_map, mult, primes[:, :2], offsets, **kw)
    with pytest.raises(ValueError, match="token_map must be int64"):
        op.engram_rows_ref(ids, positions, ring, token_map.int(), mult, primes, offsets, **kw)
    with pytest.raises(ValueError, match=r"multipliers must be \[L >= 1, N >= 2\]"):
        op.engram_rows_ref(ids, positions, ring, token_map, mult[:0], primes[:0], offsets[:0], **kw)
