"""Every update option end to end in ``lit train``, with nothing stood in (real vLLM, worker, ZeroMQ, SQLite): the
config is accepted, 2 steps train and sync (vLLM's logprobs checked against the trainer's after every sync), a
checkpoint is written, ``--resume`` continues to step 3, and ``lit eval --checkpoint`` serves the result.

- LoRA with a KL term, in bf16 (``policy.precision = "bf16"``: CPU autocast, the frozen base in bfloat16, float32
  adapters, LM head and loss): the adapter trains, merged weights reach vLLM (the sync check scores them in float32),
  the reference is the base under the adapter, the checkpoint is a plain model for ``lit eval`` and resumes as base +
  adapter; the trainer-vs-vLLM logprob gap of the sampled tokens stays within what bf16 explains; the TensorBoard
  tracker logs every step, the resumed one too, and W&B (offline) logs both runs to one W&B run. Served by two vLLM
  servers (``inference.servers = 2``, a core each): both serve rollouts, all of one task's group on one server, and both
  take every weight sync (``two_servers_served``); resumed on one (``inference.servers = 1``: the count of servers is
  not the run's state, and one vLLM start fewer). With dynamic sampling (``rollouts.extra_rollouts``): some tasks are
  solved by every rollout (``solved``: reward 1), so a step whose first draw holds one has a group without signal and
  draws a fresh task (step 1 of seed 0), stored under the step (``drew_more``). With the curriculum
  (``rollouts.rest_after = 1``, ``rollouts.rest_by = "family"``): the solved tasks, one family, rest after that group,
  so steps 2 and 3 draw none of them, the resumed step 3 too (it drew ``train11`` before the curriculum: the checkpoint
  keeps what rests). The learning rate decays linearly to half over ``train.steps`` (2, then 3 when resumed: each step's
  rate follows from its number). The decoder's 30 layers and final norm are compiled (``policy.compile``: under LoRA,
  bf16 autocast and the adapter switched off for the reference; the checkpoint and the weight sync see the model's own
  names). The loss clips asymmetrically under a ratio cap and sums each sequence's tokens (``loss.clip_eps_low/high``,
  ``ratio_cap``, ``aggregation``); replies cut at ``max_tokens`` cost 0.1 of credit each
  (``credit.auto_reward_weight``). Each step adds the SFT term (``sft.weight``) on demonstrations made from the
  first two tasks' references (``sft.source = "references"``, ``sft.tasks``, ``sft.batch_size``), collected once
  and read back by the resumed run.
- Full fine-tune with every schedule option: KL to a frozen copy, 2 PPO epochs x 2 mini-batches, recomputed old
  logprobs with truncated importance sampling, overlong responses masked, the ``kept`` normaliser; trained by two
  processes (``torchrun --nproc_per_node 2``, gloo) with the model sharded across them (``policy.shard``: the decoder
  layers and the KL reference's, FSDP2; the weights gathered for each push, the sync check scored and the checkpoint
  written by both; the main process logs to TensorBoard, and its tracker's end must not take down the process group
  before the other process hears the run is over), and resumed by one process from their checkpoint; a cosine
  learning-rate schedule after 2 warm-up steps; with asynchronous rollouts (``rollouts.max_staleness = 1``: each step's
  rollouts run during the update before it; ``rollouts.min_step_groups = 1``: a group not ended when its step wants it
  carries over to the next); with an entropy bonus; with off-policy guidance (``rollouts.guidance``: one task of each
  step fails in every rollout and carries a reference, which joins its group and is trained on, its behaviour
  logprobs the trainer's own, computed by both shards: ``guided_groups``); with an 8-token micro-batch budget
  (``batching.max_tokens_per_micro_batch``: each task's rows are a micro-batch of their own, shared out among
  the processes); with each process's sharded decoder layers compiled (``policy.compile``), and the resumed
  process's whole ones.

Both train, resume and evaluate on vLLM without torch.compile (``--enforce-eager``: about 24 s less per start,
bench/vllm_start.py; lit's compiled default starts in the session's server and test_server.py's). Both sample at
temperature 0.7: the trainer's logprobs of the sampled tokens must match vLLM's (the first optimizer step of a
training step sees the weights that sampled)."""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from wandb_offline import go_offline, run_ids

