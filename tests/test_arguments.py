"""Bad arguments are refused with an error naming the argument, the value and what is valid, before any
process group starts."""

import inspect
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _models import IndexedDataset, RecordingModule, cpu_trainer
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

import lightning_shardplus  # noqa: F401
from lightning_shardplus import (
    ShardPlusDataModule,
    ShardPlusModelParallelStrategy,
    ShardPlusStrategy,
    SyntheticDataModule,
)
from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus.data.datamodule import per_device_batch_size


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"shard_padding": "zeros"}, ValueError, r"`shard_padding`='zeros'.*'first', 'wrap'"),
        ({"shuffle_seed": -1}, ValueError, r"`shuffle_seed`=-1.*>= 0"),
        ({"shuffle_seed": 1.5}, TypeError, r"`shuffle_seed`=1.5.*integer"),
        ({"exact_evaluation": "yes"}, TypeError, r"`exact_evaluation`='yes'.*True or False"),
        ({"verify_sharding": 1}, TypeError, r"`verify_sharding`=1"),
        ({"average_training_metrics": "yes"}, TypeError, r"`average_training_metrics`='yes'.*True or False"),
        ({"average_training_metrics": 0}, TypeError, r"`average_training_metrics`=0"),
        ({"tensor_fusion_threshold_mb": 0}, ValueError, r"`tensor_fusion_threshold_mb`=0.*> 0"),
        ({"tensor_fusion_threshold_mb": -5.0}, ValueError, r"`tensor_fusion_threshold_mb`=-5.0"),
        # DDP hands its C++ reducer int(mb * 2**20) bytes as a 64-bit integer: 2**43 MB and more fail inside DDP
        ({"tensor_fusion_threshold_mb": 1e30}, ValueError, r"`tensor_fusion_threshold_mb`=1e\+30.*< 8796093022208 MB"),
        ({"tensor_fusion_threshold_mb": 2.0**43}, ValueError, r"`tensor_fusion_threshold_mb`=8796093022208.0 is not"),
        ({"start_method": "thread"}, ValueError, r"`start_method`='thread'.*'popen'"),
        ({"bucket_cap_mb": 10}, TypeError, r"`bucket_cap_mb`=10.*tensor_fusion_threshold_mb"),
        ({"shard_paddin": "first"}, TypeError, r"unknown option\(s\) `shard_paddin`='first'.*valid"),
        ({"aggregation_frequenzy": 2}, TypeError, r"`aggregation_frequenzy`=2"),
        ({"tensor_fusion_threshold_mb": float("inf")}, ValueError, r"`tensor_fusion_threshold_mb`=inf.*finite"),
        ({"tensor_fusion_threshold_mb": "8"}, TypeError, r"`tensor_fusion_threshold_mb`='8' is not valid.*number"),
        ({"timeout": "5"}, TypeError, r"`timeout`='5'.*timedelta > 0, a number of seconds"),
        ({"timeout": -1}, ValueError, r"`timeout`=-1"),
        ({"timeout": 1e300}, ValueError, r"`timeout`=1e\+300"),
        ({"process_group_backend": ""}, ValueError, r"`process_group_backend`='' is not valid: expected None.*name"),
        ({"process_group_backend": 3}, TypeError, r"`process_group_backend`=3 is not valid: expected None"),
        ({"find_unused_parameters": "no"}, TypeError, r"`find_unused_parameters`='no'.*True or False"),
        ({"static_graph": 1}, TypeError, r"`static_graph`=1"),
        ({"broadcast_buffers": "yes"}, TypeError, r"`broadcast_buffers`='yes'"),
    ],
)
def test_strategy_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        ShardPlusStrategy(**kwargs)
    assert not dist.is_initialized()


