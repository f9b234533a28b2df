"""The command line of ``python -m lightning_shardplus.bench``: its arguments, checked (:func:`parse_args`), and
:func:`main`, which runs the benchmark they choose and prints its tables."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lightning.fabric.accelerators.cuda import num_cuda_devices

from lightning_shardplus.bench.collective import format_collective_table, run_collective
from lightning_shardplus.bench.fusion import FUSION_SHAPES, run_fusion
from lightning_shardplus.bench.host_syncs import HOST_SYNC_CONFIGS, format_host_sync_table, run_host_syncs
from lightning_shardplus.bench.model_parallel import run_model_parallel
from lightning_shardplus.bench.pooled import pool_reports
from lightning_shardplus.bench.rewrap import REWRAP_HIDDEN, format_rewrap_table, run_rewrap
from lightning_shardplus.bench.runner import keep_parent_single_threaded, run
from lightning_shardplus.bench.sampler import SAMPLER_SIZES, run_sampler
from lightning_shardplus.bench.tables import (
    format_breakdown_table,
    format_fusion_table,
    format_markdown,
    format_overhead,
    format_sampler_table,
    format_table,
    write_plots,
)
from lightning_shardplus.bench.workloads import default_configs, select_configs

FULL = {"repeats": 7, "steps": 100, "warmup": 10}
QUICK = {"repeats": 2, "steps": 24, "warmup": 6}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments (``sys.argv`` when None), with the defaults of ``--quick`` or of a full run filled in and
    every value checked (a bad one exits with argparse's usage error)."""
    description = sys.modules[__package__].__doc__  # the package's documentation is the command's
    parser = argparse.ArgumentParser(prog="python -m lightning_shardplus.bench", description=description)
    _add_matrix_arguments(parser)
    _add_workload_arguments(parser)
    _add_sampler_arguments(parser)
    _add_fusion_arguments(parser)
    _add_rewrap_arguments(parser)
    _add_collective_arguments(parser)
    _add_host_sync_arguments(parser)
    _add_model_parallel_arguments(parser)
    args = parser.parse_args(argv)
    _fill_defaults(args)
    _check(parser, args)
    if args.configs is not None:
        args.configs = _chosen_configs(parser, args.configs)
    return args