from lit_trainer.learner.schedule import learning_rate_at
from lit_trainer.results.runs import WANDB_ID_FILE

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TESTS = Path(__file__).parents[1]

CONFIG = """
model = "{model}"
[agent]
function = "rollout_agents:reply_length_parity"
concurrency = 8
max_tokens = 16
temperature = 0.7
[data]
tasks = "rollout_agents:parity_tasks"
train_size = 20
val_size = 4
[train]
steps = 2
val_every = 0
checkpoint_every = 0
check_sync_every = 1
output_dir = "{out}"
[rollouts]
tasks_per_step = 2
group_size = 4
[policy]
learning_rate = 1e-5
[inference]
log_dir = "{logs}"
"""

OPTIONS = {
    "lora_kl": ["policy.lora_rank=8", "policy.learning_rate=1e-4", "loss.kl_beta=0.05", "policy.precision='bf16'",
                "train.trackers=['tensorboard','wandb']", "inference.servers=2", "inference.cpu_kv_cache_gb=1",
                "inference.extra_args=['--enable-log-requests','--enforce-eager']",  # each request's id in its log
                "rollouts.extra_rollouts=4", "data.tasks='rollout_agents:some_solved_parity_tasks'",
                "rollouts.rest_after=1", "rollouts.rest_by='family'",
                "policy.lr_schedule='linear'", "policy.min_lr_ratio=0.5", "policy.compile=true",
                "loss.clip_eps_low=0.1", "loss.clip_eps_high=0.28", "loss.ratio_cap=2.5",
                "loss.aggregation='seq_mean_token_sum'", "credit.auto_reward_weight=0.1",
                "sft.source='references'", "sft.weight=0.5", "sft.tasks=2", "sft.batch_size=2"],
    "ppo_schedule": ["loss.kl_beta=0.05", "loss.entropy_coef=0.01", "update.ppo_epochs=2", "update.mini_batches=2",
                     "update.recompute_old_logprobs=true", "loss.is_correction='truncate'", "update.overlong='mask'",
                     "loss.normalizer='kept'", "rollouts.max_staleness=1", "rollouts.min_step_groups=1",
                     "policy.shard=true", "train.trackers=['tensorboard']",
                     "policy.lr_schedule='cosine'", "policy.warmup_steps=2", "inference.cpu_kv_cache_gb=1",
                     "inference.extra_args=['--enforce-eager']", "rollouts.guidance=true",
                     "data.tasks='rollout_agents:guided_parity_tasks'", "batching.max_tokens_per_micro_batch=8",
                     "policy.compile=true"],
}
RESUME_OPTIONS = {"lora_kl": ["inference.servers=1"], "ppo_schedule": []}
"""What ``--resume`` changes beside ``train.steps=3``."""


EVAL_OPTIONS = {name: ["inference.extra_args=['--enforce-eager']"] for name in OPTIONS}
"""``lit eval``'s own options: vLLM without torch.compile (lit's compiled default starts in the session's server,
tests/conftest.py, and in test_server.py's)."""

PROCESSES = {"lora_kl": (1, 1), "ppo_schedule": (2, 1)}
"""Trainer processes of each option's ``lit train``, then of its ``--resume`` (learner/distributed.py)."""


