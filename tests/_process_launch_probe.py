"""``python tests/_process_launch_probe.py STRATEGY START_METHOD DP TP OUT``: a fit and a validation on CPU processes
that Lightning's multiprocessing launcher starts (fork or spawn), under ``ShardPlusModelParallelStrategy`` on a DP x TP
mesh (STRATEGY ``model_parallel``) or ``ShardPlusStrategy`` on DP processes (``ddp``); the launching process writes
the weights its module got back, the one-process reference and what validation returned to ``OUT``."""

from __future__ import annotations

import importlib.util
import json
import sys

import lightning_shardplus  # first: it chooses its namespace (as the tests' conftest.py)

if importlib.util.find_spec("lightning") is None:  # only pytorch_lightning installed: imported as lightning.*
    import _lightning_alias

    _lightning_alias.install()

import lightning.pytorch as pl  # noqa: E402
from _model_parallel_probe import Model, Samples, full_weights, reference  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

ShardPlusModelParallelStrategy, ShardPlusStrategy = (
    lightning_shardplus.ShardPlusModelParallelStrategy,
    lightning_shardplus.ShardPlusStrategy,
)


class RankZeroStateDict(pl.Callback):
    """Rank 0 alone reads the module's state_dict at the end of the fit, as scripts do: no collective may hide in it."""

    def on_fit_end(self, trainer, pl_module, stage=None) -> None:
        if trainer.is_global_zero:
            pl_module.state_dict()

    teardown = on_fit_end


class Replicated(Model):
    """The probe's model without sharding (DDP)."""

    def configure_model(self) -> None:
        pass


if __name__ == "__main__":
    strategy, start_method, dp, tp, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    if strategy == "model_parallel":
        chosen, model = (
            ShardPlusModelParallelStrategy(dp, tp, aggregation_frequency=2, start_method=start_method),
            Model(),
        )
    else:
        chosen, model = ShardPlusStrategy(aggregation_frequency=2, start_method=start_method), Replicated()
    trainer = pl.Trainer(
        accelerator="cpu", devices=dp * tp, strategy=chosen, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[RankZeroStateDict()],
    )  # fmt: skip
    trainer.fit(model, DataLoader(Samples(4 * dp), batch_size=2))  # one optimizer step on every sample
    validated = trainer.validate(model, DataLoader(Samples(2 * dp - 1), batch_size=2), verbose=False)
    found = {"weights": full_weights(model), "reference": reference([list(range(4 * dp))]), "validate": validated}
    with open(out, "w") as file:
        json.dump(found, file)
