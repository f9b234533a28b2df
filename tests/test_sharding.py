"""Properties of the shard samplers, checked in one process over many sizes, world sizes and epochs."""

import itertools
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_shardplus import ExactShardSampler, PaddedShardSampler
from lightning_shardplus.data.sharding import (
    DIGEST_WIDTH,
    ShardingError,
    check_checkpoint_entry,
    check_epoch_shards,
    digest_problem,
    epoch_permutation,
    shard_digest,
)

sizes = st.integers(min_value=0, max_value=1000)
world_sizes = st.integers(min_value=1, max_value=8)
seeds = st.integers(min_value=0, max_value=2**31)
epochs = st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=3, unique=True)


def padded_shards(n, w, epoch, **kwargs):
    shards = []
    for rank in range(w):
        sampler = PaddedShardSampler(n, w, rank, **kwargs)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


@settings(max_examples=200, deadline=None)
@given(n=sizes, w=world_sizes, seed=seeds, epochs=epochs, padding=st.sampled_from(["first", "wrap"]))
def test_padded_shards_are_equal_cover_everything_and_pad_as_specified(n, w, seed, epochs, padding):
    for epoch in epochs:
        shards = padded_shards(n, w, epoch, seed=seed, padding=padding)
        expected_len = math.ceil(n / w)
        assert [len(s) for s in shards] == [expected_len] * w
        assert all(len(PaddedShardSampler(n, w, r)) == expected_len for r in range(w))
        # Interleaving the shards gives back the epoch order followed by the padding.
        interleaved = [shards[pos % w][pos // w] for pos in range(expected_len * w)]
        order = epoch_permutation(n, seed=seed, epoch=epoch).tolist()
        assert interleaved[:n] == order
        assert sorted(order) == list(range(n))
        pads = interleaved[n:]
        if padding == "first":
            assert pads == [0] * len(pads)
        else:
            assert pads == (order * (len(pads) // max(n, 1) + 1))[: len(pads)]
        # The pads sit at the end of the shards, after num_real_samples real indices.
        real = [s[: PaddedShardSampler(n, w, r).num_real_samples] for r, s in enumerate(shards)]
        assert sorted(i for s in real for i in s) == list(range(n))


@settings(max_examples=100, deadline=None)
@given(n=sizes, w=world_sizes, seed=seeds)
def test_drop_last_drops_the_tail_instead_of_padding(n, w, seed):
    shards = padded_shards(n, w, 0, seed=seed, drop_last=True)
    assert [len(s) for s in shards] == [n // w] * w
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == len(flat) == (n // w) * w


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=3, max_value=1000), w=world_sizes, seed=seeds)
def test_permutation_is_deterministic_per_seed_and_changes_every_epoch(n, w, seed):
    assert padded_shards(n, w, 3, seed=seed) == padded_shards(n, w, 3, seed=seed)
    # 20 epochs all in one order: (n!)**-19, at most 6**-19 here (4 epochs of n = 3 repeat 1 time in 216)
    assert len({tuple(epoch_permutation(n, seed=seed, epoch=e).tolist()) for e in range(20)}) > 1
    orders = {tuple(epoch_permutation(n, seed=seed, epoch=e).tolist()) for e in range(4)}
    # two equal orders among 4 epochs: about 6 / n! for a uniform permutation; at n = 8 that is 1.5e-4 per
    # example, which 100 examples a run hit now and then; from n = 12 on (6 / 12! ~ 1e-8) a repeat is a bug
    if n >= 12:
        assert len(orders) == 4
        assert (
            epoch_permutation(n, seed=seed, epoch=0).tolist()
            != epoch_permutation(n, seed=seed + 1, epoch=0).tolist()
        )


def test_shuffle_false_keeps_dataset_order():
    assert padded_shards(10, 3, 5, shuffle=False) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 0]]
    assert padded_shards(10, 3, 5, shuffle=False, padding="wrap") == [
        [0, 3, 6, 9],
        [1, 4, 7, 0],
        [2, 5, 8, 1],
    ]


@settings(max_examples=200, deadline=None)
@given(n=sizes, w=world_sizes, seed=seeds, shuffle=st.booleans())
def test_exact_shards_cover_every_index_exactly_once(n, w, seed, shuffle):
    shards = [list(ExactShardSampler(n, w, r, shuffle=shuffle, seed=seed)) for r in range(w)]
    lengths = [len(s) for s in shards]
    assert lengths == [len(ExactShardSampler(n, w, r)) for r in range(w)]
    assert max(lengths) - min(lengths) <= 1
    assert Counter(i for s in shards for i in s) == Counter(range(n))
    if not shuffle:  # contiguous blocks in rank order: concatenation is the dataset order
        assert [i for s in shards for i in s] == list(range(n))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"padding": "zeros"}, r"`padding`='zeros'.*'first', 'wrap'"),
        ({"num_replicas": 0}, r"`num_replicas`=0.*>= 1"),
        ({"rank": 2}, r"`rank`=2.*num_replicas=2"),
        ({"rank": -1}, r"`rank`=-1"),
        ({"seed": -3}, r"`seed`=-3"),
        ({"dataset_or_length": -1}, r"`dataset_or_length`=-1"),
        ({"dataset_or_length": object()}, r"`dataset_or_length`"),
    ],
)
def test_bad_sampler_arguments_name_the_argument(kwargs, message):
    args = {"dataset_or_length": 10, "num_replicas": 2, "rank": 0} | kwargs
    with pytest.raises((ValueError, TypeError), match=message):
        PaddedShardSampler(**args)