def test_a_misspelled_option_lists_the_strategys_options_and_ddps_and_suggests_the_closest():
    import inspect

    from lightning_shardplus.gradients.ddp.config import STRATEGY_OPTIONS

    own = set(inspect.signature(ShardPlusStrategy.__init__).parameters) - {"self", "ddp_kwargs"}
    assert set(STRATEGY_OPTIONS) == own
    with pytest.raises(TypeError) as error:
        ShardPlusStrategy(agregation_frequency=2)
    message = str(error.value)
    assert "`agregation_frequency`=2" in message and "did you mean `aggregation_frequency`?" in message
    strategy_part, ddp_part = message.split("DistributedDataParallel's")
    assert all(name in strategy_part for name in ("aggregation_frequency", "tensor_fusion_threshold_mb", "timeout"))
    assert "static_graph" in ddp_part and "bucket_cap_mb_list" in ddp_part
    with pytest.raises(TypeError, match=r"`tensor_fusion_mb`=4 \(did you mean `tensor_fusion_threshold_mb`\?\)"):
        ShardPlusStrategy(tensor_fusion_mb=4)
    with pytest.raises(TypeError) as error:
        ShardPlusStrategy(zzz=1)
    assert "did you mean" not in str(error.value)  # nothing close


def test_a_misspelled_option_in_a_cli_config_gets_the_closest_name(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from lightning_shardplus.cli import ShardPlusCLI

    monkeypatch.setattr("sys.argv", ["shardplus"])
    config = Path(__file__).resolve().parents[1] / "configs" / "digits.yaml"
    typo = tmp_path / "typo.yaml"
    misspelled = "verify_sharding: false\n      agregation_frequency: 2"
    typo.write_text(config.read_text().replace("verify_sharding: false", misspelled))
    with pytest.raises(SystemExit):
        ShardPlusCLI(args=["--config", str(typo), "--trainer.logger=false"], run=False)
    error = capsys.readouterr().err
    assert "Option 'agregation_frequency' is not accepted" in error
    assert "ShardPlusStrategy: did you mean 'aggregation_frequency'?" in error


@pytest.mark.parametrize("strategy", [ShardPlusStrategy, ShardPlusModelParallelStrategy])
def test_every_argument_of_the_strategies_has_a_description(strategy):
    # LightningCLI's help reads the descriptions from the docstrings' Args sections (jsonargparse), base classes too
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(strategy, "strategy")
    described = {action.dest.removeprefix("strategy."): action.help for action in _lightning.parser_actions(parser)}
    arguments = [name for name, parameter in inspect.signature(strategy.__init__).parameters.items()
                 if name != "self" and parameter.kind is not parameter.VAR_KEYWORD]  # fmt: skip
    assert [name for name in arguments if not described.get(name)] == []


def test_strategy_passes_ddp_arguments_through():
    strategy = ShardPlusStrategy(tensor_fusion_threshold_mb=4, static_graph=True, bucket_cap_mb_list=None)
    assert _lightning.ddp_kwargs(strategy)["bucket_cap_mb"] == 4.0
    assert _lightning.ddp_kwargs(strategy)["static_graph"] is True
    # broadcast_buffers only when given (torch 2.13 warns that it is deprecated): DDP's default otherwise
    assert "broadcast_buffers" not in _lightning.ddp_kwargs(strategy)
    assert _lightning.ddp_kwargs(ShardPlusStrategy(broadcast_buffers=False))["broadcast_buffers"] is False
    assert ShardPlusStrategy(process_group_backend="cpu:gloo,cuda:nccl")._process_group_backend == "cpu:gloo,cuda:nccl"


def test_a_third_party_process_group_backend_is_taken_at_construction_as_ddp_takes_it():
    # ccl (Intel oneCCL) and hccl (Ascend) register themselves with torch when their package is imported: that
    # may happen after the strategy is built, so the name is checked when the processes start
    for backend in ("ccl", "hccl", "cpu:gloo,xpu:ccl"):
        assert ShardPlusStrategy(process_group_backend=backend)._process_group_backend == backend


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("mpi2", r"`process_group_backend`='mpi2' is not valid: 'mpi2' is not a process-group backend torch knows.*"
         r"'gloo'.*register_backend.*'cpu:gloo,cuda:nccl'"),
        ("cpu:gloo,cuda:nccl2", r"`process_group_backend`='cpu:gloo,cuda:nccl2' is not valid: 'nccl2' is not"),
        ("cpu:gloo, cuda:nccl", r"`process_group_backend`='cpu:gloo, cuda:nccl' is not valid: ' cuda:nccl' has"),
    ],
)
def test_an_unknown_process_group_backend_fails_when_the_processes_start_before_any_process_group(
    tmp_path, backend, message
):
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork", process_group_backend=backend), 2, max_epochs=1)
    with pytest.raises(ValueError, match=message):
        trainer.fit(RecordingModule(tmp_path), DataLoader(IndexedDataset(8), batch_size=2))
    assert not dist.is_initialized()


