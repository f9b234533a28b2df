"""Streams of WebDataset and Mosaic Streaming: uneven shards per rank take equal steps, with every sample once
under "join"; Mosaic under Lightning's own launcher and through a mid-epoch resume after a rank ran out.

The libraries are optional test dependencies: each test is skipped, with the reason, where its library is absent
(docs/uneven-inputs.md gives the install recipe)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from datetime import timedelta
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _models import IndexedDataset, RecordingModule, cpu_trainer, in_external_ranks
from test_uneven import Regression, SaveAtStep, assert_state_close, batches_of, rows, sample, write_litdata
from torch.utils.data import DataLoader, IterableDataset

from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus.data.uneven import is_stream

# in the compatibility stage's `streams` environment every stream library is installed
pytestmark = pytest.mark.compat

needs_webdataset = pytest.mark.skipif(
    importlib.util.find_spec("webdataset") is None, reason="webdataset is not installed (`pip install webdataset`)"
)

# ------------------------------------------------------------------------------------------------- WebDataset


def write_tar_shards(directory: Path, sizes: list[int]) -> list[str]:
    """WebDataset tar shards of ``sizes[k]`` samples each; sample ``i`` carries its id (``sample(i)`` is the data)."""
    import webdataset as wds

    directory.mkdir(parents=True, exist_ok=True)
    urls, first = [], 0
    for k, size in enumerate(sizes):
        url = str(directory / f"shard-{k:03d}.tar")
        with wds.TarWriter(url) as sink:
            for i in range(first, first + size):
                sink.write({"__key__": f"{i:06d}", "json": {"id": i}})
        urls.append(url)
        first += size
    return urls


def _as_sample(fields):
    x, y, i = sample(fields[0]["id"])
    return x, y, i


def web_loader(urls: list[str], batch_size: int):
    """A ``wds.WebLoader`` over ``urls`` split by rank (``split_by_node``: rank r reads shards r, r + world, ...)."""
    import webdataset as wds

    stream = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node, empty_check=False)
    return wds.WebLoader(stream.decode().to_tuple("json").map(_as_sample), batch_size=batch_size, num_workers=0)


class WebRegression(Regression):
    """:class:`Regression` trained and evaluated on WebDataset loaders built on each rank."""

    def __init__(self, out: Path, urls: list[str], batch_size: int) -> None:
        super().__init__(out, lr=0.01)
        self.urls, self.batch_size = urls, batch_size

    def train_dataloader(self):
        return web_loader(self.urls, self.batch_size)

    def val_dataloader(self):
        return web_loader(self.urls, self.batch_size)


@needs_webdataset
def test_a_web_loader_is_a_stream_without_importing_webdataset_for_it():
    urls = ["unused.tar"]
    assert is_stream(web_loader(urls, 2))


# shard sizes: rank r of `world` reads shards r, r + world, ...: uneven totals per rank
SHARDS = {2: [3, 5, 2, 4, 1], 3: [6, 1, 2, 4, 0, 3]}


@needs_webdataset
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("policy", ["join", "drop"])
def test_web_loaders_with_uneven_shards_take_equal_steps(tmp_path, world, policy):
    sizes, batch_size = SHARDS[world], 2
    urls = write_tar_shards(tmp_path / "shards", sizes)
    per_rank_ids = [[i for k in range(r, len(sizes), world) for i in range(sum(sizes[:k]), sum(sizes[: k + 1]))]
                    for r in range(world)]  # fmt: skip
    assert len({len(ids) for ids in per_rank_ids}) > 1  # the streams are uneven
    out = tmp_path / "records"
    strategy = ShardPlusStrategy(start_method="fork", uneven_inputs=policy)
    trainer = cpu_trainer(strategy, world, max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(WebRegression(out, urls, batch_size))
    steps = [len(batches_of([len(ids)], 0, batch_size)) for ids in per_rank_ids]
    steps_per_epoch = max(steps) if policy == "join" else min(steps)
    ends = [rows(out, r, "end")[0] for r in range(world)]
    assert {end["global_step"] for end in ends} == {2 * steps_per_epoch}  # the same steps on every rank
    assert all(end["state"] == ends[0]["state"] for end in ends)
    for epoch in range(2):
        trained = [
            [i for row in rows(out, r, "train") if row["epoch"] == epoch for i in row["ids"]] for r in range(world)
        ]
        if policy == "join":
            assert sorted(i for ids in trained for i in ids) == list(range(sum(sizes)))  # every sample once
        else:
            assert trained == [ids[: steps_per_epoch * batch_size] for ids in per_rank_ids]
    # exact evaluation over the streams: every sample once, in each of the two validations
    evaluated = sorted(i for r in range(world) for row in rows(out, r, "val") for i in row["ids"])
    assert evaluated == sorted(list(range(sum(sizes))) * 2)


# ---------------------------------------------------------------------------- a stream that meets at each pass


class BarrierStream(IterableDataset):
    """Rank r streams its own ``lengths[r]`` samples; every pass starts with a barrier of all ranks, as Mosaic
    Streaming's does (in shared memory, between the ranks of a machine). ``start``: samples to skip in the next
    pass (a resume)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.start = lengths, 0

    def __iter__(self):
        dist.barrier()
        rank = dist.get_rank()
        first, (start, self.start) = sum(self.lengths[:rank]), (self.start, 0)
        for i in range(first + start, first + self.lengths[rank]):
            yield sample(i)


