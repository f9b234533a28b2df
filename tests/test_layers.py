"""The house's layers: the data side imports no gradient side and no strategy, and runs a fit without one."""

import ast
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy

import lightning_shardplus
from lightning_shardplus.strategies.data_side import ShardPlusDataSide

PACKAGE = Path(lightning_shardplus.__file__).parent
DOCS = Path(__file__).resolve().parents[1] / "docs"


def _imports(path: Path) -> set[str]:
    """The ``lightning_shardplus`` modules ``path`` imports (at any depth of the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_shardplus"):
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("lightning_shardplus")}
    return found


@pytest.mark.parametrize("lower, upper", [
    ("data", ("lightning_shardplus.gradients", "lightning_shardplus.strategies", "lightning_shardplus.launch",
              "lightning_shardplus.diagnostics", "lightning_shardplus.large_batch")),
    ("gradients", ("lightning_shardplus.strategies", "lightning_shardplus.launch")),
    ("_compat", ("lightning_shardplus.data", "lightning_shardplus.gradients", "lightning_shardplus.strategies")),
])  # fmt: skip
def test_no_import_runs_from_a_lower_layer_up(lower, upper):
    up = {f"{path.relative_to(PACKAGE)}: {name}" for path in (PACKAGE / lower).rglob("*.py")
          for name in _imports(path) if name.startswith(upper)}  # fmt: skip
    assert not up


class _NoGradientSide:
    """A gradient side with nothing of its own: the data side alone, over plain DDP."""

    forward_communicates = False
    ranks = "processes"

    def features(self):
        return []

    def window_gradients(self, module, data_parallel, done, frequency):
        return None

    def set_window_gradients(self, module, gradients):
        raise AssertionError("no window state was saved")

    def checkpointed(self, states, checkpoint, checkpoint_path):
        pass

    def start_fit(self, trainer, backend, device):
        return None


class _DataSideOnly(ShardPlusDataSide, DDPStrategy):
    def __init__(self, **data_options):
        from lightning_shardplus.data.config import DataSideConfig

        super().__init__()
        self.start_method = "popen"  # one process: it runs in this one
        self._init_data_side(DataSideConfig(**data_options))

    @property
    def num_replicas(self):
        return self.num_nodes * self.num_processes

    def _gradient_side(self):
        return _NoGradientSide()


@pytest.mark.timeout(120)
def test_the_data_side_fits_with_a_gradient_side_of_its_own(tmp_path):
    """Any object with the gradient side's small interface serves: the data side asks it, never which it is."""
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=_DataSideOnly(aggregation_frequency=2), accelerator="cpu", devices=1, max_epochs=1,
        limit_val_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert trainer.global_step == 32  # 64 batches, 2 micro-batches per step


def test_architecture_names_every_module():
    """docs/architecture.md names every module outside bench/ by its path in the package (``data/loaders.py``)."""
    page = (DOCS / "architecture.md").read_text()
    modules = [path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
               if path.name != "__init__.py" and path.relative_to(PACKAGE).parts[0] != "bench"]  # fmt: skip
    assert modules
    unnamed = [m for m in modules if not re.search(rf"(?<![\w/.])(lightning_shardplus/)?{re.escape(m)}(?!\w)", page)]
    assert not unnamed, f"modules docs/architecture.md does not name: {sorted(unnamed)}"


def test_the_docs_index_lists_every_page():
    index = (DOCS / "index.md").read_text()
    pages = [path.name for path in DOCS.glob("*.md") if path.name != "index.md"]
    assert pages
    unlisted = [page for page in pages if not re.search(rf"\]\({re.escape(page)}(#[^)]*)?\)", index)]
    assert not unlisted, f"pages docs/index.md does not link: {sorted(unlisted)}"
