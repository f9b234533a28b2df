"""The private Lightning names that `lightning_shardplus._compat.lightning` and the strategy rely on. If Lightning
moves one of them, this file fails first and says which."""

import inspect
import re

from lightning.pytorch.overrides.distributed import (
    UnrepeatedDistributedSamplerWrapper,
    _IndexBatchSamplerWrapper,
)
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from lightning_shardplus import ExactShardSampler, ShardPlusStrategy
from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus._compat import results as _results
from lightning_shardplus._compat import torch as _torch
from lightning_shardplus._compat import warnings as false_warnings


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


def test_a_prediction_sampler_injected_over_one_replica_is_resharded_as_lightning_shards_it():
    # for prediction with exact shards the strategy has Lightning inject over one replica (its prediction sampler
    # asserts that every rank has a sample); a user's sampler is then sharded as Lightning would have
    loader = DataLoader(range(6), batch_size=2, sampler=list(range(5, -1, -1)))
    kwargs = ShardPlusStrategy().distributed_sampler_kwargs | {"num_replicas": 1, "rank": 0}
    predicting = RunningStage.PREDICTING
    injected = _get_distributed_sampler(loader, shuffle=False, overfit_batches=0, mode=predicting, **kwargs)
    assert not _lightning.injected_over_dataset_order(injected)
    resharded = _lightning.unrepeated_sampler(injected, 2, 1)
    assert isinstance(resharded, UnrepeatedDistributedSamplerWrapper) and _lightning.is_injected(resharded)
    assert list(resharded) == [4, 2, 0]


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


