"""Both Lightning namespaces: ``lightning.pytorch`` and ``pytorch_lightning`` Trainers fit with shardplus, by name
and by instance, in one process and under the launchers that re-import or unpickle, and from the CLI's YAML."""

import bdb
import importlib
import importlib.metadata
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_shardplus
from lightning_shardplus._compat import namespace as _namespace

ROOT = Path(__file__).resolve().parents[1]

def installed(distribution):
    try:
        return bool(importlib.metadata.distribution(distribution))
    except importlib.metadata.PackageNotFoundError:
        return False


BOTH = installed("lightning") and installed("pytorch-lightning")
needs_both = pytest.mark.skipif(not BOTH, reason="needs lightning and pytorch_lightning installed")
FEATURES = dict(  # every feature that a 2-process CPU fit can turn on
    aggregation_frequency=2,
    gradient_compression="fp16",
    tensor_fusion_threshold_mb=1,
    average_training_metrics=True,
    exact_evaluation=True,
    shard_padding="wrap",
    verify_sharding=True,
)


def package(namespace):
    """Our package for ``namespace``, and that namespace's Lightning."""
    ours = lightning_shardplus if namespace == _namespace.PRIMARY else importlib.import_module(_namespace.MIRROR)
    return ours, importlib.import_module(namespace)


def fit_quick_start(namespace, tmp_path):
    """The quick-start model on 2 forked CPU processes with every feature on; the trained weights (rank 0's)."""
    ours, pl = package(namespace)
    pl.seed_everything(0)
    model = importlib.import_module(f"{ours.__name__}.demo").ClassifierModule(input_dim=8, hidden_dims=(16,))
    data = ours.SyntheticDataModule(global_batch_size=16, num_samples=96, val_samples=20, input_shape=(8,))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ours.ShardPlusStrategy(start_method="fork", **FEATURES),
        max_epochs=2,
        callbacks=[ours.ScaleLearningRate(reference_batch_size=16)],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    trainer.fit(model, datamodule=data)
    assert type(trainer.strategy) is ours.ShardPlusStrategy
    assert isinstance(trainer.strategy, pl.strategies.DDPStrategy)
    trained = {name: value.detach().clone() for name, value in model.state_dict().items()}  # rank 0's, sent back
    assert not all(torch.equal(trained[name], value) for name, value in initial.items())
    return trained


