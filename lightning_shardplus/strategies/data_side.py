"""``ShardPlusDataSide``: what both shardplus strategies do with the data (padded training shards, exact evaluation,
averaged training metrics, uneven streams, aggregation windows, resume), over the data-parallel ranks. Each
strategy adds its gradient side: DDP's (``ShardPlusStrategy``) or FSDP2 and tensor parallel's
(``ShardPlusModelParallelStrategy``). Every override delegates to one run's ``RunComponents``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.distributed
from lightning.pytorch.strategies import ParallelStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus._compat.changes import Change, RunChanges
from lightning_shardplus.data.aggregation import effective_batch_size
from lightning_shardplus.data.components import (
    DistributedSetup,
    RunComponents,
    checkpointed_states,
    process_group_backend,
)
from lightning_shardplus.data.config import DataSideConfig
from lightning_shardplus.data.gradient_side import GradientSide
from lightning_shardplus.data.group import DataParallel, data_parallel, read_by_data_parallel_rank
from lightning_shardplus.data.loaders import gather_predictions
from lightning_shardplus.data.uneven import silence_litdata_drop_last_warning
from lightning_shardplus.launch import (
    LaunchAfterCheck,
    check_fit,
    check_launcher_world_size,
    check_trainer_call,
    rank_variables,
    unshare_memory,
)
from lightning_shardplus.strategies import registry


class ShardPlusDataSide(ParallelStrategy):
    """The data side, put before a Lightning strategy (``class S(ShardPlusDataSide, DDPStrategy)``: its ``super()`` is
    that strategy); ``S`` calls :meth:`_init_data_side` in its ``__init__`` and defines ``num_replicas``, its
    data-parallel size."""

    config: DataSideConfig
    num_replicas: int
    start_method: str  # how the processes start: "popen", "fork", "spawn" or "forkserver"
    launcher_name: str | None = None  # who starts the processes, in the start-up line; None: Lightning or as found
    processes_setting = "devices x num_nodes"  # what sets the number of processes, named in refusals
    saves_outside_callbacks = False  # whether checkpoints are saved without Lightning's checkpoint callbacks (Ray)
    components_after_checks = False  # built in the gradient side's `setup`, once Lightning's checks of the module pass

    def _init_data_side(self, config: DataSideConfig) -> None:
        self.config = config
        self._components: RunComponents | None = None  # this Trainer run's, from `setup` to `teardown`
        self._checkpointed: dict[str, Any] = {}  # component states of a checkpoint loaded before `setup`
        self._changes = RunChanges()  # what this strategy's run changed in objects it does not own, until teardown

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Each strategy's names, from the one table (``registry.py``)."""
        registry.register(cls, strategy_registry)

    def _gradient_side(self) -> GradientSide:
        """What differs on this strategy's gradient side (``data.gradient_side.GradientSide``)."""
        raise NotImplementedError

    def _distributed_setup(self) -> DistributedSetup:
        """What this strategy's components need to know of its processes (after they started): the data-parallel
        group, with the size and rank Lightning gives samplers (``distributed_sampler_kwargs``)."""
        backend = process_group_backend(self.process_group_backend, self.root_device)
        kwargs = self.distributed_sampler_kwargs
        group = data_parallel(self)
        data_parallel_group = DataParallel(kwargs["num_replicas"], kwargs["rank"], group.group, group.groups)
        gradients, launcher = self._gradient_side(), self.launcher_name
        return DistributedSetup(
            data_parallel_group, backend, self.root_device, gradients, launcher_name=launcher,
            saves_outside_callbacks=self.saves_outside_callbacks,
        )  # fmt: skip

    @property
    def started_processes(self) -> int:
        """How many processes run this Trainer: ``devices x num_nodes`` (under Ray, Ray's worker count)."""
        return self.num_nodes * self.num_processes

    def check_launcher(self) -> None:
        """Refuse a launcher whose world size is not the Trainer's (:func:`launch.check_launcher_world_size`)."""
        check_launcher_world_size(self.cluster_environment, self.num_processes, self.num_nodes)

    @property
    def micro_batches_per_step(self) -> int:
        """``aggregation_frequency`` (or, left at 1, the Trainer's ``accumulate_grad_batches``)."""
        aggregation = self._components and self._components.aggregation
        return aggregation.micro_batches_per_step if aggregation else self.config.aggregation_frequency

    @property
    def effective_batch_size(self) -> int | None:
        """Samples per optimizer step over the data-parallel ranks once the training data is known; None before."""
        trainer = _lightning.attached_trainer(self.lightning_module)
        return None if trainer is None else effective_batch_size(trainer)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        kwargs = {**super().distributed_sampler_kwargs, "seed": _lightning.InjectedSeed(self.config.epoch_seed)}
        return self._components.loaders.injection_kwargs(kwargs) if self._components is not None else kwargs

    @property
    def _exact_across_ranks(self) -> bool:
        return self.config.exact_evaluation and self.num_replicas > 1

    @property
    @override
    def launcher(self) -> Any:
        """Lightning's launcher, whose ``launch`` first checks the Trainer call in the launching process, before any
        worker starts (it keeps its type for Lightning)."""
        launcher = self._processes_launcher()
        if launcher is not None and not isinstance(launcher.launch, LaunchAfterCheck):
            self._changes.set(
                Change.LAUNCH, launcher, "launch", LaunchAfterCheck(self.check_trainer_call, launcher.launch)
            )
        return launcher

    def check_trainer_call(self, *call_args: Any, trainer: Any = None) -> None:
        """Refuse a Trainer call that cannot work with this strategy (:func:`launch.check_trainer_call`), in the
        launching process before any worker starts."""
        check_trainer_call(self, *call_args, trainer=trainer)

    def _processes_launcher(self) -> Any:
        """What starts the processes: the launcher Lightning configured for the strategy."""
        return super().launcher

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        if self.config.exact_evaluation:  # its shards are empty on some ranks when the dataset is that small
            self._changes.set(
                Change.ZERO_LENGTH_LOADERS, model, "allow_zero_length_dataloader_with_multiple_devices", True
            )
        check_fit(self, _lightning.attached_trainer(model), model)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # then the variables stream libraries read (Mosaic)
        self._changes.set_environment(
            Change.RANK_VARIABLES, rank_variables(self.cluster_environment, self.num_processes)
        )
        if self._exact_across_ranks:  # uneven evaluation streams are safe then, uneven training streams always
            self._changes.apply(Change.WARNING_FILTERS, silence_litdata_drop_last_warning())
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            _lightning.destroy_process_group_at_exit()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """This run's components, before the gradient side's ``setup`` (DDP's wraps the module with their hook and
        bucket size), unless ``components_after_checks``."""
        if self.start_method in ("spawn", "forkserver") and self.root_device.type == "cpu":
            unshare_memory(self.lightning_module)
        if not self.components_after_checks:
            self._build_components(trainer)
        super().setup(trainer)

    def _build_components(self, trainer: pl.Trainer) -> None:
        """This run's components, once."""
        if self._components is None:
            self._components = RunComponents.build(self.config, trainer, self._distributed_setup(), self._changes)
            self._components.load_states(self._checkpointed)

    @override
    def teardown(self) -> None:
        self._components, self._checkpointed = None, {}
        self._changes.undo()
        super().teardown()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add each component's state under its own key (training checkpoints only); every rank writes its files."""
        if self._components is not None and "loops" in checkpoint:
            checkpoint.update(self._components.checkpoint_states(filepath))
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # what this Lightning gives (2.6 added `weights_only`); restored before `setup` builds the components, or
        # after it (model parallel restores after setup)
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._checkpointed = checkpointed_states(checkpoint, checkpoint_path, self._gradient_side())
        if self._components is not None:
            self._components.load_states(self._checkpointed)
        return checkpoint

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Put shardplus samplers into the loaders Lightning prepared; training streams go in even steps; stream
        libraries read by the data-parallel rank."""
        dataloader = super().process_dataloader(dataloader)
        read_by_data_parallel_rank(dataloader, data_parallel(self), self.world_size)
        if (parts := self._components) is not None:
            training = parts.aggregation is not None and self.lightning_module.trainer.training
            dataloader = parts.process_dataloader(dataloader, training)
        return dataloader

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._components.on_train_start(self.lightning_module.trainer)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._components.on_train_batch_start(self.lightning_module.trainer, batch_idx)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if aggregation := self._components and self._components.aggregation:
            closure = aggregation.wrap_closure(optimizer, closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if (exact := self._components and self._components.exact) and exact.deferring:
            return tensor  # no per-batch collective (uneven shards): `ExactEvaluation` reduces at the epoch end
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def on_predict_end(self) -> None:
        """Data-parallel rank 0 returns every data-parallel rank's predictions, in dataset order; the others theirs."""
        super().on_predict_end()
        if self._exact_across_ranks:
            gather_predictions(self.lightning_module.trainer.predict_loop, data_parallel(self))
