"""verify_sharding: a violation raises naming the ranks and a sample."""

import pytest
from _models import IndexedDataset, RecordingModule, cpu_trainer
from torch.utils.data import DataLoader

from lightning_shardplus import ShardPlusStrategy


@pytest.mark.timeout(120)
def test_verify_sharding_raises_when_shards_overlap(tmp_path):
    # A loader the user sharded wrongly (both ranks told they are rank 0) is left alone; verification is about
    # our samplers, so make ours overlap instead by giving every rank the same rank number.
    class Broken(ShardPlusStrategy):
        @property
        def global_rank(self):
            return (
                0
                if self.lightning_module is not None and self.lightning_module.trainer.training
                else super().global_rank
            )

    trainer = cpu_trainer(Broken(start_method="fork", verify_sharding=True), 2, max_epochs=1)
    with pytest.raises(Exception, match="verify_sharding: in epoch 0, ranks 0 and 1 both read sample"):
        trainer.fit(RecordingModule(tmp_path), DataLoader(IndexedDataset(10), batch_size=5, shuffle=True))
