"""A Lightning release that moved a private name shardplus needs: the package imports, the feature that needs the
name is refused at construction (naming the releases that run it) or falls back to Lightning's behaviour with one
warning, never a failure in the middle of a fit (``_lightning.lightning_gaps``, ``config.fit_to_lightning``)."""

import ast
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from _models import IndexedDataset, RecordingModule, cpu_trainer, read_records
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus._compat import results as _results


@pytest.fixture
def probe_again():
    """Probe this Lightning afresh in the test, and once more after it (the test changes what is found)."""
    _lightning.lightning_gaps.cache_clear()
    yield _lightning.lightning_gaps
    _lightning.lightning_gaps.cache_clear()


@pytest.mark.compat
def test_every_feature_finds_its_private_lightning_names_on_this_release(probe_again):
    assert probe_again() == {}


# Private names `_compat/lightning.py` and `_compat/results.py` read that no probe touches, each with why
UNPROBED = {
    "_last_global_step_saved": "ModelCheckpoint's: read only where `hasattr` finds it",
    "_logger_connector": "a Trainer's: only a running Trainer has it (its class `_LoggerConnector` is probed)",
}


def _fenced_trees() -> list[ast.Module]:
    """The modules that read Lightning's private names: ``_compat/lightning.py`` (with the probes) and
    ``_compat/results.py``."""
    return [ast.parse(Path(module.__file__).read_text()) for module in (_lightning, _results)]


def test_every_private_name_lightning_py_reads_is_probed_for_the_feature_that_needs_it():
    trees = _fenced_trees()
    own = {node.name for tree in trees for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    own |= {t.id for tree in trees for node in tree.body if isinstance(node, ast.Assign) for t in node.targets}
    read = {
        node.attr for tree in trees for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
    }  # fmt: skip
    probes = [node for node in trees[0].body if isinstance(node, ast.FunctionDef) and node.name.startswith("_probe")]
    probed = {
        part for probe in probes for node in ast.walk(probe)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) for part in node.value.split(".")
    }  # fmt: skip
    assert read - own - probed == set(UNPROBED)
    imported = {
        target.id for tree in trees for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", None) == "_private" for target in node.targets
    }  # fmt: skip
    assert len(imported) >= 8 and imported <= probed  # each name `_private` imports is checked by a probe


def test_a_moved_name_is_reported_for_the_feature_that_needs_it_and_no_other(monkeypatch, probe_again):
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.trainer.connectors.logger_connector import _LoggerConnector

    monkeypatch.delattr(_LoggerConnector, "update_eval_epoch_metrics")
    monkeypatch.delattr(_FitLoop, "_should_accumulate")
    monkeypatch.delattr(DDPStrategy, "_setup_model")
    gaps = probe_again()
    assert set(gaps) == {"exact_evaluation", "average_training_metrics", "auto_tune_tensor_fusion"}
    assert "update_eval_epoch_metrics" in gaps["exact_evaluation"]
    assert "_should_accumulate" in gaps["average_training_metrics"]
    assert "_setup_model" in gaps["auto_tune_tensor_fusion"]


def test_a_moved_import_is_reported_for_the_sharding_itself(monkeypatch, probe_again):
    monkeypatch.setattr(_lightning, "_update_dataloader", None)  # what `_private` leaves where the import failed
    assert probe_again() == {"sharding": "ImportError: cannot import _update_dataloader"}


def test_a_moved_multiprocessing_launcher_refuses_fork_and_spawn_under_model_parallel_only(monkeypatch, probe_again):
    from lightning_shardplus import ShardPlusModelParallelStrategy

    monkeypatch.setattr(_lightning, "_MultiProcessingLauncher", None)
    assert set(probe_again()) == {"start_method"}
    with pytest.raises(RuntimeError, match=r"start_method='fork' cannot run here: .* Use start_method='popen'"):
        ShardPlusModelParallelStrategy(start_method="fork")
    ShardPlusModelParallelStrategy()  # Lightning's subprocess launcher
    ShardPlusStrategy(start_method="fork")  # DDPStrategy builds its own launcher


@pytest.mark.timeout(120)  # a process of its own
def test_the_package_imports_where_a_private_import_moved_and_the_strategy_is_refused_at_construction():
    script = (
        "import importlib, importlib.util\n"
        "root = 'lightning.pytorch' if importlib.util.find_spec('lightning') else 'pytorch_lightning'\n"
        "del importlib.import_module(root + '.loops.fetchers')._PrefetchDataFetcher\n"
        "import lightning_shardplus\n"
        "try:\n"
        "    lightning_shardplus.ShardPlusStrategy()\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ShardPlusStrategy cannot run here: Lightning ")
    assert "(ImportError: cannot import _PrefetchDataFetcher). Lightning 2.4 to 2.6 run it" in run.stdout


def gaps_of(monkeypatch, *features):
    gaps = {feature: f"AttributeError: {feature} probe {id(monkeypatch)}" for feature in features}
    monkeypatch.setattr(_lightning, "lightning_gaps", lambda: gaps)


@pytest.mark.parametrize("feature", ["sharding", "auto_tune_tensor_fusion"])
def test_a_feature_without_a_fallback_is_refused_at_construction_naming_the_releases(monkeypatch, feature):
    gaps_of(monkeypatch, feature)
    arguments = {"auto_tune_tensor_fusion": True} if feature != "sharding" else {}
    with pytest.raises(
        RuntimeError, match=rf"cannot run here: Lightning .* \(AttributeError: {feature} probe.*2\.4 to 2\.6 run it"
    ):
        ShardPlusStrategy(**arguments)


