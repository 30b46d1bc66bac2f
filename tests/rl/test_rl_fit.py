"""The RL memory check: measured on the job's own model, a job whose trainer step and generator
states cannot fit is refused in one line before any process starts, naming the prompt length."""

from megabase.pipeline.cli import main


def test_a_job_that_cannot_fit_is_refused_before_anything_starts(config, capsys, monkeypatch):
    from megabase.rl import fit

    seen, measure = {}, fit.rl_need

    def need(model, cfg):
        seen.update(measure(model, cfg))
        return seen

    # 50 MiB free, not "this process's RSS and 50 MiB more": freed heap that an earlier test left
    # is handed back before the job measures, and its need then fell under such a room
    room = 50 * 2**20
    monkeypatch.setattr(fit, "available_bytes", lambda: room)
    monkeypatch.setattr(fit, "rl_need", need)
    path = config("big.yaml", out="big", **{"prompt.length": 20_000})
    assert main(["rl", "--config", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "prompt.length 20,000" in err and "GB of the" in err and len(err.splitlines()) == 1, err
    assert not (path.parent / "big").exists() or not any((path.parent / "big").iterdir())
    # measured, not assumed: the generator's states grow with the prompt, the step holds weights
    assert seen["per_base"] > 0 and seen["trainer"] > seen["generator"] > 0
