"""Chain verification of a drafted block: greedy matching and exact rejection sampling.

One round verifies the first L drafts x_0..x_{L-1} of a request (L chosen by `dspark.verify.planner`)
with one target forward over [anchor, x_0, .., x_{L-1}], which yields L + 1 target rows: row j is the
target's distribution for the token after the anchor and x_0..x_{j-1}, so row j judges x_j and
row L supplies the bonus token (spec §2.3, §3.1–3.2).

Sampling rule (Leviathan et al. / Chen et al., as in the DSpark paper §2.1). For j = 0, 1, ..:
accept x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection emit a token from the
residual r_j ∝ max(0, p_j − q_j) and stop; if all L drafts pass, emit a bonus token from p_L. Every
round therefore commits n_accepted + 1 tokens.

Why it is exact. At one position, with both p and q summing to 1,
    P(emit v) = q(v) min(1, p(v)/q(v)) + P(reject) r(v) = min(p, q)(v) + max(0, p − q)(v) = p(v),
because P(reject) = Σ_v max(0, q − p)(v) = Σ_v max(0, p − q)(v), the residual's normaliser. Given
x_j was accepted, the next position is judged by the target row conditioned on the accepted
prefix, so by induction every committed token follows the target's conditional distribution. How
many drafts L are verified does not matter as long as L is fixed before the drafts it admits are
sampled (`dspark.verify.planner` explains why and the tests show the converse).

What p and q are. `p_j` is the *target* distribution defined by the request's `SamplingParams`
(temperature, top-k, top-p: `dspark.sampling.probs_from_logits`); the output matches exactly that
distribution. `q_j` is whatever the drafter actually sampled x_j from (for DSpark the unfiltered,
Markov-corrected softmax at the request temperature; a point mass for deterministic drafters such
as n-gram lookup, passed as `draft_probs=None`). Rejection sampling is exact for any q, so q need
not be filtered like p: a draft outside p's support is simply always rejected.

Greedy (temperature 0): p is one-hot at the target argmax, so x_j is accepted iff it equals the
argmax and the next token is the argmax at the first mismatch (or of row L).

Shape symbols: R requests, K padded block width (drafts per request, K >= max length),
V vocabulary, k drafts of a single request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.sampling import Generators, SamplingParams, exponential_noise, greedy, probs_from_logits, uniform_noise


def verify_greedy(draft_tokens: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of one block.

    Parameters
    ----------
    draft_tokens : LongTensor [k]
    target : LongTensor [k + 1] (target argmax per row) or floating [k + 1, V] (logits or probs;
        the argmax is taken, ties to the lowest id)

    Returns
    -------
    n_accepted : LongTensor [] in [0, k], length of the leading run of drafts equal to the argmax
    next_token : LongTensor [], the target argmax of row n_accepted (correction or bonus)
    """
    _check_single(draft_tokens)
    n, nxt = verify_greedy_batch(draft_tokens[None], target[None], [draft_tokens.shape[0]])
    return n[0], nxt[0]


def accept_greedy(drafts: list[int], targets: list[int]) -> tuple[int, int]:
    """`verify_greedy` on host ids: (accepted, next token) for drafts [k] and the target argmax of
    their k + 1 rows (a round reads all its greedy rows' argmax in one host copy): the leading run of
    drafts equal to the target, then the target's token at the first mismatch (or the bonus row)."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n, targets[n]


def verify_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                  generator: Generators) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rejection-sampling verification of one block (module docstring).

    Parameters
    ----------
    draft_tokens : LongTensor [k]
    draft_probs : floating [k, V], or None for a point-mass (deterministic) drafter
        Row j is the distribution x_j was sampled from; one-hot rows are fine.
    target_probs : floating [k + 1, V]
        Target distribution p_j per row (after temperature/top-k/top-p); computed in float32.
    generator : torch.Generator on the tensors' device

    Returns
    -------
    n_accepted : LongTensor [] in [0, k]
    next_token : LongTensor [], residual sample at the first rejection, else bonus from row k
    """
    _check_single(draft_tokens)
    probs = None if draft_probs is None else draft_probs[None]
    n, nxt = verify_sample_batch(draft_tokens[None], probs, target_probs[None], [draft_tokens.shape[0]],
                                 _one_generator(generator))
    return n[0], nxt[0]


