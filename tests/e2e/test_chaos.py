"""``lit train`` SIGKILLed at the worst moments, then ``--resume``d, with nothing stood in: real vLLM, real worker
processes, real ZeroMQ, real SQLite, the real policy update and weight sync. The agent
(rollout_agents.reply_length_parity) makes real LLM calls and gets a reward that varies within each group.

One run of 3 steps is killed three times, each time at the second step (after the first checkpoint): during its
rollouts, during its policy update, and during its weight sync (vLLM paused, new weights half way). Each kill is a
SIGKILL of the trainer process from inside (a patched function, in a small harness that then
runs the real CLI), so it lands exactly there; vLLM and the local workers die with the trainer. The fourth run has
its vLLM killed during the third step's rollouts: the trainer starts it again with the current weights, runs the
step's rollouts again (or, when vLLM is found dead only after the step's update, pushes the new weights into the
new server), and finishes. Then: no span lost (every rollout's root declares how many spans it emitted,
and that many are stored; the workers' spools are empty), no step trained twice (each step's metrics come once,
from the run that completed it), the store passes SQLite's integrity check, and the run is whole: every step's
weights reached vLLM (the trainer checks vLLM's logprobs against its own after each sync), the held-out tasks were
validated, the final checkpoint holds the trained weights and the optimizer state, and the curve was drawn."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from lit_sdk import semconv as sc
from lit_sdk.protocol import codec
from lit_trainer.engine._shm import free_orphan_segments
from lit_trainer.engine.launch import compile_cache_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TESTS = Path(__file__).parents[1]

CONFIG = """
model = "{model}"
[agent]
function = "rollout_agents:reply_length_parity"
local_workers = 1
concurrency = 8
max_tokens = 16
[data]
tasks = "rollout_agents:parity_tasks"
train_size = 20
val_size = 4
[train]
steps = 3
val_every = 3
checkpoint_every = 1
check_sync_every = 1
output_dir = "{out}"
[rollouts]
tasks_per_step = 2
group_size = 4
[inference]
cpu_kv_cache_gb = 1
# vLLM without torch.compile starts about 24 s sooner (bench/vllm_start.py); the compiled default runs in the
# session server (conftest.py), test_server.py's engine-core test and test_train_options.py's lit eval
extra_args = ["--enforce-eager"]
[policy]
learning_rate = 1e-5
[loss]
kl_beta = 0.001  # a KL term makes every step update and sync, even one whose groups all got equal rewards
"""

HARNESS = """
import os, signal, sys
from pathlib import Path

point, out = sys.argv[1], Path(sys.argv[2])