def _lit(*args: str, processes: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "CI": "true"}
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes)] if processes > 1 else []
    return subprocess.run([sys.executable, *launcher, "-m", "lit_trainer.cli", *args], env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.timeout(1500)  # three vLLM starts and two trainer processes: about 9 min alone, 17 under load
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_trains_syncs_checkpoints_resumes_and_evaluates(name: str, prepared_model: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    go_offline(monkeypatch, tmp_path)
    out = tmp_path / "run"
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(model=prepared_model, out=out, logs=tmp_path / "vllm-logs"))
    options = OPTIONS[name]

    processes, resumed_by = PROCESSES[name]
    first = _lit("train", str(config), *options, processes=processes)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    if "policy.compile=true" in options:  # the decoder compiled in the trainer, the resumed one too (below)
        assert "lit: policy.compile: 31 decoder modules compile" in first.stderr, first.stderr[-3000:]
    if "policy.shard=true" in options:  # learner/memory.py's plan, printed at start
        assert f"sharded over {processes} processes" in first.stderr, first.stderr[-3000:]
    # what it says to do next repeats the options it was given, and the launch: as many trainer processes
    [done] = [line for line in first.stderr.splitlines() if line.startswith("lit: trained to step 2")]
    evaluate, _, go_on = done.split("`")[1::2]
    launch = ["lit"] if processes == 1 else ["torchrun", "--nproc_per_node", str(processes), "-m", "lit_trainer.cli"]
    assert shlex.split(go_on) == [*launch, "train", str(config), *options, "--resume", "train.steps=4"], done
    assert shlex.split(evaluate) == ["lit", "eval", str(config), *options, "--checkpoint", str(out)], done
    resumed = _lit("train", str(config), *options, *RESUME_OPTIONS[name], "train.steps=3", "--resume",
                   processes=resumed_by)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-3000:]
    changed = "train.steps: 2 -> 3" + ("; inference.servers: 2 -> 1" if name == "lora_kl" else "")
    assert ("lit: --resume with settings other than those of the run that stopped (its config.json): "
            f"{changed}") in resumed.stderr.splitlines(), log[-3000:]
    assert "resumed from" in log and "step 3/3" in log and "step 2/3" not in log
    assert ("policy.compile: 31 decoder modules" in log) == ("policy.compile=true" in options)

    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["rollouts/failed"] == 0
        # a step left with nothing to train on (e.g. every response cut by max_tokens and masked) does not update
        # nor sync; every step that updated did both
        assert ("time/update" in r) == ("sync/logprob_gap_max" in r), r
        if "time/update" in r:
            assert r["sync/logprob_gap_max"] < 0.02, r  # vLLM serves the weights the trainer has
        if r.get("update/transitions"):
            assert "loss/kl" in r and r["policy/grad_norm"] > 0, r
    trained = [r for r in train if r.get("update/transitions")]
    assert trained, "no step had a group with differing rewards"
    # each step's rate from its number, over train.steps as each run had it (2, then 3 when resumed): linear
    # 1e-4, 0.75e-4 | 0.667e-4; cosine with 2 warm-up steps 0.5e-5, 1e-5 | 1e-5
    schedule = {"lora_kl": (1e-4, "linear", 0, 0.5), "ppo_schedule": (1e-5, "cosine", 2, 0.0)}[name]
    for r in trained:
        assert r["policy/learning_rate"] == learning_rate_at(r["step"], 2 if r["step"] < 3 else 3, *schedule), r
    assert all(r["update/processes"] == (processes if r["step"] < 3 else resumed_by) for r in trained), trained
    if name == "lora_kl":
        # One optimizer step per training step on the weights that sampled: the tempered logprobs agree, to what
        # the trainer's bf16 decoder costs: 0.026-0.062 nats on average here on 2026-11-26 (float32 on both sides:
        # under 0.01, this test before policy.precision); the sync check above stays float32's
        gaps = [r["policy/vllm_logprob_gap"] for r in trained]
        assert 0 < max(gaps) < 0.1, gaps
        # the logprob gap is the worse server's; the resumed step 3 had one
        assert [r["sync/servers_checked"] for r in train] == [2, 2, 1], train
        two_servers_served(out / "lit.sqlite", tmp_path / "vllm-logs")
        drew_more(train, out / "lit.sqlite")
        # replies cut at max_tokens (16) cost 0.1 each in the credit (credit.auto_reward_weight)
        assert any(r["credit/auto_penalized_calls"] > 0 for r in train), train
        assert all(r["credit/auto_reward_sum"] == pytest.approx(-0.1 * r["credit/auto_penalized_calls"]) for r in train)
        # the SFT term (sft.weight) on the references of the first 2 tasks, collected once and read back to resume
        assert all(r["sft/tokens"] > 0 and r["sft/nll"] > 0 for r in train), train
        [collected] = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                       if r["kind"] == "demonstrations"]
        assert collected["sft/demonstrations_total"] == 2, collected
        assert "lit: 2 demonstrations read back from" in resumed.stderr, resumed.stderr[-3000:]
    else:
        assert all(r["update/optimizer_steps"] >= 2 for r in trained) and all("mismatch/k3" in r for r in trained)
        # an 8-token budget (batching.max_tokens_per_micro_batch), shorter than any prompt: each prompt group (a
        # task's rows) a micro-batch of its own, run whole with gradient checkpointing, where the default budget
        # packs a mini-batch's groups into one. (How many groups a mini-batch holds is chance: rewards and the
        # asynchronous steps decide how many groups a step trains on.)
        assert all(r["update/micro_batches"] >= r["update/optimizer_steps"] for r in trained), trained
        assert all(r["update/micro_batches_over_budget"] == r["update/micro_batches"] > 0 for r in trained), trained
        # asynchronous rollouts: every call carried the engine's weight version, none was more than 1 version
        # older than the policy trained on it, and the steps after the first of each run trained on calls sampled
        # by the previous weights (their rollouts ran during the update before). A step that took a group carried
        # over (not seen so far: the rollouts end well within the update) may have older calls, not trained on.
        assert [r["step"] for r in train if "async/calls" in r] == [1, 2, 3], train
        assert all(r["async/versioned_calls"] == r["async/calls"] > 0 for r in train), train
        assert all(r["rollouts/groups_in_flight"] == 0 for r in train if r["step"] in (2, 3)), train  # last steps
        fresh = [r for r in train if r["rollouts/carried_groups"] == 0]
        assert all(r["async/staleness_max"] <= 1 and r["async/dropped_stale"] == 0 for r in fresh), train
        expected = [0, 1]  # step 3 resumed: synchronous
        assert all(r["async/staleness_max"] == e for r, e in zip(train[:2], expected, strict=True) if r in fresh), train
        assert any(r["loss/kl"] > 0 for r in trained[1:] or trained)
        assert all(r["loss/entropy"] > 0 for r in trained), trained  # the bonus's entropy, through both shards
        guided_groups(train, out / "lit.sqlite")

    result_file = tmp_path / "eval.json"
    # an override after the options, as people type it
    evaluated = _lit("eval", str(config), "--checkpoint", str(out), "--output", str(result_file),
                     f"train.output_dir={tmp_path / 'eval'}", *EVAL_OPTIONS[name])
    assert evaluated.returncode == 0, (evaluated.stdout + evaluated.stderr)[-3000:]
    result = json.loads(result_file.read_text())
    assert result["model"].endswith("step-000003/model") and result["tasks"] == 4 and result["step"] == 3
    assert (tmp_path / "eval" / "eval.jsonl").exists()
    assert f"checkpoint {out / 'checkpoints' / 'step-000003'} (step 3): accuracy" in evaluated.stdout, evaluated.stdout
    assert f"its rollouts: lit show --run {tmp_path / 'eval'}" in evaluated.stderr, evaluated.stderr[-3000:]
    for folder, listed in ((tmp_path / "eval", "validation after step 3"), (out, "training step 3")):
        shown = _lit("show", "--run", str(folder))  # the eval's one rollout per task; the last step's by default
        assert shown.returncode == 0 and f"rollouts of {listed} in {folder}" in shown.stderr, shown.stderr[-3000:]
        assert len(shown.stdout.splitlines()) > 4, shown.stdout
    if "wandb" in str(OPTIONS[name]):  # the resume, after the last step logged, went on with the same W&B run
        assert run_ids(out) == [(out / WANDB_ID_FILE).read_text().strip()] * 2
        assert "lit: W&B: logging to a new W&B run" not in log
    if "tensorboard" in str(OPTIONS[name]):  # the tracker logged every step, the resumed one too
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        steps = set()
        for events_file in (out / "lit").glob("events.out.tfevents.*"):  # accelerate's run "lit" in output_dir
            events = EventAccumulator(str(events_file))
            events.Reload()
            steps |= {e.step for e in events.Scalars("train/reward/mean")}
        assert steps == {1, 2, 3}, steps


