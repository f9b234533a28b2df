"""The benchmark runs its rows and counts the communication of each (a tiny workload: a smoke test, not a
measurement)."""

import json
import os
import statistics
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _models import run_commands
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy

import lightning_shardplus
from lightning_shardplus import ShardPlusStrategy, bench
from lightning_shardplus._compat.lightning import release
from lightning_shardplus.bench import host_syncs
from lightning_shardplus.data.sharding import DIGEST_WIDTH


@pytest.mark.timeout(180)
def test_bench_rows_count_bytes_and_rounds_per_optimizer_step(tmp_path, capsys):
    report = bench.main(
        [
            "--repeats=1",
            "--steps=8",
            "--warmup=8",
            "--global-batch-size=8",
            "--input-dim=8",
            "--hidden-dim=16",
            "--layers=1",
            "--configs=ddp,shardplus,none,agg4,fp16,powersgd",
            f"--json={tmp_path / 'report.json'}",
        ]
    )
    rows = report["results"]
    assert list(rows) == ["ddp", "shardplus", "none", "agg4", "fp16", "powersgd"]
    parameters = 8 * 16 + 16 + 16 * 10 + 10
    assert rows["ddp"]["bytes_per_step"] is None  # stock DDP's built-in all-reduce is not instrumented
    assert rows["shardplus"]["bytes_per_step"] is None  # compared with ddp: no counting hook
    assert rows["none"]["bytes_per_step"] == rows["agg4"]["bytes_per_step"] == 4 * parameters
    assert rows["fp16"]["bytes_per_step"] == 2 * parameters
    assert rows["powersgd"]["bytes_per_step"] < 4 * parameters
    assert all(rows[name]["rounds_per_step"] == 1 for name in ("none", "agg4", "fp16", "powersgd"))
    assert all(row["median_samples_per_s"] > 0 for row in rows.values())
    table = capsys.readouterr().out
    assert "| agg4 |" in table and "gradient bytes / step" in table
    assert (tmp_path / "report.json").exists()


@pytest.mark.timeout(180)
def test_the_matrix_prints_one_progress_line_per_run_and_the_tables_and_no_lightning_banner(capfd):
    tiny = ["--steps=2", "--warmup=2", "--global-batch-size=8", "--input-dim=4", "--hidden-dim=8", "--layers=1"]
    bench.main(["--repeats=2", *tiny, "--configs=ddp,shardplus"])
    out, err = capfd.readouterr()  # the file descriptors: the forked workers' output too
    lines = (out + err).splitlines()
    progress = [line for line in lines if line.startswith("run ")]
    assert [line.split(":")[0] for line in progress] == ["run 1/4 ddp", "run 2/4 shardplus", "run 3/4 shardplus",
                                                         "run 4/4 ddp"]
    assert all(line.endswith(" samples/s") for line in progress)
    note = "fewer than 6 runs per row (2): ratios are not significant"
    assert sum(line.startswith(note) for line in lines) == 1
    tables = [line for line in lines if line.startswith("|")]
    assert len(tables) == 2 + 2 + 2  # two tables: header, rule, and the ddp and shardplus rows of the first
    assert len(lines) == len(progress) + len(tables) + 1 + 2  # the note and the blank lines around it: nothing else
    assert not any("GPU available" in line or "Initializing distributed" in line for line in lines)


@pytest.mark.timeout(120)
def test_the_rewrap_bench_times_the_construction_with_and_without_the_broadcast(tmp_path, capsys):
    report = bench.main(
        ["--rewrap", "--rewrap-hidden=8,16", "--rewrap-repeats=2", "--input-dim=4", "--layers=1"]
        + [f"--json={tmp_path / 'rewrap.json'}"]
    )
    rows = report["rewrap_rows"]
    assert [row["parameters"] for row in rows] == [4 * 8 + 8 + 8 * 10 + 10, 4 * 16 + 16 + 16 * 10 + 10]
    assert all(row["repeats"] == 2 and row["ms_with_broadcast"] > 0 and row["ms_without_broadcast"] > 0 for row in rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "| model | parameters | MB | ms with broadcast (init_sync=True) | ms without (init_sync=False) | ratio |"
    )
    assert [line.split(" | ")[0] for line in lines[2:4]] == ["| MLP hidden 8", "| MLP hidden 16"]
    assert all(len(line.split(" | ")) == 6 for line in lines[2:4])  # both columns and the ratio, per model
    assert "2 processes (gloo), median of 2 constructions each" in lines[-1]
    with pytest.raises(SystemExit):
        bench.parse_args(["--rewrap", "--rewrap-repeats=0"])


