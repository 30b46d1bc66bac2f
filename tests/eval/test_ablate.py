"""Ablations cut one kind of layer's far context and leave everything else as the full pass."""

import numpy as np
import pytest
import torch

from megabase.eval.ablate import ablated, check_ablation, label
from megabase.eval.score import ModelScorer


def _awake(model):
    """``model`` with noise on every weight: a fresh one starts with its output projections at
    zero, and its predictions would not depend on the context at all."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.fixture(scope="module")
def scorer():
    from megabase.model import build_model

    torch.manual_seed(0)
    return ModelScorer(_awake(build_model("debug")))


@pytest.fixture(scope="module")
def window(hsap_store):
    """5,000 bases of human chr22 (a ragged last piece of 904 at a limit of 1,024), few N."""
    return np.array(hsap_store.tokens("chr22")[30_024_576:30_029_576])


@pytest.mark.parametrize("name", ["kda_reset", "dsa_near"])
def test_a_limit_past_the_window_changes_nothing(scorer, window, name):
    full = scorer(window)
    same = ablated(scorer, name, 5 * 1024)(window)
    ok = ~np.isnan(full)
    assert (np.isnan(same) == ~ok).all() and ok.sum() > 4000
    np.testing.assert_allclose(same[ok], full[ok], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name, untouched", [("kda_reset", 1024), ("dsa_near", 2048)])
def test_an_ablation_changes_only_what_lies_past_its_limit(scorer, window, name, untouched):
    """KDA memory reset every 1,024 bases: the first piece is the full pass's; DSA keys kept
    for 1,024-2,048 bases back: the first two pieces are (no query there sees further)."""
    full, cut = scorer(window), ablated(scorer, name, 1024)(window)
    ok = ~np.isnan(full)
    # the scorer's input starts with <sep>: base i is predicted at input position i
    head = ok & (np.arange(len(window)) < untouched)
    np.testing.assert_allclose(cut[head], full[head], rtol=0, atol=1e-5)
    tail = ok & (np.arange(len(window)) >= untouched)
    moved = np.abs(cut[tail] - full[tail])
    assert (moved > 1e-4).mean() > 0.5, f"{name}: {np.median(moved):.2e}"


def test_the_dsa_ablation_leaves_a_model_without_far_keys_alone(window):
    """A model whose DSA layers keep only their most recent keys selects none past the limit:
    dropping them changes nothing (the cut caches and seed table keep their positions right)."""
    from megabase.model import build_model

    torch.manual_seed(1)
    model = _awake(build_model("debug", topk=16, keep_recent=16))
    s = ModelScorer(model)
    full = s(window)
    ok = ~np.isnan(full)
    np.testing.assert_allclose(ablated(s, "dsa_near", 1024)(window)[ok], full[ok], rtol=0, atol=1e-5)


def test_unknown_ablations_and_ragged_limits_are_refused():
    with pytest.raises(ValueError, match="unknown ablation 'dsa'; one of kda_reset, dsa_near"):
        check_ablation("dsa", 16384)
    with pytest.raises(ValueError, match="multiple of 1024"):
        check_ablation("kda_reset", 1000)
    assert label("dsa_near", 16384) == "DSA keys beyond 16,384-32,768 bases dropped"


def test_evaluate_reports_each_ablation_paired_with_the_model(hsap_store, tmp_path, capsys):
    import json

    from megabase.model import build_model, save_checkpoint
    from megabase.pipeline.cli import main

    torch.manual_seed(0)
    ckpt = save_checkpoint(_awake(build_model("debug")), tmp_path / "ckpt",
                           extra={"window_length": 4096})
    common = ["evaluate", "--checkpoint", str(ckpt), "--data", str(hsap_store.path),
              "--regions", "chr22:30,024,577-30,032,768", "--no-probe", "--no-copy",
              "--baselines", "", "--bootstrap", "50", "--no-mlflow", "--out", str(tmp_path / "e")]
    assert main([*common, "--ablations", "kda_reset,dsa_near", "--controls", "1000"]) == 2
    assert "--ablation-limit: an ablation's limit must be a multiple of 1024, got 1000" \
        in capsys.readouterr().err
    assert main([*common, "--ablations", "dsa", "--controls", "1024"]) == 2
    assert "--ablations: unknown ablation 'dsa'" in capsys.readouterr().err
    assert main([*common, "--ablations", "kda_reset,dsa_near", "--controls", "1024",
                 "--edges", "0,1024,2048"]) == 0
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    kda, dsa = report["ablations"]["kda_reset"], report["ablations"]["dsa_near"]
    assert kda["limit"] == dsa["limit"] == 1024 and kda["overall"]["n_tokens"] == \
        report["overall"]["n_tokens"]
    # nothing moves before the limit; the pooled cost beyond it is the per-bin one's sum
    assert kda["cost"][0]["all"]["gain_bits_per_base"] == pytest.approx(0, abs=1e-6)
    assert dsa["cost"][1]["all"]["gain_bits_per_base"] == pytest.approx(0, abs=1e-6)
    assert kda["cost_beyond"]["context_lo"] == 1024 and kda["cost"][1]["all"]["ci"][0] is not None
    assert "ablation kda_reset (KDA memory reset every 1,024 bases): beyond [1,024, 4,096)" \
        in capsys.readouterr().out