def _add_matrix_arguments(parser: argparse.ArgumentParser) -> None:
    """The processes, the runs of the matrix, its rows, and what to write besides the tables."""
    parser.add_argument(
        "--devices", type=int, default=None, help="processes: one per GPU with --accelerator=gpu, else 2 (default)"
    )
    parser.add_argument(
        "--accelerator", choices=("auto", "cpu", "gpu"), default="cpu",
        help="cpu (default): CPU processes on gloo; gpu: one process per GPU on NCCL; auto: gpu if there is one",
    )
    parser.add_argument(
        "--repeats", type=int, default=None,
        help=f"runs per configuration, alternating (default {FULL['repeats']}; --quick {QUICK['repeats']})",
    )
    parser.add_argument(
        "--steps", type=int, default=None,
        help=f"timed micro-batches per run (optimizer steps if not aggregating; default 100, --quick {QUICK['steps']})",
    )
    parser.add_argument(
        "--warmup", type=int, default=None,
        help=f"untimed micro-batches at the start of each run (default 10; --quick {QUICK['warmup']})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the whole matrix in short runs: about a minute on 2 CPU cores"
    )
    parser.add_argument(
        "--read-every-step", action="store_true",
        help="add to every row a callback that reads callback_metrics after every batch (shardplus then averages "
        "every step; without it nothing reads the step values and it averages them at the epoch end)",
    )
    parser.add_argument("--plots", type=Path, default=None, help="write the two PNG plots to this directory")
    parser.add_argument("--markdown", action="store_true", help="also print the section of docs/performance.md")
    parser.add_argument(
        "--from-json", type=Path, nargs="+", default=None,
        help="render a report written by --json (tables, --markdown, --plots) instead of running; several reports "
        "of the same rows and settings: pooled into one (every run of each row)",
    )
    parser.add_argument(
        "--configs", default=None,
        help=f"comma-separated rows to run, ddp first as the baseline (default all: "
        f"{','.join(c.name for c in default_configs())})",
    )


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The MLP's shape, the global batch, the JSON report and torch's threads per process."""
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--input-dim", type=int, default=256)
    parser.add_argument("--hidden-dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the report to this JSON file")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads per process (default: torch's)"
    )


def _add_sampler_arguments(parser: argparse.ArgumentParser) -> None:
    """``--sampler``, the sampler benchmark, and its lengths."""
    parser.add_argument(
        "--sampler", action="store_true",
        help="benchmark the samplers instead of training (rank 0 of --devices ranks; see above)",
    )
    parser.add_argument(
        "--sampler-sizes", type=_length_list, default=list(SAMPLER_SIZES),
        help="with --sampler: comma-separated dataset lengths (default 1e6,1e8,1e9,1e12)",
    )
    parser.add_argument(
        "--sampler-indices", type=int, default=2_000_000,
        help="with --sampler: indices timed per row for indices/s (default 2,000,000)",
    )
    parser.add_argument(
        "--torch-max-length", type=_length_list, default=[10**8],
        help="with --sampler: largest N run with torch's DistributedSampler, which materializes the whole "
        "permutation as a Python list (about 50 bytes per sample: 5 GB at 1e8; default 1e8)",
    )


def _add_fusion_arguments(parser: argparse.ArgumentParser) -> None:
    """``--fusion``, the tensor-fusion benchmark, and its shapes, candidates and samples."""
    parser.add_argument(
        "--fusion", action="store_true",
        help="benchmark tensor-fusion autotuning instead (see lightning_shardplus.bench.fusion): per --fusion-shapes, "
        "tune, then measure the fixed candidates and the tuned setting interleaved",
    )
    parser.add_argument("--fusion-shapes", type=_fusion_shapes, default=_fusion_shapes(FUSION_SHAPES),
                        help=f"with --fusion: name:input_dim:hidden_dim:layers,... (default {FUSION_SHAPES})")
    parser.add_argument("--fusion-candidates", type=lambda t: [float(v) for v in t.split(",")], default=None,
                        help="with --fusion: candidate bucket sizes in MB (default: the strategy's)")
    parser.add_argument("--fusion-steps", type=int, default=8, help="with --fusion: timed steps per sample (8)")
    parser.add_argument("--fusion-warmup", type=int, default=1, help="with --fusion: untimed steps per sample (1)")
    parser.add_argument("--fusion-rounds", type=_positive_ints, default=[5],
                        help="with --fusion: interleaved rounds measured after tuning, one number or one per shape "
                        "(default 5; a noisier shape needs more to resolve 1-2%% differences)")


def _add_rewrap_arguments(parser: argparse.ArgumentParser) -> None:
    """``--rewrap``, the cost of a DDP re-wrap with and without the broadcast from rank 0, and its models."""
    parser.add_argument(
        "--rewrap", action="store_true",
        help="time DistributedDataParallel(init_sync=True) against init_sync=False instead (see "
        "lightning_shardplus.bench.rewrap), on --devices CPU processes, per --rewrap-hidden",
    )
    parser.add_argument("--rewrap-hidden", type=_positive_ints, default=list(REWRAP_HIDDEN),
                        help="with --rewrap: hidden sizes of the MLP (--input-dim, --layers), comma-separated "
                        f"(default {','.join(map(str, REWRAP_HIDDEN))})")
    parser.add_argument("--rewrap-repeats", type=int, default=7,
                        help="with --rewrap: constructions timed per setting and model; the median (default 7)")


def _add_collective_arguments(parser: argparse.ArgumentParser) -> None:
    """``--collective``: what one small all_reduce per step adds, blocking and overlapped."""
    parser.add_argument(
        "--collective", action="store_true",
        help="time the benchmark MLP's forward and backward alone, with a blocking all_reduce after it, and with the "
        "all_reduce started before and waited for after (see lightning_shardplus.bench.collective), on --devices "
        "CPU processes, --steps iterations each",
    )
    parser.add_argument("--collective-floats", type=int, default=81,
                        help="with --collective: float64 values in the all_reduce (default 81: about the averaged "
                        "training metrics' buffer for 40 means, 2 + 2 per mean)")


def _add_model_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-parallel", action="store_true",
        help="ShardPlusModelParallelStrategy's defaults against Lightning's ModelParallelStrategy on the same FSDP2 "
        "model over --devices data-parallel ranks, in one launch (lightning_shardplus.bench.model_parallel)",
    )  # fmt: skip


def _add_host_sync_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host-syncs``: the device synchronizations per training batch on a GPU, and the logging interval."""
    parser.add_argument(
        "--host-syncs", action="store_true",
        help="count the device synchronizations per training batch instead, as torch reports them "
        "(torch.cuda.set_sync_debug_mode), one fit per --configs row (default: "
        f"{','.join(HOST_SYNC_CONFIGS)}); needs --accelerator gpu (see lightning_shardplus.bench.host_syncs)",
    )
    parser.add_argument("--log-every-n-steps", type=int, default=50,
                        help="with --host-syncs: the CSV logger's interval (default 50)")