def verify_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                 params: SamplingParams, generator: Generators | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify one block against raw target logits under the request's `params`.

    Greedy when `params.greedy` (no random draws; `draft_probs` and `generator` unused), otherwise
    `verify_sample` against `probs_from_logits(target_logits, params)`.

    Shapes: draft_tokens LongTensor [k]; draft_probs [k, V] or None; target_logits floating [k + 1, V].
    Returns (n_accepted, next_token), LongTensor [] each.
    """
    if params.greedy:
        return verify_greedy(draft_tokens, target_logits)
    if generator is None:
        raise ValueError("generator is required when params.temperature > 0")
    return verify_sample(draft_tokens, draft_probs, probs_from_logits(target_logits, params), generator)


def verify_chain_batch(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_logits: torch.Tensor, lengths: Sequence[int] | torch.Tensor,
                       params: SamplingParams, generator: Generators | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched `verify_chain` for requests sharing `params`; padded layout of `verify_sample_batch`.

    Shapes: draft_tokens LongTensor [R, K]; draft_probs [R, K, V] or None; target_logits floating
    [R, K + 1, V]; lengths [R]. Returns n_accepted, next_token: LongTensor [R] each.
    """
    if params.greedy:
        return verify_greedy_batch(draft_tokens, target_logits, lengths)
    if generator is None:
        raise ValueError("generator is required when params.temperature > 0")
    return verify_sample_batch(draft_tokens, draft_probs, probs_from_logits(target_logits, params),
                               lengths, generator)


