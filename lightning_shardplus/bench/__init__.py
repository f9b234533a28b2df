"""``python -m lightning_shardplus.bench``: the same synthetic workload under plain ``strategy="ddp"`` and
under shardplus configurations, run alternately and repeated, reported as samples/s (median) and ratio to ddp.

Each run is a fresh ``Trainer.fit`` on CPU processes (fork launcher) over the same number of micro-batches
(``--warmup`` untimed, then ``--steps`` timed), so a row with ``aggregation_frequency=A`` takes ``1/A`` as
many optimizer steps. Alternating the configurations spreads the machine's drift over all of them.

Beside samples/s, shardplus rows report what the gradient communication hook sent on rank 0 per optimizer step
during the timed steps (median), *counted* by :class:`~lightning_shardplus.diagnostics.CommunicationCounter`
(not estimated): bytes handed to collectives, all-reduce rounds (gradient synchronizations) and collectives.
Counting needs a hook, so the ``none`` row (``gradient_compression="none"``) runs torch's Python
``allreduce_hook``, the equivalent of DDP's built-in all-reduce that the ``ddp`` row uses (not counted). The
``shardplus`` (defaults) and ``shardplus-plain`` (``average_training_metrics=False``: no extra feature) rows, the
ones to compare with ``ddp``, run without the counting hook.

Every row also reports the step time and the Python-level ``torch.distributed`` all_reduce and barrier calls
per optimizer step, counted in every worker by :class:`~lightning_shardplus.diagnostics.CollectiveCalls` ("-"
where torch cannot count them; the metrics rows: 16 scalars logged per step with no sync, Lightning's
``sync_dist=True``, and shardplus averaging). ``--configs`` picks rows; the first is the baseline.

Rows other than ``ddp``, ``shardplus``, ``shardplus-plain`` and the metrics rows run a
:class:`~lightning_shardplus.diagnostics.ScalingReport`: where each micro-batch's time goes (data, between steps,
forward, backward, exposed communication, optimizer; medians over the runs). The ``shardplus-report`` row is
``shardplus`` with the report: their ratio is the report's overhead. ``--quick`` runs the whole matrix in
shorter runs (about a minute on 2 CPU cores); ``--json``, ``--plots DIR`` (two PNGs: samples/s per row with
its spread, time per step by phase) and ``--markdown`` (the section of docs/performance.md) write the results;
``--from-json`` renders a report written before without running anything; given several reports of one command, it
pools them (every run of each row: :mod:`lightning_shardplus.bench.pooled`). ``--accelerator gpu`` (or ``auto``
with a GPU) runs one fork-launched process per GPU instead of CPU processes; the ScalingReport's figures are then
host-side times.

``--sampler`` runs a different benchmark, in this process and without training: for each dataset length N, rank
0's :class:`~lightning_shardplus.PaddedShardSampler` (on-the-fly permutation) beside torch's
``DistributedSampler`` (materialized ``randperm``, only up to ``--torch-max-length``): time to the first index,
indices per second per rank after the first index and over the whole pass (first index included), and peak
resident memory above the level before the sampler.

``--fusion`` measures tensor-fusion autotuning (:mod:`lightning_shardplus.bench.fusion`); ``--rewrap`` times a DDP
re-wrap with and without the broadcast from rank 0 (:mod:`lightning_shardplus.bench.rewrap`). The matrix prints one
line per run, then its tables; Lightning's banners and warnings are silenced within the benchmark's runs.
"""

from lightning_shardplus.bench.cli import FULL, QUICK, main, parse_args
from lightning_shardplus.bench.fusion import FUSION_REFERENCE_RUN_STEPS, FUSION_SHAPES, run_fusion, run_fusion_shape
from lightning_shardplus.bench.report_cost import measure_report_cost
from lightning_shardplus.bench.runner import machine, run, run_once
from lightning_shardplus.bench.sampler import SAMPLER_SIZES, measure_sampler, run_sampler
from lightning_shardplus.bench.tables import (
    PLOT_DPI,
    PLOT_SIZE,
    format_breakdown_table,
    format_fusion_table,
    format_markdown,
    format_overhead,
    format_sampler_table,
    format_table,
    report_overhead,
    write_plots,
)
from lightning_shardplus.bench.workloads import (
    BenchConfig,
    ManyMetricsClassifier,
    RankStream,  # noqa: F401  (the streaming row's data, for tests)
    default_configs,
    select_configs,
    strategy_accepts,
)
from lightning_shardplus.diagnostics import STEP_PHASES

__all__ = [
    "FULL",
    "FUSION_REFERENCE_RUN_STEPS",
    "FUSION_SHAPES",
    "PLOT_DPI",
    "PLOT_SIZE",
    "QUICK",
    "SAMPLER_SIZES",
    "STEP_PHASES",
    "BenchConfig",
    "ManyMetricsClassifier",
    "default_configs",
    "format_breakdown_table",
    "format_fusion_table",
    "format_markdown",
    "format_overhead",
    "format_sampler_table",
    "format_table",
    "machine",
    "main",
    "measure_report_cost",
    "measure_sampler",
    "parse_args",
    "report_overhead",
    "run",
    "run_fusion",
    "run_fusion_shape",
    "run_once",
    "run_sampler",
    "select_configs",
    "strategy_accepts",
    "write_plots",
]
