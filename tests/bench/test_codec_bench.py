"""``snapshotd-bench codec`` at tiny sizes: it runs, its numbers are sane, its report prints, saves and draws."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from snapshotd.bench import codec
from snapshotd.bench.report import Report, emit
from snapshotd.harness import workloads

TINY = [
    "--chunk",
    "1MiB",
    "--params",
    "30000",
    "--steps",
    "3",
    "--batch",
    "2",
    "--seq-len",
    "16",
    "--vocab",
    "256",
    "--random-bytes",
    "256KiB",
    "--repeat",
    "1",
]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and spinning OpenMP workers crawl on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def report() -> Report:
    parser = argparse.ArgumentParser()
    codec.add_arguments(parser)
    return codec.run(parser.parse_args(TINY))


def test_summary_keys_and_sanity(report: Report) -> None:
    s = report.summary
    for key in (
        "encode_decode_us",
        "memcpy_us",
        "memcpy_cached_us",
        "encode_decode_vs_memcpy",
        "checksum_Bps",
    ):
        assert s[key] > 0, key
    assert s["encode_decode_vs_memcpy"] == pytest.approx(s["encode_decode_us"] / s["memcpy_us"])
    assert s["encode_decode_vs_memcpy"] < 1.0  # framing a 1 MiB chunk costs less than copying it (~0.1 here)
    for dtype in ("fp32", "bf16"):
        for kind in ("params", "exp_avg", "exp_avg_sq"):
            assert 0 < s[f"delta_ratio_{dtype}_{kind}"] <= 1
            assert s[f"delta_breakeven_Gbit_{dtype}_{kind}"] >= 0
        assert 0 < s[f"shuffle_ratio_{dtype}_params"] <= 1
    assert s["best_breakeven_Gbit"] == max(r["breakeven_Gbit"] for r in report.results)
    fp32 = [r for r in report.results if r["codec"] == "delta-lz4" and r["data"].endswith("-fp32")]
    raw = sum(r["raw_bytes"] for r in fp32)
    assert s["delta_speedup_bound_fp32"] == pytest.approx(
        raw / sum(r["raw_bytes"] * r["entropy_ratio"] for r in fp32)
    )
    assert s["delta_speedup_fp32"] == pytest.approx(raw / sum(r["raw_bytes"] * r["ratio"] for r in fp32))


def test_rows(report: Report) -> None:
    pairs = {(r["data"], r["codec"]) for r in report.results}
    assert len(pairs) == len(report.results) == 2 * 7 + 6
    assert ("random-fp32", "shuffle-lz4") in pairs and ("params-bf16", "delta-lz4") in pairs
    for row in report.results:
        assert set(report.columns or []) <= row.keys()
        assert 0 < row["ratio"] <= 1 and row["compress_Bps"] > 0 and row["decompress_Bps"] > 0
        assert row["elem"] == (2 if row["data"].endswith("bf16") else 4)
        if row["codec"] == "delta-lz4":  # some bits of an element change less often than others
            assert 0 < row["entropy_ratio"] < 1
        else:
            assert row["entropy_ratio"] is None
        if row["encoded_chunks"] == 0:  # nothing shrank: all raw, ratio exactly 1, never pays
            assert row["ratio"] == 1 and row["breakeven_Gbit"] == 0
    random = {r["codec"]: r for r in report.results if r["data"] == "random-fp32"}
    assert random["lz4"]["ratio"] == 1  # lz4 alone gains nothing on fp32 noise (DESIGN.md)
    assert (
        report.config["model"]["n_params"]
        == workloads.config_for_params(30000, vocab=256, seq_len=16).n_params
    )


def test_report_prints_saves_and_plots(report: Report, tmp_path: Path) -> None:
    json_path, png_path = tmp_path / "codec.json", tmp_path / "codec.png"
    out = tmp_path / "out.txt"
    with out.open("w") as f:
        emit(report, json_path=str(json_path), plot_path=str(png_path), plot_fn=codec.plot, out=f)
    text = out.read_text()
    assert "delta_ratio_bf16_params" in text and "shuffle-lz4" in text
    doc = json.loads(json_path.read_text())
    assert doc["bench"] == "codec" and len(doc["results"]) == len(report.results)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments() -> None:
    parser = argparse.ArgumentParser()
    codec.add_arguments(parser)
    with pytest.raises(ValueError):
        codec.run(parser.parse_args([*TINY, "--steps", "1"]))


# ------------------------------------------------------------------------------------------------ workloads


def test_config_for_params_is_close_and_consistent() -> None:
    for target in (1_000_000, 3_000_000, 17_000_000, 124_000_000):
        cfg = workloads.config_for_params(target)
        assert abs(math.log(cfg.n_params / target)) < 0.25, (target, cfg)
        assert cfg.d_model % cfg.n_head == 0
    cfg = workloads.config_for_params(1)  # the smallest shape
    assert (cfg.d_model, cfg.n_layer) == (32, 1)
    with pytest.raises(ValueError):
        workloads.config_for_params(0)
    with pytest.raises(ValueError):
        workloads.GPTConfig(d_model=100, n_head=3)


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_parameter_count_and_shapes(tie: bool) -> None:
    cfg = workloads.GPTConfig(vocab=64, d_model=32, n_layer=2, n_head=2, seq_len=8, tie_weights=tie)
    model = workloads.GPT(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params
    x, y = workloads.make_batch(cfg, 3, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 8) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert model(x).shape == (3, 8, 64)
    with pytest.raises(ValueError):
        model(torch.zeros(1, 9, dtype=torch.int64))


def test_training_is_deterministic_and_learns() -> None:
    cfg = workloads.GPTConfig(vocab=64, d_model=32, n_layer=2, n_head=2, seq_len=16)

    def run(model_seed: int, data_seed: int) -> tuple[list[float], torch.Tensor]:
        model = workloads.GPT(cfg, seed=model_seed)
        opt = workloads.make_optimizer(model, lr=3e-3)
        seen: list[int] = []
        losses = workloads.train_steps(model, opt, cfg, 40, 8, data_seed, on_step=seen.append)
        assert seen == list(range(1, 41))
        return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    torch.manual_seed(123)
    a_losses, a_params = run(0, 1)
    torch.manual_seed(456)  # the global RNG plays no part
    b_losses, b_params = run(0, 1)
    assert a_losses == b_losses and torch.equal(a_params, b_params)
    c_losses, _ = run(1, 1)
    assert c_losses != a_losses
    assert all(math.isfinite(v) for v in a_losses)
    assert sum(a_losses[-5:]) / 5 < sum(a_losses[:5]) / 5