class ResumableLoader(DataLoader):
    """A loader over :class:`BarrierStream` (batch size 1) that saves and restores its place in the pass."""

    yielded = 0

    def __iter__(self):
        self.yielded = self.dataset.start
        for batch in super().__iter__():
            self.yielded += 1
            yield batch

    def state_dict(self):
        return {"yielded": self.yielded}

    def load_state_dict(self, state):
        self.dataset.start = state["yielded"]


class BarrierRegression(Regression):
    def __init__(self, out: Path, lengths: list[int]) -> None:
        super().__init__(out)
        self.lengths = lengths

    def train_dataloader(self):
        return ResumableLoader(BarrierStream(self.lengths), batch_size=1)


@pytest.mark.timeout(120)
def test_a_resume_after_a_rank_ran_out_starts_that_ranks_pass_too(tmp_path):
    # rank 1's stream ran out at step 2; the checkpoint is saved at step 4: on resume rank 1 has nothing left in
    # this pass, yet it starts its iterator, so that both ranks meet in the stream's barrier (it hung there)
    lengths, saved_at, checkpoint = [6, 2], 4, tmp_path / "mid.ckpt"

    def fit(out: Path, **fit_kwargs) -> None:
        torch.manual_seed(0)
        strategy = ShardPlusStrategy(start_method="fork", timeout=timedelta(seconds=30))
        trainer = cpu_trainer(strategy, 2, max_epochs=2, callbacks=[SaveAtStep(saved_at, checkpoint)])
        trainer.fit(BarrierRegression(out, lengths), **fit_kwargs)

    fit(tmp_path / "whole")
    fit(tmp_path / "resumed", ckpt_path=checkpoint)
    for rank in range(2):
        whole = [row["ids"] for row in rows(tmp_path / "whole", rank, "train") if row["step"] >= saved_at]
        assert [row["ids"] for row in rows(tmp_path / "resumed", rank, "train")] == whole
    ends = [rows(tmp_path / d, 0, "end")[0] for d in ("whole", "resumed")]
    assert ends[1]["global_step"] == ends[0]["global_step"] == 12
    assert_state_close(ends[1]["state"], ends[0]["state"])


class RankVariables(Regression):
    def on_train_start(self):
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        self._write("environment", **{name: os.environ.get(name) for name in names})


