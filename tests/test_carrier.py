"""The gradient carrier: numbers summed over ranks inside DDP's gradient all-reduce, without changing the model,
its gradients or its checkpoints. Raw DDP on 3 forked gloo processes, then Lightning fits."""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback
from contextlib import nullcontext
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import cpu_trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus.carrier import GradientCarrier
from lightning_shardplus.metrics import CARRIED_NUMEL, FusedMetricReducer

WORLD = 3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def loaded(rank: int, step: int) -> torch.Tensor:
    """What rank ``rank`` carries in step ``step``: 0/1 flags, then values."""
    flags = torch.tensor([1.0, rank % 2, 1.0, 0.0])
    return torch.cat((flags, torch.arange(6, dtype=torch.float64) * (rank + 1) + step / 3))


def _worker(rank: int, store: str, flags: dict, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        inputs = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
        plain, carried_module = model(), model()
        reference = DistributedDataParallel(plain, **flags)
        carrier = GradientCarrier(numel=10)
        with carrier.registered_on(carried_module):
            ddp = DistributedDataParallel(carried_module, **flags)
        rows, kept = [], []
        for step in range(3):  # the second step runs in the buckets DDP rebuilt after the first
            # from the second step on, a micro-batch under no_sync, then the synced one (static_graph refuses
            # no_sync in its first iteration, as torch documents)
            for micro, sync in enumerate((False, True) if step else (True,)):
                context = ddp.no_sync() if not sync else nullcontext()
                reference_context = reference.no_sync() if not sync else nullcontext()
                with reference_context:
                    reference(inputs + micro).square().mean().backward()
                with context:
                    loss = carrier.join(ddp(inputs + micro).square().mean())
                    if sync:  # DDP averages: numbers times the world size come out summed
                        carrier.load(loaded(rank, step) * WORLD)
                    loss.backward()
            total = carrier.average()
            kept.append((total, total.tolist()))
            # equal up to the order of the float32 additions (the ring all-reduce cuts a longer bucket elsewhere)
            grads_equal = all(
                torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7)
                for a, b in zip(plain.parameters(), carried_module.parameters(), strict=True)
            )
            for module in (plain, carried_module):
                module.zero_grad()
            rows.append({"total": total.tolist(), "grads_equal": grads_equal, "again": carrier.average()})
        # a result stays as it was read through the later backwards (under gradient_as_bucket_view too, where
        # the carrier's gradient is a view of DDP's bucket)
        rows.append({"kept_intact": [tensor.tolist() == values for tensor, values in kept]})
        names = [name for name, _ in carried_module.named_parameters()] + list(carried_module.state_dict())
        rows.append({"carrier_seen": any("carrier" in name for name in names)})
        carrier.close()
        (out / f"rank{rank}.json").write_text(json.dumps(rows))
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    # exit at once: tearing the DDP wrappers down with the process group hung now and then in these raw workers
    os._exit(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flags",
    [{}, {"static_graph": True}, {"gradient_as_bucket_view": True}],
    ids=["defaults", "static_graph", "bucket_view"],
)
def test_ddp_sums_the_carried_buffers_and_leaves_the_gradients_alone(tmp_path, flags):
    context = multiprocessing.get_context("fork")
    store = str(tmp_path / "store")
    workers = [context.Process(target=_worker, args=(r, store, flags, tmp_path)) for r in range(WORLD)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(90)
    assert [worker.exitcode for worker in workers] == [0] * WORLD
    for rank in range(WORLD):
        rows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rows[-2] == {"kept_intact": [True] * 3}
        for step, row in enumerate(rows[:-2]):
            expected = sum(loaded(r, step) for r in range(WORLD))
            assert row["total"] == pytest.approx(expected.tolist(), rel=1e-6, abs=1e-6)
            assert [round(x) for x in row["total"][:4]] == expected[:4].tolist()  # the 0/1 sums: integers
            assert row["grads_equal"], "the carrier changed the model's gradients"
            assert row["again"] is None  # a sum is read once
        assert rows[-1] == {"carrier_seen": False}


def test_bit_headers_survive_ddps_float32_average_at_a_thousand_ranks():
    """The reducer's header (0/1 flags) summed as DDP sums a float32 gradient: each rank's value divided by the
    world size, rounded to float32, added up in float32: still read exactly, and a mismatch still found."""
    world = 1000

    def run(mismatched_rank: int | None) -> list:
        reducers = [FusedMetricReducer(world, r, None, lambda obj: [obj] * world) for r in range(world)]
        for r, reducer in enumerate(reducers):
            reducer.observe("loss", "mean", torch.tensor(1.0 + r / world), weight=2.0 + r % 3)
            if r == mismatched_rank:
                reducer.observe("extra", "mean", torch.tensor(1.0))
        averaged = torch.stack([reducer.pack().float() / world for reducer in reducers]).sum(0)
        total = averaged.double() * world
        return [reducers[0].unpack(total.clone()), reducers[-1].unpack(total.clone())]

    first, last = run(None)
    weights = [2.0 + r % 3 for r in range(world)]
    mean = sum((1.0 + r / world) * w for r, w in enumerate(weights)) / sum(weights)
    assert first["loss"].value == pytest.approx(mean, rel=1e-5)
    assert last["loss"].value == first["loss"].value
    with pytest.raises(Exception, match="different training metrics"):
        run(mismatched_rank=7)


def test_a_float64_value_packs_into_the_carriers_float32_buffer():
    carrier = GradientCarrier(CARRIED_NUMEL)
    with carrier.registered_on(nn.Linear(2, 2)):
        pass
    reducer = FusedMetricReducer(2, 0, None, None, carrier=carrier)
    reducer.observe("a", "mean", torch.tensor(1.5, dtype=torch.float64), weight=2.0)
    reducer.observe("b", "sum", torch.tensor(2.0), weight=1.0)
    buffer = reducer.pack()
    assert (buffer.dtype, buffer.numel()) == (torch.float32, CARRIED_NUMEL)
    # 2 x 1.5 and its weight 2, the sum 2, times the world size 2 (DDP averages the carried buffers)
    assert sorted((buffer[81:85] / 2).tolist()) == [0.0, 2.0, 2.0, 3.0]


class _RecordingCarrier(GradientCarrier):
    """Remembers where the loaded buffer and the returned average live (no reference to either)."""

    def load(self, buffer):
        self.loaded_at = buffer.data_ptr()
        super().load(buffer)

    def average(self):
        total = super().average()
        self.average_at = None if total is None else total.data_ptr()
        return total


def test_the_carried_buffer_becomes_the_carriers_gradient_without_a_copy():
    """The reducer keeps no reference to the buffer it hands over: autograd stores it as the carrier's gradient as
    it is, with no copy in the backward."""
    module = nn.Linear(3, 1)
    carrier = _RecordingCarrier(CARRIED_NUMEL)
    with carrier.registered_on(module):
        pass
    reducer = FusedMetricReducer(1, 0, None, None, carrier=carrier)
    for step in range(2):
        reducer.observe("loss", "mean", torch.tensor(1.5 + step), weight=4.0)
        loss = carrier.join(module(torch.ones(2, 3)).sum())
        reducer.start()
        loss.backward()
        assert reducer.finish()["loss"].value == 1.5 + step
        assert carrier.average_at == carrier.loaded_at


def test_a_step_whose_backward_did_not_run_reduces_its_buffer_by_an_all_reduce():
    carrier = GradientCarrier(CARRIED_NUMEL)
    with carrier.registered_on(nn.Linear(2, 2)):
        pass
    sent = []

    def all_reduce(tensor, op=None, async_op=False):  # as if the other rank sent the same buffer
        sent.append(tensor.clone())
        tensor.mul_(2)

    reducer = FusedMetricReducer(2, 0, all_reduce, None, carrier=carrier)
    reducer.observe("loss", "mean", torch.tensor(1.5), weight=4.0)
    reducer.start()  # packed for the carrier (times the world size) ...
    reduced = reducer.finish()  # ... but no backward took it: packed again, unscaled, and reduced on its own
    assert len(sent) == 1 and sent[0][0].item() == 1.0  # this rank's contribution count, not scaled
    assert reduced["loss"].value == 1.5


class _LossModule(nn.Module):
    """A model whose forward returns its loss: a linear layer's output sum, plus a fixed number (NaN, inf...)."""

    def __init__(self, dtype: torch.dtype, added: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.added = nn.Linear(3, 1).to(dtype), added

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs).sum() + self.added


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("added", [2.5, float("nan"), float("inf")])
def test_the_carried_loss_keeps_its_value_and_type_and_the_gradients_theirs(dtype, added):
    """One process, no DDP: the joined loss is the module's (value, type), its backward gives
    the model the gradients it gives without the carrier, and the carrier the loaded buffer, step after step."""
    module, reference = _LossModule(dtype, added), _LossModule(dtype, added)
    carrier = GradientCarrier(numel=4)
    with carrier.registered_on(module):
        pass
    inputs = torch.ones(2, 3, dtype=dtype)
    for step in range(3):
        loss = carrier.join(module(inputs))
        plain = reference(inputs)
        assert loss.dtype == plain.dtype == dtype
        assert torch.equal(loss, plain) or (loss.isnan().item() and plain.isnan().item())
        buffer = torch.arange(4.0) + step
        carrier.load(buffer)
        loss.backward()
        plain.backward()
        assert carrier.average().tolist() == buffer.tolist()  # one process: the "average" is what was loaded
        for a, b in zip(module.parameters(), reference.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
        module.zero_grad(), reference.zero_grad()
    carrier.close()


def test_the_carriers_gradient_is_ready_first_in_every_backward():
    """DDP launches its buckets in order and the carrier sits in the first one after the bucket rebuild: its
    gradient must be ready at the start of each backward, not the end, or no all-reduce overlaps the backward."""
    module = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    carrier = GradientCarrier(numel=2)
    with carrier.registered_on(module):
        pass
    order: list[str] = []
    for name, parameter in [*module.named_parameters(), ("carrier", carrier.parameter)]:
        parameter.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name))
    for step in range(3):
        order.clear()
        loss = carrier.join(module(torch.ones(2, 3)).sum())
        carrier.load(torch.ones(2))
        loss.backward()
        assert order[0] == "carrier" and len(order) == 7, (step, order)
        carrier.average()
    carrier.close()


