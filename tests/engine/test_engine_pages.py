"""Page allocator and scheduler: no page is lost or shared, whatever admits, grows, finishes,
aborts and preemptions happen (host-side only, no model)."""

import random

import pytest
import torch

from dspark.engine.footprint import StateFootprint, StateKind
from dspark.engine.pages import PagePool, StateAllocator
from dspark.engine.scheduler import Scheduler
from dspark.request import Request

# A V4-like request: token ids, a window of 7 + f rows, entries every 4 and every 16 tokens, and a
# drafter context of 8 committed rows.
FOOTPRINT = StateFootprint((StateKind("token_ids", 8), StateKind("window_kv", 96, bound=7),
                            StateKind("compressed_kv", 64, rate=4), StateKind("compressed_kv", 64, rate=16),
                            StateKind("compressor_buffers", 40, bound=7),
                            StateKind("drafter_context", 32, bound=8, grows_with_call=False)))


def test_pool_reuses_released_pages_and_refuses_double_free():
    pool = PagePool(5)
    a = pool.allocate(3)
    pool.release(a[:2])
    b = pool.allocate(4)
    assert sorted(a[:2]) == sorted(b[:2]) and pool.free == 0  # released ids come back first
    with pytest.raises(ValueError, match="1 pages requested, 0 free"):
        pool.allocate(1)
    pool.release(b)
    with pytest.raises(ValueError, match="not allocated"):
        pool.release(b[:1])
    pool.check()


def test_pages_needed_follow_each_kind():
    alloc = StateAllocator(FOOTPRINT, 100, 256)  # rows per page: 32, 2, 4, 4, 6, 8
    assert alloc.rows_per_page == (32, 2, 4, 4, 6, 8)
    # length 40 after a call of 5: rows 40, min(40, 12)=12, 10, 2, 12, 8
    assert FOOTPRINT.rows(40, 5) == (40, 12, 10, 2, 12, 8)
    assert alloc.pages_needed(40, 5) == (2, 6, 3, 1, 2, 1)
    assert FOOTPRINT.bytes(40, 5) == 40 * 8 + 12 * 96 + 10 * 64 + 2 * 64 + 12 * 40 + 8 * 32
    with pytest.raises(ValueError, match="largest state row"):
        StateAllocator(FOOTPRINT, 10, 64)


def test_resize_is_all_or_nothing():
    alloc = StateAllocator(FOOTPRINT, 20, 256)
    assert alloc.resize("a", 40, 5) and alloc.held("a") == 15
    before = alloc.pool.free
    assert not alloc.resize("b", 40, 5)  # needs 15, 5 free: nothing taken
    assert alloc.pool.free == before and "b" not in alloc.owners()
    assert alloc.resize("a", 8, 0) and alloc.held("a") == sum(alloc.pages_needed(8, 0))
    assert alloc.release("a") > 0 and alloc.pool.used == 0
    alloc.check()


def _request(rng, i):
    prompt = [rng.randrange(50) for _ in range(rng.randint(1, 40))]
    return Request(prompt, None, torch.Generator(), rng.randint(1, 30), frozenset(), request_id=f"r{i}")


def _run_step(sched, rng, finish_early=False):
    """What the engine does with the scheduled requests, on the host only: feed, commit, finish."""
    for req in list(sched.running):
        if req.in_prefill:
            length, fed = sched.next_call(req)
            req.prefilled = length
            if not req.in_prefill and not req.out:
                req.commit([1])
        else:
            _, width = sched.next_call(req)
            req.commit([1] * rng.randint(1, width))  # accepted drafts + bonus
        if req.finish_reason or (finish_early and rng.random() < 0.02):
            sched.finish(req)