def die():
    print(f"chaos: SIGKILL during {point}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def when_rollouts_ended(step, then):
    # call then() right after the store records the second ended rollout of training step `step` (from 0), in the
    # thread that ends it: the step's other rollouts are still queued or running
    from lit_trainer.intake.rows import RolloutStatus
    from lit_trainer.intake.store import SqliteStore
    set_status, ended = SqliteStore.set_rollout_status, []

    def set_status_then(self, rollout_id, status, error=None):
        set_status(self, rollout_id, status, error)
        row = self.get_rollout(rollout_id)
        if row.step == step and row.status not in (RolloutStatus.QUEUED, RolloutStatus.RUNNING):
            ended.append(rollout_id)
            if len(ended) == 2:
                then()
    SqliteStore.set_rollout_status = set_status_then


def kill_vllm():
    import psutil
    for child in psutil.Process().children(recursive=True):
        try:
            leader = "vllm" in " ".join(child.cmdline()) and child.pid == os.getpgid(child.pid)
        except (psutil.Error, OSError):
            continue
        if leader:
            print(f"chaos: SIGKILL to vLLM's process group {child.pid}", flush=True)
            os.killpg(child.pid, signal.SIGKILL)
            return


if point == "rollouts":  # the second step's (index 1)
    when_rollouts_ended(1, die)
elif point == "vllm":  # vLLM, not the trainer, during the third step's rollouts
    when_rollouts_ended(2, kill_vllm)
elif point == "update":  # the first policy update of this run: the second step's
    import lit_trainer.run.pipeline as pipeline
    pipeline.run_update = lambda *args, **kwargs: die()
elif point == "sync":  # the second weight sync of this run (the first pushes the checkpoint), with vLLM paused
    from lit_trainer.engine.weight_sync import WeightSync
    post, pauses = WeightSync.post, []

    def post_then_die(self, route, *args, **kwargs):
        answer = post(self, route, *args, **kwargs)
        if route == "/pause":
            pauses.append(route)
            if len(pauses) == 2:
                die()
        return answer
    WeightSync.post = post_then_die

from lit_trainer.cli import main
sys.exit(main(sys.argv[3:]))
"""


def run(point: str, config: Path, out: Path, resume: bool, temp: Path) -> subprocess.CompletedProcess:
    """The harness at ``point``, with ``temp`` as its temporary directory (vLLM's sockets go there), and the compile
    cache of this machine's other vLLM starts (torch's default, under /tmp), as a user's run has: with a cold one of
    its own in ``temp``, the first run's first request took 19 s and the later runs' 5 s (2026-11-29; the test as a
    whole was no quicker on CI with this, 656 s against 646 s)."""
    cmd = [sys.executable, "-c", HARNESS, point, str(out), "train", str(config)] + (["--resume"] if resume else [])
    env = {**os.environ, "PYTHONPATH": str(TESTS), "CI": "true", "TMPDIR": str(temp),
           "TORCHINDUCTOR_CACHE_DIR": str(compile_cache_dir())}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, start_new_session=True)


def test_sigkill_in_rollouts_update_and_sync_then_resume_loses_and_repeats_nothing(prepared_model, tmp_path,
                                                                                   short_temp):
    began = time.time()
    out = tmp_path / "run"
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(model=prepared_model, out=out))
    for i, point in enumerate(["rollouts", "update", "sync"]):
        result = run(point, config, out, resume=i > 0, temp=short_temp)
        log = result.stdout + result.stderr
        assert result.returncode == -9 and f"chaos: SIGKILL during {point}" in log, log[-3000:]
        assert "step 1/3" in log if i == 0 else "(step 1)" in log, log[-3000:]
        assert "step 2/3" not in log, log[-3000:]
    final = run("vllm", config, out, resume=True, temp=short_temp)
    log = final.stdout + final.stderr
    assert final.returncode == 0, log[-3000:]
    final_checkpoint = out / "checkpoints" / "step-000003"
    assert (final_checkpoint / "DONE").exists() and (out / "curve.png").stat().st_size > 0

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]  # each step trained once: killed steps never logged
    assert all(r["rollouts/failed"] == 0 and r["rollouts/unusable"] == 0 for r in train), train
    # every step updated, and vLLM served exactly the weights the trainer had after each sync
    assert all(r["sync/logprob_gap_max"] < 0.02 for r in train), train
    assert [r["step"] for r in records if r["kind"] == "validation"][-1] == 3
    state = torch.load(final_checkpoint / "trainer_state.pt", weights_only=False)
    saved = FileSystemReader(final_checkpoint / "optimizer").read_metadata().state_dict_metadata  # by name
    assert state["step"] == 3 and any(key.endswith(".exp_avg_sq") for key in saved), "optimizer state missing"
    trained = load_file(final_checkpoint / "model" / "model.safetensors")
    base = load_file(prepared_model / "model.safetensors")
    changed = [k for k in base if k in trained and not torch.equal(base[k], trained[k])]
    assert len(changed) > 0.9 * len(base), f"only {len(changed)} of {len(base)} tensors changed"
    # killed once two rollouts of step 3 ended: found dead in its rollouts, or (when the rest had ended meanwhile)
    # by the weight sync after its update; either way started again, once
    assert "chaos: SIGKILL to vLLM" in log and ("vLLM died during the rollouts of step 3" in log or
                                                "vLLM died before the weights of step 3 reached it" in log), log[-3000:]
    assert [r["engine/restarts"] for r in train] == [0, 0, 1]  # restarted once, and step 3 ran again
    # no shared memory left behind: a CPU server is one process and makes none (launch.ONE_PROCESS); what a killed
    # multi-process vLLM leaves, the trainer frees when it starts it again (test_server.py, free_orphan_segments)
    assert free_orphan_segments(began) == [], "vLLM's shared memory left in /dev/shm"
    # nor in the temporary directory: each killed trainer's vLLM folder (its sockets and file store, the route
    # guard) went at the next launch, the last run's when its servers stopped (engine/owned_folders.py)
    left = [p.relative_to(short_temp) for p in short_temp.rglob("*")
            if p.name.startswith(("lit-", "vllm_dist_")) or p.is_socket()]
    assert left == [], f"left in the temporary directory: {left}"

    with sqlite3.connect(out / "lit.sqlite") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        roots = conn.execute("SELECT rollout_id, attributes FROM spans WHERE parent_id IS NULL AND name = ?",
                             (sc.ROLLOUT_SPAN,)).fetchall()
        stored = dict(conn.execute("SELECT rollout_id, count(*) FROM spans GROUP BY rollout_id").fetchall())
        succeeded = {r for (r,) in conn.execute("SELECT rollout_id FROM rollouts WHERE status = 'succeeded'")}
        # the attempts the kills left running were ended by the next start, with the reason
        unfinished = conn.execute("SELECT count(*) FROM rollouts WHERE status IN ('queued', 'running')").fetchone()
        stopped = conn.execute("SELECT count(*) FROM rollouts WHERE error = ?",
                               ("the trainer stopped before this attempt ended",)).fetchone()
    assert unfinished == (0,) and stopped[0] > 0, (unfinished, stopped)
    declared = {rid: codec.unpackb(blob, strict_map_key=False)[sc.ROLLOUT_SPANS] for rid, blob in roots}
    assert succeeded <= set(declared), "a rollout reported succeeded without its root span stored"
    lost = {rid: (n, stored[rid]) for rid, n in declared.items() if stored[rid] < n}
    assert not lost, f"spans lost (declared, stored): {lost}"
    spool = out / "spool"
    left = [p.name for p in spool.iterdir() if p.suffix == ".seg"] if spool.exists() else []
    assert not left, f"spans left undelivered in the spool: {left}"
    print(f"chaos: {len(declared)} rollouts with roots, {sum(declared.values())} spans declared, "
          f"{sum(stored[r] for r in declared)} stored, {len(succeeded)} succeeded, {stopped[0]} ended by a restart")
