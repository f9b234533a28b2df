"""Every change shardplus makes to an object it does not own goes through ``RunChanges`` and is undone when the run
ends, also when an exception ends it; docs/architecture.md's table names each kind."""

from __future__ import annotations

import os
import re
import warnings
from collections import Counter
from pathlib import Path

import pytest
from _models import IndexedDataset, RecordingModule, cpu_trainer, in_external_ranks
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric

from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus._compat import results as _results
from lightning_shardplus._compat.changes import Change, RunChanges, active_changes

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


class _Stop(Exception):
    pass


class _RaisesInItsSecondValidation(RecordingModule):
    """Logs a training value and updates a torchmetrics Metric in validation; raises in the second validation (mid-fit,
    mid-evaluation), after noting the changes in effect there."""

    def __init__(self, record_dir) -> None:
        super().__init__(record_dir)
        self.mean = MeanMetric()
        self.in_effect: Counter[Change] = Counter()

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.mean.update(batch[1].float())
        if not self.trainer.sanity_checking and self.trainer.global_step >= 2:
            self.in_effect = Counter(active_changes())
            raise _Stop


def _fit_raise_and_fit_again(record_dir: Path) -> None:
    environ, filters = dict(os.environ), list(warnings.filters)
    before = Counter(active_changes())  # other strategies' launchers that launched a Trainer from this process
    module = _RaisesInItsSecondValidation(record_dir)
    metric_settings = (module.mean.sync_on_compute, module.mean.dist_sync_on_step, module.mean.distributed_available_fn)
    trainer = cpu_trainer(ShardPlusStrategy(aggregation_frequency=2), 2, max_epochs=1, val_check_interval=2)
    with pytest.raises(_Stop):
        trainer.fit(module, DataLoader(IndexedDataset(16), batch_size=2), DataLoader(IndexedDataset(5), batch_size=2))
    assert set(module.in_effect - before) >= {
        Change.RANK_VARIABLES, Change.WARNING_FILTERS, Change.ZERO_LENGTH_LOADERS, Change.ACCUMULATION,
        Change.TRAINING_LOGS, Change.METRIC_SYNC,
    }  # fmt: skip
    assert not Counter(active_changes()) - before  # none left but those (other strategies may be collected meanwhile)
    # Lightning's own `LightningEnvironment.teardown` removes WORLD_SIZE (in a torchrun job too)
    assert dict(os.environ) == {k: v for k, v in environ.items() if k != "WORLD_SIZE"} and warnings.filters == filters
    assert trainer.accumulate_grad_batches == 1
    assert "log" not in vars(_results.training_results(trainer))
    assert module.allow_zero_length_dataloader_with_multiple_devices is False
    mean = module.mean
    assert (mean.sync_on_compute, mean.dist_sync_on_step, mean.distributed_available_fn) == metric_settings
    # a second fit in the same process, under Lightning's own DDP, finds Lightning's objects
    os.environ["WORLD_SIZE"] = environ["WORLD_SIZE"]
    second = cpu_trainer("ddp", 2, max_epochs=1, limit_val_batches=0)
    second.fit(RecordingModule(record_dir), DataLoader(IndexedDataset(8), batch_size=2))
    assert second.accumulate_grad_batches == 1 and "log" not in vars(_results.training_results(second))
    assert "RANK" not in os.environ and "train_loss" in second.callback_metrics


@pytest.mark.timeout(180)
def test_every_change_is_undone_after_a_fit_that_raises_mid_fit(tmp_path):
    in_external_ranks(lambda: _fit_raise_and_fit_again(tmp_path))


def test_a_scoped_change_is_undone_at_the_end_of_its_block_and_the_rest_in_reverse_order():
    class Owner:
        value = "class"

        def method(self):
            return "own"

    owner, changes = Owner(), RunChanges()
    owner.value = "first"
    changes.set(Change.ACCUMULATION, owner, "value", "second")
    changes.set(Change.ACCUMULATION, owner, "value", "third")
    with changes.scoped(Change.FORWARD_WITHOUT_DATA, owner, "method", lambda: "patched"):
        assert owner.method() == "patched" and Change.FORWARD_WITHOUT_DATA in active_changes()
    assert owner.method() == "own" and "method" not in vars(owner)
    assert changes.active == [Change.ACCUMULATION, Change.ACCUMULATION]
    changes.undo()
    assert owner.value == "first" and changes.active == []
    del owner.value
    changes.set(Change.ACCUMULATION, owner, "value", "set")
    changes.undo()
    assert "value" not in vars(owner) and owner.value == "class"


def test_an_undo_that_raises_leaves_the_others_undone_and_raises_after():
    class Owner:
        pass

    owner, changes = Owner(), RunChanges()
    changes.set(Change.ACCUMULATION, owner, "a", 1)

    def failing() -> None:
        raise KeyError("undo")

    changes.apply(Change.WARNING_FILTERS, failing)
    changes.set(Change.ACCUMULATION, owner, "b", 2)
    with pytest.raises(KeyError, match="undo"):
        changes.undo()
    assert not vars(owner) and changes.active == []


def test_the_architecture_page_names_every_kind_of_change():
    text = ARCHITECTURE.read_text()
    table = re.search(r"<!-- run-changes -->(.*?)<!-- /run-changes -->", text, re.S)
    assert table is not None
    named = set(re.findall(r"^\| `(\w+)` \|", table.group(1), re.M))
    assert named == {change.name for change in Change}


def test_a_copy_sent_to_another_process_starts_empty():
    # a spawn worker's strategy is a pickled copy: what the launching process changed is that process's to undo
    import pickle

    class Owner:
        pass

    changes = RunChanges()
    changes.set(Change.LAUNCH, Owner(), "launch", lambda: None)
    assert pickle.loads(pickle.dumps(changes)).active == [] and changes.active == [Change.LAUNCH]
    changes.undo()
