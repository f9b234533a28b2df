"""shardplus on Ray Train (``lightning_shardplus.ray``): a local Ray instance, ``TorchTrainer`` with 2 and 3 CPU
workers, the Trainer built as Ray documents its Lightning integration. What Ray reports (``result.metrics``) is
compared with a one-process evaluation of the final weights; each worker's samples are read from its records. One
Ray instance and one run per worker count, shared by the tests (starting workers dominates the time)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.lightning")

from _models import read_records  # noqa: E402
from _ray_probe import (  # noqa: E402
    Gate,
    RayRegression,
    RegressionData,
    UnequalSplit,
    ray_data_rows,
    ray_data_train_function,
    resumable_train_function,
    train_function,
)
from ray.cluster_utils import Cluster  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("ray")]  # one Ray instance, in one xdist worker


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (each worker takes half a CPU: 3 fit in it), a cluster of one node
    that a test can add nodes to (all on this machine); the workers import the tests' helpers. ``slot``: a resource
    of which the head node has 2, for the elastic test."""
    tests = str(Path(__file__).parent)
    path = os.pathsep.join(filter(None, [str(Path(tests).parent), tests, os.environ.get("PYTHONPATH")]))
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"slot": 2}, "include_dashboard": False}
    )
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _fit(
    tmp_path: Path, workers, function=train_function, max_failures: int = 0, scaling=None, trainer_kwargs=None, **config
):
    config = dict(record_dir=str(tmp_path / "records"), strategy="shardplus", epochs=2, batch_size=2) | config
    scaling = dict(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 0.5}) | (scaling or {})
    trainer = TorchTrainer(
        function, train_loop_config=config, scaling_config=ScalingConfig(**scaling),
        run_config=RunConfig(
            storage_path=str(tmp_path / "storage"), name="run", failure_config=FailureConfig(max_failures=max_failures)
        ),
        **(trainer_kwargs or {}),
    )  # fmt: skip
    result = trainer.fit()
    assert result.error is None
    return result, read_records(tmp_path / "records"), tmp_path / "records"


@pytest.fixture(scope="module")
def two_workers(local_ray, tmp_path_factory):
    """9 training samples (padded to 10) and 7 validation samples on 2 workers; the mesh refusal, then a model
    parallel fit first."""
    return _fit(tmp_path_factory.mktemp("ray2"), 2, train_size=9, val_size=7, mesh_refusal=True, model_parallel=True)


@pytest.fixture(scope="module")
def three_workers(local_ray, tmp_path_factory):
    """7 training samples (padded to 9) and 2 validation samples on 3 workers: the third has no sample."""
    return _fit(tmp_path_factory.mktemp("ray3"), 3, train_size=7, val_size=2)


KILL_STEP = 4  # rank 1 ends before step 5 (epoch 1's second of 3 batches), after the checkpoint of step 4


@pytest.fixture(scope="module")
def killed_and_restarted(local_ray, tmp_path_factory):
    """``two_workers``'s fit (9 training samples on 2 workers, 3 steps an epoch), reporting a checkpoint every 2
    steps, under ``FailureConfig(max_failures=1)``: rank 1's process ends before step 5 in the first attempt; Ray
    restarts the worker group, which resumes from ``ray.train.get_checkpoint()`` (step 4, inside epoch 1)."""
    directory = tmp_path_factory.mktemp("ray_killed")
    kill = (1, KILL_STEP, str(directory / "killed.json"))
    return _fit(
        directory, 2, resumable_train_function, max_failures=1, train_size=9, val_size=7, every_n_steps=2, kill=kill
    )


@pytest.fixture(scope="module")
def grown(local_ray, tmp_path_factory):
    """``two_workers``'s fit under ``ScalingConfig(num_workers=(2, 3))`` with workers that take a ``slot`` each: the
    head node has 2, so Ray starts 2 workers. Before step 4 (after its checkpoint) they stop, the driver adds a node
    with one more slot, and Ray's elastic policy replaces the group with 3 workers, which resume from
    ``ray.train.get_checkpoint()``; 3 epochs."""
    gate = Gate.remote()

    def add_node() -> None:
        ray.get(gate.wait.remote())
        # Without exit hooks: they set signal handlers, which only the main thread may (it runs `fit`); the
        # fixture's `cluster.shutdown()` stops this node too.
        local_ray._shutdown_at_exit = False
        local_ray.add_node(num_cpus=1, resources={"slot": 1})

    thread = threading.Thread(target=add_node, daemon=True)
    thread.start()
    scaling = dict(resources_per_worker={"CPU": 0.5, "slot": 1}, elastic_resize_monitor_interval_s=1.0)
    run = _fit(
        tmp_path_factory.mktemp("ray_grown"), (2, 3), resumable_train_function, scaling=scaling, train_size=9,
        val_size=7, every_n_steps=2, epochs=3, grow=(2, KILL_STEP, gate),
    )  # fmt: skip
    thread.join()
    return run