@needs_both
@pytest.mark.compat
@pytest.mark.timeout(240)
def test_both_namespaces_fit_the_quick_start_model_with_every_feature_on_to_the_same_weights(tmp_path):
    lightning = fit_quick_start("lightning.pytorch", tmp_path / "lightning")
    pytorch_lightning = fit_quick_start("pytorch_lightning", tmp_path / "pytorch_lightning")
    assert lightning.keys() == pytorch_lightning.keys()
    for name, value in lightning.items():
        torch.testing.assert_close(pytorch_lightning[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.compat
@pytest.mark.timeout(240)
def test_the_primary_namespace_fits_the_quick_start_model(tmp_path):
    """Where only one namespace is installed (the compatibility stage's pytorch_lightning run), the package itself."""
    weights = fit_quick_start(_namespace.PRIMARY, tmp_path)
    assert all(torch.isfinite(value).all() for value in weights.values())


def python(code, tmp_path, timeout=240, **environ):
    """Run ``code`` as a script (the popen launcher re-runs it) in a fresh interpreter; its output."""
    (tmp_path / "script.py").write_text(code)
    result = subprocess.run(
        [sys.executable, "script.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | {"PYTHONPATH": str(ROOT)} | environ,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout


FIT_BY_NAME = """
import sys
import {namespace} as pl
import lightning_shardplus
from lightning_shardplus._compat import namespace as _namespace


def main():
    # one string per print: both ranks write to one pipe, and print writes its arguments one by one
    print(f"mirror imported before the Trainer: {{_namespace.MIRROR in sys.modules}}")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="{name}", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    ours = sys.modules[type(trainer.strategy).__module__.partition(".strategies.")[0]]
    model = __import__(ours.__name__ + ".demo", fromlist=["x"]).ClassifierModule(input_dim=8, hidden_dims=(16,))
    data = ours.SyntheticDataModule(global_batch_size=16, num_samples=64, val_samples=16, input_shape=(8,))
    trainer.fit(model, datamodule=data)
    print(f"strategy: {{type(trainer.strategy).__module__}} {{trainer.global_step}}")


if __name__ == "__main__":
    main()
"""


@needs_both
@pytest.mark.compat
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["shardplus", "shardplus_spawn"])  # re-runs this script / unpickles the mirror
def test_pytorch_lightning_trainer_takes_the_registered_name_in_a_process_that_imported_both(tmp_path, name):
    out = python(FIT_BY_NAME.format(namespace="pytorch_lightning", name=name), tmp_path)
    assert "mirror imported before the Trainer: False" in out  # registered lazily, imported on first use
    assert f"strategy: {_namespace.MIRROR}.strategies.ddp" in out


@pytest.mark.timeout(120)
def test_importing_the_package_does_not_import_a_namespace_the_user_never_imports(tmp_path):
    out = python(
        "import sys, lightning_shardplus\n"
        "print(sorted(n for n in ('lightning', 'pytorch_lightning') if n in sys.modules))",
        tmp_path,
    )
    assert out.strip() == str(["lightning"] if _namespace.PRIMARY == "lightning.pytorch" else ["pytorch_lightning"])


@pytest.mark.timeout(120)
def test_only_pytorch_lightning_the_package_itself_is_for_it_and_the_mirror_is_the_same_modules(tmp_path):
    if not installed("pytorch-lightning"):
        pytest.skip("needs pytorch_lightning")
    out = python(
        "import sys, pytorch_lightning as pl, lightning_shardplus as ours\n"
        "from lightning_shardplus.pytorch_lightning import ShardPlusStrategy\n"
        "from lightning_shardplus.pytorch_lightning import ScaleLearningRate\n"
        "assert ShardPlusStrategy is ours.ShardPlusStrategy and ScaleLearningRate is ours.ScaleLearningRate\n"
        "assert issubclass(ShardPlusStrategy, pl.strategies.DDPStrategy)\n"
        "assert pl.strategies.StrategyRegistry['shardplus']['strategy'] is ShardPlusStrategy\n"
        "print('lightning imported:', 'lightning' in sys.modules)",
        tmp_path,
        SHARDPLUS_NAMESPACE="pytorch_lightning",
    )
    assert "lightning imported: False" in out


@pytest.mark.timeout(60)
def test_an_unknown_namespace_choice_names_the_valid_ones(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "import lightning_shardplus"],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": str(ROOT), "SHARDPLUS_NAMESPACE": "lightning2"},
        timeout=60,
    )
    assert result.returncode != 0 and "SHARDPLUS_NAMESPACE='lightning2' is not valid" in result.stderr


def cli_fit(tmp_path, module, config_text, **environ):
    (tmp_path / "config.yaml").write_text(config_text)
    result = subprocess.run(
        [sys.executable, "-m", module, "fit", "--config", "config.yaml", "--trainer.max_steps=4",
         "--trainer.log_every_n_steps=1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=os.environ | {"PYTHONPATH": str(ROOT)} | environ,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "fit ended after" in result.stdout
    assert list(tmp_path.glob("lightning_logs/*/version_0/metrics.csv")), "the config's CSVLogger wrote nothing"


@needs_both
@pytest.mark.timeout(300)
def test_the_cli_fits_the_shipped_config_with_pytorch_lightning_when_asked(tmp_path):
    """``SHARDPLUS_NAMESPACE=pytorch_lightning shardplus fit --config configs/synthetic.yaml``: the shipped config
    names no namespace (``CSVLogger``, ``lightning_shardplus.*``), so it serves both."""
    cli_fit(tmp_path, "lightning_shardplus.cli", (ROOT / "configs" / "synthetic.yaml").read_text(),
            SHARDPLUS_NAMESPACE="pytorch_lightning")


@needs_both
@pytest.mark.timeout(300)
def test_the_mirror_cli_fits_a_yaml_naming_the_mirror_classes(tmp_path):
    config = (ROOT / "configs" / "synthetic.yaml").read_text().replace("lightning_shardplus.", f"{_namespace.MIRROR}.")
    config = config.replace("strategy: shardplus", f"strategy:\n    class_path: {_namespace.MIRROR}.ShardPlusStrategy")
    cli_fit(tmp_path, f"{_namespace.MIRROR}.cli", config)


# ---------------------------------------------------------------------------------------------- the mirror's loader
needs_pytorch_lightning = pytest.mark.skipif(not installed("pytorch-lightning"), reason="needs pytorch_lightning")


@needs_pytorch_lightning
@pytest.mark.timeout(120)
@pytest.mark.parametrize("chosen", ["", "pytorch_lightning"])
def test_python_m_runs_a_module_of_the_pytorch_lightning_side(chosen):
    result = subprocess.run(
        [sys.executable, "-m", f"{_namespace.MIRROR}.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": str(ROOT), "SHARDPLUS_NAMESPACE": chosen},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fit" in result.stdout and "Runs the full optimization routine" in result.stdout


@needs_pytorch_lightning
@pytest.mark.timeout(120)
@pytest.mark.parametrize("chosen", ["", "pytorch_lightning"])
def test_both_sides_share_one_finder_and_one_namespace_module(tmp_path, chosen):
    out = python(
        "import sys, lightning_shardplus\n"
        f"import {_namespace.MIRROR}.strategies.ddp, {_namespace.MIRROR}.cli\n"
        "finders = [type(f).__module__ for f in sys.meta_path if type(f).__name__ == '_Finder']\n"
        "ours = sys.modules['lightning_shardplus._compat.namespace']\n"
        f"same = sys.modules.get('{_namespace.MIRROR}._compat.namespace', ours) is ours\n"
        "print(finders, same)",
        tmp_path,
        SHARDPLUS_NAMESPACE=chosen,
    )
    assert out.split() == ["['lightning_shardplus._compat.namespace']", "True"]


@needs_pytorch_lightning
def test_both_sides_cache_tuned_fusion_in_one_file():
    mirror, _ = package("pytorch_lightning")
    path = importlib.import_module(f"{mirror.__name__}.gradients.ddp.fusion").default_cache_path()
    ours = lightning_shardplus.gradients.ddp.fusion_cache.default_cache_path()
    assert path == ours and path.parts[-2:] == ("lightning_shardplus", "fusion.json")


@needs_pytorch_lightning
def test_a_traceback_from_the_pytorch_lightning_side_names_the_real_file_and_line():
    import linecache
    import traceback

    strategy = importlib.import_module(f"{package('pytorch_lightning')[0].__name__}.strategies.ddp")
    with pytest.raises(ValueError) as raised:
        strategy.ShardPlusStrategy(aggregation_frequency=0)
    ours = [f for f in traceback.extract_tb(raised.tb) if f"{os.sep}lightning_shardplus{os.sep}" in f.filename]
    assert ours and all(Path(f.filename).is_file() for f in ours)  # no file name on no disk
    assert all(f.line and f.line == linecache.getline(f.filename, f.lineno).strip() for f in ours)
    assert any(f.name == "__init__" and f.filename == strategy.__file__ for f in ours)


class _Breakpoints(bdb.Bdb):
    """A debugger that records the module of each breakpoint hit, as pdb or an IDE would stop there."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[str] = []

    def user_line(self, frame: Any) -> None:
        if self.get_break(self.canonic(frame.f_code.co_filename), frame.f_lineno):
            self.hits.append(frame.f_globals["__name__"])
        self.set_continue()


@needs_pytorch_lightning
def test_a_breakpoint_on_a_line_of_the_real_file_fires_when_the_pytorch_lightning_side_runs_it():
    mirror = importlib.import_module(f"{package('pytorch_lightning')[0].__name__}.strategies.ddp")
    lines, start = inspect.getsourcelines(lightning_shardplus.strategies.ddp.ShardPlusStrategy.__init__)
    line = start + next(i for i, text in enumerate(lines) if "check_arguments(locals())" in text)
    debugger = _Breakpoints()
    assert debugger.set_break(mirror.__file__, line) is None  # None: set (else bdb's message)
    strategy = debugger.runcall(mirror.ShardPlusStrategy)
    assert debugger.hits == [mirror.__name__] and mirror.__name__.startswith(_namespace.MIRROR)
    assert isinstance(strategy, importlib.import_module("pytorch_lightning").strategies.DDPStrategy)


@needs_both
@pytest.mark.timeout(120)
def test_pytorch_lightning_trainer_takes_the_model_parallel_name_as_the_mirrors_class(tmp_path):
    out = python(
        "import lightning_shardplus, sys\n"
        "import pytorch_lightning as ptl\n"
        "from pytorch_lightning.strategies import ModelParallelStrategy\n"
        "print('mirror imported before the Trainer:', 'lightning_shardplus.pytorch_lightning' in sys.modules)\n"
        "trainer = ptl.Trainer(strategy='shardplus_model_parallel', accelerator='cpu', devices=1, logger=False)\n"
        "strategy = trainer.strategy\n"
        "print('strategy:', type(strategy).__module__, isinstance(strategy, ModelParallelStrategy))\n",
        tmp_path,
    )
    assert "mirror imported before the Trainer: False" in out
    assert f"strategy: {_namespace.MIRROR}.strategies.model_parallel True" in out


def test_the_type_stub_of_the_pytorch_lightning_side_names_every_public_name():
    """Type checkers resolve ``lightning_shardplus.pytorch_lightning`` through its stub (docs/compatibility.md)."""
    import ast

    stub = Path(lightning_shardplus.__file__).parent / "pytorch_lightning" / "__init__.pyi"
    imported = [node for node in ast.parse(stub.read_text()).body if isinstance(node, ast.ImportFrom)]
    names = {alias.asname for node in imported for alias in node.names if alias.name == alias.asname}
    assert names == set(lightning_shardplus.__all__)
