"""verify_sharding: a violation raises naming the ranks and a sample; a fit whose checks all passed says so in one
line on rank 0."""

import json
import logging

import pytest
from _models import IndexedDataset, RecordingModule, cpu_trainer
from lightning.pytorch.callbacks import Callback
from torch.multiprocessing import ProcessRaisedException  # what a forked rank raised, in this process
from torch.utils.data import DataLoader, IterableDataset

from lightning_shardplus import ShardPlusStrategy

VERIFY_LINE = "shardplus: verify_sharding "


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
    with pytest.raises(ProcessRaisedException, match="verify_sharding: in epoch 0, ranks 0 and 1 both read sample"):
        trainer.fit(RecordingModule(tmp_path), DataLoader(IndexedDataset(10), batch_size=5, shuffle=True))


class _VerifyLines(Callback):
    """Writes, per rank, the verify_sharding lines Lightning's logger printed during the fit (fork workers cannot
    hand objects back); written at teardown, after every callback's ``on_train_end``."""

    def __init__(self, out):
        self.out = out
        self.lines = []

    def setup(self, trainer, pl_module, stage):
        handler = logging.Handler()
        handler.emit = lambda record: self.lines.append(record.getMessage())
        for name in ("lightning.pytorch", "pytorch_lightning"):  # rank_zero_info logs under the last one imported
            logging.getLogger(name).addHandler(handler)

    def teardown(self, trainer, pl_module, stage):
        lines = [line for line in self.lines if line.startswith(VERIFY_LINE)]
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(lines))


class _Stream(IterableDataset):
    """Six samples per rank, not sharded by any sampler of ours."""

    def __iter__(self):
        return (IndexedDataset(6)[i] for i in range(6))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("loader", "trainer_kwargs", "line"),
    [
        (
            DataLoader(IndexedDataset(10), batch_size=2, shuffle=True),
            {"max_epochs": 2},
            "checked 2 epochs: shards disjoint and complete",
        ),
        (
            DataLoader(IndexedDataset(20), batch_size=2, shuffle=True),
            {"max_steps": 3},  # 5 steps an epoch: the first ends early
            "checked 1 epoch: shards disjoint; complete in 0 (the others ended early: their coverage is not checked)",
        ),
        (
            DataLoader(_Stream(), batch_size=2),
            {"max_epochs": 1},
            "checked no epoch: no training epoch that read through a PaddedShardSampler ended",
        ),
    ],
    ids=["complete", "cut-short", "stream"],
)
def test_a_fit_whose_checks_passed_says_so_once_on_rank_zero(tmp_path, loader, trainer_kwargs, line):
    out = tmp_path / "lines"
    out.mkdir()
    strategy = ShardPlusStrategy(start_method="fork", verify_sharding=True)
    trainer = cpu_trainer(strategy, 2, callbacks=[_VerifyLines(out)], **trainer_kwargs)
    trainer.fit(RecordingModule(tmp_path / "records"), loader)
    printed = {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    assert printed == {0: [VERIFY_LINE + line], 1: []}


@pytest.mark.timeout(120)
def test_without_verify_sharding_nothing_is_said(tmp_path):
    out = tmp_path / "lines"
    out.mkdir()
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 2, callbacks=[_VerifyLines(out)], max_epochs=1)
    trainer.fit(RecordingModule(tmp_path / "records"), DataLoader(IndexedDataset(10), batch_size=2))
    assert json.loads((out / "rank0.json").read_text()) == []