def test_a_registered_third_party_backend_passes_the_launch_check():
    from lightning_shardplus.validation import check_process_group_backend_known

    name = "shardplus_test_backend"
    if name not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, lambda *args: None, devices=["cpu"])
    check_process_group_backend_known(name)
    check_process_group_backend_known(f"cpu:{name.upper()},cuda:gloo")  # torch takes names in any case


@pytest.mark.parametrize("accelerator", ["mps", "auto", "instance"])
def test_the_mps_accelerator_is_refused_as_lightning_refuses_the_ddp_family(monkeypatch, accelerator):
    # Lightning recognizes its DDP family by a name containing "ddp": "shardplus" has to refuse MPS itself
    import lightning.pytorch as pl
    from lightning.fabric.accelerators.mps import MPSAccelerator as FabricMPSAccelerator
    from lightning.pytorch.accelerators import MPSAccelerator

    monkeypatch.setattr(FabricMPSAccelerator, "is_available", staticmethod(lambda: True))  # as on Apple silicon
    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    flag = MPSAccelerator() if accelerator == "instance" else accelerator
    wording = r"but strategies from the DDP family are not supported on the MPS accelerator\. Either explicitly set "
    with pytest.raises(ValueError, match=r"You set `strategy=ddp_spawn` " + wording):  # Lightning's own
        pl.Trainer(accelerator=flag, strategy="ddp_spawn", devices=1)
    for strategy in ("shardplus", "shardplus_spawn", ShardPlusStrategy(), ShardPlusStrategy(start_method="fork")):
        with pytest.raises(ValueError, match=r"You set `strategy=.*" + wording + r"`accelerator='cpu'`"):
            pl.Trainer(accelerator=flag, strategy=strategy, devices=1)
    assert not dist.is_initialized()


def test_numpy_numbers_are_numbers():
    import numpy as np

    strategy = ShardPlusStrategy(tensor_fusion_threshold_mb=np.float32(4), timeout=np.int64(60))
    given = _lightning.ddp_kwargs(strategy)["bucket_cap_mb"]
    assert given == 4.0 and type(given) is float
    assert strategy._timeout.total_seconds() == 60
    candidates = ShardPlusStrategy(autotune_candidates_mb=np.array([1.0, 4.0])).config.autotune_settings.candidates_mb
    assert candidates == (1.0, 4.0)


def test_numpy_integers_are_integers():
    import numpy as np

    from lightning_shardplus import PaddedShardSampler, ScaleLearningRate

    strategy = ShardPlusStrategy(
        aggregation_frequency=np.int64(2),
        shuffle_seed=np.int32(3),
        autotune_steps_per_sample=np.uint8(4),
        autotune_warmup_steps=np.int16(2),
    )
    config = strategy.config
    assert (config.aggregation_frequency, config.shuffle_seed) == (2, 3)
    assert type(config.aggregation_frequency) is int and type(config.shuffle_seed) is int  # Lightning checks `int`
    settings = config.autotune_settings
    assert (settings.steps_per_sample, settings.warmup_steps) == (4, 2) and type(settings.steps_per_sample) is int
    sampler = PaddedShardSampler(np.int64(10), np.int64(2), np.int64(1), seed=np.int64(5))
    assert len(sampler) == 5 and type(sampler.num_replicas) is int and type(sampler.seed) is int
    datamodule = ShardPlusDataModule(np.int64(8), num_workers=np.int64(0))
    assert type(datamodule.global_batch_size) is int
    assert ScaleLearningRate(reference_batch_size=np.int64(32), warmup_steps=np.int64(10)).warmup_steps == 10
    with pytest.raises(TypeError, match=r"`aggregation_frequency`=True is not valid: expected an integer >= 1"):
        ShardPlusStrategy(aggregation_frequency=True)
    with pytest.raises(TypeError, match=r"`aggregation_frequency`=np.float64\(2.0\) is not valid"):
        ShardPlusStrategy(aggregation_frequency=np.float64(2.0))


def test_a_timeout_in_seconds_becomes_a_timedelta():
    from datetime import timedelta

    assert ShardPlusStrategy(timeout=90)._timeout == timedelta(seconds=90)
    assert ShardPlusStrategy(timeout=timedelta(minutes=2))._timeout == timedelta(minutes=2)


