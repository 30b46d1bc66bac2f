"""megabase.pipeline: the command line; later the training loop, checkpoints and MLflow tracking."""
