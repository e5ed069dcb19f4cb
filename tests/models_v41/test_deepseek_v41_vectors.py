"""Spec §14.2 deterministic vectors: Engram primes, multipliers and hashes; the candidate mask; the
QAT codes; visibility; the single-pass mHC start; compressed token ids from a tokenizer."""

import pytest
import torch

from dspark.models.deepseek_v4.mhc import collapse
from dspark.kernels.indexer_pool import indexer_pool_ref
from dspark.models.deepseek_v41.csa2 import SharedSlots
from dspark.models.deepseek_v41.engram_hash import (
    DEAD,
    build_token_map,
    column_offsets,
    hash_multipliers,
    is_prime,
    ngram_hashes,
    table_primes,
)
from dspark.models.deepseek_v41.qat import fp4_e4m3, fp4_ue8m0, fp8_ue8m0

RELEASED_PRIMES = {
    1: [[16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183],
        [16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321],
        [16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463]],
    14: [[16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627],
         [16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769],
         [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889]],
}
RELEASED_MULTIPLIERS = [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                        [67716810739261, 51510806800915, 30921347202721, 82619226485591]]


@pytest.fixture(scope="module")
def released_hashing():
    """(multipliers, primes, offsets) of the released layout: layers 1 and 14, 99 092 compressed ids."""
    primes = table_primes(2, 4, 8, 16000000)
    return (hash_multipliers((1, 14), 4, 99092), torch.tensor(primes), column_offsets(primes))


