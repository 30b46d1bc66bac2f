"""Re-fitting the MoE selection biases on unlabelled bases (``evaluate --rebalance``), on real DNA.

The debug model with 8 experts trained 40 steps on U. maydis under DeepSeek-V3's sign update
routes held-out chr22 unevenly (test_moe_balance: max/mean 1.77); re-fitting its biases on one
part of chr22 must even out the load on another part, and the report must say so.
"""

import json

import pytest
import torch

from megabase.eval.rebalance import rebalance_moe
from megabase.eval.score import ModelScorer
from megabase.eval.report import report_metrics
from megabase.model import load_checkpoint
from megabase.pipeline.cli import main

FIT, SCORED = "chr22:1-150,000", "chr22:150,001-300,000"


@pytest.fixture(scope="module")
def skewed(bundled_store, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("skewed")
    sets = {"name": "moe", "workdir": str(workdir), "data.store": str(bundled_store.path),
            "data.window_length": "4096", "model.preset": "debug", "model.overrides.n_experts": "8",
            "model.overrides.bias_update": "sign", "model.overrides.bias_update_rate": "1e-3",
            "train.steps": "40", "train.seq_warmup": "false", "train.checkpoint_every": "40",
            "eval.enabled": "false"}
    assert main(["train", *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")],
                 "--quiet"]) == 0
    return workdir / "runs" / "moe" / "checkpoints" / "step-000040"


def _evaluate(ckpt, store, out, *flags):
    return main(["evaluate", "--checkpoint", str(ckpt), "--data", str(store.path), "--out", str(out),
                 "--regions", SCORED, "--controls", "", "--baselines", "", "--no-probe",
                 "--no-copy", "--bootstrap", "50", "--quiet", *flags])


def test_rebalancing_evens_the_held_out_load(skewed, bundled_store, tmp_path, capsys):
    assert _evaluate(skewed, bundled_store, tmp_path / "trained") == 0
    assert _evaluate(skewed, bundled_store, tmp_path / "fitted", "--rebalance", FIT,
                     "--rebalance-rounds", "3") == 0
    out = capsys.readouterr().out
    trained, fitted = (json.loads((tmp_path / d / "report.json").read_text())
                       for d in ("trained", "fitted"))
    before = [r["max_over_mean"] for r in trained["moe_load"]]
    after = [r["max_over_mean"] for r in fitted["moe_load"]]
    assert max(before) > 1.5, before  # the skew the test is about is there
    assert max(after) <= 1.25 and max(after) < max(before) - 0.3, (before, after)
    fit = fitted["moe_rebalance"]
    assert fit["regions"] == [FIT] and fit["rounds"] == 3 and len(fit["max_over_mean"]) == 4
    kept = fit["kept"]
    assert kept > 0 and max(fit["max_over_mean"][kept]) == min(max(r) for r in fit["max_over_mean"])
    assert "moe_rebalance" not in trained
    # the same windows and bases, scored with another selection of experts only
    assert fitted["overall"]["n_tokens"] == trained["overall"]["n_tokens"]
    assert fitted["overall"]["bits_per_base"] != trained["overall"]["bits_per_base"]
    assert abs(fitted["overall"]["bits_per_base"] - trained["overall"]["bits_per_base"]) < 0.1
    # its own pass with the trained biases is the other run's scoring, paired per window
    was = fit["trained"]
    assert was["n_tokens"] == trained["overall"]["n_tokens"]
    assert was["bits_per_base"] == pytest.approx(trained["overall"]["bits_per_base"], abs=1e-9)
    assert [r["max_over_mean"] for r in was["moe_load"]] == pytest.approx(before, abs=1e-6)
    cost = fit["cost"]["all"]
    assert cost["gain_bits_per_base"] == pytest.approx(
        was["bits_per_base"] - fitted["overall"]["bits_per_base"], abs=1e-9)
    assert cost["ci"][0] <= cost["gain_bits_per_base"] <= cost["ci"][1]
    assert f"MoE biases re-fitted first on {FIT}" in out and "the imbalance costs" in out
    metrics = report_metrics(fitted)
    assert metrics["eval/moe_rebalance/cost_bits_per_base"] == cost["gain_bits_per_base"]
    assert metrics["eval/moe_rebalance/max_over_mean_after/layer_0"] == fit["max_over_mean"][kept][0]


def test_no_rounds_measure_without_moving(skewed, bundled_store):
    model = load_checkpoint(skewed)
    biases = [m.bias.clone() for m in model.moe_layers()]
    tokens = bundled_store.tokens("chr22")
    wins = [tokens[i : i + 4096] for i in range(0, 3 * 4096, 4096)]
    entry = rebalance_moe(ModelScorer(model), wins, rounds=0, progress=False)
    assert len(entry["max_over_mean"]) == 1 and entry["bases"] == 3 * 4096
    assert all(torch.equal(m.bias, b) for m, b in zip(model.moe_layers(), biases))
    assert all(x == 0 for row in entry["bias_shift"] for x in row)


@pytest.mark.parametrize("flags, says", [
    (["--rebalance", "chr22:100,001-200,000"], "splits overlap"),
    (["--rebalance", FIT, "--rebalance-rounds", "0"], "--rebalance-rounds must be a positive"),
    (["--rebalance", "chr99"], "chr99"),
])
def test_bad_rebalance_options_are_refused_in_one_line(skewed, bundled_store, tmp_path, capsys,
                                                       flags, says):
    assert _evaluate(skewed, bundled_store, tmp_path / "bad", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "bad").exists()
