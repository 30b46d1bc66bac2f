import re
from dataclasses import replace
from pathlib import Path

import pytest

from megabase.core.errors import InputError
from megabase.pipeline.config import dump_config, flat_params, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")
                                         if not p.name.startswith("rl-")))  # tests/rl: RL configs
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.data.train and cfg.data.eval and cfg.train.steps > 0


def test_the_demo_file_is_the_default():
    assert load_config(CONFIGS / "demo.yaml") == load_config(None)


def test_sets_are_converted_and_validated():
    cfg = load_config(None, ["train.lr=1e-3", "train.seq_warmup=false", "data.train=chr1,chr2",
                             "data.stride=null", "model.preset=debug", "model.overrides.topk=16",
                             "model.overrides.bias_update_rate=1e-3", "name=x"])
    assert cfg.train.lr == 1e-3 and cfg.train.seq_warmup is False
    assert cfg.data.train == ["chr1", "chr2"] and cfg.data.stride is None
    # 1e-3 is a float (YAML 1.2), not the string YAML 1.1 makes of it
    assert cfg.model.overrides == {"topk": 16, "bias_update_rate": 0.001} and cfg.name == "x"
    text = dump_config(cfg)
    assert "lr: 0.001" in text and flat_params(cfg)["model.config.topk"] == "16"
    # the DSA stage is one sub-config: a --set names a field of it, and MLflow gets each field
    cfg = load_config(None, ["model.overrides.dsa_stage.start=0", "model.overrides.dsa_stage.summary=mean"])
    assert cfg.model.overrides == {"dsa_stage": {"start": 0, "summary": "mean"}}
    params = flat_params(cfg)
    assert (params["model.config.dsa_stage.start"], params["model.config.dsa_stage.summary"],
            params["model.config.dsa_stage.block"]) == ("0", "mean", "128")


def test_set_takes_the_yaml_of_the_config_files_and_commas_alike():
    yaml_form = load_config(None, ["eval.controls=[1000]", "eval.baselines=[0, 4, 7]",
                                   "data.train=[chr01, 'chr02:1-200,000']"])
    comma_form = load_config(None, ["eval.controls=1000", "eval.baselines=0,4,7",
                                    "data.train=chr01,chr02:1-200,000"])
    assert yaml_form == comma_form
    assert yaml_form.eval.baselines == [0, 4, 7] and yaml_form.data.train[1] == "chr02:1-200,000"


def test_one_home_for_every_default_and_choice():
    from megabase.eval.config import EvalConfig
    from megabase.kernels.dsa import BACKENDS
    from megabase.model import ModelConfig
    from megabase.pipeline import config, memory

    assert config.EvalConfig is EvalConfig and load_config(None).eval == EvalConfig()
    assert memory.RECOMPUTE_MODES is config.RECOMPUTE
    with pytest.raises(InputError, match=re.escape(", ".join(BACKENDS))):
        ModelConfig(dsa_backend="cuda")


@pytest.mark.parametrize("sets, message", [
    (["train.lrr=1"], "unknown key 'train.lrr'; valid keys in train: steps"),
    (["trian.lr=1"], "unknown key 'trian'"),
    (["train.precision=fp8"], "train.precision = 'fp8' is not one of fp32, bf16"),
    (["train.recompute=all"], "is not one of none, layer, selective"),
    (["train.steps=0"], "train.steps must be at least 1"),
    (["train.steps=ten"], "train.steps must be an integer"),
    (["train.offload=maybe"], "train.offload must be true or false"),
    (["model.preset=huge"], "unknown model preset 'huge'"),
    (["model.overrides.d_modle=8"], "unknown model config key 'd_modle'"),
    (["train.lr"], "expected section.key=value"),
    (["data.repeat_frac=1.5"], "data.repeat_frac must be within [0, 1)"),
    (["data.repeat_length=50,10"], "data.repeat_length must be [min, max]"),
    (["data.repeat_frac_first=1"], "data.repeat_frac_first must be within [0, 1)"),
    (["data.repeat_first_steps=-2"], "data.repeat_first_steps must be >= 0"),
    (["data.repeat_divergence=-0.1"], "data.repeat_divergence must be within [0, 1]"),
    (["train.indexer_warmup_steps=-1"], "train.indexer_warmup_steps must be >= 0"),
    (["train.indexer_warmup_steps=5", "train.devices=2", "train.context_parallel=2"],
     "train.indexer_warmup_steps needs whole sequences"),
    (["model.overrides.bias_update=median"], "model.bias_update must be one of quantile"),
    (["model.overrides.bias_update_rate=2"], "model.bias_update_rate must be >= 0 (and <= 1"),
    (["model.overrides.bias_update_rate=fast"], "model.bias_update_rate must be a float, got 'fast'"),
    (["model.overrides.n_experts=2.5"], "model.n_experts must be an int, got 2.5"),
    (["model.overrides.dsa_stage.block=20"], "model.dsa_stage.block must be a positive multiple"),
    (["model.overrides.dsa_stage.blok=16"], "unknown model.dsa_stage key 'blok'"),
    (["eval.bootstrap=0"], "eval.bootstrap must be a positive integer, got 0"),
    (["eval.edges=[0, 100, 50]"], "eval.edges must be integers that start at 0"),
    (["eval.controls=[1000"], "not valid YAML"),
])
def test_bad_keys_and_values_are_one_clear_error(sets, message):
    with pytest.raises(InputError, match=re.escape(message)):
        load_config(None, sets)


