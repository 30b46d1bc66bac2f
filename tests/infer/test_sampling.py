import numpy as np
import pytest
import torch

from megabase.core.vocab import SEP
from megabase.infer import generate_tokens
from megabase.model import load_checkpoint, log_probs
from megabase.pipeline.cli import main


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_checkpoint(checkpoint).eval()


def test_log_probs_recorded_while_sampling_equal_a_teacher_forced_pass(model, bundled_store):
    prompt = np.asarray(bundled_store.tokens("chr22")[20_000:22_500])
    sample = generate_tokens(model, prompt, 120, seed=5, segment=1_000)
    seq = torch.from_numpy(np.concatenate([[SEP], prompt, sample.tokens]).astype(np.int64))[None]
    forced = log_probs(model, seq)[0, -120:].numpy()
    assert np.abs(forced - sample.log_probs).max() <= 1e-4
    assert set(np.unique(sample.tokens)) <= {0, 1, 2, 3} and len(np.unique(sample.tokens)) > 1


def test_with_the_candidate_stage_sampling_log_probs_equal_a_teacher_forced_pass(checkpoint,
                                                                               bundled_store):
    from tests.kernels.test_dsa_candidates import STAGED_MODEL

    model = load_checkpoint(checkpoint, **STAGED_MODEL).eval()
    prompt = np.asarray(bundled_store.tokens("chr22")[50_000:52_500])
    sample = generate_tokens(model, prompt, 80, seed=3, segment=1_000)
    seq = torch.from_numpy(np.concatenate([[SEP], prompt, sample.tokens]).astype(np.int64))[None]
    assert np.abs(log_probs(model, seq)[0, -80:].numpy() - sample.log_probs).max() <= 1e-4