@pytest.mark.timeout(120)
def test_each_process_has_the_rank_variables_stream_libraries_read_during_the_run(tmp_path):
    out = tmp_path / "records"
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 3, max_steps=1)
    trainer.fit(RankVariables(out), DataLoader([sample(i) for i in range(6)], batch_size=2))
    for rank in range(3):
        (seen,) = rows(out, rank, "environment")
        assert seen == {"kind": "environment", "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": "3"}  # fmt: skip
    one = cpu_trainer(ShardPlusStrategy(start_method="fork"), 1, max_steps=1)
    one.fit(RankVariables(tmp_path / "one"), DataLoader([sample(i) for i in range(6)], batch_size=2))
    assert "RANK" not in os.environ and "LOCAL_WORLD_SIZE" not in os.environ  # removed at teardown
    # one process: none set (as under ddp), so a strategy set up and never torn down leaves none behind
    (alone,) = rows(tmp_path / "one", 0, "environment")
    assert alone["RANK"] is alone["WORLD_SIZE"] is alone["LOCAL_WORLD_SIZE"] is None  # (LOCAL_RANK: Lightning's)


# ------------------------------------------------------------------------------------------- Mosaic Streaming

needs_mosaic = pytest.mark.skipif(
    importlib.util.find_spec("streaming") is None,
    reason="mosaicml-streaming is not installed (it needs a torchvision matching torch: docs/uneven-inputs.md)",
)

MOSAIC_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import lightning.pytorch as pl
import torch
from streaming import StreamingDataset
from torch.utils.data import DataLoader
import lightning_shardplus
from test_uneven import Regression, sample


class MosaicRegression(Regression):
    def train_dataloader(self):  # built in each process, after the strategy set up the distributed environment
        return DataLoader(StreamingDataset(local={data!r}, batch_size=2, shuffle=False), batch_size=2)

    def training_step(self, batch, batch_idx):
        ids = batch["id"].tolist()
        x, y = torch.stack([sample(i)[0] for i in ids]), torch.stack([sample(i)[1] for i in ids])
        return super().training_step((x, y, torch.tensor(ids)), batch_idx)


if __name__ == "__main__":
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="shardplus", max_epochs=2, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )
    trainer.fit(MosaicRegression({out!r}))
