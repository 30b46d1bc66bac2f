import pytest

from megabase.data import InputError
from megabase.model import PRESETS, ModelConfig, build_model, get_preset, parameter_counts


def test_glm5_flash_layer_pattern():
    kinds = get_preset("glm5-flash").layer_kinds
    assert len(kinds) == 45 and kinds.count("K") == 34 and kinds.count("D") == 11
    assert all((c == "D") == (i % 4 == 3) for i, c in enumerate(kinds))


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_states_its_parameter_counts(name):
    cfg = get_preset(name)
    counts = parameter_counts(cfg)
    # a token uses one row of each k-mer table (k = 2..kmer_embed), and top-k of the routed experts
    unused_kmer_rows = sum(4**k + 1 for k in range(2, cfg.kmer_embed + 1)) - (cfg.kmer_embed - 1)
    idle = counts["total"] - counts["active"] - (unused_kmer_rows * cfg.d_model if cfg.kmer_embed else 0)
    assert 0 < counts["active"] <= counts["total"] and (idle == 0) == (cfg.mixer == "attention")


def test_the_dense_baseline_matches_cpu_small_in_active_parameters():
    dense, hybrid = (parameter_counts(get_preset(n))["active"] for n in ("cpu-small-dense", "cpu-small"))
    assert get_preset("cpu-small-dense").layer_kinds == "A" * 8
    assert abs(dense - hybrid) / hybrid < 1e-3


def test_debug_has_every_part_and_counts_match_a_real_model():
    cfg = get_preset("debug")
    assert "K" in cfg.layer_kinds and "D" in cfg.layer_kinds and cfg.n_experts >= 4
    assert cfg.topk < 2000 and 32 <= cfg.d_model <= 64
    model = build_model("debug")
    assert sum(p.numel() for p in model.parameters()) == parameter_counts(cfg)["total"]


def test_unknown_preset_and_field_are_clear_errors():
    with pytest.raises(InputError, match="unknown model preset 'gpu-9b'; choose from debug"):
        get_preset("gpu-9b")
    with pytest.raises(InputError, match="unknown model config key 'd_modle'; valid keys: .*d_model"):
        get_preset("debug", d_modle=64)
    with pytest.raises(InputError, match="model.topk must be a positive integer"):
        get_preset("debug", topk=0)
    with pytest.raises(InputError, match="model.indexer_mode must be one of sparse, dense"):
        ModelConfig(indexer_mode="warm")
    with pytest.raises(InputError, match="multiple of"):
        ModelConfig(dsa_heads=3, dsa_kv_heads=2)


def test_the_dsa_stage_is_one_sub_config_that_overrides_merge_into():
    from megabase.kernels.dsa import Stage

    cfg = get_preset("debug")
    assert cfg.dsa_stage == Stage() and cfg.stage() is cfg.dsa_stage
    assert cfg.to_dict()["dsa_stage"] == {"summary": "max", "start": 65536, "block": 128,
                                          "blocks": 64, "local": 1024, "seed": 16,
                                          "seed_cap": 16, "carry": 32}
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    # an override changes only the stage fields it names; a summary alone is a shorthand
    tuned = get_preset("debug", dsa_stage={"start": 0, "block": 32})
    assert (tuned.dsa_stage.start, tuned.dsa_stage.block, tuned.dsa_stage.local) == (0, 32, 1024)
    exact = tuned.replace(dsa_stage="exact")
    assert exact.stage() is None and exact.dsa_stage.block == 32
    assert Stage.decode(tuned.dsa_stage.encode()) == tuned.dsa_stage
    # the flat names of before (config.json files and YAML overrides written then) still read
    old = {"dsa_stage": "mean", "dsa_stage_from": 0, "dsa_stage_block": 32, "dsa_stage_seed": 0}
    assert ModelConfig.from_dict(old).dsa_stage == Stage("mean", start=0, block=32, seed=0)
    assert get_preset("debug", dsa_stage_local=64).dsa_stage.local == 64


@pytest.mark.parametrize("stage, message", [
    ({"blok": 16}, "unknown model.dsa_stage key 'blok'; valid keys: summary, start, block"),
    ({"block": 20}, "model.dsa_stage.block must be a positive multiple of 16, got 20"),
    ("fast", "model.dsa_stage.summary must be one of exact, mean, max, got 'fast'"),
    ({"start": "0"}, "model.dsa_stage.start must be an integer, got '0'"),
    ({"seed": 2}, "model.dsa_stage.seed must be a seed length of 0 \\(none\\) or 4..16 bases, got 2"),
    ({"local": 8}, "model.keep_recent \\(16\\) must not exceed model.dsa_stage.local \\(8\\)"),
    (7, "model.dsa_stage must be a mapping of the candidate stage's fields or one of exact"),
])
def test_a_bad_dsa_stage_is_one_line_naming_the_field(stage, message):
    with pytest.raises(InputError, match=message):
        get_preset("debug", keep_recent=16, dsa_stage=stage)
