"""Will a step fit: the estimate from probe steps of the run's model, and the refusal before a run."""

import dataclasses

import pytest

from megabase.pipeline import fit
from megabase.pipeline.cli import main
from megabase.pipeline.config import load_config

from tests.pipeline.test_train import tiny


def _at(cfg, length, **train):
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, window_length=length),
                               train=dataclasses.replace(cfg.train, **train))


def test_a_walked_step_grows_only_by_its_borders():
    cfg = load_config(None, ["model.preset=debug"])
    probe = fit.Probe(cfg)
    whole = [fit.step_need(probe, _at(cfg, n, segment=None)) for n in (16384, 32768)]
    walked = [fit.step_need(probe, _at(cfg, n)) for n in (1 << 19, 1 << 20)]
    assert whole[1].activations > whole[0].activations > 0  # a whole window's grow with it
    assert walked[0].activations == walked[1].activations  # a walked step's are one segment's
    per_token = (walked[1].borders - walked[0].borders) / (1 << 19)
    # the DSA keys and their gradients, one layer's prefix gradient, the report, the batch
    assert per_token == walked[1].borders / (1 << 20) > 2 * 2 * 16 * 4
    assert walked[1].total < fit.step_need(probe, _at(cfg, 1 << 20, segment=None)).total


def test_a_step_that_cannot_fit_is_refused_naming_the_knob(bundled_store, tmp_path, capsys,
                                                           monkeypatch):
    """A megabase window trained whole (train.segment=null) on an 8 GB machine: refused before
    anything is written, in one line that names the setting that fits."""
    monkeypatch.setattr(fit, "available_bytes", lambda: 8 * 10**9)
    args = tiny(tmp_path, bundled_store, 2, **{"model.preset": "cpu-small",
                                               "data.window_length": "1048576",
                                               "train.segment": "null"})
    assert main(["train", *args, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "a training step at 1,048,576 tokens needs ~" in err
    assert "--set train.segment=8192" in err
    assert not (tmp_path / "runs").exists()  # nothing written, not even an empty folder

    monkeypatch.setattr(fit, "available_bytes", lambda: 5 * 10**8)  # nothing fits in 0.5 GB
    assert main(["train", *args, "--quiet"]) == 2
    assert "no memory knob brings it under" in capsys.readouterr().err


@pytest.mark.parametrize("length", [2048, 65536])
def test_a_step_that_fits_is_not_refused(length):
    cfg = load_config(None, ["model.preset=debug", f"data.window_length={length}"])
    need = fit.check_fits(cfg)
    if need is not None:  # checked (Linux, no GPU): well under this machine's memory
        assert 0 < need.total < fit.available_bytes()