@pytest.mark.timeout(120)
def test_the_collective_bench_times_the_step_alone_with_a_blocking_and_with_an_overlapped_all_reduce(capsys):
    report = bench.main(["--collective", "--steps=3", "--warmup=1", "--input-dim=4", "--hidden-dim=8", "--layers=1"])
    rows = report["collective_rows"]
    assert [row["variant"] for row in rows] == [
        "compute only",
        "compute, then a blocking all_reduce",
        "all_reduce started before, waited after",
    ]
    assert rows[0]["added_ms"] == 0 and all(row["ms"] > 0 for row in rows)
    assert all(row["added_ms"] == pytest.approx(row["ms"] - rows[0]["ms"]) for row in rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| iteration (forward + backward") and len(lines) == 2 + 3 + 2
    assert "2 processes (gloo), all_reduce of 81 float64, 3 iterations of each variant" in lines[-1]
    with pytest.raises(SystemExit):
        bench.parse_args(["--collective", "--collective-floats=0"])
    for mode in ("--collective", "--rewrap"):  # gloo on CPU processes only, refused before anything runs
        with pytest.raises(SystemExit):
            bench.parse_args([mode, "--accelerator=gpu"])


def test_bench_refuses_unknown_rows():
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs=ddp,agg3"])


def test_sampler_bench_rows_for_small_lengths(tmp_path, capsys):
    report = bench.main(
        [
            "--sampler",
            "--sampler-sizes=1000,2e4,10**5",
            "--sampler-indices=3000",
            "--torch-max-length=2e4",
            f"--json={tmp_path / 'sampler.json'}",
        ]
    )
    rows = report["sampler_rows"]
    assert [(row["length"], row["sampler"].split()[0]) for row in rows] == [
        (1000, "shardplus"),
        (1000, "torch"),
        (20000, "shardplus"),
        (20000, "torch"),
        (100000, "shardplus"),
    ]
    assert rows[0]["indices_timed"] == 499 and rows[-1]["indices_timed"] == 2999  # half of N on rank 0 of 2
    assert all(row["first_index_ms"] > 0 and row["indices_per_s"] > 0 for row in rows)
    for row in rows:  # the whole pass includes the first index: slower than the pass after it, faster than 1 / first
        assert 1e3 / row["first_index_ms"] < row["indices_per_s_with_setup"] < row["indices_per_s"]
    table = capsys.readouterr().out
    assert "| 10^5 | shardplus PaddedShardSampler |" in table and "indices/s per rank (whole pass)" in table
    assert (tmp_path / "sampler.json").exists()
    with pytest.raises(SystemExit):
        bench.parse_args(["--sampler", "--sampler-sizes=9223372036854775808"])


def _png_size(path):
    """(width, height) from a PNG's signature and IHDR chunk; fails on anything that is not a PNG."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


@pytest.mark.timeout(180)
def test_quick_bench_writes_json_plots_and_markdown_and_renders_them_again(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    json_path, plots = tmp_path / "bench" / "quick.json", tmp_path / "plots"
    tiny = ["--global-batch-size=8", "--input-dim=8", "--hidden-dim=16", "--layers=1"]
    report = bench.main(
        ["--quick", "--steps=6", "--warmup=3", *tiny, "--configs=ddp,shardplus,shardplus-report,agg4,fp16"]
        + [f"--json={json_path}", f"--plots={plots}", "--markdown"]
    )
    assert report["settings"]["quick"] and report["settings"]["repeats"] == bench.QUICK["repeats"]
    rows = report["results"]
    assert all(len(row["runs"]) == bench.QUICK["repeats"] for row in rows.values())
    # each run over the ddp run of its round: the baseline's own are all 1
    assert rows["ddp"]["paired_ratio_to_baseline"] == 1.0
    for row, ddp_runs in ((row, rows["ddp"]["runs"]) for row in rows.values()):
        paired = sorted(a / b for a, b in zip(row["runs"], ddp_runs, strict=True))
        assert paired[0] <= row["paired_ratio_to_baseline"] <= paired[-1]
    assert rows["ddp"]["breakdown_ms_per_micro_batch"] is None  # the rows compared with ddp run no report
    assert rows["shardplus"]["breakdown_ms_per_micro_batch"] is None
    for name in ("shardplus-report", "agg4", "fp16"):
        breakdown = rows[name]["breakdown_ms_per_micro_batch"]
        assert set(breakdown) == set(bench.STEP_PHASES) and breakdown["communication"] > 0
    overhead = bench.report_overhead(report)
    assert overhead["paired_min"] <= overhead["paired"] <= overhead["paired_max"] and overhead["own_work"] > 0
    assert report["machine"]["cpu_cores"] >= 1 and report["machine"]["torch"]
    for name in ("samples_per_second.png", "step_breakdown.png"):
        assert _png_size(plots / name) == bench.PLOT_SIZE
    out = capsys.readouterr().out
    assert "### Benchmark matrix" in out and "| shardplus-report |" in out and "`ScalingReport` overhead" in out
    assert "| paired ratio (median, 95% interval) |" in out
    assert json.loads(json_path.read_text())["results"].keys() == rows.keys()

    rendered = bench.main([f"--from-json={json_path}", "--markdown"])  # the README section, without running
    assert rendered == json.loads(json_path.read_text())
    assert capsys.readouterr().out.count("### Benchmark matrix") == 1


def test_quick_fills_only_what_was_not_given_and_rows_of_missing_arguments_are_left_out():
    args = bench.parse_args(["--quick", "--steps=3"])
    assert (args.steps, args.repeats, args.warmup) == (3, bench.QUICK["repeats"], bench.QUICK["warmup"])
    assert bench.parse_args([]).repeats == bench.FULL["repeats"]
    names = [config.name for config in bench.default_configs()]
    assert ("autotune" in names) == bench.strategy_accepts(auto_tune_tensor_fusion=True)
    assert not bench.strategy_accepts(no_such_argument=True)


@pytest.mark.timeout(120)
def test_fusion_bench_tunes_then_measures_every_setting_interleaved(tmp_path, capsys):
    report = bench.main(
        [
            "--fusion",
            "--fusion-shapes=small:8:16:2,wide:16:32:1",
            "--fusion-candidates=0.0002,0.001,25",
            "--fusion-steps=2",
            "--fusion-warmup=1",
            "--fusion-rounds=2,3",  # one per shape
            "--global-batch-size=8",
            f"--json={tmp_path / 'fusion.json'}",
        ]
    )
    rows = report["fusion_rows"]
    assert [row["shape"] for row in rows] == ["small", "wide"]
    for row, rounds in zip(rows, (2, 3), strict=True):
        # every candidate, and DDP's own default (the reference)
        measured = {name for label in row["ms_per_step"] for name in label.split(" = ")}
        assert {"0.0002 MB", "0.001 MB", "25 MB", "25 MB (first bucket 1 MB)"} <= measured
        assert row["tuned"] in row["ms_per_step"]
        assert "tuned, measured again" in row["ms_per_step"] and row["tuned_vs_itself_paired"] > 0  # the control
        distinct = len([label for label in row["ms_per_step"] if "first bucket" not in label and "tuned" not in label])
        assert row["samples_per_setting"] == rounds and row["csv_rows"] >= distinct  # each raced at least once
        assert row["tuned_vs_best_fixed"] > 0 and row["tuned_vs_default"] > 0 and row["tuning_steps"] > 0
    table = capsys.readouterr().out
    assert "| small | " in table and "tuned / best fixed" in table
    assert (tmp_path / "fusion.json").exists()
    with pytest.raises(SystemExit):
        bench.parse_args(["--fusion", "--fusion-shapes=small:8:16"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--fusion", "--fusion-rounds=0"])


@pytest.mark.timeout(120)
def test_the_streaming_row_runs_beside_its_map_style_twin_on_a_stream_of_the_same_samples():
    rows = {config.name: config for config in bench.default_configs()}
    for name in ("ddp-stream", "shardplus-stream"):
        assert rows[name].stream and not rows[name].count_gradients and not rows[name].scaling_report
    assert isinstance(rows["ddp-stream"].make_strategy(), DDPStrategy)
    assert not isinstance(rows["ddp-stream"].make_strategy(), ShardPlusStrategy)
    assert [int(x) for x in bench.RankStream(list(range(10)))] == list(range(10))  # one process: all of it, in order
    args = bench.parse_args(
        ["--repeats=1", "--steps=4", "--warmup=2", "--global-batch-size=8", "--input-dim=4", "--hidden-dim=8"]
        + ["--layers=1", "--configs=shardplus,ddp-stream,shardplus-stream"]
    )
    rows = bench.run(bench.select_configs(args.configs), args)["results"]
    assert list(rows) == ["shardplus", "ddp-stream", "shardplus-stream"]
    assert rows["ddp-stream"]["median_samples_per_s"] > 0
    assert rows["shardplus-stream"]["median_samples_per_s"] > 0  # ran its timed steps to the end


@pytest.mark.timeout(300)
def test_scale_bench_counts_what_shardplus_adds_over_ddp_at_two_processes(tmp_path, capsys):
    from lightning_shardplus.bench import scale

    results = scale.main(["--world-sizes=2", "--steps=2", "--epochs=2", f"--json={tmp_path / 'scale.json'}"])
    row = results["world_sizes"]["2"]
    assert set(row) == {"ddp", "shardplus", "added", "checkpoint_bytes", "powersgd_rank_file_bytes"}
    for kind in ("ddp", "shardplus"):
        assert set(row[kind]) == {"per_step", "per_epoch", "once", "by_phase"}
        assert row[kind]["once"]["calls"] > 0  # Lightning's own setup barriers and broadcasts are counted
    added = row["added"]
    # nothing reads the logged values per step (no logger, progress bar or reading callback): the averaged training
    # metrics reduce only the epoch's last step, before validation reads it
    assert added["per_step"]["calls"] == 0
    assert added["per_epoch"]["calls"] >= 2  # that all_reduce and verify_sharding's digest at least
    epoch_end = row["shardplus"]["by_phase"]["epoch_end@1"]["all_reduce"]
    # the fixed-size digest, and for one logged mean 9 float64: its 4 and the section of the unread steps' latest 4
    assert epoch_end == [2, 8 * DIGEST_WIDTH + 8 * 9]
    assert row["checkpoint_bytes"] > row["powersgd_rank_file_bytes"] > 0
    assert "| 2 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "scale.json").read_text())["world_sizes"]["2"]["added"] == added


@pytest.mark.timeout(150)
def test_one_process_fits_after_the_first_do_not_hang_in_a_forked_worker(tmp_path):
    # One process per fit (--devices 1, as on a machine with one GPU) gets all the cores: after a first fit, the
    # second one's first parallel op hung in libgomp when the benchmark process had run one itself. A fresh
    # interpreter without this suite's OMP_NUM_THREADS=1, as a user runs it.
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    tiny = ["--repeats=1", "--steps=4", "--warmup=1", "--global-batch-size=256", "--input-dim=256", "--devices=1"]
    command = [sys.executable, "-m", "lightning_shardplus.bench", *tiny, "--configs=ddp,shardplus,shardplus-plain"]
    [(returncode, out)] = run_commands([command], tmp_path, env, timeout=120)  # killed with its forked fit
    assert returncode == 0, out[-2000:]
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("run ")] == [
        "run 1/3 ddp", "run 2/3 shardplus", "run 3/3 shardplus-plain"
    ]


def test_host_sync_counts_are_per_batch_after_warmup_and_name_who_synchronized(tmp_path):
    # torch raises the warning on CUDA only; on CPU the training step raises it by hand, twice per batch
    class Synchronizing(BoringModel):
        def training_step(self, batch, batch_idx):
            for _ in range(2):
                warnings.warn(f"Warning: {host_syncs.SYNC_WARNING} (function warn_or_error_on_sync)", stacklevel=1)
            return super().training_step(batch, batch_idx)

    def fit(model, out):
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[host_syncs.SyncCounter(warmup=2, out=out)])
        trainer.fit(model)

    class Failing(Synchronizing):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                raise ValueError("a failing step")
            return super().training_step(batch, batch_idx)

    showwarning, filters = warnings.showwarning, list(warnings.filters)
    with pytest.raises(ValueError, match="a failing step"):
        fit(Failing(), tmp_path / "failed.json")
    assert warnings.showwarning is showwarning and warnings.filters == filters  # restored after a failure too
    out = tmp_path / "syncs.json"
    fit(Synchronizing(), out)
    assert warnings.showwarning is showwarning and warnings.filters == filters
    row = json.loads(out.read_text())
    assert row["batches"] == 3
    assert row["other"] == {"per_batch_mean": 2.0, "per_batch_median": 2, "batches_with_any": 3}
    assert row["shardplus"]["batches_with_any"] == row["lightning"]["batches_with_any"] == 0
    [(site, count)] = row["sites"].items()
    assert count == 6 and site.startswith("other: test_bench.py:") and site.endswith(" training_step")


def test_host_sync_origin_is_the_first_frame_outside_torch_from_the_innermost():
    def frame(path, name):
        return traceback.FrameSummary(path, 7, name)

    package = Path(lightning_shardplus.__file__).parent
    lightning = Path(pl.__file__).parent
    torch_file = str(Path(torch.__file__).parent / "_tensor.py")
    # a package whose name starts with torch's is not torch
    torchmetrics_file = str(Path(torch.__file__).parent.parent / "torchmetrics" / "metric.py")
    assert host_syncs.origin([frame(torchmetrics_file, "compute")]) == ("other", "metric.py:7 compute")
    stack = [frame(str(lightning / "trainer/trainer.py"), "fit"), frame(str(package / "metrics.py"), "pack"),
             frame(torch_file, "item")]
    assert host_syncs.origin(stack) == ("shardplus", "metrics.py:7 pack")
    assert host_syncs.origin(stack[:1] + stack[2:]) == ("lightning", "trainer.py:7 fit")
    assert host_syncs.origin([frame(str(package / "bench/runner.py"), "run_once")])[0] == "other"
    assert host_syncs.origin([frame(torch_file, "item")]) == ("other", "?")


def test_host_syncs_need_a_gpu():
    with pytest.raises(SystemExit):
        bench.main(["--host-syncs", "--accelerator=cpu"])


def test_the_median_interval_is_the_order_statistics_a_binomial_count_gives():
    from lightning_shardplus.bench.runner import median_interval

    values = [float(v) for v in range(21, 0, -1)]  # 21 runs: the 6th smallest and the 6th largest (97.3%)
    assert median_interval(values) == (6.0, 16.0)
    assert median_interval(values[:6]) == (16.0, 21.0)  # 6 runs: their whole range (96.9%)
    assert median_interval(values[:5]) is None  # 5 runs: even their whole range holds the median only 93.8%
    assert median_interval([1.0] * 100) == (1.0, 1.0)
    # 99%: the 5th smallest and largest (at most 4 of 21 below the median: 0.36% per tail; at most 5: 1.3%)
    assert median_interval(values, confidence=0.99) == (5.0, 17.0)


def test_the_table_shows_the_paired_ratio_with_its_interval_where_there_is_one():
    def row(runs, paired, interval):
        return {
            "median_samples_per_s": 100.0, "min_samples_per_s": 90.0, "max_samples_per_s": 110.0,
            "median_ms_per_step": 10.0, "ratio_to_baseline": 1.0, "paired_ratio_to_baseline": paired,
            "paired_ratio_interval_95": interval, "runs": [100.0] * runs, "bytes_per_step": None,
            "rounds_per_step": None, "collectives_per_step": None, "all_reduce_per_step": 0,
            "barrier_per_step": 0,
        }

    # as a report comes back from JSON: the interval a list
    report = {"baseline": "ddp", "results": {"ddp": row(7, 1.0, [1.0, 1.0]), "shardplus": row(7, 0.981, [0.95, 1.02])}}
    table = bench.format_table(report)
    assert "| shardplus | 100 | 90 - 110 | 10.0 | 1.000 | 0.981 (0.950 - 1.020) |" in table
    assert "not significant" not in table
    few = {"baseline": "ddp", "results": {"ddp": row(5, 1.0, None), "shardplus": row(5, 0.981, None)}}
    table = bench.format_table(few)
    assert "| 0.981 | " in table and "fewer than 6 runs per row (5)" in table


def test_reports_of_one_command_pool_every_run_and_each_paired_ratio_within_its_own_report(tmp_path, capsys):
    def report(ddp_runs, shardplus_runs, **settings):
        def row(runs, paired):
            return {"runs": runs, "median_ms_per_step": 1000 / runs[0], "paired_ratio_to_baseline": paired,
                    "bytes_per_step": None, "rounds_per_step": None, "collectives_per_step": None,
                    "all_reduce_per_step": 0, "barrier_per_step": 0}  # fmt: skip

        paired = sorted(a / b for a, b in zip(shardplus_runs, ddp_runs, strict=True))[len(ddp_runs) // 2]
        return {
            "settings": {"repeats": len(ddp_runs), "steps": 200, "json": "x.json", **settings},
            "machine": {"cpu": "test"}, "baseline": "ddp",
            "results": {"ddp": row(ddp_runs, 1.0), "shardplus": row(shardplus_runs, paired)},
        }  # fmt: skip

    # a fast first report and a slow second one: each run is paired with ddp's run of its own round and report
    first, second = report([200.0] * 7, [198.0] * 7), report([100.0] * 7, [101.0] * 6 + [50.0])
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, written in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(written))
    pooled = bench.main(["--from-json", *map(str, paths)])
    row = pooled["results"]["shardplus"]
    assert row["runs"] == [198.0] * 7 + [101.0] * 6 + [50.0]
    assert row["paired_ratio_per_report"] == [0.99, 1.01]
    # 14 paired ratios: seven 0.99, six 1.01, one 0.5: the median 0.99; across reports (198 / 100) it would be 1.01
    assert row["paired_ratio_to_baseline"] == pytest.approx(0.99)
    assert row["paired_ratio_interval_95"] == pytest.approx((0.99, 1.01))
    assert row["ratio_to_baseline"] == pytest.approx(statistics.median(row["runs"]) / 150.0)
    assert pooled["settings"]["pooled_from"] == [str(path) for path in paths]
    out = capsys.readouterr().out
    assert f"pooled from 2 reports ({paths[0]}, {paths[1]}); each one's paired ratio: shardplus 0.990, 1.010" in out

    other_steps = tmp_path / "c.json"
    other_steps.write_text(json.dumps(report([100.0] * 7, [100.0] * 7, steps=100)))
    differ = r"--from-json .*c.json: its settings differ from those of .*a.json in \['steps'\]"
    with pytest.raises(ValueError, match=differ):
        bench.main(["--from-json", str(paths[0]), str(other_steps)])
    fewer_rows = {**first, "results": {"ddp": first["results"]["ddp"]}}
    other_steps.write_text(json.dumps(fewer_rows))
    with pytest.raises(ValueError, match=r"its rows \['ddp'\] are not those of"):
        bench.main(["--from-json", str(paths[0]), str(other_steps)])
    other_steps.write_text(json.dumps({"settings": first["settings"], "sampler_rows": []}))
    with pytest.raises(ValueError, match=r"c.json: several reports pool only the matrix's"):
        bench.main(["--from-json", str(paths[0]), str(other_steps)])


def test_the_report_overhead_says_more_or_fewer_samples_per_second_never_a_negative_fewer():
    def report(with_report_runs):
        runs = {"shardplus": [100.0, 100.0, 100.0], "shardplus-report": with_report_runs}
        return {"results": {name: {"runs": values} for name, values in runs.items()}}

    faster = bench.format_overhead(report([130.0, 100.0, 140.0]))
    assert faster.startswith("`ScalingReport` overhead: 30.0% more samples/s for `shardplus-report` than `shardplus`")
    assert "from 40.0% more to 0.0% fewer" in faster and "-" not in faster.replace("shardplus-report", "")
    slower = bench.format_overhead(report([95.0, 90.0, 97.0]))
    assert "5.0% fewer samples/s" in slower and "from 3.0% fewer to 10.0% fewer" in slower


@pytest.mark.skipif(release(torch.__version__) < (2, 6), reason="the demo model's fully_shard is public from torch 2.6")
@pytest.mark.timeout(300)
def test_the_model_parallel_pair_runs_in_one_launch_and_reports_paired_ratios_on_rank_0(tmp_path):
    tiny = ["--repeats=2", "--steps=3", "--warmup=1", "--input-dim=8", "--hidden-dim=8", "--layers=2"]
    command = [sys.executable, "-m", "lightning_shardplus.bench", "--model-parallel", *tiny, f"--json={tmp_path / 'j'}"]
    env = {key: value for key, value in os.environ.items() if key != "LOCAL_RANK"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "j").read_text())
    assert report["baseline"] == "model_parallel"
    rows = ["model_parallel", "shardplus_model_parallel", "shardplus_model_parallel-plain", "model_parallel-again"]
    assert list(report["results"]) == rows
    assert report["results"]["model_parallel"]["paired_ratio_to_baseline"] == 1.0
    assert all(len(row["runs"]) == 2 and min(row["runs"]) > 0 for row in report["results"].values())
    assert done.stdout.count("| shardplus_model_parallel |") == 1  # the table, printed by rank 0 alone
