#!/usr/bin/env bash
# The human protocol's long-window stage end to end (issue 43): the 16k start
# checkpoint, the long arm (40 steps at 524,288), its evaluation, the start's evaluation on the
# same windows, then the 16k arm on as many tokens and its evaluation. Every step resumes where a
# stopped try left it (training from its latest checkpoint, evaluation from the windows it
# finished), so run this again after a stop until it ends; ~30 hours on 2 CPU cores in all.
# Run from the repository root after `bash scripts/setup.sh`; MEGABASE names another executable.
set -euo pipefail
mb=${MEGABASE:-.venv/bin/megabase}
start=work-human-cpu/runs/human-chr22-cpu

# The protocol (configs/human-chr22-cpu.yaml) for a fixed 600 steps instead of its 60 minutes, so
# that the start does not depend on how busy the machine is; evaluated below, at 1M.
"$mb" run --config configs/human-chr22-cpu.yaml \
    --set train.steps=600 --set train.max_minutes=null --set eval.enabled=false
"$mb" run --config configs/human-chr22-long.yaml
"$mb" evaluate --checkpoint "$start" --data work-human-cpu/store --length 1048576 \
    --controls 16384,65536 --baselines 4,8,12 --probe-distances 65536,262144,1000000 \
    --probe-windows 4 --probe-pairs 8 --ci-block 65536 --out "$start/eval-1m" \
    --tracking-uri "sqlite:///$PWD/work-human-cpu/mlflow.db" --experiment human-chr22
"$mb" run --config configs/human-chr22-long-16k.yaml
echo "long_protocol: done; reports in work-human-cpu/runs/*/eval*/report.json"
