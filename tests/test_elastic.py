"""torchrun elastic restart: a worker dies abruptly mid-epoch; torchrun restarts the job, which resumes from the
last checkpoint and ends with bitwise the weights of an uninterrupted run, every sample read once per epoch."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from _elastic_probe import EPOCHS, NUM_SAMPLES, fit
from _models import read_records, run_commands

ROOT = Path(__file__).resolve().parents[1]
FAIL_AT_STEP = 9  # the 4th step of epoch 1; last.ckpt holds step 8


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    paths = [str(ROOT), str(ROOT / "tests")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = "1"
    # torchrun's c10d rendezvous shares one TCPStore with every attempt's workers, without a per-attempt prefix:
    # a restarted worker may read the gloo address of a dead one and fail to connect (seen 1 run in 3 here).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def epoch_indices(rows: list[dict]) -> dict[int, Counter]:
    counts: dict[int, Counter] = {}
    for row in rows:
        counts.setdefault(row["epoch"], Counter()).update(row["indices"])
    return counts


@pytest.mark.timeout(180)
def test_torchrun_restart_after_a_worker_dies_resumes_to_the_uninterrupted_result(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        str(ROOT / "tests" / "_elastic_probe.py"),
        str(tmp_path / "elastic"),
        str(FAIL_AT_STEP),
    ]
    [(returncode, output)] = run_commands([command], tmp_path, job_env(), timeout=150)
    assert returncode == 0, output[-5000:]

    rows = [r for r in read_records(tmp_path / "elastic" / "record") if r["stage"] == "train"]
    assert {r["attempt"] for r in rows} == {0, 1}, "rank 1 did not die, or torchrun did not restart"
    assert max(r["step"] for r in rows if r["attempt"] == 0) <= FAIL_AT_STEP
    resumed_from = min(r["step"] for r in rows if r["attempt"] == 1)
    assert resumed_from == FAIL_AT_STEP - 1  # last.ckpt, written at step 8
    # what the final weights were trained on: the first attempt up to the checkpoint, then the second attempt
    trained = [r for r in rows if (r["attempt"] == 0 and r["step"] < resumed_from) or r["attempt"] == 1]

    reference_weights = fit(tmp_path / "reference", start_method="fork")
    reference = [r for r in read_records(tmp_path / "reference" / "record") if r["stage"] == "train"]

    def per_rank_batches(records):
        return {rank: [r["indices"] for r in records if r["rank"] == rank] for rank in (0, 1)}

    assert per_rank_batches(trained) == per_rank_batches(reference)
    counts = epoch_indices(trained)
    assert sorted(counts) == list(range(EPOCHS))
    for epoch in range(EPOCHS):  # no sample lost or repeated (22 samples on 2 ranks: no padding)
        assert counts[epoch] == Counter(range(NUM_SAMPLES)), epoch
    final = torch.load(tmp_path / "elastic" / "final.pt")
    assert final.keys() == reference_weights.keys()
    for key, value in reference_weights.items():
        assert torch.equal(final[key], value), key
