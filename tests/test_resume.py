"""Mid-epoch resume: a run restarted from a checkpoint continues with exactly the samples that were next (same
world size: same indices and bitwise the same weights as an uninterrupted run), or reshards the rest of the epoch
over another world size so that every sample of the epoch is read exactly once, apart from the final padding."""

import warnings
from collections import Counter

import pytest
import torch
from _models import IndexedDataset, RecordingModule, cpu_trainer, read_records
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.multiprocessing import ProcessRaisedException  # what a forked rank raised, in this process
from torch.utils.data import DataLoader

import lightning_shardplus  # noqa: F401
from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus.data.sharding import CHECKPOINT_KEY

N, BATCH, EPOCHS = 22, 2, 2  # on 2 ranks: 11 samples, 6 batches per rank and epoch (the last one of 1 sample)

# Lightning 2.4 resumes its batch count one micro-batch behind a checkpoint saved in `on_train_batch_end`; the
# window's gradients are then not restored, with a warning (aggregation.py; docs/compatibility.md)
NEEDS_WINDOW_RESUME = pytest.mark.skipif(
    not _lightning.RESUMES_INSIDE_A_WINDOW, reason="Lightning < 2.5 cannot resume inside an aggregation window"
)


def fit(
    directory, world_size, ckpt_path=None, every_n_train_steps=None, batch=BATCH, callbacks=(), strategy=None,
    **strategy_kwargs,
):
    """A 2-epoch fit on ``world_size`` ranks recording every rank's batches in ``directory`` (under shardplus, or
    ``strategy``); returns the final weights (rank 0's, which the fork launcher hands back to this process)."""
    torch.manual_seed(0)
    model = RecordingModule(directory)
    callbacks = list(callbacks)
    if every_n_train_steps:
        callbacks.append(
            ModelCheckpoint(
                dirpath=directory / "checkpoints",
                every_n_train_steps=every_n_train_steps,
                save_top_k=-1,
                filename="{step}",
            )
        )
    trainer = cpu_trainer(
        strategy or ShardPlusStrategy(start_method="fork", shuffle_seed=3, **strategy_kwargs),
        world_size,
        max_epochs=EPOCHS,
        deterministic=True,
        callbacks=callbacks,
        enable_checkpointing=bool(every_n_train_steps),
    )
    trainer.fit(model, DataLoader(IndexedDataset(N), batch_size=batch, shuffle=True), ckpt_path=ckpt_path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def batches(rows, rank, epoch):
    return [r["indices"] for r in rows if r["stage"] == "train" and r["rank"] == rank and r["epoch"] == epoch]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "strategy_kwargs",
    [
        {},
        pytest.param({"aggregation_frequency": 2}, marks=NEEDS_WINDOW_RESUME),
        {"gradient_compression": "powersgd"},
    ],
    ids=["plain", "aggregation", "powersgd"],
)
@pytest.mark.compat
def test_resume_on_the_same_world_size_continues_with_the_next_samples_and_the_same_weights(tmp_path, strategy_kwargs):
    if strategy_kwargs.get("gradient_compression") == "powersgd":
        # PowerSGD from the 2nd step, so that the checkpoints hold error feedback and warm-start state
        strategy_kwargs = strategy_kwargs | {
            "ddp_comm_state": PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        }
    steps_per_epoch = 6 // strategy_kwargs.get("aggregation_frequency", 1)
    reference = fit(tmp_path / "reference", 2, every_n_train_steps=1, **strategy_kwargs)
    expected = read_records(tmp_path / "reference")
    micro = strategy_kwargs.get("aggregation_frequency", 1)
    # inside epoch 0, at the end of epoch 0 (its last batch), inside epoch 1
    for step in (2, steps_per_epoch, steps_per_epoch + 2):
        checkpoint = tmp_path / "reference" / "checkpoints" / f"step={step}.ckpt"
        entry = torch.load(checkpoint, weights_only=False)[CHECKPOINT_KEY]
        assert entry["batches_done"] == (step - 1) % steps_per_epoch * micro + micro
        resumed_dir = tmp_path / f"resumed{step}"
        weights = fit(resumed_dir, 2, ckpt_path=checkpoint, **strategy_kwargs)
        resumed = read_records(resumed_dir)
        done_epochs, done_batches = divmod(step * micro, 6)
        for rank in range(2):
            assert batches(resumed, rank, done_epochs) == batches(expected, rank, done_epochs)[done_batches:]
            for epoch in range(done_epochs + 1, EPOCHS):
                assert batches(resumed, rank, epoch) == batches(expected, rank, epoch)
        assert all(r["epoch"] >= done_epochs for r in resumed if r["stage"] == "train")
        for key, value in reference.items():
            assert torch.equal(weights[key], value), (step, key)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("step", [4, 6], ids=["inside-epoch", "last-batch-of-epoch"])