@pytest.mark.parametrize("seed", range(4))
def test_random_admit_grow_finish_abort_preempt_leaves_no_page_behind(seed):
    rng = random.Random(seed)
    alloc = StateAllocator(FOOTPRINT, 60, 256)  # room for a few requests only: preemption is common
    sched = Scheduler(alloc, max_running=6, prefill_chunk=8, verify_width=4)
    ids, preempted_total = iter(range(10**6)), 0
    for _ in range(400):
        for _ in range(rng.randint(0, 2)):
            req = _request(rng, next(ids))
            assert sched.fits(len(req.prompt), req.max_new)
            sched.add(req)
        if rng.random() < 0.1 and (sched.waiting or sched.running):
            victim = rng.choice([*sched.waiting, *sched.running])
            assert sched.remove(victim.request_id) and alloc.held(victim) == 0
        admitted, preempted = sched.schedule()
        preempted_total += len(preempted)
        alloc.check()
        # every running request holds exactly what its next call needs; waiting ones hold nothing
        for req in sched.running:
            assert alloc.pages_needed(*sched.next_call(req)) == tuple(map(len, alloc._tables[req]))
        assert all(alloc.held(r) == 0 and r.prefilled == 0 for r in sched.waiting)
        assert all(r.state is None for r in preempted) and set(preempted) <= set(sched.waiting)
        assert alloc.pool.used == sum(alloc.held(r) for r in sched.running) <= alloc.pool.num_pages
        _run_step(sched, rng, finish_early=True)
    while sched.waiting or sched.running:
        sched.schedule()
        _run_step(sched, rng)
    assert preempted_total > 0
    assert alloc.pool.used == 0 and alloc.owners() == []
    alloc.check()


def test_preemption_takes_the_newest_and_requeues_it_in_front():
    alloc = StateAllocator(FOOTPRINT, 30, 256)
    sched = Scheduler(alloc, max_running=2, prefill_chunk=8, verify_width=1)
    rng = random.Random(0)
    old, new, queued = (Request([2] * 8, None, torch.Generator(), 200, frozenset(), request_id=n)
                        for n in ("old", "new", "queued"))
    for r in (old, new, queued):
        sched.add(r)
    assert sched.schedule() == ([old, new], [])
    for _ in range(200):  # decoding grows both until they no longer fit together
        _run_step(sched, rng)
        _, preempted = sched.schedule()
        if preempted:
            break
    assert preempted == [new] and sched.running == [old]
    assert list(sched.waiting) == [new, queued]
    assert new.feed == new.prompt + new.out[:-1] and new.prefilled == 0 and new.stats.preemptions == 1


class _SettleAll(Scheduler):
    """The settle step without the skip: every running request shrinks to its state first."""

    def schedule(self):
        for req in self.running:
            assert self.allocator.resize(req, req.fed_length if not req.in_prefill else req.prefilled)
        preempted = self._grow()
        return ([] if preempted else self._admit()), preempted


@pytest.mark.parametrize("seed", range(3))
def test_keeping_a_reservation_that_fits_the_next_call_preempts_and_admits_the_same(seed):
    """Settling only the requests whose pages differ from their next call's changes no decision of the
    policy: the same requests are admitted, preempted and running at every step, under memory pressure."""
    runs = []
    for cls in (Scheduler, _SettleAll):
        rng, alloc = random.Random(seed), StateAllocator(FOOTPRINT, 60, 256)
        sched, ids, log = cls(alloc, max_running=6, prefill_chunk=8, verify_width=4), iter(range(10**6)), []
        for _ in range(300):
            for _ in range(rng.randint(0, 2)):
                sched.add(_request(rng, next(ids)))
            admitted, preempted = sched.schedule()
            alloc.check()
            log.append(([r.request_id for r in admitted], [r.request_id for r in preempted],
                        [r.request_id for r in sched.running]))
            _run_step(sched, rng, finish_early=True)
        runs.append(log)
    assert runs[0] == runs[1]
    assert any(preempted for _, preempted, _ in runs[0])


def test_a_decode_step_whose_widest_call_crosses_a_page_keeps_its_pages():
    """A request whose settled state needs fewer pages than its next (widest) call keeps that call's
    pages from step to step instead of releasing and taking them back (window rows: 7 settled, 7 + 4
    reserved, 2 rows per page)."""
    alloc = StateAllocator(FOOTPRINT, 100, 256)
    sched = Scheduler(alloc, max_running=2, prefill_chunk=8, verify_width=4)
    reqs = [Request([2] * 8, None, torch.Generator(), 100, frozenset(), request_id=f"r{i}") for i in range(2)]
    for r in reqs:
        sched.add(r)
    sched.schedule()
    _run_step(sched, random.Random(0))  # prefill: both decode from now on
    released, release = [], alloc.pool.release
    alloc.pool.release = lambda pages: (released.extend(pages), release(pages))[1]
    for _ in range(20):
        sched.schedule()
        for req in reqs:
            assert alloc.pages_needed(*sched.next_call(req)) == tuple(map(len, alloc._tables[req]))
        for req in reqs:
            req.commit([1])  # a plain round: one token, well under the reserved width
    assert alloc.pages_needed(10, 0)[1] < alloc.pages_needed(14, 4)[1]  # the settled state needs fewer
    assert released == []