def verify_greedy_batch(draft_tokens: torch.Tensor, target: torch.Tensor,
                        lengths: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of R blocks of different lengths, padded to width K.

    Parameters
    ----------
    draft_tokens : LongTensor [R, K]
        Request r's drafts in columns 0..lengths[r]-1; the padding is ignored.
    target : LongTensor [R, K + 1] (argmax ids) or floating [R, K + 1, V] (logits or probs)
        Row j of request r judges draft j; rows past lengths[r] are ignored.
    lengths : sequence of int or LongTensor [R], values in [0, K]
        Drafts verified per request (the verify width is lengths[r] + 1). Host values are
        range-checked; a device tensor is trusted, so this call never syncs.

    Returns
    -------
    n_accepted : LongTensor [R]
    next_token : LongTensor [R]
    """
    rows, width = _check_tokens(draft_tokens)
    target_ids = _target_ids(target, rows, width)  # [R, K+1]
    lens = _lengths(lengths, rows, width, draft_tokens.device)  # [R]
    valid = torch.arange(width, device=draft_tokens.device) < lens[:, None]  # [R, K]
    match = (draft_tokens == target_ids[:, :width]) & valid
    n_accepted = match.long().cumprod(dim=-1).sum(dim=-1)  # [R] leading run of matches
    next_token = target_ids.gather(1, n_accepted[:, None]).squeeze(1)
    return n_accepted, next_token


def verify_sample_batch(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                        target_probs: torch.Tensor, lengths: Sequence[int] | torch.Tensor,
                        generator: Generators) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rejection-sampling verification of R blocks of different lengths, padded to width K.

    Vectorised over requests and positions, no host sync: all acceptance tests are drawn at once
    and the accepted count is the length of the leading run of passes (later tests are simply
    discarded, which leaves the law of the emitted tokens unchanged).

    Parameters
    ----------
    draft_tokens : LongTensor [R, K]
        Request r's drafts in columns 0..lengths[r]-1; padding may hold any value.
    draft_probs : floating [R, K, V], or None for point-mass drafters
        Row (r, j) is the distribution x_{r,j} was sampled from; padding rows are ignored.
    target_probs : floating [R, K + 1, V]
        Target distributions; row (r, j) judges x_{r,j}, row (r, lengths[r]) gives the bonus.
    lengths : sequence of int or LongTensor [R], values in [0, K]
        As in `verify_greedy_batch`.
    generator : torch.Generator, or a sequence of R generators (one private stream per request)
        Request r's stream reads V exponentials (for the emitted token), then K uniforms (one
        acceptance test per position, only the first lengths[r] used). With a sequence of CPU
        generators a request's result is therefore the same as `verify_sample` on its own block,
        whatever the batch and its padding (CPU generators produce prefix-consistent streams; on
        CUDA this holds when the padded width equals the request's length).

    Returns
    -------
    n_accepted : LongTensor [R]
    next_token : LongTensor [R]

    Edge cases (all exact):
    * q(x) = 0 for a drafted x (impossible for a true sample, possible with rounded inputs): the
      test `u · q(x) < p(x)` accepts iff p(x) > 0, i.e. the ratio is +inf, and rejects 0/0.
    * p(x) = 0 (e.g. x outside the target's top-k/top-p set): always rejected.
    * Residual with no mass: only when p <= q everywhere, i.e. p = q, where rejection has
      probability 0 (with rounding: at most the residual's mass, which is the rejection
      probability). Falling back to p then changes nothing in distribution.
    """
    rows, width = _check_tokens(draft_tokens)
    device = draft_tokens.device
    if not torch.is_floating_point(target_probs) or target_probs.dim() != 3 or \
            target_probs.shape[:2] != (rows, width + 1):
        raise ValueError(f"target_probs must be floating [R, K+1, V] = [{rows}, {width + 1}, V], got "
                         f"{target_probs.dtype} {tuple(target_probs.shape)}")
    vocab = target_probs.shape[-1]
    if draft_probs is not None and (not torch.is_floating_point(draft_probs)
                                    or tuple(draft_probs.shape) != (rows, width, vocab)):
        raise ValueError(f"draft_probs must be floating [R, K, V] = [{rows}, {width}, {vocab}] or None, "
                         f"got {draft_probs.dtype} {tuple(draft_probs.shape)}")
    if generator is None:
        raise ValueError("generator is required for sampled verification")
    lens = _lengths(lengths, rows, width, device)  # [R]
    p = target_probs.float()  # [R, K+1, V]
    q = None if draft_probs is None else draft_probs.float()  # [R, K, V]
    tok = draft_tokens.long().clamp(0, vocab - 1)  # [R, K] padding may be -1 or garbage
    valid = torch.arange(width, device=device) < lens[:, None]  # [R, K]

    # Draw the race noise for the emitted token before the K acceptance uniforms: a request's
    # stream then reads V exponentials and a prefix of uniforms whatever the padded width K, so
    # with per-request generators its result does not depend on the batch it shares.
    noise = exponential_noise((rows, vocab), generator, device)  # [R, V]
    u = uniform_noise((rows, width), generator, device)  # [R, K]
    p_tok = p[:, :width].gather(-1, tok[..., None]).squeeze(-1)  # [R, K] p_j(x_j)
    q_tok = torch.ones_like(p_tok) if q is None else q.gather(-1, tok[..., None]).squeeze(-1)
    # u < p/q written without the division, so q = 0 needs no clamp (see Edge cases).
    accept = (u * q_tok < p_tok) & valid
    n_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [R]

    p_row = p.gather(1, n_accepted.view(rows, 1, 1).expand(rows, 1, vocab)).squeeze(1)  # [R, V]
    dist = p_row
    if width > 0:
        at = n_accepted.clamp(max=width - 1)  # [R] rejected position (clamped for bonus rows)
        if q is None:
            # max(0, p − δ_x) is p with x's entry removed (p(x) <= 1), no V-sized one-hot needed.
            residual = p_row.scatter(-1, tok.gather(1, at[:, None]), 0.0)
        else:
            q_row = q.gather(1, at.view(rows, 1, 1).expand(rows, 1, vocab)).squeeze(1)  # [R, V]
            residual = (p_row - q_row).clamp_min(0.0)
        rejected = (n_accepted < lens)[:, None]  # [R, 1]
        has_mass = residual.sum(dim=-1, keepdim=True) > 0
        dist = torch.where(rejected & has_mass, residual, p_row)
    # Exponential race (as in `dspark.sampling.sample`): needs no normalisation of the residual.
    next_token = greedy(dist / noise)
    return n_accepted, next_token


def pad_ragged(flat: torch.Tensor, seq_lens: Sequence[int], width: int, fill: float | int = 0) -> torch.Tensor:
    """Scatter a ragged row-concatenation into a padded [R, width, ...] tensor.

    The target forward returns one row per verified token, concatenated over requests (request r
    contributes seq_lens[r] = lengths[r] + 1 rows); this gives the [R, K + 1, ...] layout that the
    batched verifiers take. `seq_lens` is host-side plan data, so no sync is needed.

    Shapes: flat [N, *rest] with N = sum(seq_lens) -> [R, width, *rest], padding = `fill`.
    """
    lens = [int(n) for n in seq_lens]
    if any(n < 0 or n > width for n in lens):
        raise ValueError(f"seq_lens must lie in [0, width={width}], got {lens}")
    if sum(lens) != flat.shape[0]:
        raise ValueError(f"flat has {flat.shape[0]} rows but seq_lens sum to {sum(lens)}")
    dest = [r * width + j for r, n in enumerate(lens) for j in range(n)]
    out = flat.new_full((len(lens) * width, *flat.shape[1:]), fill)
    out[torch.tensor(dest, dtype=torch.long, device=flat.device)] = flat
    return out.view(len(lens), width, *flat.shape[1:])


def _check_single(draft_tokens: torch.Tensor) -> None:
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be [k], got shape {tuple(draft_tokens.shape)}")


def _one_generator(generator: Generators) -> Generators:
    """A single-request call takes one generator; a one-element sequence is accepted as well."""
    if generator is None:
        raise ValueError("generator is required for sampled verification")
    if isinstance(generator, torch.Generator):
        return generator
    gens = list(generator)
    if len(gens) != 1:
        raise ValueError(f"a single block needs one generator, got {len(gens)}")
    return gens


def _check_tokens(draft_tokens: torch.Tensor) -> tuple[int, int]:
    if draft_tokens.dim() != 2 or draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an integer tensor [R, K], got {draft_tokens.dtype} "
                         f"{tuple(draft_tokens.shape)}")
    return draft_tokens.shape[0], draft_tokens.shape[1]