def test_a_nan_carried_number_does_not_trip_anomaly_detection():
    """A NaN training metric is carried as a number, not computed by autograd: `detect_anomaly` lets it pass."""
    module = _LossModule(torch.float32, 1.0)
    carrier = GradientCarrier(numel=2)
    with carrier.registered_on(module):
        pass
    with pytest.warns(UserWarning, match="Anomaly Detection"), torch.autograd.detect_anomaly():
        loss = carrier.join(module(torch.ones(2, 3)))
        carrier.load(torch.tensor([1.0, float("nan")]))
        loss.backward()
    assert carrier.average()[1].isnan()


def test_join_joins_a_loss_or_a_mappings_loss_and_leaves_anything_else_alone():
    carrier = GradientCarrier(numel=2)
    with carrier.registered_on(nn.Linear(2, 2)):
        pass
    loss = torch.tensor(3.0, requires_grad=True) * 2
    joined = carrier.join({"loss": loss, "logits": "kept"})
    assert joined["logits"] == "kept" and joined["loss"].item() == 6.0 and joined["loss"] is not loss
    carrier.load(torch.tensor([1.0, 2.0]))
    joined["loss"].backward()
    assert carrier.average().tolist() == [1.0, 2.0]
    constant = torch.tensor(1.0)  # no backward can run through it
    assert carrier.join(constant) is constant
    assert carrier.join(None) is None
    assert carrier.join({"x": 1}) == {"x": 1}