def test_resume_on_another_world_size_reads_the_rest_of_the_epoch_once(tmp_path, world_size, step):
    fit(tmp_path / "first", 2, every_n_train_steps=step)
    first = read_records(tmp_path / "first")
    fit(tmp_path / "resumed", world_size, ckpt_path=tmp_path / "first" / "checkpoints" / f"step={step}.ckpt")
    resumed = read_records(tmp_path / "resumed")
    before = [i for r in range(2) for b in batches(first, r, 0)[:step] for i in b]
    remaining = N - len(before)
    per_rank = -(-remaining // world_size)
    shards = [[i for b in batches(resumed, r, 0) for i in b] for r in range(world_size)]
    assert [len(s) for s in shards] == [per_rank] * world_size  # equal shards, padded at the end
    assert len({len(batches(resumed, r, 0)) for r in range(world_size)}) == 1
    padding = per_rank * world_size - remaining
    assert Counter(before + [i for s in shards for i in s]) == Counter(range(N)) + Counter({0: padding})
    # the next epoch is a whole one on the new world size: the batch count Lightning uses follows it
    full = -(-N // world_size)
    shards = [[i for b in batches(resumed, r, 1) for i in b] for r in range(world_size)]
    assert [len(s) for s in shards] == [full] * world_size
    assert Counter(i for s in shards for i in s) == Counter(range(N)) + Counter({0: full * world_size - N})


@pytest.mark.timeout(120)
def test_resume_with_another_batch_size_reads_the_rest_of_the_epoch_once(tmp_path):
    fit(tmp_path / "first", 2, every_n_train_steps=3)
    first = read_records(tmp_path / "first")
    fit(tmp_path / "resumed", 2, ckpt_path=tmp_path / "first" / "checkpoints" / "step=3.ckpt", batch=4)
    resumed = read_records(tmp_path / "resumed")
    before = [i for r in range(2) for b in batches(first, r, 0)[:3] for i in b]
    after = [i for r in range(2) for b in batches(resumed, r, 0) for i in b]
    assert [len(batches(resumed, r, 0)) for r in range(2)] == [2, 2]  # 5 samples left per rank: 4 + 1
    assert Counter(before + after) == Counter(range(N))


@pytest.mark.timeout(120)
@NEEDS_WINDOW_RESUME
def test_after_a_resume_with_aggregation_every_n_steps_checkpointing_does_not_save_mid_window(tmp_path):
    # ModelCheckpoint does not restore the step it saved last: resumed at step 3 with 2 micro-batches per step, it
    # would save again after the first micro-batch (global_step still 3), inside the window, over `last.ckpt`
    log = tmp_path / "saves.txt"

    class RecordSaves(ModelCheckpoint):
        def _save_checkpoint(self, trainer, filepath):  # in the workers: appended to a file
            with open(log, "a") as f:
                f.write(f"{trainer.global_step} {trainer.fit_loop.epoch_loop.batch_progress.current.completed}\n")
            super()._save_checkpoint(trainer, filepath)

    def run(max_steps, ckpt_path=None):
        callback = RecordSaves(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_last=True, save_top_k=-1)
        trainer = cpu_trainer(
            ShardPlusStrategy(start_method="fork", aggregation_frequency=2),
            2,
            max_steps=max_steps,
            callbacks=[callback],
            enable_checkpointing=True,
        )
        trainer.fit(RecordingModule(tmp_path), DataLoader(IndexedDataset(80), batch_size=2), ckpt_path=ckpt_path)

    run(3)
    run(6, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 6 and saved[CHECKPOINT_KEY]["batches_done"] == 12
    saves = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    # every save (on each rank) at an optimizer step: after an even number of micro-batches of the epoch (the
    # loop's `completed` does not count the micro-batch being ended yet)
    assert {step for step, _ in saves} == {3, 6} and all((completed + 1) % 2 == 0 for _, completed in saves), saves


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"samplers": []}, r"\['samplers'\]`=\[\] is not valid: expected a list of one state per training loader"),
        ({"batches_done": "4"}, r"`checkpoint\['shardplus_training_samplers'\]\['batches_done'\]`='4' is not valid"),
    ],
    ids=["no-sampler-state", "text"],
)
def test_a_hand_edited_sampler_state_is_refused_on_resume_saying_what_is_wrong(tmp_path, edit, message):
    fit(tmp_path / "first", 2, every_n_train_steps=4)
    checkpoint = torch.load(tmp_path / "first" / "checkpoints" / "step=4.ckpt", weights_only=False)
    checkpoint[CHECKPOINT_KEY] |= edit
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    # raised on every rank, at setup: no rank waits for another
    with pytest.raises(ProcessRaisedException, match=message):
        fit(tmp_path / "resumed", 2, ckpt_path=tmp_path / "edited.ckpt")