# ==========================================================================================================
# Training metrics: the names `_results.intercept_training_logs` and friends use (`training_metrics.py`).
# ==========================================================================================================

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.core.module import LightningModule  # noqa: E402
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop  # noqa: E402
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import (  # noqa: E402
    _LoggerConnector,
)
from lightning.pytorch.trainer.connectors.logger_connector.result import (  # noqa: E402
    _Metadata,
    _ResultCollection,
    _ResultMetric,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402


def test_lightning_module_log_ends_in_the_result_collection_with_the_strategy_sync():
    source = inspect.getsource(LightningModule.log)
    assert "results = trainer._results" in source and "results.log(" in source
    assert "sync_dist_fn=trainer.strategy.reduce" in source  # Lightning syncs each value through it
    parameters = inspect.signature(_ResultCollection.log).parameters
    used = ["fx", "name", "value", "on_step", "on_epoch", "sync_dist", "sync_dist_fn", "sync_dist_group"]
    used += ["add_dataloader_idx", "batch_size", "rank_zero_only"]
    assert list(parameters)[1:4] == ["fx", "name", "value"] and set(used) <= set(parameters)


def test_the_training_results_and_the_logging_rule_are_where_the_metrics_glue_looks():
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    results = _results.training_results(trainer)
    assert isinstance(results, _ResultCollection) and results.training
    assert callable(trainer.fit_loop._should_accumulate)
    rule = inspect.getsource(_LoggerConnector.update_train_step_metrics)
    assert "fit_loop._should_accumulate() and self.trainer.lightning_module.automatic_optimization" in rule
    assert "if self.should_update_logs or self.trainer.fast_dev_run:" in rule
    assert isinstance(_LoggerConnector.should_update_logs, property)
    # what `loggers_read_this_step` restates of it while the fit loop runs
    should_update = inspect.getsource(_LoggerConnector.should_update_logs.fget)
    for part in ("trainer.log_every_n_steps == 0", "loop.epoch_loop._batches_that_stepped + 1", "trainer.should_stop"):
        assert part in should_update
    assert isinstance(trainer._logger_connector, _LoggerConnector)
    # `loggers_read_this_step` asks in `on_train_batch_end`: the loggers are updated after it, before the counter
    # `should_update_logs` reads moves on
    advance = inspect.getsource(_TrainingEpochLoop.advance)
    order = ['"on_train_batch_end"', "update_train_step_metrics()"]
    assert all(part in advance for part in order) and sorted(order, key=advance.index) == order
    assert "_batches_that_stepped += 1" in inspect.getsource(_TrainingEpochLoop.on_advance_end)


def never_called(*args, **kwargs):
    raise AssertionError("Lightning's own sync ran")


@pytest.mark.parametrize("reduce_fx", ["mean", "sum", "max", "min"])
def test_intercepted_logs_skip_lightning_sync_and_expose_their_state(reduce_fx):
    results = _ResultCollection(training=True)
    results.batch = (torch.zeros(5, 2), torch.zeros(5))
    taken = []
    restore = _results.intercept_training_logs(results, lambda log: log.name != "other", taken.append)
    kwargs = dict(on_step=True, on_epoch=True, reduce_fx=reduce_fx, sync_dist=True, sync_dist_fn=never_called)
    results.log("training_step", "x", torch.tensor(2.0), **kwargs)
    results.log("training_step", "x", torch.tensor(3.0), batch_size=4, **kwargs)
    first, second = taken
    assert first.log.key == "training_step.x" and first.log.sync_dist and second.log.batch_size == 4
    assert first.reduce_fx == reduce_fx and first.value.item() == 2.0 and second.value.item() == 3.0
    meta = _Metadata("training_step", "x", reduce_fx=getattr(torch, reduce_fx))
    fresh = _ResultMetric(meta, is_tensor=True)
    assert first.epoch_state_before[0].item() == fresh.value.item()  # `_default_epoch_state` mirrors __init__
    after_first = {"mean": 10.0, "sum": 2.0, "max": 2.0, "min": 2.0}[reduce_fx]  # mean: 2.0 * batch 5
    assert second.epoch_state_before[0].item() == after_first
    if reduce_fx == "mean":
        assert first.epoch_state_before[1].item() == 0 and second.epoch_state_before[1].item() == 5
    assert results["training_step.x"].meta.sync.should  # no "use sync_dist=True" warning at epoch end

    metric = second.metric
    _results.set_step_value(metric, torch.tensor(7.0))
    on_step = results.metrics(on_step=True)
    assert on_step["log"]["x_step"].item() == 7.0 and on_step["callback"]["x"].item() == 7.0
    _results.set_step_value(metric, None)
    assert "x_step" not in results.metrics(on_step=True)["log"]
    _results.set_epoch_state(metric, torch.tensor(12.0), torch.tensor(3) if reduce_fx == "mean" else None)
    assert results.metrics(on_step=False)["log"]["x_epoch"].item() == (4.0 if reduce_fx == "mean" else 12.0)

    # after the epoch-end reset, a value written without `self.log` (a rank that follows, without data) counts
    results.reset()
    assert "x_epoch" not in results.metrics(on_step=False)["log"]
    assert _results.epoch_state(metric)[0].item() == fresh.value.item()  # the reset state is the fresh one
    _results.set_epoch_state(metric, torch.tensor(12.0), torch.tensor(3) if reduce_fx == "mean" else None)
    assert results.metrics(on_step=False)["log"]["x_epoch"].item() == (4.0 if reduce_fx == "mean" else 12.0)
    results.reset()
    _results.set_step_value(metric, torch.tensor(5.0))
    assert results.metrics(on_step=True)["callback"]["x"].item() == 5.0

    with pytest.raises(AssertionError, match="own sync ran"):  # what `take` refuses keeps Lightning's sync
        results.log("training_step", "other", torch.tensor(1.0), **kwargs)
    restore()
    assert "log" not in vars(results)


LOGS = [  # (name, value, keyword arguments) in the order a training step logs them, three steps of batches
    ("loss", 2.0, dict(on_step=True, on_epoch=False, prog_bar=True)),
    ("acc", 0.5, dict(on_step=True, on_epoch=True)),
    ("top", 3.0, dict(on_step=True, on_epoch=True, reduce_fx="max")),
    ("low", 1.0, dict(on_step=True, on_epoch=True, reduce_fx="min", batch_size=3)),
    ("seen", 4.0, dict(on_step=True, on_epoch=True, reduce_fx="sum")),
]


def unsynced(value, *args, **kwargs):
    return value


@pytest.mark.parametrize("intercepted", [True, False])
def test_an_intercepted_log_leaves_the_state_lightning_leaves(monkeypatch, intercepted):
    moves = []
    move = _ResultMetric.to
    monkeypatch.setattr(_ResultMetric, "to", lambda self, *a, **k: moves.append(self.meta.name) or move(self, *a, **k))
    results, plain = _ResultCollection(training=True), _ResultCollection(training=True)
    if intercepted:
        _results.intercept_training_logs(results, lambda log: True, lambda logged: None)
    for step, size in enumerate((5, 7, 2)):
        for collection in (results, plain):
            collection.batch, collection.batch_size = (torch.zeros(size, 2),), None
            for name, value, kwargs in LOGS:
                logged = torch.tensor(value * (step + 1), requires_grad=True) * 1.0  # in a graph, as a loss is
                collection.log("training_step", name, logged, sync_dist=True, sync_dist_fn=unsynced, **kwargs)
    for key, metric in plain.items():
        mine = results[key]
        assert not mine._forward_cache.requires_grad and mine._forward_cache.item() == metric._forward_cache.item()
        assert mine.value.item() == metric.value.item() and not mine.has_reset
        if metric.meta.is_mean_reduction:
            assert mine.cumulated_batch_size.item() == metric.cumulated_batch_size.item()
    assert {k: v.item() for k, v in results.metrics(on_step=False)["log"].items()} == {
        k: v.item() for k, v in plain.metrics(on_step=False)["log"].items()
    }
    assert results["training_step.acc"].cumulated_batch_size.item() == 14  # 5 + 7 + 2: inferred from each batch
    names = [name for name, _, _ in LOGS]
    assert moves == names * 6  # Lightning's own log, with its own steps, for both
    if intercepted:  # other arguments for a logged name: Lightning's own error, from Lightning's own log
        with pytest.raises(MisconfigurationException, match="twice in `training_step` with different arguments"):
            results.log("training_step", "loss", torch.tensor(1.0), on_step=True, on_epoch=False)


def test_batch_size_of_the_current_batch_follows_lightning_inference():
    results = _ResultCollection(training=True)
    assert _results.batch_size_of_current_batch(results) is None
    results.batch = {"x": torch.zeros(6, 3)}
    assert _results.batch_size_of_current_batch(results) == 6
    results.batch_size = 2  # what Lightning cached for this batch
    assert _results.batch_size_of_current_batch(results) == 2
    results.batch, results.batch_size = "no tensor", None
    assert _results.batch_size_of_current_batch(results) is None


# ==========================================================================================================
# Resume (`sharding.PaddedShardSampler.load_state_dict`, `_lightning.refresh_training_batch_count`).
# ==========================================================================================================


def test_training_batch_count_and_progress_are_where_resume_reads_them():
    from lightning.pytorch.loops.fetchers import _DataFetcher
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.utilities import CombinedLoader

    # setup_data reads the loader lengths into `combined_loader.limits`, `max_batches` and `val_check_batch`
    source = inspect.getsource(_FitLoop.setup_data)
    assert "_parse_num_batches(stage, length, trainer.limit_train_batches)" in source
    assert "combined_loader.limits = limits" in source
    assert "max_batches = sized_len(combined_loader)" in source
    assert "trainer.val_check_batch = int(self.max_batches * trainer.val_check_interval)" in source
    assert _parse_num_batches(RunningStage.TRAINING, 10, 0.5) == 5
    # the running iterator holds the loader's `limits` list: updated in place, the loader's length follows it
    combined = CombinedLoader([range(5), range(7)], "max_size_cycle")
    combined.limits = [5, 7]
    iter(combined)
    assert len(combined) == 7
    combined.limits[:] = [3, 6]
    assert len(combined) == 6 and next(combined)[0] == [0, 0]
    # the batch just trained counts as processed, not yet completed, when on_train_batch_end saves a checkpoint
    source = inspect.getsource(_TrainingEpochLoop.advance)
    processed = source.index("self.batch_progress.increment_processed()")
    assert processed < source.index('"on_train_batch_end"') < source.index("self.batch_progress.increment_completed()")
    # the fetcher marks the last batch from its length, counting the restored batches as fetched
    assert "data_fetcher.fetched += self.batch_progress.current.ready" in inspect.getsource(
        _TrainingEpochLoop.on_run_start
    )
    assert "self.done = self.fetched >= self.length" in inspect.getsource(_DataFetcher.__next__)
    assert "self.batch_progress.is_last_batch = data_fetcher.done" in source
    assert source.index("is_last_batch = data_fetcher.done") < source.index('"on_train_batch_start", batch')
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert _lightning.micro_batches_trained_in_epoch(trainer) == 0
    assert not _lightning.refresh_training_batch_count(trainer)  # no training loader yet


def test_lightning_profiles_the_training_batch_fetch_under_the_action_name_the_scaling_report_reads():
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.profilers import SimpleProfiler

    profiler = SimpleProfiler()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, logger=False, profiler=profiler,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    assert len(profiler.recorded_durations[_lightning.TRAIN_DATALOADER_NEXT]) == 3


# ==========================================================================================================
# Fusion autotuning: the re-wrap goes through DDPStrategy's private `_setup_model` and `_ddp_kwargs`.
# ==========================================================================================================


def test_ddp_is_wrapped_from_the_strategy_ddp_kwargs_by_setup_model():
    assert "_setup_model" in vars(DDPStrategy)
    assert "self.model = self._setup_model(self.model)" in inspect.getsource(DDPStrategy.configure_ddp)
    assert "**self._ddp_kwargs" in inspect.getsource(DDPStrategy._setup_model)
    strategy = ShardPlusStrategy(tensor_fusion_threshold_mb=4)
    _lightning.set_ddp_kwargs(strategy, {"bucket_cap_mb": 8.0, "bucket_cap_mb_list": [1.0, 8.0]})
    assert strategy._ddp_kwargs["bucket_cap_mb"] == 8.0 and strategy._ddp_kwargs["bucket_cap_mb_list"] == [1.0, 8.0]
    _lightning.set_ddp_kwargs(strategy, {"bucket_cap_mb_list": None})
    assert "bucket_cap_mb_list" not in strategy._ddp_kwargs


def test_the_trainer_and_ddp_kwargs_are_read_where_lightning_keeps_them():
    from lightning.pytorch.demos.boring_classes import BoringModel

    module = BoringModel()
    assert _lightning.attached_trainer(module) is None and _lightning.attached_trainer(None) is None
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    module.trainer = trainer
    assert _lightning.attached_trainer(module) is trainer is module.trainer
    strategy = ShardPlusStrategy(tensor_fusion_threshold_mb=4, static_graph=True)
    assert _lightning.ddp_kwargs(strategy)["bucket_cap_mb"] == 4 and _lightning.ddp_kwargs(strategy)["static_graph"]


def test_ddps_default_first_bucket_is_read_where_torch_keeps_it():
    # _torch.DDP_DEFAULT_FIRST_BUCKET_BYTES is torch.distributed's private _DEFAULT_FIRST_BUCKET_BYTES, the first
    # bucket DDP builds when no bucket size is given (tests/test_fusion.py counts the buckets DDP really builds)
    import torch.distributed as dist
    import torch.nn.parallel.distributed as ddp_module

    from lightning_shardplus._compat import torch as _torch
    from lightning_shardplus.gradients.ddp import fusion

    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20 == _torch.DDP_DEFAULT_FIRST_BUCKET_BYTES
    assert fusion.DDP_FIRST_BUCKET_MB == 1.0
    assert "dist._DEFAULT_FIRST_BUCKET_BYTES" in inspect.getsource(ddp_module)  # what DDP reads


def test_model_checkpoint_skips_the_step_it_saved_last_and_does_not_restore_it():
    # _lightning.mark_resumed_step_saved sets `_last_global_step_saved`: Lightning must still read it, and still
    # not restore it from a checkpoint (once it does, the workaround can go)
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.states import TrainerFn

    callback = ModelCheckpoint(every_n_train_steps=3)
    at_validation = ModelCheckpoint(monitor="val_loss")  # saves at validation ends: did not save at step 3
    other_steps = ModelCheckpoint(every_n_train_steps=2)  # step 3 is not one of its steps
    assert callback._last_global_step_saved == 0
    callbacks = [callback, at_validation, other_steps]
    trainer = SimpleNamespace(fast_dev_run=False, sanity_checking=False, global_step=3, checkpoint_callbacks=callbacks)
    trainer.state = SimpleNamespace(fn=TrainerFn.FITTING)
    assert not callback._should_skip_saving_checkpoint(trainer)
    _lightning.mark_resumed_step_saved(trainer)
    assert callback._should_skip_saving_checkpoint(trainer)
    assert not at_validation._should_skip_saving_checkpoint(trainer)
    assert not other_steps._should_skip_saving_checkpoint(trainer)
    fresh = ModelCheckpoint(every_n_train_steps=3)
    fresh.load_state_dict(callback.state_dict())
    assert fresh._last_global_step_saved == 0


def test_lightnings_evaluation_sampler_warning_still_reads_as_shardplus_silences_it():
    import re
    import warnings
    from pathlib import Path

    import lightning.pytorch as pl
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    connector = (Path(pl.__file__).parent / "trainer/connectors/data_connector.py").read_text()
    text = "Using `DistributedSampler` with the dataloaders. During `trainer."
    assert text in connector.replace('f"', '"') and re.match(false_warnings.EVALUATION_SAMPLER_WARNING, text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restore = false_warnings.silence_evaluation_sampler_warning()
        warnings.warn(text + "validate()`, ...", PossibleUserWarning, stacklevel=1)
        warnings.warn("another warning", PossibleUserWarning, stacklevel=1)
        restore()  # when the run ends: later Trainers (plain ddp) see it again
        warnings.warn(text + "validate()`, ...", PossibleUserWarning, stacklevel=1)
        assert [str(w.message)[:16] for w in caught] == ["another warning", text[:16]]


def test_lightnings_epoch_sync_advice_still_reads_as_shardplus_silences_it():
    import warnings

    from lightning.pytorch.trainer.connectors.logger_connector import result
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    source = inspect.getsource(result._ResultCollection._get_cache)
    assert "category=PossibleUserWarning" in source
    assert "It is recommended to use `self.log({result_metric.meta.name!r}, ..., sync_dist=True)`" in source
    assert "when logging on epoch level in distributed setting" in source and "warning_cache.warn(" in source
    text = (
        "It is recommended to use `self.log({!r}, ..., sync_dist=True)` when logging on epoch level in distributed "
        "setting to accumulate the metric across devices."
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restore = false_warnings.silence_epoch_sync_advice({"val_loss", "acc(x)"})
            for name in ("val_loss", "acc(x)", "other"):
                result.warning_cache.warn(text.format(name), category=PossibleUserWarning)
            restore()  # evaluation ends: said again where true, although Lightning says it once per name
            result.warning_cache.warn(text.format("val_loss"), category=PossibleUserWarning)
        assert [str(w.message) for w in caught] == [text.format("other"), text.format("val_loss")]
    finally:
        result.warning_cache.difference_update({text.format(name) for name in ("val_loss", "other")})


def test_the_evaluation_values_of_a_loader_are_published_by_update_eval_epoch_metrics():
    from types import SimpleNamespace

    results = _ResultCollection(training=False)
    trainer = SimpleNamespace(_results=results, sanity_checking=False)
    trainer._logger_connector = _LoggerConnector(trainer)
    for idx in (0, 1):
        results.dataloader_idx = idx
        results.log("validation_step", "loss", torch.tensor(float(idx + 1)), on_epoch=True, batch_size=1)
    _results.publish_loader_values(trainer, 0)
    assert results.dataloader_idx == 1  # left as it was
    assert trainer._logger_connector._callback_metrics == {"loss/dataloader_idx_0": 1.0}
    _results.publish_loader_values(trainer, 1)
    assert trainer._logger_connector.callback_metrics["loss/dataloader_idx_1"] == 2.0


def test_shardplus_registers_its_process_group_teardown_at_exit_once_and_it_destroys_the_group(monkeypatch, tmp_path):
    import atexit

    import torch.distributed as dist

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", lambda f: registered.remove(f) if f in registered else None)
    _lightning.destroy_process_group_at_exit()
    _lightning.destroy_process_group_at_exit()
    # once; not on torch < 2.13 (a gloo group's destructor can deadlock there at exit)
    old_torch = _lightning.release(torch.__version__) < (2, 13)
    assert registered == ([] if old_torch else [_lightning.destroy_process_group])
    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    _lightning.destroy_process_group()
    assert not dist.is_initialized()
    _lightning.destroy_process_group()  # no group left (Lightning's own teardown then): nothing to do


@pytest.mark.parametrize("log_every_n_steps", [1, 3, 0])
def test_loggers_read_this_step_is_lightnings_own_rule_in_every_training_batch(log_every_n_steps):
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen = []

    class Compare(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            lightning = trainer._logger_connector.should_update_logs and _results.logs_this_step(trainer)
            seen.append((_results.loggers_read_this_step(trainer), bool(lightning)))
            # Lightning also logs at once where a stop was asked for (EarlyStopping, SIGTERM); ours leaves that out:
            # a rank may ask alone (and train on to `min_epochs`), and every rank must decide the same
            trainer.should_stop = True
            seen.append((_results.loggers_read_this_step(trainer), bool(lightning)))
            trainer.should_stop = False

    trainer = pl.Trainer(
        max_steps=7, accumulate_grad_batches=2, log_every_n_steps=log_every_n_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[Compare()],
    )
    trainer.fit(BoringModel())
    assert len(seen) == 28 and all(ours == theirs for ours, theirs in seen)
    assert any(ours for ours, _ in seen) == (log_every_n_steps > 0)


def test_a_callback_queued_when_backward_starts_runs_after_every_gradient_before_later_ones():
    """`call_when_backward_ends` (torch's private engine queue): queued from a hook on the loss, the callback runs
    once every gradient is computed, and before a callback queued later in the pass (as DDP's is)."""
    weight = torch.nn.Parameter(torch.ones(3))
    order = []

    def last_gradient(grad):  # the last gradient of the pass: queues the "later" callback, as DDP does
        order.append("gradient")
        _torch.call_when_backward_ends(lambda: order.append("later"))

    weight.register_hook(last_gradient)
    loss = (weight * 2).sum()
    loss.register_hook(lambda grad: _torch.call_when_backward_ends(lambda: order.append("queued first")))
    loss.backward()
    assert order == ["gradient", "queued first", "later"]


def test_the_training_combined_loader_is_where_uneven_inputs_reads_it():
    # `_lightning.training_loader_count`: the stream-combination check of `uneven.EvenSteps`
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.utilities import CombinedLoader

    assert "self._combined_loader = combined_loader" in inspect.getsource(_FitLoop.setup_data)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert _lightning.training_loader_count(trainer) == 1  # nothing built yet
    trainer.fit_loop._combined_loader = CombinedLoader({"a": [1, 2], "b": [3]}, mode="max_size")
    assert _lightning.training_loader_count(trainer) == 2


def test_lightnings_not_resumable_warning_still_reads_as_shardplus_silences_it(tmp_path):
    # a one-process fit resumed from a mid-epoch checkpoint with a plain DataLoader: Lightning warns in these words
    import warnings

    import lightning.pytorch as pl
    from _models import IndexedDataset, RecordingModule
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(ckpt_path=None):
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[checkpoints],
        )  # fmt: skip
        trainer.fit(RecordingModule(tmp_path / "r"), DataLoader(IndexedDataset(20), batch_size=2), ckpt_path=ckpt_path)

    fit()
    mid_epoch = str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(mid_epoch)
    assert any(re.match(false_warnings.NOT_RESUMABLE_WARNING, str(w.message)) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restore = false_warnings.silence_not_resumable_warning()
        fit(mid_epoch)
        restore()
    assert not any(re.match(false_warnings.NOT_RESUMABLE_WARNING, str(w.message)) for w in caught)


# ---------------------------------------------------------------------------------------------- releases


def test_release_reads_major_and_minor_of_every_version_form():
    assert [_lightning.release(v) for v in ("2.4.0", "2.5.1.post0", "2.7.0rc1", "10.12")] == [
        (2, 4), (2, 5), (2, 7), (10, 12)
    ]


def test_window_resume_follows_the_release_that_counts_the_batch_saved_in_train_batch_end():
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert hasattr(_TrainingEpochLoop, "restarted_on_train_batch_end") == _lightning.RESUMES_INSIDE_A_WINDOW


def test_a_release_newer_than_the_newest_tested_warns_once_at_import(monkeypatch):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _lightning.warn_if_untested()
        monkeypatch.setattr(_lightning, "LIGHTNING_RELEASE", (2, 99))
        _lightning.warn_if_untested()
    assert len(caught) == 1 and "tested with Lightning 2.4 to 2.6" in str(caught[0].message)


def test_argparse_keeps_a_parsers_actions_in_actions():
    # the CLI edits the strategy's help through `_lightning.parser_actions` (argparse's private `_actions`)
    import argparse

    parser = argparse.ArgumentParser()
    action = parser.add_argument("--name", help="the help")
    assert action in _lightning.parser_actions(parser)


def test_checkpoints_within_epochs_reads_the_model_checkpoint_arguments_that_save_after_a_batch():
    # `_results.checkpoints_within_epochs` (the averaged metrics' readers): ModelCheckpoint keeps them private
    from datetime import timedelta

    from lightning.pytorch.callbacks import ModelCheckpoint

    assert not _results.checkpoints_within_epochs(ModelCheckpoint())
    assert not _results.checkpoints_within_epochs(ModelCheckpoint(every_n_epochs=3, monitor="loss"))
    assert _results.checkpoints_within_epochs(ModelCheckpoint(every_n_train_steps=3))
    assert _results.checkpoints_within_epochs(ModelCheckpoint(train_time_interval=timedelta(minutes=1)))