TRAIN_ROWS, VAL_ROWS = 11, 9  # Ray Data rows, in 3 blocks each: an unequal split gives 2 blocks to one worker


@pytest.fixture(scope="module")
def ray_data(local_ray, tmp_path_factory):
    """Fits on Ray Data shards (``ray_data_train_function``) on 2 workers: ``train`` (11 rows) and ``val`` (9) split
    without dropping rows (``UnequalSplit``: the greedy split gives one worker 2 of the 3 blocks), ``train_equal``
    (the same 11 rows) by Ray's own equal split; batches of 2."""
    pytest.importorskip("ray.data")
    datasets = {
        "train": ray.data.from_items(ray_data_rows(TRAIN_ROWS, 1), override_num_blocks=3),
        "train_equal": ray.data.from_items(ray_data_rows(TRAIN_ROWS, 1), override_num_blocks=3),
        "val": ray.data.from_items(ray_data_rows(VAL_ROWS, 2), override_num_blocks=3),
    }
    kwargs = dict(datasets=datasets, dataset_config=UnequalSplit(["train", "val"]))
    return _fit(tmp_path_factory.mktemp("ray_data"), 2, ray_data_train_function, trainer_kwargs=kwargs)


def _one_process_values(result, val_size: int) -> tuple[float, float]:
    """``val_mse`` and the sample count of the checkpoint Ray reported last over the whole validation set, in this
    process."""
    with result.checkpoint.as_directory() as directory:
        return _evaluate(Path(directory) / "checkpoint.ckpt", val_size)


def _evaluate(checkpoint: Path, val_size: int) -> tuple[float, float]:
    state = torch.load(checkpoint, weights_only=False)["state_dict"]
    model = RayRegression(".")
    model.load_state_dict(state)
    data = RegressionData(val_size, seed=2)
    with torch.no_grad():
        return F.mse_loss(model(data.inputs), data.targets).item(), float(len(data))


def _by_rank_and_epoch(records: list[dict], stage: str) -> dict[tuple[int, int], list[int]]:
    seen: dict[tuple[int, int], list[int]] = {}
    for row in records:
        if row["stage"] == stage:
            seen.setdefault((row["rank"], row["epoch"]), []).extend(row["indices"])
    return seen


@pytest.mark.parametrize("run, train_size, val_size, workers", [("two_workers", 9, 7, 2), ("three_workers", 7, 2, 3)])
def test_ray_reports_one_process_values(request, run, train_size, val_size, workers):
    """``result.metrics`` (``RayTrainReportCallback``: rank 0's ``callback_metrics``) equal a one-process evaluation of
    the final weights: the mean over every validation sample once, and a ``reduce_fx="sum"`` count of the dataset
    size, also where a worker has no sample (plain ``RayDDPStrategy`` reports rank 0's own values: docs/ray.md)."""
    result, records, _ = request.getfixturevalue(run)
    val_mse, count = _one_process_values(result, val_size)
    assert result.metrics["val_count"] == count == val_size
    assert result.metrics["val_mse"] == pytest.approx(val_mse, rel=1e-5)
    for epoch in (0, 1):  # every validation sample once per epoch, over the workers
        seen = _by_rank_and_epoch(records, "val")
        assert sorted(i for rank in range(workers) for i in seen.get((rank, epoch), [])) == list(range(val_size))