def guided_groups(train: list[dict], store_path: Path) -> None:
    """Off-policy guidance: the unsolvable tasks' groups all failed, each got its reference as one more episode
    (every step of seed 0 draws one: ``train18``, ``train6``, ``train15``; the resumed step 3 too), whose advantage
    is positive, and the update trained on it: the trainer kept its logprobs of the reference's tokens, taken
    before the step (``"Apple."`` and the end of the turn). A parity group may fail too, by chance: it has no
    reference."""
    import sqlite3

    from lit_trainer.intake.store import SqliteStore

    assert all(r["guidance/groups"] == 1 <= r["guidance/failed_groups"] for r in train), train
    with sqlite3.connect(store_path) as db:
        rows = db.execute("SELECT rollout_id, step, advantage FROM advantages").fetchall()
    guided = [(rollout, step, adv) for rollout, step, adv in rows if rollout.endswith(":guided")]
    assert sorted(step for _, step, _ in guided) == [1, 2, 3] and all(adv > 0 for _, _, adv in guided), rows
    with SqliteStore(store_path) as store:
        for rollout, _, _ in guided:
            [values] = store.trainer_logprobs_of_rollout(rollout).values()
            assert len(values) >= 2 and all(v < 0 for v in values), (rollout, values)


def two_servers_served(store_path: Path, logs: Path) -> None:
    """Two vLLM servers behind the first ``lit train`` and one behind the resumed one, told apart by their own
    logs: vLLM logs the id of every request it receives (``--enable-log-requests``), which is the id of its
    answer, recorded on the call's span in the store. Steps 1 and 2's first two tasks went to the two servers (the
    task of an extra draw, ``drew_more``, to one of them), every call of one task's group to the same one; each server
    took every weight sync of its run (its access log: 2 in the first run, the resumed weights and step 3's in the
    second) and answered every call of step s with the weights
    of step s (the version lit's route guard adds to its answers)."""
    from lit_sdk import semconv
    from lit_trainer.intake.rows import RolloutStatus
    from lit_trainer.intake.store import SqliteStore
    from lit_trainer.steps import kind_of

    server_of, syncs = {}, {}
    for log in sorted(logs.glob("vllm-*.log")):
        text = log.read_text(errors="replace")
        syncs[log.name] = text.count('"POST /update_weight_version HTTP/1.1" 200')
        server_of.update(dict.fromkeys(re.findall(r"Received request (chatcmpl-[^\s:]+)", text), log.name))
    assert sorted(syncs.values()) == [2, 2, 2], syncs  # three servers: two in the first run, one resumed
    with SqliteStore(store_path) as store:
        for step in range(3):
            servers_of_task = collections.defaultdict(set)
            for row in store.rollouts_of_step(step):
                if row.status is not RolloutStatus.SUCCEEDED or kind_of(row.rollout_id) == "demonstrations":
                    continue  # an attempt that was retried; the rollouts that collected the SFT term's references
                for span in store.spans_of_rollout(row.rollout_id):
                    if span.name == semconv.LLM_SPAN:
                        servers_of_task[row.task_id].add(server_of[span.attributes[semconv.LLM_RESPONSE_ID]])
                        assert span.attributes[semconv.LLM_WEIGHT_VERSION] == str(step), (step, span)
            assert len(servers_of_task) in (2, 3) and all(len(s) == 1 for s in servers_of_task.values()), \
                servers_of_task
            # a task of each draw on each server of the run
            assert len(set.union(*servers_of_task.values())) == (2 if step < 2 else 1), servers_of_task