def test_released_primes_and_multipliers(released_hashing):
    multipliers, primes, _ = released_hashing
    assert primes.tolist() == [RELEASED_PRIMES[1], RELEASED_PRIMES[14]]
    assert primes.sum(dim=(1, 2)).tolist() == [384006168, 384016682]  # = engram_num_embeddings
    assert multipliers.tolist() == RELEASED_MULTIPLIERS
    assert all(m % 2 == 1 and m < 46539438283891 * 2 + 1 for row in RELEASED_MULTIPLIERS for m in row)
    assert [n for n in range(60) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
    assert is_prime(2**61 - 1) and not is_prime(3215031751)  # a strong pseudoprime to bases 2, 3, 5, 7


def test_released_hash_vectors(released_hashing):
    multipliers, primes, offsets = released_hashing
    ids = torch.tensor([10, 20, 30, 40])
    columns = ngram_hashes(ids[:0], ids, multipliers, primes, offsets, pad=7)  # [4, 2, 24]
    assert columns[3, 0].tolist() == [
        1326936, 22120929, 40011923, 55142539, 77849479, 85421395, 105208034, 120570043, 142088989, 151706440,
        164511320, 186980067, 199834903, 222266846, 231919637, 244765195, 270969918, 287524568, 292261800,
        310632033, 322879311, 341250912, 361620893, 378628807]
    assert columns[3, 1].tolist() == [
        5403109, 26519290, 42262171, 52759697, 74009651, 83431750, 98759453, 114437397, 136663117, 159466275,
        161102974, 190712189, 206344738, 219595678, 225703309, 243746465, 258079010, 283475728, 290789713,
        309926711, 321434350, 340293184, 357342800, 378588994]
    first = columns[0, 0].tolist()  # position 0: every look-back is the pad
    assert (first[0], first[1], first[2], first[8], first[16]) == (7192719, 21950884, 40747309, 137673476, 263199926)
    # The same hashes, fed in pieces with the history carried over.
    pieces = [ngram_hashes(ids[:0], ids[:1], multipliers, primes, offsets, 7),
              ngram_hashes(ids[:1], ids[1:3], multipliers, primes, offsets, 7),
              ngram_hashes(ids[:3], ids[3:], multipliers, primes, offsets, 7)]
    assert torch.equal(torch.cat(pieces), columns)


def test_dead_token_changes_exactly_positions_5_to_8(released_hashing):
    """An image-span (DEAD) token at position 5 blocks every n-gram reaching it: orders <= 4 reach
    back 3 positions, so positions 5..8 change and nothing else (spec §14.3)."""
    multipliers, primes, offsets = released_hashing
    ids = torch.arange(100, 112)
    dead = ids.clone()
    dead[5] = DEAD
    a = ngram_hashes(ids[:0], ids, multipliers, primes, offsets, 7)
    b = ngram_hashes(ids[:0], dead, multipliers, primes, offsets, 7)
    changed = (a != b).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [5, 6, 7, 8]
    # At position 7, the 2-gram (ids 6, 7) is intact; the 3- and 4-grams reach the DEAD token.
    assert torch.equal(a[7, :, :8], b[7, :, :8]) and (a[7, :, 8:] != b[7, :, 8:]).all()


def test_candidate_mask_vector():
    inf = float("inf")
    scores = torch.tensor([[0.1, 0.9, 0.2, 0, 0.5, 0.4, 0.3, 0.2, 2, 0.1, 0, 0,
                            0.3, 0.3, 0.3, 0.3, 0.1, 0, -inf, -inf]])  # 20 positions, 18 visible
    mask = indexer_pool_ref(scores, torch.tensor([18]), topk_blocks=2, block=4)
    assert mask[0].nonzero().flatten().tolist() == [8, 9, 10, 11, 16, 17, 18, 19]
    # Nothing visible: nothing pinned, nothing kept.
    assert not indexer_pool_ref(torch.full((1, 6), -inf), torch.tensor([0]), topk_blocks=2, block=4).any()
    assert SharedSlots().topk is None


def test_qat_codes():
    block = torch.zeros(16)
    block[0], block[1], block[2] = 10.0, -1.0, 2.0
    out = fp4_e4m3(block)  # s = e4m3(10 / 6) = 1.625; 10 -> clamp(6.15) = 6 -> 9.75
    assert out[:3].tolist() == [9.75, -0.8125, 1.625]  # -0.615 -> -0.5, 1.23 -> 1 on the e2m1 grid
    # FP4 with power-of-two scales: amax 6 -> scale 1, exact grid values stay, ties go to even.
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + [0.0] * 24)
    assert fp4_ue8m0(x)[:8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    # FP8 e4m3 with power-of-two scales: amax 448 -> scale 1; 3 mantissa bits.
    y = torch.tensor([448.0, 1.0625, 1.1875, -300.0] + [0.0] * 28)
    assert fp8_ue8m0(y)[:4].tolist() == [448.0, 1.0, 1.25, -288.0]
    z = torch.full((32,), 1e-6)
    torch.testing.assert_close(fp8_ue8m0(z), z, rtol=0.07, atol=0)  # amax floor 1e-4 keeps tiny blocks usable
    assert fp8_ue8m0(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="last dim 20 is not a multiple of the quantisation block 16"):
        fp4_e4m3(torch.zeros(20))


def test_visibility_rules(make_model):
    """Ratio 2: p = 0 sees no entry, p = 1 sees {0}, p = 4 sees {0, 1}; ratio 1: p sees 0..p."""
    model = make_model(seed=1, index_topk=64)
    for layer, ratio in ((1, 2), (4, 1)):
        indexer = model.layers[layer].attn.indexer
        keys = torch.randn(6, 32)
        q, w = torch.randn(5, 16, 32), torch.ones(5, 16)
        picks = indexer.select(q, w, keys, torch.tensor([0, 1, 2, 3, 4]), SharedSlots())
        seen = [sorted(t for t in row.tolist() if t >= 0) for row in picks]
        expected = [list(range((p + 1) // ratio)) for p in range(5)]
        assert seen == expected, (layer, seen)


def test_single_pass_start_is_the_embedding(make_model, random_ids):
    """Layer 0 (no Engram) collapses with the one-hot pre: its attention input before `attn_norm`
    is the embedding row exactly (V4's mixed pre gave about 2x the embedding)."""
    model = make_model(seed=2)
    ids = random_ids(5, seed=3)
    layer = model.layers[0]
    op, seen = layer.pre_op, {}

    def record(x, pre_in, *args, **kwargs):  # the attention site's op, its collapse recorded
        out = op(x, pre_in, *args, **kwargs)
        seen.update(u=collapse(x, pre_in), h=out[3])
        return out

    layer.pre_op = record
    try:
        model(ids, [model.new_state()], [5])
    finally:
        layer.pre_op = op
    assert torch.equal(seen["u"], model.embed(ids))
    assert torch.equal(seen["h"], layer.attn_norm(model.embed(ids)))


def test_compressed_token_map_from_a_tokenizer(bpe_tokenizer):
    tokenizer = bpe_tokenizer()
    token_map, n_compressed = build_token_map(tokenizer)
    vocab = tokenizer.get_vocab()
    assert len(token_map) == tokenizer.get_vocab_size() and n_compressed < len(token_map)
    assert token_map[0] == 0 and sorted(set(token_map)) == list(range(n_compressed))  # first-seen order
    for a, b in (("hello", "Hello"), ("hello", "HELLO"), ("world", "WORLD"), ("cafe", "CAFE")):
        if a in vocab and b in vocab:
            assert token_map[vocab[a]] == token_map[vocab[b]], (a, b)
    assert token_map[vocab["H"]] == token_map[vocab["h"]] and token_map[vocab["é"]] == token_map[vocab["e"]]
    assert token_map[vocab["h"]] != token_map[vocab["w"]]
    assert build_token_map(tokenizer) == (token_map, n_compressed)  # deterministic