def _target_ids(target: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Target argmax ids [R, K+1] from ids [R, K+1] or scores [R, K+1, V]."""
    if torch.is_floating_point(target) and target.dim() == 3 and target.shape[:2] == (rows, width + 1):
        return greedy(target)
    if not torch.is_floating_point(target) and target.dim() == 2 and target.shape == (rows, width + 1):
        return target.long()
    raise ValueError(f"target must be integer ids [R, K+1] or floating scores [R, K+1, V] with "
                     f"R={rows}, K={width}; got {target.dtype} {tuple(target.shape)}")


def _lengths(lengths: Sequence[int] | torch.Tensor, rows: int, width: int, device: torch.device) -> torch.Tensor:
    """Validated LongTensor [R] of verify lengths on `device` (range-checked only on the host)."""
    if isinstance(lengths, torch.Tensor):
        if lengths.shape != (rows,) or torch.is_floating_point(lengths):
            raise ValueError(f"lengths must be an integer tensor [R={rows}], got {lengths.dtype} "
                             f"{tuple(lengths.shape)}")
        if lengths.device.type == "cpu":
            _check_range(lengths.tolist(), width)
        return lengths.to(device=device, dtype=torch.long)
    values = [int(n) for n in lengths]
    if len(values) != rows:
        raise ValueError(f"lengths has {len(values)} entries for R={rows} requests")
    _check_range(values, width)
    return torch.tensor(values, dtype=torch.long, device=device)


def _check_range(values: list[int], width: int) -> None:
    bad = [n for n in values if not 0 <= n <= width]
    if bad:
        raise ValueError(f"lengths must lie in [0, K={width}], got {bad[0]}")
