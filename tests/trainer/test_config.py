"""The config file: TOML sections onto the config dataclasses, overrides, and errors that name the key."""

import pytest

from lit_trainer.config import ConfigError, changed_settings, load


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_sections_map_onto_the_dataclasses_and_the_model_reaches_policy_and_inference(tmp_path):
    cfg = load(write(tmp_path, """
model = "/models/x"
[agent]
function = "pkg.mod:fn"
agents = ["calc"]
[train]
steps = 3
[policy]
learning_rate = 1
[loss]
clip_eps_high = 0.28
"""))
    assert cfg.agent.function == "pkg.mod:fn" and cfg.agent.agents == ("calc",)
    assert cfg.train.steps == 3 and cfg.rollouts.group_size == 8
    assert cfg.policy.learning_rate == 1.0 and isinstance(cfg.policy.learning_rate, float)
    assert cfg.policy.model == cfg.inference.model == "/models/x"
    assert cfg.loss.clip_eps_high == 0.28


def test_overrides_take_toml_values_or_bare_words(tmp_path):
    cfg = load(write(tmp_path, "[train]\nsteps = 3\n"),
               ["train.steps=5", "train.output_dir=runs/x", "agent.agents=['a', 'b']", "policy.lora_rank=8"])
    assert cfg.train.steps == 5 and cfg.train.output_dir == "runs/x"
    assert cfg.agent.agents == ("a", "b") and cfg.policy.lora_rank == 8


