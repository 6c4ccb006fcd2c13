"""Epoch planning as pure functions: shard order, rank split, buffer, workers.

Exact values for small inputs, and hypothesis properties over many: a plan is
a partition of the samples (plus declared padding, minus declared drop), every
rank gets the same count, and the order is a function of (seed, epoch) only.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.errors import ShardflowError
from shardflow.planning.plan import (
    RankPlan,
    Segment,
    ShuffleConfig,
    SplitConfig,
    buffer_shuffle_order,
    shuffle_buffer,
    plan_epoch,
    rank_share,
    shard_order,
    split_unsized,
    worker_batches,
)
from shardflow.world import World, stable_seed


def global_ids(plan: RankPlan, counts: list[int]) -> list[int]:
    """Global sample indices (shards concatenated in manifest order) in yield order."""
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    shard = np.asarray([plan.segments[s].shard for s in plan.read_segment.tolist()], dtype=np.int64)
    ids = first[shard] + plan.read_sample if len(shard) else np.zeros(0, np.int64)
    return ids[plan.emit].tolist()


def batches_of(plan: RankPlan, counts: list[int]) -> list[list[int]]:
    ids = global_ids(plan, counts)
    return [ids[plan.batch_slice(b)] for b in range(plan.num_batches)]


# ---------------------------------------------------------------- exact values


def test_stable_seed_is_sha256_not_hash():
    assert stable_seed("shards", 0, 0) == 12650560030141004160
    assert stable_seed("shards", 0, 0) != stable_seed("shards", 0, 1)
    assert stable_seed("a", 1) != stable_seed("a1")


def test_shard_order_exact_and_per_epoch():
    # Golden values: the order must be the same on every machine and Python version.
    assert shard_order(10, 0, 0, True).tolist() == [8, 5, 4, 3, 1, 2, 9, 0, 7, 6]
    assert shard_order(10, 0, 1, True).tolist() == [6, 2, 8, 4, 3, 1, 7, 5, 9, 0]
    assert shard_order(10, 0, 0, False).tolist() == list(range(10))
    assert shard_order(10, 7, 3, False).tolist() == list(range(10))
    assert shard_order(10, 1, 0, True).tolist() != shard_order(10, 0, 0, True).tolist()


def test_buffer_order_exact():
    # Golden values, as for the shard order: PCG64's stream is the same in every numpy version
    assert buffer_shuffle_order(10, 4, 0).tolist() == [2, 1, 0, 5, 7, 8, 3, 9, 4, 6]
    assert buffer_shuffle_order(10, 4, 0, initial=2).tolist() == [1, 0, 3, 5, 7, 8, 4, 9, 2, 6]
    assert buffer_shuffle_order(10, 0, 0).tolist() == list(range(10))
    assert buffer_shuffle_order(10, 1, 0).tolist() == list(range(10))


@pytest.mark.parametrize("seed", [0, 7, 2**63 + 5])
def test_buffer_draws_are_numpys_doubles_one_by_one_or_many_at_once(seed):
    from shardflow.planning.order import BufferDraws

    reference = np.random.Generator(np.random.PCG64(seed)).random(1000)  # numpy's float64 from PCG64
    draws = BufferDraws(seed)
    got = [draws.next() for _ in range(3)] + draws.take(300).tolist() + [draws.next() for _ in range(400)]
    got += draws.take(297).tolist()
    assert got == reference.tolist()


def test_c01_plan_one_shard_two_ranks():
    split = SplitConfig(batch_size=2)
    plans = [plan_epoch([10], r, 2, 0, 0, ShuffleConfig.off(), split) for r in range(2)]
    assert [batches_of(p, [10]) for p in plans] == [[[0, 1], [2, 3], [4]], [[5, 6], [7, 8], [9]]]
    assert [p.segments for p in plans] == [(Segment(0, 0, 5),), (Segment(0, 5, 10),)]
    assert [(p.samples, p.num_batches, p.padding, p.dropped) for p in plans] == [(5, 3, 0, 0)] * 2


def test_c02_plan_uneven_shards_pad_and_drop():
    counts = [4, 4, 2]
    pad = [plan_epoch(counts, r, 2, 0, 0, ShuffleConfig.off(), SplitConfig(batch_size=2)) for r in range(2)]
    assert [batches_of(p, counts) for p in pad] == [[[0, 1], [2, 3], [4]], [[5, 6], [7, 8], [9]]]
    assert [p.segments for p in pad] == [(Segment(0, 0, 4), Segment(1, 0, 1)), (Segment(1, 1, 4), Segment(2, 0, 2))]
    counts = [4, 4, 3]  # 11 samples: the remainder policy matters
    pad = [plan_epoch(counts, r, 2, 0, 0, ShuffleConfig.off(), SplitConfig(partial="pad", batch_size=2)) for r in range(2)]
    assert [batches_of(p, counts) for p in pad] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10, 0]]]
    assert [(p.samples, p.num_batches, p.padding, p.dropped) for p in pad] == [(6, 3, 1, 0)] * 2
    drop = [plan_epoch(counts, r, 2, 0, 0, ShuffleConfig.off(), SplitConfig(partial="drop", batch_size=2)) for r in range(2)]
    assert [batches_of(p, counts) for p in drop] == [[[0, 1], [2, 3], [4]], [[5, 6], [7, 8], [9]]]
    assert [(p.samples, p.num_batches, p.padding, p.dropped) for p in drop] == [(5, 3, 0, 1)] * 2
    last = [plan_epoch(counts, r, 2, 0, 0, ShuffleConfig.off(), SplitConfig(partial="drop", batch_size=2, drop_last=True)) for r in range(2)]
    assert [batches_of(p, counts) for p in last] == [[[0, 1], [2, 3]], [[5, 6], [7, 8]]]
    assert [(p.samples, p.num_batches, p.padding, p.dropped) for p in last] == [(5, 2, 0, 3)] * 2


def test_rank_share_exact():
    assert rank_share(10, 2, SplitConfig(batch_size=2)) == (5, 3, 0, 0)
    assert rank_share(11, 2, SplitConfig(batch_size=2)) == (6, 3, 1, 0)
    assert rank_share(11, 2, SplitConfig(partial="drop", batch_size=2)) == (5, 3, 0, 1)
    assert rank_share(24, 1, SplitConfig(batch_size=8, drop_last=True)) == (24, 3, 0, 0)
    assert rank_share(25, 1, SplitConfig(batch_size=8, drop_last=True)) == (25, 3, 0, 1)
    assert rank_share(1, 3, SplitConfig()) == (1, 1, 2, 0)  # every rank repeats the one sample


def test_rank_share_errors_name_the_problem():
    assert rank_share(0, 2, SplitConfig()) == (0, 0, 0, 0)  # all shards empty: nothing, not an error
    with pytest.raises(ShardflowError, match="every rank would get 0"):
        rank_share(1, 2, SplitConfig(partial="drop"))
    with pytest.raises(ShardflowError, match="drop_last=True drops them all"):
        rank_share(10, 2, SplitConfig(batch_size=8, drop_last=True))


def test_worker_batches_exact():
    assert [list(worker_batches(3, w, 2)) for w in range(2)] == [[0], [1, 2]]
    assert [list(worker_batches(3, w, 4)) for w in range(4)] == [[], [0], [1], [2]]  # worker 0 gets none
    assert [list(worker_batches(3, w, 8)) for w in range(8)] == [[], [], [0], [], [], [1], [], [2]]


def test_split_unsized_exact_and_error():
    assert [split_unsized(8, World(r, 2, w, 2), 0, 0, False) for r in range(2) for w in range(2)] == [
        [0, 4], [2, 6], [1, 5], [3, 7],
    ]
    with pytest.raises(ShardflowError, match=r"rank 1 would get no data.*shardflow index"):
        split_unsized(1, World(1, 2), 0, 0, False)


def test_config_validation():
    with pytest.raises(ValueError, match="partial"):
        SplitConfig(partial="wrap")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        SplitConfig(batch_size=0)
    with pytest.raises(ValueError, match="shuffle buffer"):
        ShuffleConfig(buffer=-1)
    with pytest.raises(ValueError, match="invalid rank"):
        World(2, 2)
    with pytest.raises(ValueError, match="invalid worker"):
        World(0, 1, 1, 1)


def test_samples_per_epoch_walks_an_endless_stream():
    counts = [3, 3]
    split = SplitConfig(batch_size=2, samples_per_epoch=4)
    shuffle = ShuffleConfig(shards=True, buffer=0, interleave=1, window=0)
    epochs = [[global_ids(plan_epoch(counts, r, 2, 0, e, shuffle, split), counts) for r in range(2)] for e in range(3)]
    stream = [i for e in epochs for r in e for i in r]  # 24 positions = 4 passes of 6
    for p in range(4):
        assert sorted(stream[6 * p : 6 * p + 6]) == list(range(6)), f"pass {p} is not every sample once"
    assert all(len(r) == 4 for e in epochs for r in e)
    # the window shuffle permutes each epoch's stretch of that stream over the ranks: the same samples
    windowed = ShuffleConfig(shards=True, buffer=0, interleave=1)
    for e in range(3):
        mixed = [global_ids(plan_epoch(counts, r, 2, 0, e, windowed, split), counts) for r in range(2)]
        assert sorted(mixed[0] + mixed[1]) == sorted(epochs[e][0] + epochs[e][1])
        assert [len(r) for r in mixed] == [4, 4]


# ---------------------------------------------------------------- properties

counts_st = st.lists(st.integers(0, 12), min_size=1, max_size=12).filter(lambda c: sum(c) > 0)
shuffle_st = st.builds(ShuffleConfig, shards=st.booleans(), buffer=st.integers(0, 20), interleave=st.integers(1, 4),
                       window=st.sampled_from([0, 3, 1 << 18]))


@st.composite
def split_cases(draw):
    counts = draw(counts_st)
    total = sum(counts)
    w = draw(st.integers(1, 5))
    partial = draw(st.sampled_from(["pad", "drop"]))
    if partial == "drop" and total < w:
        partial = "pad"
    n = -(-total // w) if partial == "pad" else total // w
    bs = draw(st.integers(1, 6))
    drop_last = draw(st.booleans()) and n >= bs
    return counts, w, SplitConfig(partial=partial, batch_size=bs, drop_last=drop_last)


@settings(max_examples=300, deadline=None)
@given(case=split_cases(), shuffle=shuffle_st, seed=st.integers(0, 2**32), epoch=st.integers(0, 50))
def test_plan_is_a_partition_with_equal_rank_counts(case, shuffle, seed, epoch):
    counts, w, split = case
    total = sum(counts)
    plans = [plan_epoch(counts, r, w, seed, epoch, shuffle, split) for r in range(w)]
    # equal counts on every rank: samples, batches, batch sizes
    assert len({(p.samples, p.num_batches) for p in plans}) == 1
    assert len({tuple(len(b) for b in batches_of(p, counts)) for p in plans}) == 1
    p0 = plans[0]
    bs = split.batch_size
    sizes = [len(b) for b in batches_of(p0, counts)]
    assert all(s == bs for s in sizes[:-1]) and 1 <= sizes[-1] <= bs
    if split.drop_last:
        assert sizes[-1] == bs
    # every rank's yield order is a permutation of what it reads
    for p in plans:
        assert sorted(p.emit.tolist()) == list(range(len(p.read_sample)))
        assert len(p.read_sample) == min(p.samples, p.num_batches * bs)
        # a rank reads its own segments; under a window shuffle, its share of the epoch's
        assert sum(len(s) for s in p.segments) == (w * p.samples if p.scattered else len(p.read_sample))
    seen = Counter(i for p in plans for i in global_ids(p, counts))
    yielded = sum(seen.values())
    assert yielded == total + p0.padding - p0.dropped
    if split.partial == "pad" and not split.drop_last:
        # every sample at least once; the padding repeats samples, at most W-1 extra
        assert set(seen) == set(range(total))
        assert p0.padding == w * p0.samples - total and 0 <= p0.padding < w
        assert yielded == w * p0.samples
    elif split.partial == "drop" and not split.drop_last:
        assert max(seen.values()) == 1 and p0.padding == 0 and p0.dropped == total % w
        assert len(seen) == w * p0.samples and set(seen) <= set(range(total))
        if not shuffle.shards:
            assert set(seen) == set(range(w * p0.samples))  # the stream's tail is what is dropped
    else:
        assert set(seen) <= set(range(total))
    if p0.padding == 0:
        assert max(seen.values()) == 1, "a sample seen twice without declared padding"


@settings(max_examples=200, deadline=None)
@given(case=split_cases(), shuffle=shuffle_st, seed=st.integers(0, 2**32), epoch=st.integers(0, 50))
def test_plan_is_stable_per_seed_and_epoch(case, shuffle, seed, epoch):
    counts, w, split = case
    for r in range(w):
        a = plan_epoch(counts, r, w, seed, epoch, shuffle, split)
        b = plan_epoch(list(counts), r, w, seed, epoch, shuffle, split)
        assert global_ids(a, counts) == global_ids(b, counts)
        assert a.segments == b.segments


@settings(max_examples=100, deadline=None)
@given(n=st.integers(20, 200), seed=st.integers(0, 2**32))
def test_shuffle_changes_with_epoch(n, seed):
    shuffle = ShuffleConfig(shards=True, buffer=8, interleave=2)
    split = SplitConfig()
    counts = [1] * n
    a = global_ids(plan_epoch(counts, 0, 1, seed, 0, shuffle, split), counts)
    b = global_ids(plan_epoch(counts, 0, 1, seed, 1, shuffle, split), counts)
    assert sorted(a) == sorted(b) == list(range(n))
    assert a != b  # 20! orders: equal only by a bug


@settings(max_examples=200, deadline=None)
@given(nb=st.integers(0, 60), k=st.integers(1, 16))
def test_worker_batches_partition_in_order(nb, k):
    runs = [list(worker_batches(nb, w, k)) for w in range(k)]
    assert [b for r in runs for b in r] == list(range(nb))
    lengths = [len(r) for r in runs]
    assert max(lengths) - min(lengths) <= 1


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), buffer=st.integers(0, 64), seed=st.integers(0, 2**32))
def test_buffer_order_is_a_bounded_permutation(n, buffer, seed):
    order = buffer_shuffle_order(n, buffer, seed)
    assert order.dtype == np.int64
    assert sorted(order.tolist()) == list(range(n))
    assert order.tolist() == buffer_shuffle_order(n, buffer, seed).tolist()
    # a buffer of B holds back at most B items: item j leaves by output position j (read j+1 items)
    if buffer > 1:
        for out_pos, item in enumerate(order.tolist()[: max(n - buffer, 0)]):
            assert item <= out_pos + buffer


@settings(max_examples=200, deadline=None)
@given(
    num_shards=st.integers(1, 40),
    w=st.integers(1, 6),
    k=st.integers(1, 5),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 10),
    shuffle=st.booleans(),
)
def test_split_unsized_partitions_the_shards(num_shards, w, k, seed, epoch, shuffle):
    if num_shards < w:
        with pytest.raises(ShardflowError, match="would get no data"):
            split_unsized(num_shards, World(w - 1, w), seed, epoch, shuffle)
        return
    streams = [split_unsized(num_shards, World(r, w, i, k), seed, epoch, shuffle) for r in range(w) for i in range(k)]
    flat = [s for st_ in streams for s in st_]
    assert sorted(flat) == list(range(num_shards))
    per_rank = [sum(len(streams[r * k + i]) for i in range(k)) for r in range(w)]
    assert max(per_rank) - min(per_rank) <= 1 and min(per_rank) >= 1


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 400), buffer=st.integers(0, 80), initial=st.integers(1, 100), seed=st.integers(0, 2**32))
def test_shuffle_buffer_starts_early_and_grows(n, buffer, initial, seed):
    order = buffer_shuffle_order(n, buffer, seed, initial)
    assert order.tolist() == list(shuffle_buffer(range(n), buffer, seed, initial))  # one rule, two forms
    assert sorted(order.tolist()) == list(range(n))
    if buffer > 1 and n:
        assert order[0] <= max(min(initial, buffer), 2)  # the first item leaves after a fill of `initial` (+1)
        assert all(item < p + buffer for p, item in enumerate(order.tolist()))  # at most `buffer` held back


def test_first_batch_needs_a_small_fill_only():
    order = buffer_shuffle_order(20_000, 1000, 5)  # initial 100
    assert int(order[:64].max()) < 100 + 2 * 64  # the first batch of 64 needs ~230 samples read, not 1,000
    assert int(order[:64].max()) >= 64


@pytest.mark.parametrize("n,buffer,initial,seed", [(5000, 1000, 100, 7), (3000, 7, 3, 2**63 + 5), (2000, 1999, 1, 1),
                                                   (70_100, 70_000, 100, 11)])
def test_buffer_order_equals_the_buffer_in_its_steady_state(n, buffer, initial, seed):
    """The steady state's draws are taken at once (the same doubles as one by one): the
    order is still exactly that of shuffle_buffer, also past 2**16 buffer slots."""
    assert buffer_shuffle_order(n, buffer, seed, initial).tolist() == list(shuffle_buffer(range(n), buffer, seed, initial))