def test_a_carried_buffer_of_another_size_is_refused():
    carrier = GradientCarrier(numel=4)
    with carrier.registered_on(nn.Linear(2, 2)):
        pass
    with pytest.raises(ValueError, match="5 elements, expected 4"):
        carrier.load(torch.zeros(5))
    with pytest.raises(ValueError, match="`numel`=0"):
        GradientCarrier(numel=0)


# ----------------------------------------------------------------------------------------------------------
# Lightning fits: the same weights as plain DDP, nothing of the carrier in the model or its checkpoint.


class BatchNormClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(96, 4, generator=generator), torch.randint(0, 3, (96,), generator=generator))
        return DataLoader(data, batch_size=8)

    def on_train_end(self):
        if self.global_rank == 0:
            path = Path(self.trainer.default_root_dir)
            torch.save({k: v.detach().clone() for k, v in self.state_dict().items()}, path / "weights.pt")
            parameters = sum(len(group["params"]) for group in self.trainer.optimizers[0].param_groups)
            names = [name for name, _ in [*self.named_parameters(), *self.trainer.model.named_parameters()]]
            (path / "seen.json").write_text(json.dumps({"optimizer_parameters": parameters, "names": names}))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "flags", [{}, {"find_unused_parameters": True}, {"static_graph": True}], ids=["defaults", "find_unused", "static"]
)
@pytest.mark.compat
def test_a_fit_with_the_carrier_trains_the_weights_plain_ddp_trains(tmp_path, flags):
    results = {}
    for name, strategy in {
        "ddp": DDPStrategy(start_method="fork", **flags),
        "shardplus": ShardPlusStrategy(start_method="fork", **flags),
    }.items():
        root = tmp_path / name
        root.mkdir()
        trainer = cpu_trainer(
            strategy, 2, max_epochs=2, default_root_dir=root, use_distributed_sampler=False, enable_checkpointing=True
        )
        trainer.fit(BatchNormClassifier())
        results[name] = torch.load(root / "weights.pt")
        seen = json.loads((root / "seen.json").read_text())
        assert seen["optimizer_parameters"] == 6
        assert not any("carrier" in n for n in seen["names"]), seen["names"]
        checkpoint = torch.load(next(root.rglob("*.ckpt")), weights_only=False)
        assert set(checkpoint["state_dict"]) == set(results[name])
    assert set(results["ddp"]) == set(results["shardplus"])
    for key, value in results["ddp"].items():
        torch.testing.assert_close(results["shardplus"][key], value, rtol=0, atol=0, msg=key)
