"""scripts/gate_profile.py on a gated checkpoint and real human DNA."""

import json
import subprocess
import sys
from pathlib import Path

from megabase.model import save_checkpoint
from tests.model.conftest import live_model
from tests.model.test_dsa_gate import _gated


def test_the_script_prints_and_writes_each_layers_gates(hsap_store, tmp_path):
    ckpt = save_checkpoint(_gated(live_model("debug", dsa_gate=True)), tmp_path / "ckpt")
    script = Path(__file__).resolve().parents[2] / "scripts" / "gate_profile.py"
    done = subprocess.run([sys.executable, str(script), "--checkpoint", str(ckpt), "--data",
                           str(hsap_store.path), "--region", "chr22:40,000,001-40,005,000",
                           "--segment", "2000", "--out", str(tmp_path / "p.json")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "DSA layer 0" in done.stdout and "4,000-5,000" in done.stdout
    profile = json.loads((tmp_path / "p.json").read_text())
    assert profile["edges"] == [0, 1_000, 4_000, 5_000]
    assert all(len(b["unique"]["mean_gate"]) == 2 for b in profile["layers"][0]["bins"])
