"""At 8 processes (fork, tiny models): equal training shards, exact evaluation with several empty ranks,
predictions in order, and verify_sharding catching an overlap. Nothing here depends on the world size being 2."""

import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from _models import IndexedDataset, RecordingModule, cpu_trainer, read_records
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.multiprocessing import ProcessRaisedException  # what a forked rank raised, in this process
from torch.utils.data import DataLoader

from lightning_shardplus import ShardPlusStrategy

WORLD = 8


@pytest.mark.timeout(240)
def test_eight_ranks_train_on_equal_shards_and_evaluate_every_sample_once_with_empty_ranks(tmp_path):
    n_train, n_val = 21, 5  # 3 training samples per rank (3 of them padding); ranks 5, 6 and 7 evaluate nothing
    model = RecordingModule(tmp_path)
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork", verify_sharding=True), WORLD, max_epochs=2)
    trainer.fit(model, DataLoader(IndexedDataset(n_train), batch_size=2), DataLoader(IndexedDataset(n_val)))
    rows = read_records(tmp_path)
    for epoch in range(2):
        train = [[i for r in rows if r["stage"] == "train" and r["epoch"] == epoch and r["rank"] == rank
                  for i in r["indices"]] for rank in range(WORLD)]
        assert [len(shard) for shard in train] == [3] * WORLD
        assert Counter(i for shard in train for i in shard) == Counter(range(n_train)) + Counter({0: 3})
        val = [i for r in rows if r["stage"] == "val" and r["epoch"] == epoch for i in r["indices"]]
        assert sorted(val) == list(range(n_val))
    # the epoch metric is the one of a single process over the 5 samples, with the final weights
    data = IndexedDataset(n_val)
    with torch.no_grad():
        expected = F.cross_entropy(model(data.inputs), data.labels)
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("count", [13, 3])
def test_eight_ranks_predict_every_sample_once_in_dataset_order(tmp_path, count):
    # fork hands no predictions back to the calling process: each rank writes its own, as a prediction writer does
    class WritePredictions(BasePredictionWriter):
        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            flat = [int(i) for batch in predictions for i in batch]
            indices = [i for batch in batch_indices[0] for i in batch]
            (tmp_path / f"rank{trainer.global_rank}.json").write_text(json.dumps([flat, indices]))

    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), WORLD, callbacks=[WritePredictions("epoch")])
    trainer.predict(RecordingModule(tmp_path / "records"), DataLoader(IndexedDataset(count), batch_size=2))
    written = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    assert [i for flat, _ in written for i in flat] == list(range(count))  # rank order is dataset order
    assert all(flat == indices for flat, indices in written)  # the writer's batch indices name the samples


@pytest.mark.timeout(240)
def test_verify_sharding_catches_an_overlapping_shard_at_eight_ranks(tmp_path):
    class RankFiveReadsRankFoursShard(ShardPlusStrategy):
        @property
        def global_rank(self):
            rank = super().global_rank
            training = self.lightning_module is not None and self.lightning_module.trainer.training
            return 4 if training and rank == 5 else rank

    trainer = cpu_trainer(RankFiveReadsRankFoursShard(start_method="fork", verify_sharding=True), WORLD, max_epochs=1)
    with pytest.raises(ProcessRaisedException, match="verify_sharding: in epoch 0, ranks 4 and 5 both read sample"):
        trainer.fit(RecordingModule(tmp_path), DataLoader(IndexedDataset(40), batch_size=5))