def test_registered_strategies_give_ddp_what_lightnings_ddp_names_give():
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    def defaults(function):
        parameters = inspect.signature(function).parameters.values()
        return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}

    ddp_defaults = defaults(DistributedDataParallel.__init__)
    shardplus_names = [name for name in StrategyRegistry.available_strategies() if name.startswith("shardplus")]
    names = [name for name in shardplus_names if not name.startswith("shardplus_model_parallel")]  # the DDP family's
    assert len(names) == 12 and len(shardplus_names) == 15, shardplus_names
    for name in names:
        # registered with the parameters of Lightning's ddp name of the same suffix (Lightning's registry tests)
        lightning_name = name.replace("shardplus", "ddp", 1)
        assert StrategyRegistry[name]["init_params"] == StrategyRegistry[lightning_name]["init_params"], name
        # DDP gets what Lightning's ddp name gives it: its defaults by leaving them out, a flag the name sets as set
        ours, lightnings = StrategyRegistry.get(name), StrategyRegistry.get(lightning_name)
        assert _lightning.ddp_kwargs(ours) == _lightning.ddp_kwargs(lightnings), name
    shardplus, ddp = StrategyRegistry.get("shardplus"), StrategyRegistry.get("ddp")
    assert _lightning.ddp_kwargs(shardplus) == _lightning.ddp_kwargs(ddp) == {}
    strategy = ShardPlusStrategy(static_graph=True, gradient_as_bucket_view=False, tensor_fusion_threshold_mb=4)
    given = _lightning.ddp_kwargs(strategy)
    assert given == {"static_graph": True, "bucket_cap_mb": 4.0}
    assert all(ddp_defaults[key] != value for key, value in given.items())
    # find_unused_parameters and broadcast_buffers as DDPStrategy keeps them: where given
    assert _lightning.ddp_kwargs(ShardPlusStrategy(find_unused_parameters=False)) == {"find_unused_parameters": False}
    assert _lightning.ddp_kwargs(ShardPlusStrategy(broadcast_buffers=False)) == {"broadcast_buffers": False}


def test_strategy_names_are_registered_with_their_start_methods():
    for name, start_method in [
        ("shardplus", "popen"),
        ("shardplus_spawn", "spawn"),
        ("shardplus_fork", "fork"),
        ("shardplus_notebook", "fork"),
    ]:
        flags = (("", False), ("_find_unused_parameters_true", True), ("_find_unused_parameters_false", False))
        for flag, unused in flags:  # as Lightning's: ddp_spawn_find_unused_parameters_true, ...
            strategy = StrategyRegistry.get(name + flag)
            assert isinstance(strategy, ShardPlusStrategy)
            assert strategy._start_method == start_method
            assert _lightning.ddp_kwargs(strategy).get("find_unused_parameters", False) is unused
            assert StrategyRegistry.get(f"ddp{name[len('shardplus'):]}{flag}")._start_method == start_method


@pytest.mark.parametrize(
    ("global_batch_size", "world_size", "error", "message"),
    [
        (0, 2, ValueError, r"`global_batch_size`=0.*>= 1"),
        (-8, 2, ValueError, r"`global_batch_size`=-8"),
        (2.5, 2, TypeError, r"`global_batch_size`=2.5"),
        (3, 4, ValueError, r"`global_batch_size`=3 is smaller than the data-parallel size \(4 processes.*>= 4"),
    ],
)
def test_global_batch_size_is_checked(global_batch_size, world_size, error, message):
    with pytest.raises(error, match=message):
        per_device_batch_size(global_batch_size, world_size)


def test_per_device_batch_is_derived_from_the_world_size():
    assert per_device_batch_size(64, 3) == 21
    datamodule = SyntheticDataModule(global_batch_size=64)
    datamodule.world_size = 3
    assert datamodule.per_device_batch_size == 21
    assert datamodule.effective_global_batch_size == 63


def test_global_batch_below_world_size_fails_before_any_process_starts(tmp_path):
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 3, max_epochs=1)
    message = r"`global_batch_size`=2 is smaller than the data-parallel size \(3 processes"
    with pytest.raises(ValueError, match=message):
        trainer.fit(
            RecordingModule(tmp_path), datamodule=ShardPlusDataModule(2, train_dataset=IndexedDataset(8))
        )
    assert not dist.is_initialized()


