"""The private Lightning names that `lightning_shardplus._lightning` and the strategy rely on. If Lightning
moves one of them, this file fails first and says which."""

import inspect

from lightning.pytorch.overrides.distributed import (
    UnrepeatedDistributedSamplerWrapper,
    _IndexBatchSamplerWrapper,
)
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from lightning_shardplus import ExactShardSampler, ShardPlusStrategy, _lightning


def test_lightning_passes_the_strategy_seed_to_the_sampler_it_injects():
    kwargs = ShardPlusStrategy(shuffle_seed=7).distributed_sampler_kwargs | {"num_replicas": 2, "rank": 0}
    loader = DataLoader(range(10), batch_size=2)
    sampler = _get_distributed_sampler(loader, shuffle=True, overfit_batches=0, **kwargs)
    assert type(sampler) is DistributedSampler and _lightning.is_injected(sampler) and sampler.seed == 7
    predict = _get_distributed_sampler(
        loader, shuffle=False, overfit_batches=0, mode=RunningStage.PREDICTING, **kwargs
    )
    assert isinstance(predict, UnrepeatedDistributedSamplerWrapper) and _lightning.is_injected(predict)
    assert _lightning.injected_over_dataset_order(predict)  # reads `_DatasetSamplerWrapper._sampler`


def test_prediction_loader_swap_reaches_the_wrapped_batch_sampler():
    loader = DataLoader(range(10), batch_size=3)
    wrapped = _lightning.replace_sampler(loader, SequentialSampler(range(10)), RunningStage.PREDICTING)
    assert isinstance(wrapped.batch_sampler, _IndexBatchSamplerWrapper)
    assert isinstance(wrapped.batch_sampler._batch_sampler, BatchSampler)
    exact = ExactShardSampler(10, 3, 1)
    swapped = _lightning.replace_sampler(wrapped, exact, RunningStage.PREDICTING)
    assert [b.tolist() for b in swapped] == [[4, 5, 6]]
    assert swapped.batch_sampler.seen_batch_indices == [[4, 5, 6]]


def test_training_loader_rebuild_keeps_the_loader_arguments():
    def collate(batch):
        return batch

    loader = DataLoader(range(10), batch_size=3, collate_fn=collate, drop_last=True)
    rebuilt = _lightning.replace_sampler(loader, ExactShardSampler(10, 2, 0), RunningStage.TRAINING)
    assert rebuilt.batch_size == 3 and rebuilt.collate_fn is collate and rebuilt.drop_last
    assert list(rebuilt) == [[0, 1, 2]]


def test_the_launcher_hook_the_strategy_overrides_exists():
    assert "_configure_launcher" in vars(DDPStrategy)
    assert inspect.signature(DDPStrategy._configure_launcher).parameters.keys() == {"self"}


def test_accumulation_window_counter_and_loss_normalization_are_where_the_strategy_reads_them():
    # ShardPlusStrategy sizes the accumulation window from `batch_progress.current.ready` (as Lightning's loop
    # does) and corrects Lightning's division of every micro-batch loss by accumulate_grad_batches.
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loops.optimization.automatic import ClosureResult
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert _lightning.micro_batches_done_in_epoch(trainer) == 0
    source = inspect.getsource(_TrainingEpochLoop._accumulated_batches_reached)
    assert "batch_progress.current.ready % self.trainer.accumulate_grad_batches" in source
    assert ClosureResult.from_training_step_output(torch.tensor(6.0), 3).closure_loss.item() == 2.0


def test_the_ddp_hook_registration_the_strategy_overrides_exists():
    assert "_register_ddp_hooks" in vars(DDPStrategy)
    assert "self._register_ddp_hooks()" in inspect.getsource(DDPStrategy.configure_ddp)