def _fill_defaults(args: argparse.Namespace) -> None:
    """What was not given: ``--quick``'s or the full run's repeats, steps and warmup; the accelerator and devices
    (``auto``: a GPU if there is one; one process per GPU, else 2); ``--torch-max-length`` as one number."""
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.accelerator == "auto":
        args.accelerator = "gpu" if num_cuda_devices() > 0 else "cpu"
    if args.devices is None:
        args.devices = num_cuda_devices() if args.accelerator == "gpu" else 2
    args.torch_max_length = args.torch_max_length[0] if args.torch_max_length else 0


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error naming the first argument out of range."""
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads={args.threads} is not valid: expected >= 1")
    if args.sampler_indices < 1 or not args.sampler_sizes or min(args.sampler_sizes) < 1:
        parser.error("--sampler-indices and --sampler-sizes are not valid: expected integers >= 1")
    if max(args.sampler_sizes) > 2**63 - 1:
        parser.error("--sampler-sizes is not valid: expected lengths <= 2**63 - 1")
    names = (
        "devices", "rewrap_repeats", "collective_floats", "repeats", "steps", "global_batch_size", "input_dim",
        "hidden_dim", "layers", "log_every_n_steps",
    )
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid: expected >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup} is not valid: expected >= 0")
    if args.host_syncs and args.accelerator != "gpu":
        parser.error(f"--host-syncs with --accelerator={args.accelerator} is not valid: expected gpu (torch counts "
                     "device synchronizations on CUDA only)")
    for mode in ("rewrap", "collective"):
        if getattr(args, mode) and args.accelerator != "cpu":
            parser.error(f"--{mode} with --accelerator={args.accelerator} is not valid: only cpu (gloo) is measured")


def _chosen_configs(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The row names of ``--configs``; a usage error for none or an unknown one."""
    known = [c.name for c in default_configs()]
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        parser.error(f"--configs={text!r} is not valid: expected names among {', '.join(known)}")
    return chosen


def _length_list(text: str) -> list[int]:
    """``"1e6,10**8,5000"`` -> ``[1000000, 100000000, 5000]``."""
    values = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        base, power = item.split("**") if "**" in item else (item, "1")
        mantissa, exponent = base.lower().split("e") if "e" in base.lower() else (base, "0")
        values.append((int(mantissa) * 10 ** int(exponent)) ** int(power))
    return values


def _positive_ints(text: str) -> list[int]:
    """``N`` or ``N,M,...``, each >= 1."""
    items = text.split(",")
    if not all(item.strip().isdigit() and int(item) >= 1 for item in items):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number >= 1, or a comma-separated list of them")
    return [int(item) for item in items]


def _fusion_shapes(text: str) -> list[tuple[str, int, int, int]]:
    """``name:input_dim:hidden_dim:layers,...``."""
    shapes = []
    for item in text.split(","):
        name, *numbers = item.strip().split(":")
        if len(numbers) != 3 or not all(n.isdigit() and int(n) > 0 for n in numbers):
            raise argparse.ArgumentTypeError(f"{item!r}: expected name:input_dim:hidden_dim:layers")
        shapes.append((name, *(int(n) for n in numbers)))
    return shapes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark the arguments choose (or read ``--from-json``), print its tables, write ``--json``; the
    report."""
    args = parse_args(argv)
    report = _report(args)
    if report is None:  # a rank other than 0 of a model-parallel launch
        return {}
    if "sampler_rows" in report:
        print(format_sampler_table(report))
    elif "fusion_rows" in report:
        print(format_fusion_table(report))
    elif "rewrap_rows" in report:
        print(format_rewrap_table(report))
    elif "collective_rows" in report:
        print(format_collective_table(report))
    elif "host_sync_rows" in report:
        print(format_host_sync_table(report))
    else:
        _print_matrix(report, args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return report


def _report(args: argparse.Namespace) -> dict[str, Any] | None:
    """The report ``args`` ask for: read from ``--from-json``, or run (sampler, re-wrap, collective, fusion, host
    synchronizations, or the matrix)."""
    if args.from_json is not None:
        reports = [json.loads(path.read_text()) for path in args.from_json]
        return reports[0] if len(reports) == 1 else pool_reports(reports, [str(path) for path in args.from_json])
    if args.sampler:
        return run_sampler(args)
    if args.rewrap:
        return run_rewrap(args)
    if args.collective:
        return run_collective(args)
    if args.model_parallel:  # Lightning's launcher re-runs this command on every rank: no fork
        return run_model_parallel(args)
    keep_parent_single_threaded()  # the modes below fork Lightning fits from this process
    if args.fusion:
        return run_fusion(args)
    if args.host_syncs:
        return run_host_syncs(select_configs(args.configs or list(HOST_SYNC_CONFIGS)), args)
    return run(select_configs(args.configs), args)


def _print_matrix(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The matrix's tables and the ScalingReport's overhead; ``--markdown``'s section; ``--plots``."""
    print(format_table(report))
    print()
    print(format_breakdown_table(report))
    overhead = format_overhead(report)
    if overhead is not None:
        print("\n" + overhead)
    if args.markdown:
        print("\n" + format_markdown(report))
    if args.plots is not None:
        for path in write_plots(report, args.plots):
            print(f"wrote {path}")