@pytest.mark.parametrize("run, train_size, workers", [("two_workers", 9, 2), ("three_workers", 7, 3)])
def test_ray_training_shards_are_padded_equal_and_reshuffled(request, run, train_size, workers):
    _, records, _ = request.getfixturevalue(run)
    seen = _by_rank_and_epoch(records, "train")
    per_rank = -(-train_size // workers)
    orders = []
    for epoch in (0, 1):
        shards = [seen[(rank, epoch)] for rank in range(workers)]
        assert [len(shard) for shard in shards] == [per_rank] * workers
        assert set().union(*shards) == set(range(train_size))  # every sample, padded with a repeat
        orders.append(shards)
    assert orders[0] != orders[1]  # a new global permutation in epoch 1


def _starts(records: list[dict]) -> dict[tuple[str, int], dict]:
    return {(row["attempt"], row["rank"]): row for row in records if row["stage"] == "start"}


def _global_order(shards: list[list[int]]) -> list[int]:
    """The epoch's order from the ranks' shards: rank ``r`` reads positions ``r, r + W, ...`` (docs/sharding.md)."""
    return [shards[p % len(shards)][p // len(shards)] for p in range(sum(map(len, shards)))]


def test_ray_restart_after_a_killed_worker_resumes_mid_epoch_exactly(killed_and_restarted, two_workers):
    """Rank 1 ends before step 5 (``os._exit``); Ray restarts both workers, the training function resumes from
    ``ray.train.get_checkpoint()`` (step 4, after 1 of epoch 1's 3 batches), and each rank's samples before that
    checkpoint and after the resume are, batch by batch, the uninterrupted run's (``two_workers``): every sample of
    the padded epoch order once. The final weights equal that run's bitwise."""
    result, records, record_dir = killed_and_restarted
    reference, reference_records, _ = two_workers
    killed = json.loads((record_dir.parent / "killed.json").read_text())
    assert killed == {"epoch": 1, "step": KILL_STEP}
    starts = _starts(records)
    assert {key: (row["epoch"], row["step"]) for key, row in starts.items()} == {
        ("fresh", 0): (0, 0), ("fresh", 1): (0, 0), ("resumed", 0): (1, KILL_STEP), ("resumed", 1): (1, KILL_STEP),
    }  # fmt: skip
    trained = [row for row in records if row["stage"] == "train"]
    assert not [row for row in trained if row["attempt"] == "fresh" and row["rank"] == 1 and row["step"] >= KILL_STEP]
    kept = [row for row in trained if row["attempt"] == "resumed" or row["step"] < KILL_STEP]
    expected = _by_rank_and_epoch(reference_records, "train")
    assert _by_rank_and_epoch(kept, "train") == expected
    for epoch in (0, 1):
        order = _global_order([expected[(rank, epoch)] for rank in (0, 1)])
        assert sorted(order[:9]) == list(range(9)) and len(order) == 10  # each sample once, one padding at the end
    with result.checkpoint.as_directory() as resumed, reference.checkpoint.as_directory() as uninterrupted:
        weights = torch.load(Path(resumed) / "checkpoint.ckpt", weights_only=False)["state_dict"]
        expected_weights = torch.load(Path(uninterrupted) / "checkpoint.ckpt", weights_only=False)["state_dict"]
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[name], expected_weights[name]) for name in weights)
    assert result.metrics["val_mse"] == reference.metrics["val_mse"]


def test_ray_elastic_resize_from_2_to_3_workers_reads_each_remaining_sample_once(grown, two_workers):
    """Ray's elastic policy grows the worker group from 2 to 3 when a node joins; the 3 workers resume from the
    checkpoint of step 4 (epoch 1, 4 of 9 positions consumed): the 2 workers' samples before it are the uninterrupted
    run's, the remaining 5 positions of epoch 1 are read once over 3 workers (padding after them), epoch 2 is whole."""
    result, records, _ = grown
    _, reference_records, _ = two_workers
    starts = _starts(records)
    assert {key: (row["epoch"], row["step"], row["world_size"]) for key, row in starts.items()} == {
        ("fresh", 0): (0, 0, 2), ("fresh", 1): (0, 0, 2),
        ("resumed", 0): (1, KILL_STEP, 3), ("resumed", 1): (1, KILL_STEP, 3), ("resumed", 2): (1, KILL_STEP, 3),
    }  # fmt: skip
    trained = [row for row in records if row["stage"] == "train"]
    reference = _by_rank_and_epoch(reference_records, "train")
    before = _by_rank_and_epoch([row for row in trained if row["attempt"] == "fresh"], "train")
    assert before == {key: reference[key] for key in [(0, 0), (1, 0)]} | {
        (rank, 1): reference[(rank, 1)][:2] for rank in (0, 1)
    }  # epoch 0, then epoch 1's first batch: no step past the checkpoint on 2 workers
    after = _by_rank_and_epoch([row for row in trained if row["attempt"] == "resumed"], "train")
    epoch_order = _global_order([reference[(rank, 1)] for rank in (0, 1)])
    remaining = _global_order([after[(rank, 1)] for rank in range(3)])
    assert len(remaining) == 6 and remaining[:5] == epoch_order[4:9]  # then one position of padding
    assert sorted(_global_order([before[(rank, 1)] for rank in (0, 1)]) + remaining[:5]) == list(range(9))
    assert sorted(_global_order([after[(rank, 2)] for rank in range(3)])) == list(range(9))
    assert result.error is None


def test_ray_training_metrics_are_averaged_over_workers(two_workers):
    """The reported ``train_loss`` (the last step's) is the mean of every worker's last step, not rank 0's."""
    result, records, _ = two_workers
    last = {row["rank"]: row["loss"] for row in records if row["stage"] == "train"}
    assert last[0] != pytest.approx(last[1])
    assert result.metrics["train_loss"] == pytest.approx((last[0] + last[1]) / 2, rel=1e-5)


def test_ray_model_parallel_is_exact_without_prepare_trainer(two_workers):
    """``RayShardPlusModelParallelStrategy`` (FSDP2 over Ray's 2 workers, the "auto" mesh 2 x 1): every rank's epoch
    values equal a one-process evaluation of the final (gathered) weights, 7 samples counted for 7."""
    *_, record_dir = two_workers
    directory = record_dir / "model_parallel"
    val_mse, count = _evaluate(directory / "final.ckpt", 7)
    for rank in (0, 1):
        metrics = json.loads((directory / f"metrics{rank}.txt").read_text())
        assert metrics["val_count"] == count == 7
        assert metrics["val_mse"] == pytest.approx(val_mse, rel=1e-5)


def test_ray_mesh_that_does_not_fit_workers_is_refused(two_workers):
    """A 2 x 2 mesh on Ray's 2 workers: refused in every worker before training, naming Ray's setting."""
    *_, record_dir = two_workers
    message = (record_dir / "refusal.txt").read_text()
    assert "mesh of 4 processes" in message and "starts 2 (ScalingConfig(num_workers=...))" in message


def _batches(records: list[dict], fit: str, stage: str) -> dict[tuple[int, int], list[list[int]]]:
    """The row ids of each batch of ``fit``'s ``stage`` (``yielded``: what the Ray Data shard gave), by rank and
    epoch, in order."""
    seen: dict[tuple[int, int], list[list[int]]] = {}
    for row in records:
        if row["attempt"] == fit and row["stage"] == stage:
            seen.setdefault((row["rank"], row["epoch"]), []).append(row["indices"])
    return seen


def _rows(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _epoch_end_steps(records: list[dict], fit: str) -> dict[tuple[int, int], int]:
    """The optimizer steps taken by the end of each epoch of ``fit``, by rank and epoch."""
    ends = [row for row in records if (row["attempt"], row["stage"]) == (fit, "epoch_end")]
    return {(row["rank"], row["epoch"]): row["step"] for row in ends}


def test_ray_data_shards_of_different_lengths_join_every_row_once_in_equal_steps(ray_data):
    """``uneven_inputs="join"`` on Ray Data shards of different batch counts (``streaming_split(equal=False)``), read
    through a ``DataLoader`` over an ``IterableDataset``: both workers take the longer shard's number of steps, each
    batch its shard yielded is trained once, and every row once over the workers, in each epoch."""
    _, records, _ = ray_data
    yielded, trained = _batches(records, "join", "yielded"), _batches(records, "join", "train")
    ends, steps = _epoch_end_steps(records, "join"), 0
    for epoch in (0, 1):
        counts = [len(yielded[(rank, epoch)]) for rank in (0, 1)]
        assert counts[0] != counts[1]  # the shards are uneven
        assert sorted(_rows(yielded[(0, epoch)]) + _rows(yielded[(1, epoch)])) == list(range(TRAIN_ROWS))
        assert all(trained[(rank, epoch)] == yielded[(rank, epoch)] for rank in (0, 1))
        steps += max(counts)
        assert ends[(0, epoch)] == ends[(1, epoch)] == steps


def test_ray_data_shards_of_different_lengths_drop_stops_at_the_shortest(ray_data):
    """``uneven_inputs="drop"``: both workers stop after the shorter shard's batches; the longer shard's rest is read
    (and counted as dropped) but not trained on."""
    _, records, _ = ray_data
    yielded, trained = _batches(records, "drop", "yielded"), _batches(records, "drop", "train")
    counts = [len(yielded[(rank, 0)]) for rank in (0, 1)]
    assert counts[0] != counts[1]
    shortest = min(counts)
    assert all(trained[(rank, 0)] == yielded[(rank, 0)][:shortest] for rank in (0, 1))
    assert _epoch_end_steps(records, "drop") == {(0, 0): shortest, (1, 0): shortest}
    assert sorted(_rows(yielded[(0, 0)]) + _rows(yielded[(1, 0)])) == list(range(TRAIN_ROWS))


def test_ray_data_default_equal_split_is_even_and_drops_a_row(ray_data):
    """Ray's own split (``DataConfig``: ``streaming_split(equal=True)``): equal shards, so equal steps without
    shardplus's help, and 11 rows on 2 workers lose one (11 mod 2), never trained."""
    _, records, _ = ray_data
    yielded, trained = _batches(records, "equal", "yielded"), _batches(records, "equal", "train")
    rows = [_rows(yielded[(rank, 0)]) for rank in (0, 1)]
    assert len(rows[0]) == len(rows[1]) == TRAIN_ROWS // 2
    assert len(set(rows[0] + rows[1])) == TRAIN_ROWS - 1
    assert all(trained[(rank, 0)] == yielded[(rank, 0)] for rank in (0, 1))
    assert _epoch_end_steps(records, "equal") == {(0, 0): 3, (1, 0): 3}


def test_ray_data_unequal_validation_shards_are_evaluated_exactly(ray_data):
    """Validation on Ray Data shards split without dropping rows (3 batches on one worker, 2 on the other), passed as
    ``iter_torch_batches`` itself: every row once per epoch, and the reported ``val_mse`` and sum-reduced count equal
    a one-process evaluation of the final weights over the 9 rows."""
    result, records, record_dir = ray_data
    val = _batches(records, "join", "val")
    for epoch in (0, 1):
        assert len(val[(0, epoch)]) != len(val[(1, epoch)])
        assert sorted(_rows(val[(0, epoch)]) + _rows(val[(1, epoch)])) == list(range(VAL_ROWS))
    val_mse, count = _one_process_values(result, VAL_ROWS)
    assert result.metrics["val_count"] == count == VAL_ROWS
    assert result.metrics["val_mse"] == pytest.approx(val_mse, rel=1e-5)
    for rank in (0, 1):
        metrics = json.loads((record_dir / f"metrics_{rank}.txt").read_text())
        assert metrics["val_mse"] == pytest.approx(val_mse, rel=1e-5) and metrics["val_count"] == VAL_ROWS


def test_ray_data_stream_has_no_mid_epoch_position_and_says_so(ray_data):
    """A Ray Data stream has no ``state_dict``: shardplus warns once when the fit starts (Ray's workers save
    checkpoints without a checkpoint callback). A checkpoint from an epoch's end resumes with the next epoch whole; one
    saved after epoch 1's first step resumes with epoch 1's stream from its start (its rows read again)."""
    _, records, record_dir = ray_data
    warned = json.loads((record_dir / "warnings_join_0.txt").read_text())
    assert len([w for w in warned if "no `state_dict`" in w and "iter_torch_batches" in w]) == 1
    ends = _epoch_end_steps(records, "join")
    saved = {row["name"]: row["step"] for row in records if row["stage"] == "saved" and row["rank"] == 0}
    assert saved == {"epoch_end": ends[(0, 0)], "mid_epoch": ends[(0, 0)] + 1}
    from_end = _batches(records, "from_epoch_end", "train")
    assert set(from_end) == {(0, 1), (1, 1)}
    assert sorted(_rows(from_end[(0, 1)]) + _rows(from_end[(1, 1)])) == list(range(TRAIN_ROWS))
    steps = _epoch_end_steps(records, "from_epoch_end")
    assert steps[(0, 1)] == steps[(1, 1)] == ends[(0, 1)]
    from_mid = _batches(records, "from_mid_epoch", "train")
    assert set(from_mid) == {(0, 1), (1, 1)}
    assert sorted(_rows(from_mid[(0, 1)]) + _rows(from_mid[(1, 1)])) == list(range(TRAIN_ROWS))  # the whole epoch
    steps = _epoch_end_steps(records, "from_mid_epoch")
    assert steps[(0, 1)] == steps[(1, 1)] == ends[(0, 1)] + 1  # the first step's rows trained a second time


def test_ray_front_in_the_namespace_ray_does_not_use_is_refused_at_import():
    """Ray builds its classes on ``lightning.pytorch`` where ``lightning`` is installed: the ``pytorch_lightning``
    mirror's Ray front would mix the two class hierarchies, so its import says which namespace Ray uses."""
    import importlib.util

    if importlib.util.find_spec("lightning") is None or importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("needs both Lightning namespaces")
    with pytest.raises(ImportError, match=r"built on lightning\.pytorch here, this module on pytorch_lightning"):
        import lightning_shardplus.pytorch_lightning.ray  # noqa: F401