def test_bad_files(tmp_path):
    with pytest.raises(InputError, match="config file not found"):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(InputError, match=f"{bad}: not valid YAML at line"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("train:\n  steps: 5\n  warmup: 2\n")
    with pytest.raises(InputError, match=f"{wrong}: unknown key 'train.warmup'"):
        load_config(wrong)


def test_repeat_schedule():
    from megabase.pipeline.config import repeat_frac_at

    cfg = load_config(None, ["data.repeat_frac=0.1", "data.repeat_frac_first=0.3",
                             "data.repeat_first_steps=100"])
    assert [repeat_frac_at(s, cfg.data) for s in (0, 99, 100, 500)] == [0.3, 0.3, 0.1, 0.1]
    demo = load_config(None).data  # the demo's curriculum
    assert [repeat_frac_at(s, demo) for s in (0, 119, 120)] == [0.5, 0.5, 0.05]
    off = load_config(None, ["data.repeat_frac=0", "data.repeat_frac_first=null"]).data
    assert repeat_frac_at(0, off) == 0.0


@pytest.mark.parametrize("sets, message", [
    (["train.max_minutes=1,5"], "train.max_minutes must be a number, got '1,5' (a comma"),
    (["train.lr=0,001"], "train.lr must be a number, got '0,001'"),
    (["train.steps=4096,8192"], "train.steps must be an integer, got '4096,8192'"),
    (["train.steps=1,5"], "train.steps must be an integer, got '1,5'"),
    (["data.window_length=16,38"], "data.window_length must be an integer"),
])
def test_a_comma_is_never_dropped_from_a_number(sets, message):
    with pytest.raises(InputError, match=re.escape(message)):
        load_config(None, sets)


def test_a_comma_separates_thousands_of_a_whole_number():
    from megabase.pipeline.config import parse_number

    cfg = load_config(None, ["data.window_length=16,384", "train.steps=1_000"])
    assert cfg.data.window_length == 16384 and cfg.train.steps == 1000
    assert parse_number("1,048,576") == 1048576 and parse_number("-1,000") == -1000
    assert parse_number("1,500", float) is None and parse_number("0,7", float) is None


def test_the_cli_reads_numbers_as_written(capsys):
    from megabase.pipeline.cli import main

    assert main(["evaluate", "--checkpoint", "x", "--data", "y", "--length", "4096,8192"]) == 2
    assert "--length must be an integer, got '4096,8192'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["score", "--checkpoint", "x", "--data", "y", "--regions", "chr1", "--out", "o",
              "--context", "1,5"])
    assert exit_.value.code == 2
    assert "expected a whole number, got '1,5'" in capsys.readouterr().err


def test_a_section_given_twice_is_refused(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  steps: 3\ndata:\n  window_length: 4096\ntrain:\n  lr: 0.001\n")
    with pytest.raises(InputError, match=re.escape(f"{twice}: key 'train' appears twice in one "
                                                   "mapping (lines 1 and 5)")):
        load_config(twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(InputError, match="key 'steps' appears twice"):
        load_config(nested)


@pytest.mark.parametrize("assignment", ["data=", "data=null", "model=debug", "train=[1]"])
def test_a_section_is_not_a_value(assignment):
    with pytest.raises(InputError, match=f"{assignment.split('=')[0]} is a section, not a value"):
        load_config(None, [assignment])


def test_every_shipped_config_loads_and_the_long_window_arms_match():
    """Each file of configs/ passes its loader's checks; the long-window protocol's two arms
    train the same checkpoint on as many tokens, warm up over as many, and are evaluated alike
    (what makes their difference the window length's alone)."""
    from pathlib import Path

    from megabase.pipeline.config import load_config
    from megabase.rl.config import load_rl_config

    root = Path(__file__).resolve().parents[2] / "configs"
    loaded = {p.stem: (load_rl_config if p.stem.startswith("rl-") else load_config)(p)
              for p in sorted(root.glob("*.yaml"))}
    assert {"demo", "human-chr22-cpu", "human-chr22-long", "human-chr22-long-16k"} <= set(loaded)
    long, short = loaded["human-chr22-long"], loaded["human-chr22-long-16k"]
    assert long.data.window_length == 524_288 and short.data.window_length == 16_384
    tokens = [c.train.steps * c.train.batch_size * c.data.window_length for c in (long, short)]
    assert tokens[0] == tokens[1] == 40 * 524_288
    assert long.train.warmup_steps * long.data.window_length == \
        short.train.warmup_steps * short.data.window_length
    assert long.train.init_from == short.train.init_from and long.train.lr == short.train.lr
    # the same windows, controls and CIs; the long arm alone also carries the far-key ablation
    assert replace(long.eval, ablations=short.eval.ablations) == short.eval
    assert long.data.eval == short.data.eval and long.eval.ablations == ["dsa_near"]
    assert long.eval.length == 1_048_576 and long.eval.ci_block == 65_536
