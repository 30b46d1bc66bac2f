"""megabase.eval: held-out scoring binned by prior context, Markov baselines, reports (DESIGN.md, Evaluation)."""
