"""Issue 40's `megabase rl` cases: a policy gone NaN is never saved, a reward that calls
sys.exit or returns numbers float32 cannot hold is one line, generator failures are one line,
FASTA prompts obey prompt.max_n_frac, and out/checkpoint is replaced only when rl wrote it."""

import copy
import shutil

import pytest
import torch

from megabase.data import InputError
from megabase.pipeline.cli import main
from megabase.core.errors import TrainingError
from megabase.rl import load_rl_config, rl
from megabase.rl.config import RLConfig


def test_a_policy_gone_non_finite_is_never_saved(config):
    """lr=1e30 (accepted before config checked it) made 99% of the saved policy NaN with exit 0.
    Past the config check, a policy that diverges stops the job on the step it happened."""
    path = config("diverge.yaml", out="out-diverge", asynchronous=False, steps=2)
    cfg = load_rl_config(path)
    cfg.lr = 1e30  # what a diverging run does, at a learning rate the check lets through
    with pytest.raises(TrainingError, match=r"became (nan|inf|-inf|non-finite).* at step [12]; "
                                            r"stopped, the policy was not saved") as info:
        rl(cfg, progress=False)
    assert "\n" not in str(info.value)
    out = path.parent / "out-diverge"
    assert not (out / "checkpoint").exists() and not (out / "summary.json").exists()
    assert not (path.parent / ".out-diverge.lock").exists()  # the lock went with the job


@pytest.mark.parametrize("sets, message", [
    (["lr=1e30"], "lr must be within (0, 1), got 1e+30"),
    (["temperature=1e-300"], "temperature must be within [0.01, 100], got 1e-300"),
])
def test_absurd_settings_are_one_line(config, capsys, sets, message):
    args = ["rl", "--config", str(config()), "--quiet"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_non_finite_sampling_probabilities_are_a_training_error(policy, human_prompts):
    """A temperature so small logits / temperature overflow gave multinomial's RuntimeError."""
    from megabase.rl.generator import WeightChannel, generator_model, sample_batch

    cfg = RLConfig(checkpoint="-", group_size=2, sample_length=8, temperature=1e-300)
    model = generator_model(copy.deepcopy(policy), cfg)
    with pytest.raises(TrainingError, match="sampling probabilities became non-finite at base 1 "
                                            "of batch 0"):
        sample_batch(model, human_prompts[:1], cfg, 0, WeightChannel(policy), 0,
                     torch.Generator().manual_seed(0))


def test_a_generator_failure_reaches_the_trainer_as_one_line(config):
    """In the generator's process, the same failure came back as a RuntimeError with the
    generator's traceback; now as the generator's one line."""
    cfg = load_rl_config(config("gen-fails.yaml", out="out-gen-fails", steps=2))
    cfg.temperature = 1e-300  # past the config check: what the generator must survive reporting
    with pytest.raises(TrainingError, match="the generator stopped: the generator's sampling "
                                            "probabilities became non-finite") as info:
        rl(cfg, progress=False)
    assert "\n" not in str(info.value)
    assert not (cfg.path(cfg.out) / "checkpoint").exists()


@pytest.mark.parametrize("code", ["import sys\nsys.exit(0)\n",
                                  "import sys\ndef reward(seqs):\n    sys.exit(0)\n"])
def test_a_reward_that_exits_is_one_line(config, capsys, tmp_path, code):
    """sys.exit(0) in a reward file ended `megabase rl` with exit 0 and no output at all."""
    (tmp_path / "quits.py").write_text(code)
    spec = f"{tmp_path}/quits.py:reward"
    path = config("quits.yaml", out="out-quits", **{"reward.function": spec})
    assert main(["rl", "--config", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "quits.py" in err and "sys.exit(0)" in err, err


def test_fasta_prompts_obey_max_n_frac(tmp_path):
    """A FASTA prompt of 76 N was used while store prompts of more than max_n_frac N are not."""
    from megabase.rl.rollout import Prompts

    fasta = tmp_path / "prompts.fa"
    fasta.write_text(">good\n" + "ACGT" * 19 + "\n>gappy\n" + "N" * 76 + "ACGT\n")
    sets = ["checkpoint=c", f"prompt.fasta={fasta}", "prompt.length=76"]
    with pytest.raises(InputError) as info:
        Prompts(load_rl_config(None, sets))
    assert str(info.value) == (f"{fasta}: record 'gappy': the prompt (its first 76 bases) holds 76 "
                               "N (100%), more than prompt.max_n_frac (0%) allows")
    fasta.write_text(">good\n" + "ACGT" * 19 + "\n>some\n" + "N" * 19 + "ACG" * 19 + "\n")
    prompts = Prompts(load_rl_config(None, sets + ["prompt.max_n_frac=0.25"]))
    assert [int((p == 4).sum()) for p in prompts.fixed] == [0, 19]


def test_a_checkpoint_folder_rl_did_not_write_is_kept(config, capsys, checkpoint):
    """`--set out=DIR` replaced a user's DIR/checkpoint/ whole."""
    path = config("foreign.yaml", out="out-foreign")
    folder = path.parent / "out-foreign" / "checkpoint"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    assert main(["rl", "--config", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "holds 'notes.txt', which megabase rl did not write" in err
    assert "choose another out" in err and (folder / "notes.txt").read_text() == "mine"
    shutil.rmtree(folder)
    shutil.copytree(checkpoint, folder)  # a megabase checkpoint, but a run's, not rl's
    assert main(["rl", "--config", str(path), "--quiet"]) == 2
    assert "is a checkpoint megabase rl did not write" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in checkpoint.iterdir())
