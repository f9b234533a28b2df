"""What a fit prints: no false warning where shardplus makes it false, no warning printed more often than under
ddp, at most one start-up line on the batch sizes."""

import logging
import warnings
from pathlib import Path

import pytest
import torch
from _models import IndexedDataset, RecordingModule, cpu_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.multiprocessing import ProcessRaisedException  # what a forked rank raised, in this process
from torch.utils.data import DataLoader, IterableDataset

import lightning_shardplus  # noqa: F401
from lightning_shardplus import ShardPlusDataModule, ShardPlusStrategy

PROBE = "shardplus-test probe"


class WarnsEveryStep(RecordingModule):
    """Warns the same warning, from one line, at every training and validation step."""

    def training_step(self, batch, batch_idx):
        warnings.warn(PROBE, UserWarning, stacklevel=1)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        warnings.warn(PROBE, UserWarning, stacklevel=1)
        return super().validation_step(batch, batch_idx)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("exact_evaluation", [True, False])
def test_a_warning_is_shown_once_per_process_as_under_ddp(tmp_path, monkeypatch, exact_evaluation):
    # Python shows a "default" warning once per place, until the warning filters change: shardplus's filters for
    # Lightning's false warnings reset that, and Lightning's LeafSpec deprecation was printed twice as often
    shown = tmp_path / "shown.txt"

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if PROBE in str(message):
            with open(shown, "a") as out:
                out.write(f"{torch.distributed.get_rank()}\n")

    monkeypatch.setattr(warnings, "showwarning", showwarning)  # the forked ranks inherit it
    counts = {}
    for name, strategy in (
        ("ddp", DDPStrategy(start_method="fork")),
        ("shardplus", ShardPlusStrategy(start_method="fork", exact_evaluation=exact_evaluation)),
    ):
        shown.write_text("")
        with warnings.catch_warnings():
            warnings.filterwarnings("default", message=PROBE)
            trainer = cpu_trainer(strategy, 2, max_epochs=3)
            data = DataLoader(IndexedDataset(16), batch_size=2)
            trainer.fit(WarnsEveryStep(tmp_path / name), data, DataLoader(IndexedDataset(8), batch_size=2))
        counts[name] = sorted(shown.read_text().split())
    assert counts["shardplus"] == counts["ddp"] == ["0", "0", "1", "1"]  # once per place (two) and process


class Stream(IterableDataset):
    """8 samples on every rank, with no ``state_dict``: not resumable mid-epoch."""

    def __iter__(self):
        return iter(IndexedDataset(8))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_stream_without_state_dict_is_warned_about_only_where_a_checkpoint_can_be_saved(tmp_path, checkpointing):
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt")] if checkpointing else []
    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork"),
        2,
        max_epochs=1,
        enable_checkpointing=checkpointing,
        callbacks=callbacks,
    )
    with warnings.catch_warnings():  # the ranks (forked) inherit the filter: the warning stops the fit, named
        warnings.filterwarnings("error", message=".*stream's loader has no `state_dict`")
        if checkpointing:
            expected = "a checkpoint saved mid-epoch resumes at the start of the epoch"
            with pytest.raises(ProcessRaisedException, match=expected):
                trainer.fit(RecordingModule(tmp_path / "r"), DataLoader(Stream(), batch_size=2))
        else:
            trainer.fit(RecordingModule(tmp_path / "r"), DataLoader(Stream(), batch_size=2))


NOT_RESUMABLE = ".*ended before the epoch ended and your dataloader is not resumable"


@pytest.mark.timeout(240)
def test_a_mid_epoch_resume_that_shardplus_makes_exact_is_not_called_unreliable(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    strategy = ShardPlusStrategy(start_method="fork")
    trainer = cpu_trainer(strategy, 2, max_epochs=1, enable_checkpointing=True, callbacks=[checkpoints])
    trainer.fit(RecordingModule(tmp_path / "first"), DataLoader(IndexedDataset(40), batch_size=2))
    mid_epoch = str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")  # 10 steps per epoch: in its middle
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=NOT_RESUMABLE)
        trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 2, max_epochs=1)
        data = DataLoader(IndexedDataset(40), batch_size=2)
        trainer.fit(RecordingModule(tmp_path / "resumed"), data, ckpt_path=mid_epoch)
        # Lightning's warning where it is true: a loader shardplus does not shard (its own sampler)
        sampled = DataLoader(IndexedDataset(40), batch_size=2, sampler=list(range(40)))
        trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 2, max_epochs=1)
        with pytest.raises(ProcessRaisedException, match="not resumable"):
            trainer.fit(RecordingModule(tmp_path / "custom"), sampled, ckpt_path=mid_epoch)


# Lightning's rank-zero messages go to the logger of whichever namespace was imported last (both set
# lightning_utilities' rank-zero logger at import): listen to both.
RANK_ZERO_LOGGERS = ("lightning.pytorch", "pytorch_lightning")


class Messages(Callback):
    """Rank 0's messages logged through Lightning's logger (its rank-zero info) in a fit, written when it ends;
    :meth:`remove` takes the handler off the logger in the launching process."""

    def __init__(self, out: Path) -> None:
        self.out, self.messages = out, []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        for name in RANK_ZERO_LOGGERS:  # the forked ranks inherit the handler
            logging.getLogger(name).addHandler(self.handler)

    def on_train_start(self, trainer, pl_module):
        self.messages.append("<on_train_start: the progress bar starts>")

    def teardown(self, trainer, pl_module, stage):
        if trainer.is_global_zero:
            self.out.write_text("\n".join(self.messages))

    def remove(self):
        for name in RANK_ZERO_LOGGERS:
            logging.getLogger(name).removeHandler(self.handler)


class DigitsLike(ShardPlusDataModule):
    def build_train_dataset(self):
        return IndexedDataset(32)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("frequency", "expected"), [(1, None), (4, "effective batch 64 = 8 per device x 2 processes")])
def test_one_start_up_line_on_the_batch_sizes_and_none_where_it_says_nothing(tmp_path, capfd, frequency, expected):
    out = tmp_path / "messages.txt"
    strategy = ShardPlusStrategy(start_method="fork", aggregation_frequency=frequency)
    messages = Messages(out)
    try:
        trainer = cpu_trainer(strategy, 2, max_steps=2, callbacks=[messages])
        trainer.fit(RecordingModule(tmp_path / "r"), datamodule=DigitsLike(16))
    finally:
        messages.remove()
    messages = out.read_text().splitlines()
    lines = [m for m in messages if m.startswith("shardplus: effective batch")]  # not the features line
    assert "micro-batches" not in capfd.readouterr().out  # nothing printed beside Lightning's logging
    if expected is None:
        assert lines == []  # one micro-batch per step, a global batch split over the ranks: what was asked for
    else:
        assert len(lines) == 1 and lines[0].startswith(f"shardplus: {expected} x {frequency} micro-batches"), lines
        # logged before the progress bar starts its line (it was glued to the bar's "Training: 0/?")
        assert messages.index(lines[0]) < messages.index("<on_train_start: the progress bar starts>")