def drew_more(train: list[dict], store_path: Path) -> None:
    """Step 1 (seed 0) drew a solved task first (train18): one group at most with signal of the 2 wanted, so one
    extra draw of one fresh task, the 4 rollouts of the budget, stored under the step beside its first draw's.
    Steps 2 and 3 draw more only if a group's 4 rollouts got the same parity by chance. The solved family rested
    after step 1 (``rollouts.rest_after = 1``): steps 2 and 3, the resumed one too, ran none of its tasks."""
    from lit_trainer.intake.store import SqliteStore

    draws = {r["step"]: r["sampling/draws"] for r in train}
    assert draws[1] == 1 and draws[2] in (0, 1) and draws[3] in (0, 1), draws
    assert [r["curriculum/resting"] >= 1 for r in train] == [False, True, True], train
    assert all(r["curriculum/resting_tasks"] >= 3 for r in train[1:]), train  # train4, train11, train18
    with SqliteStore(store_path) as store:
        for r in train:
            rows = store.rollouts_of_step(r["step"] - 1)
            ids = [row.rollout_id for row in rows]
            more = [i for i in ids if f"-s{r['step'] - 1}-more1-" in i]
            assert len(more) == r["sampling/extra_rollouts"] == 4 * r["sampling/draws"], (r, ids)
            assert r["rollouts/requested"] == 8  # the first draw's metrics: 2 tasks x 4
            solved = {row.task_id for row in rows} & {"train4", "train11", "train18"}
            assert ("train18" in solved) if r["step"] == 1 else not solved, (r["step"], solved)
