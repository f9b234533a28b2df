"""Multi-process fits that record the indices every rank actually received."""

from collections import Counter

import pytest
from _models import IndexedDataset, RecordingModule, cpu_trainer, in_process_run, read_records
from torch.multiprocessing import ProcessRaisedException  # what a forked rank raised, in this process
from torch.utils.data import DataLoader, DistributedSampler

import lightning_shardplus  # noqa: F401
from lightning_shardplus import ShardPlusStrategy


def by(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(("n_train", "n_val"), [(23, 11), (12, 2)])
@pytest.mark.parametrize("padding", ["first", "wrap"])
def test_fit_gives_equal_padded_training_shards_and_exact_evaluation(
    tmp_path, world_size, n_train, n_val, padding
):
    epochs, batch = 2, 3
    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork", shard_padding=padding, verify_sharding=True),
        world_size,
        max_epochs=epochs,
    )
    trainer.fit(
        RecordingModule(tmp_path),
        DataLoader(IndexedDataset(n_train), batch_size=batch, shuffle=True),
        DataLoader(IndexedDataset(n_val), batch_size=batch),
    )
    rows = read_records(tmp_path)
    per_rank = -(-n_train // world_size)
    orders = []
    for epoch in range(epochs):
        train = [by(rows, stage="train", epoch=epoch, rank=r) for r in range(world_size)]
        # equal batch counts and equal sample counts on every rank
        assert len({len(batches) for batches in train}) == 1
        assert [sum(len(b["indices"]) for b in batches) for batches in train] == [per_rank] * world_size
        seen = Counter(i for batches in train for b in batches for i in b["indices"])
        pads = per_rank * world_size - n_train
        assert set(seen) == set(range(n_train))  # coverage
        if padding == "first":
            assert seen == Counter(range(n_train)) + Counter({0: pads})
        else:
            assert sum(seen.values()) == n_train + pads and max(seen.values()) <= 2
        # the global order: interleave the ranks' shards position by position
        shards = [[i for b in batches for i in b["indices"]] for batches in train]
        orders.append([shards[p % world_size][p // world_size] for p in range(n_train)])
        val = Counter(i for r in by(rows, stage="val", epoch=epoch) for i in r["indices"])
        assert val == Counter(range(n_val))  # every validation sample exactly once
    assert orders[0] != orders[1]  # reshuffled every epoch


@pytest.mark.timeout(120)
@pytest.mark.compat
def test_training_order_follows_the_seed_and_is_shared_by_all_ranks(tmp_path):
    def train_order(seed, directory):
        trainer = cpu_trainer(ShardPlusStrategy(start_method="fork", shuffle_seed=seed), 2, max_epochs=1)
        trainer.fit(RecordingModule(directory), DataLoader(IndexedDataset(10), batch_size=5, shuffle=True))
        rows = read_records(directory)
        return [by(rows, stage="train", rank=r)[0]["indices"] for r in range(2)]

    first, again, other = (train_order(s, tmp_path / d) for s, d in [(5, "a"), (5, "b"), (6, "c")])
    assert first == again
    assert first != other
    assert sorted(first[0] + first[1]) == list(range(10))  # same permutation on both ranks: disjoint


@pytest.mark.timeout(120)
def test_user_distributed_sampler_and_use_distributed_sampler_false_are_left_alone(tmp_path):
    dataset = IndexedDataset(9)
    user_sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)
    loader = DataLoader(dataset, batch_size=5, sampler=user_sampler)
    with in_process_run(), pytest.warns(UserWarning, match="already has a DistributedSampler; it is left alone"):
        cpu_trainer(ShardPlusStrategy(), 1, max_epochs=1).fit(RecordingModule(tmp_path / "w"), loader)
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 2, max_epochs=1)
    trainer.fit(RecordingModule(tmp_path / "a"), loader)
    rows = read_records(tmp_path / "a")
    # both ranks read rank 0's shard of the user's sampler
    assert [r["indices"] for r in by(rows, stage="train", rank=1)] == [[0, 2, 4, 6, 8]]

    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork"), 2, max_epochs=1, use_distributed_sampler=False
    )
    trainer.fit(RecordingModule(tmp_path / "b"), DataLoader(dataset, batch_size=9))
    rows = read_records(tmp_path / "b")
    assert [r["indices"] for r in by(rows, stage="train")] == [list(range(9))] * 2


@pytest.mark.timeout(60)
def test_empty_training_set_is_a_clear_error(tmp_path):
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 2, max_epochs=1)
    with pytest.raises(ProcessRaisedException, match=r"training dataset is empty"):
        trainer.fit(RecordingModule(tmp_path), DataLoader(IndexedDataset(0), batch_size=2))


@pytest.mark.timeout(120)
def test_a_datamodule_with_shuffle_false_trains_in_dataset_order_on_every_rank(tmp_path):
    # Lightning marks every training loader as shuffled when it injects its sampler; the datamodule's choice holds
    from lightning_shardplus import ShardPlusDataModule

    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 2, max_epochs=2)
    datamodule = ShardPlusDataModule(4, train_dataset=IndexedDataset(10), shuffle=False)
    trainer.fit(RecordingModule(tmp_path), datamodule=datamodule)
    rows = read_records(tmp_path)
    for epoch in range(2):
        shards = [[i for b in by(rows, stage="train", epoch=epoch, rank=r) for i in b["indices"]] for r in range(2)]
        assert shards == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("n_train", "world_size", "warned"),
    [(2, 3, True), (6, 4, True), (22, 3, False), (7, 2, False)],
    ids=["2-on-3", "6-on-4", "22-on-3", "7-on-2"],
)
def test_padding_a_large_share_of_the_epoch_is_a_warning(tmp_path, n_train, world_size, warned):
    # 2 on 3: 1 of the 3 samples read per epoch is padding (33%); 6 on 4: 2 of 8 (25%); 22 on 3: 2 of 24; 7 on 2: 1 of 8
    import warnings

    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), world_size, max_epochs=1)
    with warnings.catch_warnings():  # the ranks (forked) inherit the filter: the warning fails the fit
        warnings.filterwarnings("error", message="shardplus: padding")
        run = lambda: trainer.fit(RecordingModule(tmp_path), DataLoader(IndexedDataset(n_train), batch_size=1))  # noqa: E731
        if warned:
            padding = -(-n_train // world_size) * world_size - n_train
            message = rf"shardplus: padding makes up {padding} of the {n_train + padding} training samples"
            with pytest.raises(ProcessRaisedException, match=message):
                run()
        else:
            run()
