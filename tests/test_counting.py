"""Counting communication: what the observed process group and the collective calls see, and that counting replaces
nothing in ``torch.distributed`` (the counts themselves are checked in test_compression, test_aggregation, ...)."""

import json

import pytest
import torch
import torch.distributed as dist
from _models import IndexedDataset, RecordingModule, cpu_trainer
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus.diagnostics import CollectiveCalls, CommunicationCounter, ObservedProcessGroup

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier", "all_gather_into_tensor", "reduce_scatter_tensor")
ORIGINALS = {name: getattr(dist, name) for name in COLLECTIVES}


@pytest.fixture
def one_process_group():
    """A gloo process group of this process alone, destroyed afterwards (a later fork must not inherit it)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_an_observed_group_reports_the_payload_and_forwards_the_collective(one_process_group):
    seen = []
    observed = ObservedProcessGroup(one_process_group, lambda tensors: seen.append([t.clone() for t in tensors]))
    tensor = torch.arange(3.0)
    dist.all_reduce(tensor, group=observed)
    gathered = [torch.zeros(2, dtype=torch.float16)]
    dist.all_gather(gathered, torch.ones(2, dtype=torch.float16), group=observed)
    assert torch.equal(tensor, torch.arange(3.0)) and torch.equal(gathered[0], torch.ones(2, dtype=torch.float16))
    assert [[t.dtype for t in tensors] for tensors in seen] == [[torch.float32], [torch.float16]]
    assert observed.size() == 1 and observed.rank() == 0


@pytest.mark.skipif(not CollectiveCalls.available(), reason="torch has no pre-collective hooks (torch < 2.14)")
def test_collective_calls_count_torch_distributed_calls_until_stopped(one_process_group):
    counts = CollectiveCalls()
    assert counts.start()
    for _ in range(2):
        dist.all_reduce(torch.ones(1))
    dist.barrier()
    dist.broadcast(torch.ones(1), src=0)
    observed = ObservedProcessGroup(one_process_group, lambda tensors: None)
    dist.all_reduce(torch.ones(1), group=observed)  # a hook's all-reduce, through the counter's view
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    ddp(torch.ones(1, 3)).sum().backward()  # DDP's built-in all-reduce: issued by its C++ reducer, not counted
    counts.stop()
    dist.all_reduce(torch.ones(1))
    assert counts.snapshot() == {"all_reduce": 3, "barrier": 1, "broadcast": 1}


def test_collective_calls_without_a_process_group_count_nothing():
    counts = CollectiveCalls()
    assert not counts.start() and counts.snapshot() == {}
    counts.stop()


class RecordCollectives(Callback):
    """Each rank writes whether ``torch.distributed``'s collectives are still torch's own during training."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        untouched = all(getattr(dist, name) is original for name, original in ORIGINALS.items())
        with open(self.path / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"untouched": untouched}) + "\n")


@pytest.mark.timeout(120)
def test_counting_replaces_nothing_in_torch_distributed(tmp_path):
    counter = CommunicationCounter(tmp_path / "counts")
    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork", gradient_compression="fp16"),
        2,
        max_epochs=1,
        callbacks=[counter, RecordCollectives(tmp_path)],
    )
    trainer.fit(RecordingModule(tmp_path / "records"), DataLoader(IndexedDataset(16), batch_size=2))
    for rank in range(2):
        rows = [json.loads(line) for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()]
        assert len(rows) == 4 and all(row["untouched"] for row in rows)
        summary = json.loads((tmp_path / "counts" / f"rank{rank}.json").read_text())["summary"]
        assert summary["collectives_per_step"] == 1 and summary["bytes_per_step"] == 2 * (4 * 3 + 3)  # fp16
