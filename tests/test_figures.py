"""docs/figures/draw.py: the figures are written, small, valid SVG, the same bytes on every run, and the shard
picture shows what the samplers yield."""

import importlib.util
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from lightning_shardplus import ExactShardSampler, PaddedShardSampler

pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parent.parent / "docs" / "figures" / "draw.py"
FIGURES = ("padded-vs-exact-shards.svg", "join-vs-drop.svg", "step-time.svg")


def _draw_module():
    spec = importlib.util.spec_from_file_location("draw_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(180)  # two processes of its own
def test_figures_are_small_valid_svg_and_reproducible(tmp_path):
    outputs = []
    for run in ("a", "b"):  # two processes: nothing carried over between the runs
        subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / run)], check=True, capture_output=True)
        outputs.append({name: (tmp_path / run / name).read_bytes() for name in FIGURES})
    for name in FIGURES:
        data = outputs[0][name]
        assert ET.fromstring(data).tag == "{http://www.w3.org/2000/svg}svg", name
        assert len(data) < 60_000, (name, len(data))
        assert data == outputs[1][name], f"{name} differs between two runs"


def test_the_shard_picture_is_the_samplers_assignment():
    draw = _draw_module()
    drawn = draw.shard_assignment()
    n, w = draw.SAMPLES, draw.RANKS
    for padding in ("first", "wrap"):
        for rank in range(w):
            sampler = PaddedShardSampler(n, w, rank, shuffle=True, seed=draw.SEED, padding=padding)
            sampler.set_epoch(draw.EPOCH)
            indices = list(sampler)
            real = sampler.num_real_samples
            assert drawn[padding][rank] == [(index, j >= real) for j, index in enumerate(indices)]
    assert drawn["exact"] == [[(i, False) for i in ExactShardSampler(n, w, rank)] for rank in range(w)]
    # what the picture and its captions say: 4 per rank in training, 2 padding reads ("first": sample 0; "wrap": the
    # order's first two samples); 4 + 3 + 3 contiguous evaluation samples
    order = draw.epoch_order()
    assert [len(shard) for shard in drawn["first"]] == [4, 4, 4]
    assert [i for shard in drawn["first"] for i, pad in shard if pad] == [0, 0]
    assert [i for shard in drawn["wrap"] for i, pad in shard if pad] == order[:2]
    assert [i for shard in drawn["exact"] for i, _ in shard] == list(range(n))
    assert [len(shard) for shard in drawn["exact"]] == [4, 3, 3]


def test_the_figures_page_is_what_the_reports_give():
    """docs/figures.md is generated from docs/bench/*.json: regenerate it with the command its first lines name."""
    from lightning_shardplus.bench import figures

    assert figures.main(["--check"]) == 0, "docs/figures.md is stale: python -m lightning_shardplus.bench.figures"