def test_uneven_global_batch_warns_with_the_effective_batch(tmp_path):
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 3, max_epochs=1)
    datamodule = ShardPlusDataModule(10, train_dataset=IndexedDataset(8))
    message = r"global_batch_size=10.*\(3\).*3 samples per step.*effective global batch is 9"
    with pytest.warns(UserWarning, match=message):
        datamodule.trainer = trainer
    assert datamodule.per_device_batch_size == 3
    with warnings.catch_warnings():  # attached again (each fork worker does, with its copy): said once
        warnings.simplefilter("error")
        datamodule.trainer = trainer


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": -1}, r"`num_workers`=-1"),
        ({"shuffle": "no"}, r"`shuffle`='no'"),
        ({"collate_fn": 5}, r"`collate_fn`=5 is not valid: expected a callable"),
        ({"train_dataset": _Stream()}, r"`train_dataset` is an IterableDataset \(a stream\).*train_dataloaders"),
        ({"val_dataset": [[1], [2]].__iter__()}, r"`val_dataset` is a list_iterator: .* map-style"),
    ],
)
def test_datamodule_rejects_bad_arguments(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ShardPlusDataModule(8, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_samples": 0}, r"`num_samples`=0"),
        ({"input_shape": (0, 3)}, r"`input_shape`=\(0, 3\)"),
        ({"input_shape": 32}, r"`input_shape`=32 is not valid: expected a sequence"),
        ({"num_classes": 1}, r"`num_classes`=1"),
    ],
)
def test_synthetic_datamodule_rejects_bad_arguments(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SyntheticDataModule(**kwargs)


def test_a_stream_built_by_a_datamodule_subclass_is_refused_in_setup():
    class Streaming(ShardPlusDataModule):
        def build_train_dataset(self):
            return _Stream()

    with pytest.raises(ValueError, match=r"`build_train_dataset\(\)` is an IterableDataset"):
        Streaming(4).setup("fit")


def test_empty_training_set_in_the_datamodule_is_a_clear_error():
    datamodule = ShardPlusDataModule(4, train_dataset=IndexedDataset(0))
    with pytest.raises(ValueError, match=r"`train_dataset` is empty"):
        datamodule.setup("fit")
    with pytest.raises(ValueError, match=r"no training dataset"):
        ShardPlusDataModule(4).setup("fit")


def test_synthetic_data_is_deterministic_for_a_seed():
    first, again, other = (SyntheticDataModule(seed=s, num_samples=16) for s in (1, 1, 2))
    for dm in (first, again, other):
        dm.setup("fit")
    assert first.datasets["train"].tensors[0].equal(again.datasets["train"].tensors[0])
    assert not first.datasets["train"].tensors[0].equal(other.datasets["train"].tensors[0])


def test_a_stand_in_module_without_a_trainer_connects():
    # Lightning's own launcher tests connect a `Mock(spec=BoringModel)`, which has no `_trainer` attribute
    from unittest.mock import Mock

    from lightning.pytorch.demos.boring_classes import BoringModel

    model = Mock(wraps=BoringModel(), spec=BoringModel)
    strategy = ShardPlusStrategy()
    strategy.connect(model)
    assert strategy.model is model and strategy.effective_batch_size is None


def _ddp_accepts(name):
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return name in inspect.signature(DistributedDataParallel.__init__).parameters


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"forward_sync_buffers": "no"}, TypeError, r"`forward_sync_buffers`='no' is not valid: expected True"),
        ({"init_sync": "no"}, TypeError, r"`init_sync`='no' is not valid: expected True or False"),
        ({"skip_all_reduce_unused_params": "x"}, TypeError, r"`skip_all_reduce_unused_params`='x'.*True or False"),
        ({"batched_grad_copy": 1}, TypeError, r"`batched_grad_copy`=1 is not valid"),
        ({"check_reduction": "yes"}, TypeError, r"`check_reduction`='yes' is not valid"),
        ({"gradient_as_bucket_view": "no"}, TypeError, r"`gradient_as_bucket_view`='no' is not valid"),
        ({"bucket_cap_mb_list": [-1]}, ValueError, r"`bucket_cap_mb_list`=\[-1\] is not valid: expected a list of"),
        ({"bucket_cap_mb_list": ["x"]}, ValueError, r"`bucket_cap_mb_list`=\['x'\] is not valid: expected a list"),
        ({"bucket_cap_mb_list": "x"}, ValueError, r"`bucket_cap_mb_list`='x' is not valid: expected a list"),
        ({"dim": 1.5}, TypeError, r"`dim`=1.5 is not valid: expected an integer"),
        ({"output_device": "nowhere"}, ValueError, r"`output_device`='nowhere' is not valid: expected None, a device"),
        ({"output_device": [0]}, TypeError, r"`output_device`=\[0\] is not valid: expected None, a device"),
        ({"device_ids": [0]}, TypeError, r"`device_ids`=\[0\] is not a ShardPlusStrategy option: .*one device"),
        ({"process_group": 1}, TypeError, r"`process_group`=1 is not valid: expected None or a .*ProcessGroup"),
        ({"device_mesh": 1}, TypeError, r"`device_mesh`=1 is not valid: expected None or a .*DeviceMesh"),
        ({"mixed_precision": 1}, TypeError, r"`mixed_precision`=1 is not valid: expected None or .*param_dtype"),
        ({"delay_all_reduce_named_params": "x"}, TypeError, r"`delay_all_reduce_named_params`='x' is not valid"),
        ({"param_to_hook_all_reduce": 1}, TypeError, r"`param_to_hook_all_reduce`=1 is not valid"),
    ],
)
def test_ddp_keyword_arguments_are_checked_at_construction(kwargs, error, message):
    # each failed only inside every worker (pybind errors), or was silently taken as true (`init_sync="no"`)
    if not all(_ddp_accepts(name) for name in kwargs):
        pytest.skip(f"this torch's DistributedDataParallel has no {list(kwargs)}")
    with pytest.raises(error, match=message):
        ShardPlusStrategy(**kwargs)
    assert not dist.is_initialized()