@pytest.mark.parametrize(("text", "overrides", "message"), [
    ("[trian]\nsteps = 1\n", [], r"unknown key\(s\) \['trian'\]; did you mean 'train' for 'trian'\?"),
    ("", ["policy.learnig_rate=1e-5"], r"\[policy\]: .* did you mean 'learning_rate'"),
    ("[train]\ngroup_size = 4\nrest_after = 2\n", [],
     r"train.group_size, train.rest_after moved to the \[rollouts\] section: "
     r"write rollouts.group_size, rollouts.rest_after instead"),
    ("", ["train.group_size=4"], r"train.group_size moved to the \[rollouts\] section"),
    ("[train]\nzzz = 1\n", [], r"unknown key\(s\) \['zzz'\] \(\[train\] has \['check_sync_every'"),
    ("[train]\nsteps = 'many'\n", [], r"\[train\]: steps must be int"),
    ("[train]\nsteps = 1.5\n", [], r"steps must be int"),
    ("[policy]\nlearning_rate = -1\n", [], r"policy.learning_rate must be a positive number, got -1.0"),
    ("[dispatch]\nmax_attempts = 0\n", [], r"dispatch.max_attempts must be >= 1, got 0"),
    ("train = 3\n", [], r"expected a section"),
    ("[train\n", [], r"not valid TOML"),
    ("", ["steps"], r"must look like section.key=value"),
    ("[update]\nppo_epochs = 0\n", [], r"update.ppo_epochs must be >= 1, got 0"),
    ("[update]\noverlong = 'cut'\n", [], r"update.overlong must be one of \('train', 'mask'\), got 'cut'"),
    ("[loss]\nnormalizer = 'tokens'\n", [], r"loss.normalizer must be one of"),
    ("[loss]\nis_correction = 'truncate'\n", [], r"set update.recompute_old_logprobs = true"),
    ("[rollouts]\nmax_staleness = 1\n", [], r"max_staleness = 1 trains on calls sampled by older weights"),
    ("[rollouts]\nmax_staleness = 1\n[update]\nrecompute_old_logprobs = true\n", [],
     r"loss.is_correction = 'truncate'"),
    ("[rollouts]\nmax_staleness = -1\n", [], r"rollouts.max_staleness must be >= 0 \(0: synchronous\), got -1"),
    ("[rollouts]\nmin_step_groups = 1\n", [], r"only asynchronous rollouts do: set rollouts.max_staleness >= 1"),
    ("[rollouts]\ntasks_per_step = 2\nmin_step_groups = 3\n", [], r"between 0 .* rollouts.tasks_per_step = 2, got 3"),
    ("[weight_sync]\nmode = 'lora'\n", [], r"pushed as merged full weights"),
    # values in range, each checked by the section that owns it
    ("", ["agent.temperature=-1"], r"\[agent\]: agent.temperature must be a finite number >= 0 \(0: greedy\), got -1"),
    ("", ["agent.concurrency=0"], r"agent.concurrency must be >= 1"),
    ("", ["agent.max_tokens=0"], r"agent.max_tokens must be >= 1"),
    ("", ["agent.local_workers=-1"], r"agent.local_workers must be >= 0"),
    ("", ["rollouts.group_size=1"], r"rollouts.group_size must be >= 2 \(GRPO compares the rollouts of a group"),
    ("", ["rollouts.tasks_per_step=0"], r"rollouts.tasks_per_step must be >= 1, got 0"),
    ("", ["train.steps=-5"], r"train.steps must be >= 1, got -5"),
    ("", ["rollouts.group_size=4", "rollouts.min_group_size=5"],
     r"min_group_size = 5 is more than rollouts.group_size = 4"),
    ("", ["train.max_minutes=-1"], r"train.max_minutes must be a finite number >= 0 \(0: no limit\), got -1.0"),
    ("", ["rollouts.extra_rollouts=-8"], r"rollouts.extra_rollouts must be >= 0 \(0: off\), got -8"),
    ("", ["rollouts.group_size=8", "rollouts.extra_rollouts=4"],
     r"extra_rollouts must be 0 \(off\) or at least rollouts.group_size = 8 \(extra tasks run in whole groups"),
    ("[rollouts]\nmax_staleness = 1\nextra_rollouts = 16\n[update]\nrecompute_old_logprobs = true\n[loss]\n"
     "is_correction = 'truncate'\n", [], r"asynchronous rollouts do not: set rollouts.extra_rollouts = 0"),
    ("", ["rollouts.rest_after=-1"], r"rollouts.rest_after must be >= 0 \(0: off\), got -1"),
    ("", ["rollouts.rest_after=2", "rollouts.rest_steps=0"], r"rollouts.rest_steps must be >= 1, got 0"),
    ("", ["rollouts.rest_after=2", "rollouts.rest_by=''"], r"rollouts.rest_by must name a task field"),
    ("[rollouts]\nmax_staleness = 1\nrest_after = 2\n[update]\nrecompute_old_logprobs = true\n[loss]\n"
     "is_correction = 'truncate'\n", [], r"asynchronous rollouts do not wait for: set rollouts.rest_after = 0"),
    ("", ["policy.precision='fp16'"], r"policy.precision must be one of \('auto', 'fp32', 'bf16'\)"),
    ("", ["batching.max_tokens_per_micro_batch=1"], r"micro_batch must be 0 or >= 2 \(0: chosen for the device\)"),
    # accepted before, and each failed after the model or vLLM had loaded (a raw traceback, a hang, a wrong cause)
    ("", ["dispatch.rollout_timeout_s=inf"], r"dispatch.rollout_timeout_s must be in \(0, 31536000\] \(seconds"),
    ("", ["dispatch.worker_timeout_s=nan"], r"dispatch.worker_timeout_s must be in \(0, 31536000\].*, got nan"),
    ("", ["dispatch.handshake_s=inf"], r"handshake_s must be in \[0.001, 86400\] \(seconds: at least a millisecond"),
    ("", ["weight_sync.request_timeout_s=inf"], r"request_timeout_s must be in \(0, 86400\] \(seconds: at most a day"),
    ("", ["weight_sync.logprob_tolerance=nan"], r"weight_sync.logprob_tolerance must be a positive number, got nan"),
    ("", ["inference.startup_timeout_s=nan"], r"inference.startup_timeout_s must be a positive number \(seconds\)"),
    ("", ["inference.shutdown_timeout_s=-1"], r"inference.shutdown_timeout_s must be a positive number \(seconds\)"),
    ("", ["inference.api_key=12345"], r"inference.api_key must be text \(in quotes\), got 12345"),
    ("", ["policy.learning_rate=nan"], r"policy.learning_rate must be a positive number, got nan"),
    ("", ["policy.learning_rate=inf"], r"policy.learning_rate must be a positive number, got inf"),
    ("", ["policy.weight_decay=-0.1"], r"policy.weight_decay must be a finite number >= 0, got -0.1"),
    ("", ["policy.max_grad_norm=nan"], r"max_grad_norm must be a finite number >= 0 \(0 disables clipping\), got nan"),
    ("", ["policy.lora_rank=8", "policy.lora_alpha=0"], r"policy.lora_alpha must be positive with policy.lora_rank"),
    ("", ["policy.lora_rank=8", "policy.lora_target_modules=[]"], r"policy.lora_target_modules names no layer"),
    ("", ["policy.lora_target_modules=[1]"], r"lora_target_modules must be a list of texts"),
    ("", ["inference.extra_args=['--enforce-eager', 2]"], r"extra_args must be a list of texts"),
    ("", ["inference.remote=['tcp://10.0.0.2:7400']"], r"inference.remote needs \[security\] keys_dir: the "
                                                       r"weights travel to the other hosts encrypted with its keys"),
    ("", ["inference.remote=['10.0.0.2:7400']"], r"inference.remote takes what `lit serve` prints, tcp://HOST:PORT"),
    ("", ["inference.remote=['tcp://10.0.0.2:7400']", "security.keys_dir='/k'", "weight_sync.transport='nccl'",
          "inference.weight_transfer_backend='nccl'", "inference.device='cuda'"],
     r"inference.remote takes weights over the network, and weight_sync.transport = 'nccl'"),
    ("", ["inference.layout='colocated'", "inference.device='cuda'", "rollouts.max_staleness=1",
          "update.recompute_old_logprobs=true", "loss.is_correction='truncate'"],
     r"inference.layout = 'colocated' puts vLLM to sleep during each update, and rollouts.max_staleness = 1"),
    ("", ["train.success_reward=inf"], r"train.success_reward must be a finite number, got inf"),
    ("", ["train.output_dir=''"], r"train.output_dir is empty: name the run's folder"),
    ("", ["data.train_size=0"], r"data.train_size must be >= 1 \(how many tasks of the split to load\), got 0"),
    ("", ["data.val_size=-1"], r"data.val_size must be >= 1"),
    ("", ["collector.endpoint=''"], r"collector.endpoint: '' is not a ZeroMQ endpoint"),
    ("", ["dispatch_endpoint.endpoint=bogus"], r"dispatch_endpoint.endpoint: 'bogus' is not a ZeroMQ endpoint"),
    ("", ["weight_sync.nccl_master_port=65535", "inference.servers=2"], r"runs past port 65535 \(server i meets"),
    ("", ["weight_sync.transport=nccl"], r"set inference.weight_transfer_backend = 'nccl' \(it is ''\)"),
    ("", ["inference.dtype=bf16"], r"inference.dtype must be one of .* \(vLLM's --dtype\), got 'bf16'"),
])
def test_mistakes_name_the_key(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(write(tmp_path, text), overrides)


def test_the_settings_a_resume_changes_are_listed_key_by_key():
    before = {"source": "a.toml", "overrides": ["train.steps=4"], "model": "m",
              "train": {"steps": 4, "trackers": ["jsonl"]}, "policy": {"learning_rate": 1e-06, "lora_rank": 0}}
    after = {"source": "b.toml", "overrides": [], "model": "m",  # where a config came from is no setting
             "train": {"steps": 8, "trackers": ("jsonl", "wandb")}, "policy": {"learning_rate": 1e-06},
             "loss": {"kl_beta": 0.1}}
    assert changed_settings(before, after) == [
        "train.steps: 4 -> 8", 'train.trackers: ["jsonl"] -> ["jsonl", "wandb"]', "loss.kl_beta: (none) -> 0.1",
        "policy.lora_rank: 0 -> (none)"]
    assert changed_settings(before, before) == []
    assert changed_settings({"train": {"trackers": ["jsonl"]}}, {"train": {"trackers": ("jsonl",)}}) == []


def test_a_config_and_its_json_record_show_no_change(tmp_path):
    import json

    cfg = load(write(tmp_path, '[agent]\nfunction = "m:f"\n'), ["train.steps=3", "inference.api_key=sk-1"])
    recorded = json.loads(json.dumps(cfg.to_dict(), default=str))  # as config.json keeps it
    assert changed_settings(recorded, cfg.to_dict()) == []
    again = load(write(tmp_path, '[agent]\nfunction = "m:f"\n'), ["train.steps=6", "inference.api_key=sk-1"])
    assert changed_settings(recorded, again.to_dict()) == ["train.steps: 3 -> 6"]