def test_the_same_seed_gives_the_same_sequence_and_top1_is_greedy(model, bundled_store):
    prompt = np.asarray(bundled_store.tokens("chr22")[30_000:30_700])
    a, b = (generate_tokens(model, prompt, 40, seed=11) for _ in range(2))
    assert np.array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, generate_tokens(model, prompt, 40, seed=12).tokens)
    greedy = generate_tokens(model, prompt, 30, top_k=1, seed=1)
    seq = torch.from_numpy(np.concatenate([[SEP], prompt, greedy.tokens]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(seq[:, :-1]).logits[0, -30:]
    assert np.array_equal(logits.argmax(-1).numpy(), greedy.tokens)
    assert np.array_equal(generate_tokens(model, prompt, 30, temperature=1e-4, seed=9).tokens,
                          greedy.tokens)


def test_cli_writes_fasta_from_a_region_or_a_fasta_prompt(checkpoint, bundled_store, tmp_path, capsys):
    out = tmp_path / "gen.fa"
    assert main(["generate", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--prompt-region", "22:1-1,000", "--length", "50", "--samples", "2",
                 "--out", str(out), "--quiet"]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith(">sample1 seed=0 prompt=22:1-1,000") and lines[2].startswith(">sample2")
    assert len(lines[1]) == 50 and set(lines[1]) <= set("ACGT")
    assert "GC %" in capsys.readouterr().out
    prompt = tmp_path / "prompt.fa"
    prompt.write_text(">p\nACGTACGTTTGACCA\nacgtnnACG\n")
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt-fasta", str(prompt),
                 "--length", "10", "--out", str(tmp_path / "g2.fa"), "--quiet"]) == 0
    assert "prompt=prompt.fa:p prompt_length=24" in (tmp_path / "g2.fa").read_text()


@pytest.mark.parametrize("args,message", [
    (["--prompt-region", "chr22:1-100"], "needs a token store"),
    (["--temperature", "0"], "temperature must be positive"),
    (["--top-k", "5"], "top-k must be 0 (off) to 4"),
    ([], "give one prompt"),
])
def test_bad_options_are_one_line_and_write_nothing(checkpoint, tmp_path, capsys, args, message):
    if "--prompt-region" not in args and args:
        args = args + ["--prompt-fasta", str(tmp_path / "p.fa")]
        (tmp_path / "p.fa").write_text(">p\nACGT\n")
    out = tmp_path / "g.fa"
    assert main(["generate", "--checkpoint", str(checkpoint), "--length", "5", "--out", str(out),
                 "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_write_error_names_the_fasta_not_its_temporary(checkpoint, bundled_store, tmp_path,
                                                         capsys):
    """The FASTA is written through a temporary sibling (``.<name>.tmp-<pid>-*``): an error on
    the way (here its name, 20 characters longer than the valid one asked for, is too long) is
    reported with the file the user named."""
    out = tmp_path / ("g" * 250 + ".fa")
    assert main(["generate", "--checkpoint", str(checkpoint), "--data", str(bundled_store.path),
                 "--prompt-region", "chr22:1-100", "--length", "5", "--out", str(out),
                 "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ".tmp-" not in err, err
    assert err.endswith(f"g.fa ({len(str(out))} characters): File name too long"), err
    assert list(tmp_path.iterdir()) == []


def test_errors_inside_a_temporary_name_the_target(tmp_path):
    """core.atomic: an OSError naming a temporary (a file's, or a file inside a folder's) names
    the target; one without a file name gets it; numpy's errno-less short write keeps its text."""
    import errno

    from megabase.core.atomic import building_dir, naming, writing

    target = tmp_path / "tracks.bw"
    with pytest.raises(OSError) as exc:
        with writing(target) as tmp:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
    assert exc.value.filename == str(target)
    folder = tmp_path / "model"
    with pytest.raises(OSError) as exc:
        with building_dir(folder) as tmp:
            open(tmp / "sub" / "weights.bin", "wb")
    assert exc.value.filename == str(folder / "sub" / "weights.bin")
    with pytest.raises(OSError) as exc:
        with naming(target):
            raise OSError("100000 requested and 2484 written")
    assert exc.value.filename == str(target) and "short write" in exc.value.strerror
    assert list(tmp_path.iterdir()) == []


def test_a_prompt_read_once_for_its_group_samples_as_separate_reads_do(model, bundled_store):
    """Two prompts of real DNA, three samples each: reading each prompt once and copying its state
    gives the samples, log-probs and routing of reading it once per sample; reading the state
    again mid-sample (what an update with ``recompute_state`` does) changes nothing either."""
    from megabase.infer.sampling import sample
    from megabase.model import prefill, repeat_state, state_bytes

    tokens = np.asarray(bundled_store.tokens("chr22"))
    prompts = torch.from_numpy(np.stack([np.concatenate([[SEP], tokens[s : s + 2_500]])
                                         for s in (40_000, 90_000)]).astype(np.int64))

    def draw(rows, group, before_step=None):
        return sample(model, rows, 60, gen=torch.Generator().manual_seed(7), segment=1_000,
                      before_step=before_step, record_routing=True, group=group)

    forked = draw(prompts, 3)
    apart = draw(prompts.repeat_interleave(3, 0), 1)
    assert forked.tokens.shape == (6, 60)
    assert torch.equal(forked.tokens, apart.tokens)
    assert (forked.log_probs - apart.log_probs).abs().max() <= 1e-5
    assert all(torch.equal(a, b) for a, b in zip(forked.routing, apart.routing))
    assert not torch.equal(forked.tokens[0], forked.tokens[1])  # the group's samples differ
    again = draw(prompts, 3, before_step=lambda i: i in (1, 30))
    assert torch.equal(again.tokens, forked.tokens)
    assert (again.log_probs - forked.log_probs).abs().max() <= 1e-4
    assert all(torch.equal(a, b) for a, b in zip(again.routing, forked.routing))
    state, _ = prefill(model, prompts[:1], 1_000)
    assert state_bytes(repeat_state(state, 3)) == 3 * state_bytes(state)