def test_ddp_keyword_arguments_that_go_together_are_checked_together():
    import torch.nn as nn

    parameter = nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=r"`delay_all_reduce_named_params`.*`param_to_hook_all_reduce`.*together"):
        ShardPlusStrategy(delay_all_reduce_named_params=[("w", parameter)])
    strategy = ShardPlusStrategy(delay_all_reduce_named_params=[("w", parameter)], param_to_hook_all_reduce=parameter)
    assert _lightning.ddp_kwargs(strategy)["param_to_hook_all_reduce"] is parameter
    strategy = ShardPlusStrategy(output_device="cpu", dim=np.int64(1), bucket_cap_mb_list=[np.float32(1), 25])
    assert _lightning.ddp_kwargs(strategy)["dim"] == 1 and type(_lightning.ddp_kwargs(strategy)["dim"]) is int
    assert _lightning.ddp_kwargs(strategy)["bucket_cap_mb_list"] == [1.0, 25.0]


def test_numpy_bools_are_bools():
    # numpy's numbers are taken where numbers are; its bools where bools are, given to DDP as Python bools
    flags = {name: np.bool_(True) for name in ("init_sync", "skip_all_reduce_unused_params") if _ddp_accepts(name)}
    strategy = ShardPlusStrategy(
        static_graph=np.bool_(True), find_unused_parameters=np.bool_(False), exact_evaluation=np.bool_(False), **flags
    )
    ddp_kwargs = _lightning.ddp_kwargs(strategy)
    assert ddp_kwargs["static_graph"] is True and ddp_kwargs["find_unused_parameters"] is False
    assert all(ddp_kwargs[name] is True for name in flags)
    assert strategy.config.exact_evaluation is False


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"checkpoint_io": 1}, TypeError, r"`checkpoint_io`=1 is not valid: expected None or a .*CheckpointIO"),
        ({"precision_plugin": "16"}, TypeError, r"`precision_plugin`='16' is not valid: expected None or a .*Precis"),
        ({"cluster_environment": 1}, TypeError, r"`cluster_environment`=1 is not valid: expected None or a .*Cluster"),
        ({"ddp_comm_hook": 1}, TypeError, r"`ddp_comm_hook`=1 is not valid: expected None or a callable"),
        ({"ddp_comm_wrapper": "fp16"}, TypeError, r"`ddp_comm_wrapper`='fp16' is not valid: expected None or a call"),
        ({"model_averaging_period": 0}, ValueError, r"`model_averaging_period`=0 is not valid: expected an integer"),
        ({"accelerator": 1}, TypeError, r"`accelerator`=1 is not valid: expected None, an Accelerator or one of"),
        ({"accelerator": "join"}, ValueError, r"`accelerator`='join' is not valid: expected .*'cpu'.*keyword"),
    ],
)
def test_ddp_strategy_arguments_are_checked_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        ShardPlusStrategy(**kwargs)
    assert not dist.is_initialized()