def test_check_epoch_shards_names_epoch_and_ranks():
    check_epoch_shards(1, [[0, 2], [1, 3]], 4, expect_full_coverage=True)
    with pytest.raises(ShardingError, match=r"epoch 7, ranks 0 and 1 both read sample 2"):
        check_epoch_shards(7, [[0, 2], [2, 3]], 4, expect_full_coverage=False)
    with pytest.raises(ShardingError, match=r"epoch 2.*3 of 4 samples.*\[1\]"):
        check_epoch_shards(2, [[0, 2], [3]], 4, expect_full_coverage=True)
    check_epoch_shards(2, [[0, 2], [3]], 4, expect_full_coverage=False)


def _resumed_shards(n, w_before, w_after, samples_done, epoch, seed, padding="first", drop_last=False):
    """Each rank's indices before a checkpoint after ``samples_done`` per rank, and after resuming on
    ``w_after`` ranks from rank 0's state."""
    kwargs = dict(seed=seed, padding=padding, drop_last=drop_last)
    before = []
    for rank in range(w_before):
        sampler = PaddedShardSampler(n, w_before, rank, **kwargs)
        sampler.set_epoch(epoch)
        before.append(list(sampler)[:samples_done])
    state = PaddedShardSampler(n, w_before, 0, **kwargs)
    state.set_epoch(epoch)
    state = state.state_dict(samples_done)
    after = []
    for rank in range(w_after):
        sampler = PaddedShardSampler(n, w_after, rank, seed=seed + 1, padding=padding, drop_last=drop_last)
        sampler.load_state_dict(state, samples_counted=7)
        sampler.set_epoch(epoch)  # what Lightning does when the resumed epoch starts: keeps the resume
        after.append(sampler)
    return before, state, after


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=300),
    w_before=world_sizes,
    w_after=world_sizes,
    fraction=st.floats(min_value=0, max_value=1),
    seed=seeds,
    epoch=st.integers(min_value=0, max_value=5),
    padding=st.sampled_from(["first", "wrap"]),
)
def test_resume_on_any_world_size_reads_every_remaining_sample_once(
    n, w_before, w_after, fraction, seed, epoch, padding
):
    per_rank = math.ceil(n / w_before)
    samples_done = int(fraction * per_rank)
    before, state, after = _resumed_shards(n, w_before, w_after, samples_done, epoch, seed, padding)
    assert state["positions_consumed"] == min(samples_done * w_before, n)
    assert state["epoch"] == epoch and state["seed"] == seed and state["num_replicas"] == w_before
    remaining = n - state["positions_consumed"]
    shard = math.ceil(remaining / w_after)
    shards = [list(sampler) for sampler in after]
    assert all(len(s) == shard for s in shards)  # equal shards, padded only at the end
    assert all(len(sampler) == 7 + shard for sampler in after)  # counted before the resume + remaining
    real = [s[: sampler.num_real_samples] for s, sampler in zip(shards, after, strict=True)]
    consumed = [before[p % w_before][p // w_before] for p in range(state["positions_consumed"])]
    assert Counter(consumed + [i for s in real for i in s]) == Counter(range(n))  # each sample exactly once
    if padding == "first":
        assert all(i == 0 for s, sampler in zip(shards, after, strict=True) for i in s[sampler.num_real_samples :])
    # the resumed shards continue the epoch's global order
    order = epoch_permutation(n, seed=seed, epoch=epoch).tolist()
    for rank, s in enumerate(real):
        assert s == order[state["positions_consumed"] + rank :: w_after][: len(s)]
    for sampler in after:  # the next epoch is whole again
        sampler.set_epoch(epoch + 1)
        assert len(sampler) == math.ceil(n / w_after) and sampler.start_position == 0


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=1, max_value=200), w=world_sizes, seed=seeds, done=st.integers(0, 250))
def test_resume_on_the_same_world_size_reads_what_was_next(n, w, seed, done):
    per_rank = math.ceil(n / w)
    done = min(done, per_rank)
    for rank in range(w):
        full = PaddedShardSampler(n, w, rank, seed=seed, padding="wrap")
        full.set_epoch(3)
        state = full.state_dict(done)
        resumed = PaddedShardSampler(n, w, rank, seed=seed, padding="wrap")
        resumed.load_state_dict(state, samples_counted=done)
        expected = list(full)[done:] if done * w < n else []
        assert list(resumed) == expected
        assert len(resumed) == (len(full) if done * w < n else done)