def edited_checkpoint(tmp_path, step, **sampler_edit):
    """The checkpoint of a 2-rank fit at ``step`` with ``sampler_edit`` written into its sampler state."""
    fit(tmp_path / "first", 2, every_n_train_steps=step)
    checkpoint = torch.load(tmp_path / "first" / "checkpoints" / f"step={step}.ckpt", weights_only=False)
    checkpoint[CHECKPOINT_KEY]["samplers"][0] |= sampler_edit
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    return tmp_path / "edited.ckpt"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("step", "epoch"), [(4, 1), (8, 0)], ids=["ahead-of-the-loop", "behind-the-loop"])
def test_a_sampler_state_of_another_epoch_than_the_fit_loop_is_refused_on_resume_naming_both(tmp_path, step, epoch):
    # step 4: 16 of 22 samples read in epoch 0; step 8: 8 read in epoch 1. Resumed, the sampler would start the
    # loop's epoch over while the loop skips the batches it counts as done: samples trained twice, others skipped
    edited = edited_checkpoint(tmp_path, step, epoch=epoch)
    consumed = {4: 16, 8: 8}[step]
    message = (
        rf"the checkpoint's training sampler is in epoch {epoch} \({consumed} of 22 samples read\), but the fit "
        rf"loop resumes epoch {1 - epoch}: resumed, the epoch's first samples would be trained twice"
    )
    with pytest.raises(ProcessRaisedException, match=message):  # raised on every rank, before the first batch
        fit(tmp_path / "resumed", 2, ckpt_path=edited)
    assert not [r for r in read_records(tmp_path / "resumed") if r["stage"] == "train"]  # no batch trained


@pytest.mark.timeout(120)
def test_a_mid_epoch_checkpoint_of_plain_ddp_is_refused_before_the_first_step_saying_what_is_missing(tmp_path):
    # Lightning's DistributedSampler order is not in the checkpoint: shardplus's sampler would start epoch 0 over
    # while the loop counts 3 of its 6 batches as done (3 batches trained twice, 3 never)
    fit(tmp_path / "ddp", 2, every_n_train_steps=3, strategy=DDPStrategy(start_method="fork"))
    message = (
        r"the checkpoint has no position of shardplus's training sampler \(no 'shardplus_training_samplers' entry: "
        r"another strategy wrote it.*the fit loop resumes epoch 0 after 3 of its batches.*To go on, resume from a "
        r"checkpoint saved at the end of an epoch"
    )
    with pytest.raises(ProcessRaisedException, match=message):  # raised on every rank, before the first step
        fit(tmp_path / "resumed", 2, ckpt_path=tmp_path / "ddp" / "checkpoints" / "step=3.ckpt")
    assert not [r for r in read_records(tmp_path / "resumed") if r["stage"] == "train"]  # no batch trained