def test_a_positional_argument_is_the_accelerator_and_a_shardplus_option_there_is_refused_clearly():
    # `ShardPlusStrategy("join")` passed "join" as DDPStrategy's first argument, `accelerator`: say so
    with pytest.raises(ValueError, match=r"`accelerator`='join' .*first positional argument.*by keyword"):
        ShardPlusStrategy("join")
    # an accelerator by name or instance, by keyword or position, as DDPStrategy takes it
    from lightning.pytorch.accelerators import CPUAccelerator

    devices = [torch.device("cpu")] * 2
    assert ShardPlusStrategy(accelerator="cpu", parallel_devices=devices).parallel_devices == devices
    assert isinstance(ShardPlusStrategy(CPUAccelerator(), devices).accelerator, CPUAccelerator)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("argument", ["autotune_cache", "autotune_log"])
def test_an_autotune_path_that_cannot_be_created_is_refused_at_construction(argument):
    # os.access calls /proc writable for root; creating a directory there fails
    path = "/proc/shardplus-test/fusion.json"
    with pytest.raises(ValueError, match=rf"`{argument}`='{path}' cannot be written"):
        ShardPlusStrategy(auto_tune_tensor_fusion=True, **{argument: path})
    assert not os.path.exists("/proc/shardplus-test")


def test_checking_an_autotune_path_leaves_nothing_behind(tmp_path):
    ShardPlusStrategy(auto_tune_tensor_fusion=True, autotune_log=str(tmp_path / "a" / "b" / "log.csv"))
    assert list(tmp_path.iterdir()) == []


def test_the_plugins_of_either_lightning_namespace_pass_the_construction_check():
    # pytorch_lightning / lightning_fabric are separate class hierarchies: their plugins are not refused as not ours
    fabric = pytest.importorskip("lightning_fabric.plugins")
    environments = pytest.importorskip("lightning_fabric.plugins.environments")
    pl_precision = pytest.importorskip("pytorch_lightning.plugins.precision")
    pl_accelerators = pytest.importorskip("pytorch_lightning.accelerators")
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.plugins.precision import Precision

    for plugins in (
        {"checkpoint_io": TorchCheckpointIO(), "cluster_environment": LightningEnvironment()},
        {"precision_plugin": Precision()},
        {"checkpoint_io": fabric.TorchCheckpointIO(), "cluster_environment": environments.LightningEnvironment()},
        {"precision_plugin": pl_precision.Precision(), "accelerator": pl_accelerators.CPUAccelerator()},
    ):
        ShardPlusStrategy(**plugins)


def test_the_start_up_line_names_the_features_in_effect_through_lightnings_logger(caplog):
    import logging

    from lightning_shardplus.data.components import features_in_effect
    from lightning_shardplus.gradients.ddp.config import ShardPlusConfig
    from lightning_shardplus.gradients.ddp.side import DDPGradients

    config = ShardPlusConfig(aggregation_frequency=4, gradient_compression="fp16", average_training_metrics=False)
    line = features_in_effect(config, 3, fitting=True, gradients=DDPGradients(config))
    assert line.startswith("shardplus: 3 processes: padded equal training shards (padding 'first'")
    assert "averaged training metrics off" in line and "4 micro-batches per optimizer step" in line and "'fp16'" in line
    assert features_in_effect(config, 3, False, DDPGradients(config)) == "shardplus: 3 processes, exact evaluation on"
    assert features_in_effect(config, 2, True, DDPGradients(config), launcher_name="Ray Train").startswith(
        "shardplus: 2 processes started by Ray Train: padded"
    )  # the Ray strategies' `launcher_name` (tests/test_ray.py runs them)
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    def fit() -> None:
        trainer = pl.Trainer(strategy=ShardPlusStrategy(), accelerator="cpu", devices=1, max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(BoringModel())

    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        fit()
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("shardplus: 1 processes: padded")]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning.pytorch"):  # Lightning's switch silences it
        fit()
    assert not [r for r in caplog.records if r.getMessage().startswith("shardplus:")]