def test_resume_state_after_a_resume_counts_from_the_resume():
    # 20 samples, 2 ranks, 3 per rank done (6 positions); resumed on 3 ranks with 5 samples counted; then 2 more
    # per rank: 6 + 2 * 3 = 12 positions consumed.
    first = PaddedShardSampler(20, 2, 0)
    resumed = PaddedShardSampler(20, 3, 1)
    resumed.load_state_dict(first.state_dict(3), samples_counted=5)
    assert resumed.state_dict(5 + 2)["positions_consumed"] == 12
    assert resumed.state_dict(5)["positions_consumed"] == 6
    assert resumed.state_dict(100)["positions_consumed"] == 20


def test_resume_state_from_another_dataset_is_refused():
    with pytest.raises(ValueError, match="positions_consumed`=30 is not valid for a dataset of 20 samples"):
        PaddedShardSampler(20, 2, 0).load_state_dict({"epoch": 0, "seed": 0, "positions_consumed": 30})


GOOD_STATE = {"epoch": 1, "seed": 3, "positions_consumed": 4, "num_replicas": 2}


@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        ("epoch 1", TypeError, r"`state`='epoch 1' is not valid: expected a dict with 'epoch', 'seed', 'positions_"),
        ({"epoch": 1, "seed": 3}, ValueError, r"`state` has no 'positions_consumed': expected a dict with 'epoch'"),
        (GOOD_STATE | {"positions_consumed": "abc"}, TypeError, r"`state\['positions_consumed'\]`='abc' is not valid"),
        (GOOD_STATE | {"seed": -1}, ValueError, r"`state\['seed'\]`=-1 is not valid: expected an integer >= 0"),
        (GOOD_STATE | {"epoch": 1.5}, TypeError, r"`state\['epoch'\]`=1.5 is not valid: expected an integer >= 0"),
        (GOOD_STATE | {"epoch": None}, TypeError, r"`state\['epoch'\]`=None is not valid"),
        (GOOD_STATE | {"num_replicas": 0}, ValueError, r"`state\[.num_replicas.\]`=0 is not valid: expected an int"),
    ],
)
def test_a_corrupt_sampler_state_is_refused_saying_what_is_wrong(state, error, message):
    with pytest.raises(error, match=message):
        PaddedShardSampler(20, 2, 0).load_state_dict(state)


KEY = r"`checkpoint\['shardplus_training_samplers'\]"