@pytest.mark.timeout(180)
def test_an_epoch_end_checkpoint_of_plain_ddp_resumes_with_every_sample_once_and_no_warning(tmp_path, monkeypatch):
    # at the epoch's last batch (`on_train_batch_end`, step 6) and at the epoch's end (`on_train_epoch_end`)
    epoch_end = ModelCheckpoint(dirpath=tmp_path / "ddp" / "checkpoints", filename="end-{epoch}", save_top_k=-1,
                                save_on_train_epoch_end=True)  # fmt: skip
    fit(tmp_path / "ddp", 2, every_n_train_steps=6, strategy=DDPStrategy(start_method="fork"), callbacks=[epoch_end])
    shown = tmp_path / "shown.txt"

    def showwarning(message, *args, **kwargs):  # the forked ranks inherit it
        with open(shown, "a") as out:
            out.write(f"{message}\n")

    monkeypatch.setattr(warnings, "showwarning", showwarning)
    for name in ("step=6", "end-epoch=0"):
        shown.write_text("")
        fit(tmp_path / name, 2, ckpt_path=tmp_path / "ddp" / "checkpoints" / f"{name}.ckpt")
        trained = read_records(tmp_path / name)
        assert {r["epoch"] for r in trained if r["stage"] == "train"} == {1}, name
        assert Counter(i for r in range(2) for b in batches(trained, r, 1) for i in b) == Counter(range(N)), name
        assert "shardplus" not in shown.read_text() and "not resumable" not in shown.read_text(), name


@pytest.mark.timeout(120)
def test_a_checkpoint_of_another_global_batch_resumes_with_a_warning_naming_both(tmp_path, monkeypatch):
    fit(tmp_path / "first", 2, every_n_train_steps=3)
    checkpoint = tmp_path / "first" / "checkpoints" / "step=3.ckpt"
    assert torch.load(checkpoint, weights_only=False)[CHECKPOINT_KEY]["samplers"][0]["global_batch_size"] == 4
    shown = tmp_path / "shown.txt"
    shown.write_text("")

    def showwarning(message, *args, **kwargs):  # the forked ranks inherit it
        with open(shown, "a") as out:
            out.write(f"{message}\n")

    monkeypatch.setattr(warnings, "showwarning", showwarning)
    fit(tmp_path / "resumed", 3, ckpt_path=checkpoint)
    message = "written with a global batch of 4 samples (2 processes), this run's is 6 (3 processes): the rest"
    assert shown.read_text().count(message) == 1  # rank 0's
    shown.write_text("")
    fit(tmp_path / "same-batch", 1, ckpt_path=checkpoint, batch=4)  # another world size, the same global batch
    assert "global batch" not in shown.read_text()
    fit(tmp_path / "one-process", 1, ckpt_path=checkpoint)  # one process, 2 samples a batch
    assert "global batch of 4 samples (2 processes), this run's is 2 (1 process): the rest" in shown.read_text()


class SaveAt(Callback):
    """``trainer.save_checkpoint`` after the given (epoch, batch_idx) training micro-batches, on every rank."""

    def __init__(self, directory, points):
        self.directory, self.points = directory, points

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) in self.points:
            trainer.save_checkpoint(self.directory / f"e{trainer.current_epoch}b{batch_idx}.ckpt")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("compression", ["none", "powersgd"])
@pytest.mark.compat
@NEEDS_WINDOW_RESUME
def test_a_checkpoint_saved_inside_an_aggregation_window_resumes_exactly(tmp_path, compression):
    # 6 micro-batches per rank and epoch, windows of 4 then 2: saved after micro-batch 2 of the first window,
    # after the first of the short last window, and after micro-batch 3 of epoch 1's first window
    points = [(0, 1), (0, 4), (1, 2)]
    kwargs = {"aggregation_frequency": 4, "gradient_compression": compression}
    reference = fit(tmp_path / "reference", 2, callbacks=[SaveAt(tmp_path / "checkpoints", points)], **kwargs)
    expected = read_records(tmp_path / "reference")
    for epoch, batch_idx in points:
        checkpoint = tmp_path / "checkpoints" / f"e{epoch}b{batch_idx}.ckpt"
        resumed_dir = tmp_path / f"resumed-e{epoch}b{batch_idx}"
        weights = fit(resumed_dir, 2, ckpt_path=checkpoint, **kwargs)
        resumed = read_records(resumed_dir)
        for rank in range(2):
            assert batches(resumed, rank, epoch) == batches(expected, rank, epoch)[batch_idx + 1 :]
        for key, value in reference.items():
            assert torch.equal(weights[key], value), (epoch, batch_idx, key)
    if compression == "none":  # on another world size: the checkpoint's ranks' mean gradient on every rank
        weights = fit(tmp_path / "resumed-3", 3, ckpt_path=tmp_path / "checkpoints" / "e0b1.ckpt", **kwargs)
        assert all(torch.isfinite(value).all() for value in weights.values())
