"""The benchmark runs its rows and counts the communication of each (a tiny workload: a smoke test, not a
measurement)."""

import pytest

from lightning_shardplus import bench


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
    table = capsys.readouterr().out
    assert "| 10^5 | shardplus PaddedShardSampler |" in table and "indices/s per rank" in table
    assert (tmp_path / "sampler.json").exists()
    with pytest.raises(SystemExit):
        bench.parse_args(["--sampler", "--sampler-sizes=9223372036854775808"])
