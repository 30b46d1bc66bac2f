"""`megabase rl` as a shell runs it, in a process of its own: the generator process it starts
ends with it however it ends (kill -9 included), Ctrl-C prints the one `interrupted` line, and a
second job on the same out folder is refused in one line naming the first's pid."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megabase.pipeline.cli import main

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

MEGABASE = str(Path(sys.executable).with_name("megabase"))
HANG_GUARD_S = 300  # only turns a regression (a 24 h wait) into a failure; no speed is asserted


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: pid -> command line."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                out[int(entry.name)] = command.decode()
        except (OSError, ValueError, IndexError):
            pass  # ended meanwhile
    return out


def alive(pid: int) -> bool:
    """Running: a zombie (ended, left to a PID 1 that does not reap) counts as ended."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start(path: Path, log: Path, *args: str) -> subprocess.Popen:
    """`megabase rl --config path` in a session of its own (a terminal's process group),
    stderr to ``log``, a progress line after every step."""
    env = os.environ | {"MEGABASE_PROGRESS_EVERY_S": "0"}
    with open(log, "w") as err:
        return subprocess.Popen([MEGABASE, "rl", "--config", str(path), *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def test_kill_9_of_the_trainer_ends_its_generator(config, tmp_path):
    """Killed before the generator connected, the generator and the multiprocessing resource
    tracker were left under PID 1, alive 180 s later (the rendezvous waits 24 h)."""
    log = tmp_path / "orphan.err"
    job = start(config("orphan.yaml", out="out-orphan", steps=1000), log, "--quiet")
    spawned: dict[int, str] = {}
    while job.poll() is None and not any("spawn_main" in c for c in spawned.values()):
        spawned = children(job.pid)
        time.sleep(0.02)
    assert job.poll() is None, log.read_text()
    os.kill(job.pid, signal.SIGKILL)  # the generator is still starting: it has not connected
    job.wait()
    guard = time.monotonic() + HANG_GUARD_S
    while any(alive(p) for p in spawned) and time.monotonic() < guard:
        time.sleep(0.2)
    left = {p: c for p, c in spawned.items() if alive(p)}
    for p in left:
        os.kill(p, signal.SIGKILL)  # not to the next test
    assert not left, left


def test_ctrl_c_is_one_line_and_a_second_job_is_refused(config, tmp_path, capsys):
    path = config("busy.yaml", out="out-busy", steps=1000)
    log = tmp_path / "busy.err"
    job = start(path, log)
    while job.poll() is None and "megabase: rl: 1/1,000 steps" not in log.read_text():
        time.sleep(0.1)  # after a step the generator is decoding in its loop
    assert job.poll() is None, log.read_text()

    # two jobs on one out both ended with exit 0, the first's checkpoint holding the second's
    assert main(["rl", "--config", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"process {job.pid} (megabase rl)" in err, err
    assert err.endswith("wait for it to end or set another out"), err

    generator = [p for p, c in children(job.pid).items() if "spawn_main" in c]
    os.killpg(job.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
    assert job.wait() == 130
    lines = [line for line in log.read_text().splitlines()
             if not line.startswith("megabase: rl: ")]  # the progress lines
    assert lines == ["megabase rl: interrupted; nothing half-written was kept"], lines
    assert generator and not any(alive(p) for p in generator)
    out = path.parent / "out-busy"
    assert not (out / "checkpoint").exists() and not (path.parent / ".out-busy.lock").exists()