@pytest.mark.parametrize(
    ("entry", "error", "message"),
    [
        ([], TypeError, KEY + r"`=\[\] is not valid: expected a dict with"),
        ({"samplers": [GOOD_STATE]}, ValueError, KEY + r"` has no 'batches_done'"),
        ({"batches_done": -2, "samplers": [GOOD_STATE]}, ValueError, r"`=-2 is not valid: expected an integer >= 0"),
        (
            {"batches_done": 2, "samplers": []},
            ValueError,
            KEY + r"\['samplers'\]`=\[\] is not valid: expected a list of one state per training loader",
        ),
        ({"batches_done": 2, "samplers": "x"}, TypeError, KEY + r"\['samplers'\]`='x' is not valid: expected a list"),
        (
            {"batches_done": 2, "samplers": [GOOD_STATE | {"seed": "3"}]},
            TypeError,
            KEY + r"\['samplers'\]\[0\]\['seed'\]`='3' is not valid",
        ),
        ({"batches_done": 2, "samplers": [None, 5]}, TypeError, r"\[.samplers.\]\[1\]`=5 is not valid: expected a"),
    ],
)
def test_a_corrupt_checkpoint_entry_is_refused_saying_what_is_wrong(entry, error, message):
    with pytest.raises(error, match=message):
        check_checkpoint_entry(entry)


def test_a_valid_checkpoint_entry_passes():
    assert check_checkpoint_entry({"batches_done": 2, "samplers": [GOOD_STATE, None]}) is None


def _digests(samplers, world):
    """Each simulated rank's digest and their sum (what VerifySharding's one all-reduce computes)."""
    own = [shard_digest(sampler, rank, world) for rank, sampler in enumerate(samplers)]
    return own, [sum(values) for values in zip(*own, strict=True)]


def _read_epoch(n, world, stop=None, consumed=0, **kwargs):
    samplers = [PaddedShardSampler(n, world, rank, record_indices=True, **kwargs) for rank in range(world)]
    for sampler in samplers:
        sampler.set_epoch(3)
        if consumed:  # a resumed epoch: what another world size left of it
            sampler.load_state_dict({"epoch": 3, "seed": sampler.seed, "positions_consumed": consumed})
        taken = list(itertools.islice(iter(sampler), stop)) if stop is not None else list(sampler)
        assert taken
    return samplers


@pytest.mark.parametrize(
    ("n", "world", "kwargs", "stop"),
    [(10, 3, {}, None), (12, 4, {"drop_last": True}, None), (7, 2, {"shuffle": False}, None), (50, 4, {}, 5),
     (3, 8, {"padding": "wrap"}, None), (23, 3, {"consumed": 7}, None), (23, 3, {"consumed": 7, "drop_last": True}, 2)],
)
def test_the_digest_of_correct_shards_finds_nothing_and_has_a_fixed_size(n, world, kwargs, stop):
    samplers = _read_epoch(n, world, stop, **kwargs)
    own, total = _digests(samplers, world)
    assert {len(digest) for digest in own} == {DIGEST_WIDTH}
    assert all(digest_problem(total, digest, samplers[0], world) is None for digest in own)


def test_the_digest_catches_an_overlap_that_a_gap_compensates_in_the_plain_sum():
    samplers = _read_epoch(8, 2, shuffle=False)  # rank 0 reads 0, 2, 4, 6; rank 1 reads 1, 3, 5, 7
    samplers[0].yielded_indices = [0, 3, 3, 6]  # 3 twice, 2 and 4 never: the count and the sum are unchanged
    own, total = _digests(samplers, 2)
    assert total[0] == 8 and sum(samplers[0].yielded_indices) == 0 + 2 + 4 + 6
    assert "shards overlap" in digest_problem(total, own[0], samplers[0], 2)


def test_the_digest_catches_a_rank_reading_another_ranks_shard_and_a_seed_that_differs():
    samplers = _read_epoch(20, 4)
    samplers[3].yielded_indices = list(samplers[2].yielded_indices)
    own, total = _digests(samplers, 4)
    assert all("shards overlap" in digest_problem(total, digest, samplers[0], 4) for digest in own)

    samplers = _read_epoch(20, 4)
    samplers[1] = _read_epoch(20, 4, seed=9)[1]
    own, total = _digests(samplers, 4)
    assert all("disagree on the epoch's order" in digest_problem(total, digest, samplers[0], 4) for digest in own)


def test_the_digest_catches_a_finished_epoch_that_missed_samples():
    samplers = _read_epoch(9, 3)
    samplers[2].yielded_indices = samplers[2].yielded_indices[:2]  # rank 2 lost a sample yet finished
    own, total = _digests(samplers, 3)
    assert digest_problem(total, own[0], samplers[0], 3) == "ranks 0..2 together read 8 of the 9 samples of the epoch"