def test_fusion_tuning_left_off_is_not_refused_where_it_cannot_run(monkeypatch):
    gaps_of(monkeypatch, "auto_tune_tensor_fusion")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ShardPlusStrategy().config.auto_tune_tensor_fusion is False


@pytest.mark.parametrize("feature", ["exact_evaluation", "average_training_metrics"])
def test_a_default_feature_falls_back_with_one_warning_per_process(monkeypatch, feature):
    gaps_of(monkeypatch, feature)
    with pytest.warns(
        UserWarning, match=rf"`{feature}` is off: Lightning .* \(AttributeError: {feature} probe.*, as under"
    ):
        assert getattr(ShardPlusStrategy().config, feature) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(ShardPlusStrategy().config, feature) is False  # no second warning
        assert getattr(ShardPlusStrategy(**{feature: False}).config, feature) is False


@pytest.mark.timeout(120)
def test_a_fit_where_both_default_features_fell_back_runs_as_ddp_evaluates(monkeypatch, tmp_path):
    gaps_of(monkeypatch, "exact_evaluation", "average_training_metrics")
    with pytest.warns(UserWarning, match="is off"):
        strategy = ShardPlusStrategy(start_method="fork")
    trainer = cpu_trainer(strategy, 2, max_epochs=1)
    module = RecordingModule(tmp_path / "shardplus")
    trainer.fit(module, DataLoader(IndexedDataset(8), batch_size=2), DataLoader(IndexedDataset(5), batch_size=2))
    rows = read_records(tmp_path / "shardplus")
    train = Counter(i for r in rows if r["stage"] == "train" for i in r["indices"])
    assert train == Counter(range(8))  # shardplus's training shards still
    seen = Counter(i for r in rows if r["stage"] == "val" for i in r["indices"])
    assert sum(seen.values()) == 6 and seen[0] == 2  # Lightning's padded DistributedSampler
    assert "train_loss" in trainer.callback_metrics
    # evaluation is what strategy="ddp" gives on the same weights
    ddp_module = RecordingModule(tmp_path / "ddp")
    ddp_module.load_state_dict(module.state_dict())
    loader = DataLoader(IndexedDataset(5), batch_size=2)
    (ddp,) = cpu_trainer(DDPStrategy(start_method="fork"), 2).validate(ddp_module, loader)
    (fallen_back,) = cpu_trainer(ShardPlusStrategy(start_method="fork"), 2).validate(module, loader)
    assert fallen_back == pytest.approx(ddp)
    assert torch.equal(module.layer.weight, ddp_module.layer.weight)


# Lightning's private methods shardplus calls (it overrides none: tests/test_private_fence.py), with the feature each
# serves. Gone or called otherwise, the feature is refused when the strategy is built, or off with one warning.
CALLED_PRIVATE_METHODS = [
    ("lightning.pytorch.strategies.ddp", "DDPStrategy", "_setup_model", ["auto_tune_tensor_fusion"]),
    ("lightning.pytorch.loops.fit_loop", "_FitLoop", "_should_accumulate", ["average_training_metrics"]),
    (
        "lightning.pytorch.trainer.connectors.logger_connector.logger_connector", "_LoggerConnector",
        "update_eval_epoch_metrics", ["exact_evaluation"],
    ),
    (
        "lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultCollection", "log",
        ["exact_evaluation", "average_training_metrics"],
    ),
]  # fmt: skip


def _refusal_or_one_warning_each(features):
    """Build the strategy with ``features`` on: each is refused (an error naming it) or off with one warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = ShardPlusStrategy(**dict.fromkeys(features, True)).config
        except RuntimeError as error:
            assert set(features) <= {"auto_tune_tensor_fusion"} and "cannot run here" in str(error)
            return "refused"
    for feature in features:
        said = [w for w in caught if f"`{feature}` is off" in str(w.message)]
        assert len(said) == 1 and getattr(config, feature) is False, [str(w.message) for w in caught]
    return "off"


@pytest.mark.parametrize("change", ["removed", "other-signature"])
@pytest.mark.parametrize(("module", "owner", "method", "features"), CALLED_PRIVATE_METHODS)
def test_a_private_method_lightning_removed_or_changed_refuses_or_turns_off_its_feature(
    monkeypatch, probe_again, module, owner, method, features, change
):
    import importlib

    owner = getattr(importlib.import_module(module), owner)
    if change == "removed":
        monkeypatch.delattr(owner, method)
    else:

        def changed(self, first, second):  # the same name, called otherwise
            return None

        changed.__qualname__ = f"{owner.__name__}.{method}"
        monkeypatch.setattr(owner, method, changed)
    outcome = _refusal_or_one_warning_each(features)
    assert outcome == ("refused" if features == ["auto_tune_tensor_fusion"] else "off")
    assert set(probe_again()) == set(features)


def test_every_private_method_called_on_a_lightning_class_is_in_the_removal_test():
    called = {
        node.func.attr for tree in _fenced_trees() for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("_")
        and not node.func.attr.startswith("__")
    }  # fmt: skip
    assert called == {method for _, _, method, _ in CALLED_PRIVATE_METHODS if method.startswith("_")}
