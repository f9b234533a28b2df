"""Streams of WebDataset and Mosaic Streaming: uneven shards per rank take equal steps, with every sample once
under "join"; Mosaic under Lightning's own launcher and through a mid-epoch resume after a rank ran out.

The libraries are optional test dependencies: each test is skipped, with the reason, where its library is absent
(docs/uneven-inputs.md gives the install recipe)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from _models import cpu_trainer
from test_uneven import Regression, batches_of, rows, sample

from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus.uneven import is_stream

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