"""


@needs_mosaic
@pytest.mark.timeout(300)
def test_mosaic_streaming_trains_under_lightnings_own_launcher(tmp_path):
    # Mosaic reads RANK and LOCAL_WORLD_SIZE, which Lightning's launcher does not set: every process took itself
    # for rank 0 of one and the second failed with FileExistsError on Mosaic's shared memory, before any step
    from streaming import MDSWriter

    count, data, out = 7, tmp_path / "mds", tmp_path / "records"
    with MDSWriter(out=str(data), columns={"id": "int"}) as writer:
        for i in range(count):
            writer.write({"id": i})
    script = tmp_path / "train.py"
    tests = str(Path(__file__).parent)
    script.write_text(MOSAIC_SCRIPT.format(tests=tests, data=str(data), out=str(out)))
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    assert result.returncode == 0, result.stderr[-4000:]
    per_rank = [[i for row in rows(out, r, "train") if row["epoch"] == 0 for i in row["ids"]] for r in range(2)]
    # Mosaic pads the ranks to equal shards by repeating samples (its design): every sample at least once
    assert set(per_rank[0]) | set(per_rank[1]) == set(range(count)) and len(per_rank[0]) == len(per_rank[1])
    ends = [rows(out, r, "end")[0] for r in range(2)]
    assert ends[0]["global_step"] == ends[1]["global_step"] == 4 and ends[0]["state"] == ends[1]["state"]


# ------------------------------------------------------------------------------------ litdata's drop_last warning

needs_litdata = pytest.mark.skipif(importlib.util.find_spec("litdata") is None, reason="litdata is not installed")


class LitdataWarnings(RecordingModule):
    """Builds a ``StreamingDataset(drop_last=False)`` in ``setup`` (where datamodules build theirs) and records
    what litdata logged about it on this rank."""

    def __init__(self, record_dir: Path, data: Path) -> None:
        super().__init__(record_dir)
        self.data = data

    def setup(self, stage):
        from litdata import StreamingDataset

        caught: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = caught.append
        litdata_logger = logging.getLogger("litdata.streaming.dataset")
        litdata_logger.addHandler(handler)
        try:
            StreamingDataset(str(self.data), drop_last=False)
        finally:
            litdata_logger.removeHandler(handler)
        said = [record.getMessage() for record in caught if "drop_last" in record.getMessage()]
        (self.record_dir / f"said{self.global_rank}.json").write_text(json.dumps(said))


@needs_litdata
@pytest.mark.timeout(120)
@pytest.mark.parametrize("exact_evaluation", [True, False])
def test_litdatas_drop_last_warning_is_silenced_where_shardplus_makes_it_false(tmp_path, exact_evaluation):
    # "may lead to training interruptions if your system depends on distributed collectives": not so with equal
    # training steps and evaluation without per-batch collectives (exact_evaluation=False has them)
    data = write_litdata(tmp_path / "data", 5)
    out = tmp_path / "records"
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork", exact_evaluation=exact_evaluation), 2)
    trainer.validate(LitdataWarnings(out, data), DataLoader(IndexedDataset(4), batch_size=2))
    said = [json.loads((out / f"said{rank}.json").read_text()) for rank in range(2)]
    assert said == ([[], []] if exact_evaluation else [[said[0][0]], [said[0][0]]])


# ------------------------------------------------------------------------------ stream libraries under model parallel

STREAMS_PROBE = Path(__file__).parent / "_model_parallel_streams.py"


def _write_ids(library: str, directory: Path, count: int) -> Path:
    """A litdata or Mosaic dataset of the records {"id": 0..count-1}."""
    if library == "litdata":
        from litdata.streaming.writer import BinaryWriter

        writer = BinaryWriter(str(directory), chunk_bytes="64KB")
        for i in range(count):
            writer[i] = {"id": i}
        writer.done()
        writer.merge()
        return directory
    from streaming import MDSWriter

    with MDSWriter(out=str(directory), columns={"id": "int"}) as writer:
        for i in range(count):
            writer.write({"id": i})
    return directory


def _run_streams(tmp_path: Path, library: str, dp: int = 2, tp: int = 2) -> list[dict]:
    import _model_parallel_streams as probe

    data = _write_ids(library.split("-")[0], tmp_path / "data", 10)
    run = partial(probe.main, dp, tp, library, str(data), str(tmp_path / "found"))
    in_external_ranks(run, world_size=dp * tp, timeout=300, cwd=tmp_path)
    return [json.loads((tmp_path / f"found.{rank}.json").read_text()) for rank in range(dp * tp)]


def _assert_read_by_data_parallel_rank(found: list[dict], tp: int = 2) -> None:
    from test_model_parallel import one_process

    for rank, result in enumerate(found):  # tensor-parallel peers read what their data-parallel rank 0 peer read
        assert result["seen"] == found[rank - rank % tp]["seen"], (rank, [r["seen"] for r in found])
        assert result["validate"] == [one_process(10)]  # exact evaluation: every sample once
    seen = [i for result in found[::tp] for i in result["seen"]]
    assert sorted(seen) == list(range(10))  # disjoint and complete over the data-parallel ranks


@needs_litdata
@pytest.mark.timeout(400)
def test_litdata_reads_by_the_data_parallel_rank_under_tensor_parallel(tmp_path):
    # litdata shards by torch.distributed's world: without shardplus giving it the data-parallel rank, the four ranks
    # of a 2 x 2 mesh would read four different quarters
    pytest.importorskip("torch.distributed.tensor.parallel")
    _assert_read_by_data_parallel_rank(_run_streams(tmp_path, "litdata"))


@needs_litdata
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("shuffle", "workers"), [(False, 0), (True, 2)], ids=["in-order", "shuffled-2-workers"])
def test_a_litdata_stream_resumes_mid_epoch_where_it_was_under_tensor_parallel(tmp_path, shuffle, workers):
    # scripts, not forks of this process: with loader workers (forked again from each rank) torch 2.14's CUDA build
    # aborted in the autograd engine's thread start ("Invalid thread pool!", the streams compat stage)
    from test_model_parallel import _launch

    data = _write_ids("litdata", tmp_path / "data", 20)
    probe = Path(__file__).parent / "_model_parallel_stream_resume.py"
    _launch(probe, tmp_path, 2, 2, data, tmp_path, int(shuffle), workers)
    found = [json.loads((tmp_path / f"found.2.{rank}.json").read_text()) for rank in range(4)]
    for rank, result in enumerate(found):
        assert result == found[rank - rank % 2]  # tensor-parallel peers read alike, in both fits
        assert result["resumed"] == result["whole"][4:]  # after 2 optimizer steps of 2 samples: the rest, once
        if not shuffle:
            assert result["whole"] == list(range(10 * (rank // 2), 10 * (rank // 2) + 10))  # its half, in order
    assert sorted(found[0]["whole"] + found[2]["whole"]) == list(range(20))  # every sample once per epoch
    # the same checkpoint on 3 data-parallel ranks: the streams restart their epoch, said once; every sample once
    _launch(probe, tmp_path, 3, 1, data, tmp_path, int(shuffle), workers)
    elsewhere = [json.loads((tmp_path / f"found.3.{rank}.json").read_text()) for rank in range(3)]
    assert {i for result in elsewhere for i in result["resumed"]} == set(range(20))
    assert elsewhere[0]["trained"] == 20  # each once (a rank whose stream ran out runs stand-ins: untrained)
    assert elsewhere[0]["said"] == [
        "shardplus: the checkpoint holds the training streams' positions of 2 ranks, this run has 3: the streams start "
        "again from the beginning of their epoch."
    ]
    assert [result["said"] for result in found] == [[]] * 4  # on the same mesh: nothing to say


@needs_mosaic
@pytest.mark.timeout(400)
def test_mosaic_needs_replication_by_the_tensor_parallel_size_and_reads_by_the_data_parallel_rank_with_it(tmp_path):
    _assert_read_by_data_parallel_rank(_run_streams(tmp_path / "replicated", "mosaic"))
    for result in _run_streams(tmp_path / "unreplicated", "mosaic-unreplicated"):
        assert "StreamingDataset(replication=None)" in result["error"] and "replication=2" in result["error"]


@needs_litdata
def test_litdata_datasets_are_given_the_data_parallel_rank_and_combined_ones_refused(tmp_path):
    from litdata import CombinedStreamingDataset, StreamingDataset

    from lightning_shardplus.data.group import DataParallel, read_by_data_parallel_rank

    class Subclassed(StreamingDataset):  # litdata's way to customize a stream: read by the data-parallel rank too
        pass

    data = _write_ids("litdata", tmp_path / "data", 10)
    loader = DataLoader(Subclassed(str(data)), batch_size=2)
    read_by_data_parallel_rank(loader, DataParallel(4, 3), 4)  # every rank a data-parallel rank: as litdata found it
    assert (loader.dataset.distributed_env.world_size, loader.dataset.distributed_env.global_rank) == (1, 0)
    read_by_data_parallel_rank(loader, DataParallel(2, 1), 4)  # global rank 2 or 3 of a 2 x 2 mesh
    env = loader.dataset.distributed_env
    assert (env.world_size, env.global_rank, env.num_nodes) == (2, 1, 1) and len(loader.dataset) == 5
    combined = DataLoader(CombinedStreamingDataset([StreamingDataset(str(data)), StreamingDataset(str(data))]))
    with pytest.raises(ValueError, match="CombinedStreamingDataset under model parallel .2 tensor-parallel peers"):
        read_by_data_parallel_rank(combined, DataParallel(2, 1), 4)
