import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lit_sdk.install import pip_install


def test_help_lists_the_subcommands_without_importing_torch():
    code = (
        "import sys\n"
        "from lit_trainer.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    for name in ("model", "train", "eval", "worker"):
        assert f"\n    {name} " in out.stdout, out.stdout
    assert out.stdout.strip().endswith("NO-TORCH")


def test_lit_console_script_is_installed():
    lit = Path(sys.executable).parent / "lit"
    out = subprocess.run([str(lit), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("lit ")


def test_train_with_a_missing_config_fails_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(tmp_path / "nope.toml")],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.strip() == f"lit: error: no config file at {tmp_path / 'nope.toml'}"


def test_a_command_without_its_config_asks_for_the_config_only():
    for command in (["train"], ["eval"], ["config", "show"]):
        out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", *command], capture_output=True, text=True)
        assert out.returncode == 2 and out.stderr.strip().endswith("error: the following arguments are required: "
                                                                   "config"), out.stderr


def test_train_with_a_bad_override_names_the_key(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[agent]\nfunction = "m:f"\n')
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(config), "train.stepz=3"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "unknown key(s) ['stepz']; did you mean 'steps' for 'stepz'?" in out.stderr, out.stderr


def test_keys_generate_writes_private_keys_and_never_overwrites(tmp_path):
    folder = tmp_path / "keys"
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "keys", "generate", str(folder)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert sorted(Path(p).name for p in out.stdout.split()) == ["api_key", "client.key", "client.key_secret",
                                                               "server.key", "server.key_secret"]
    assert "client.key_secret and server.key" in out.stderr and f'keys_dir = "{folder}"' in out.stderr
    assert (folder.stat().st_mode & 0o777) == 0o700 and (folder / "server.key_secret").stat().st_mode & 0o077 == 0
    secret = (folder / "server.key_secret").read_bytes()
    again = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "keys", "generate", str(folder)],
                           capture_output=True, text=True)
    assert again.returncode == 1 and "never overwrites" in again.stderr and "Traceback" not in again.stderr
    assert (folder / "server.key_secret").read_bytes() == secret


def test_train_refuses_a_public_collector_without_keys_and_says_how_to_make_them(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[agent]\nfunction = "m:f"\n[collector]\nendpoint = "tcp://0.0.0.0:7373"\n')
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(config)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "collector.endpoint" in out.stderr and "lit keys generate" in out.stderr


def _cli(*args: str, block: str = "") -> subprocess.CompletedProcess:
    """``lit ARGS`` in a fresh interpreter; ``block``: a module made unimportable, as if its extra were missing."""
    code = (f"import sys\nif {block!r}: sys.modules[{block!r}] = None\n"
            "from lit_trainer.cli import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)


def test_an_output_folder_lit_cannot_make_is_named_in_one_line_before_anything_starts(tmp_path):
    (tmp_path / "a_file").write_text("")  # a folder under a file cannot be made, whoever runs the test (root too)
    folder = tmp_path / "a_file" / "run"
    for command in ("train", "eval"):
        out = _cli(command, "examples/calc/config.toml", f"train.output_dir='{folder}'")
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert out.stderr.strip().splitlines()[-1] == (
            f"lit: error: train.output_dir '{folder}' cannot be made (Not a directory): give a folder lit can "
            "write to"), out.stderr
        assert "starting vLLM" not in out.stderr


def test_overrides_are_accepted_after_options_too(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[agent]\nfunction = "m:f"\n')
    # Each reaches the config loader, which names the bad key: the override was parsed, not refused by argparse.
    for args in (["train", str(config), "--resume", "train.stepz=3"],
                 ["eval", str(config), "--checkpoint", str(tmp_path), "train.stepz=3"],
                 ["eval", str(config), "train.seed=1", "--output", str(tmp_path / "o.json"), "train.stepz=3"]):
        out = _cli(*args)
        assert out.returncode == 1 and "unknown key(s) ['stepz']" in out.stderr, (args, out.stderr)
    out = _cli("eval", str(config), "--checkpoint", str(tmp_path), "--bogus")
    assert out.returncode == 2 and "unrecognized arguments: --bogus" in out.stderr


def test_config_keys_lists_every_key_with_its_default_and_meaning():
    out = _cli("config", "keys")
    assert out.returncode == 0, out.stderr
    assert "train.steps = 20\n    Training steps" in out.stdout
    assert 'model = "smollm2-135m"\n    The policy' in out.stdout
    assert "\n# inference.api_key is not set\n" in out.stdout  # not = "None": copied, that is a key
    names = [line.split(" = ")[0].removeprefix("# ").removesuffix(" is not set")
             for line in out.stdout.splitlines() if not line.startswith(" ")]
    from lit_trainer.config import config_keys
    assert names == [k.name for k in config_keys()] and len(names) > 80
    assert all(k.doc for k in config_keys()), [k.name for k in config_keys() if not k.doc]  # every field documented
    only = _cli("config", "keys", "loss")
    assert only.returncode == 0 and all(line.startswith(("loss.", " ")) for line in only.stdout.splitlines())
    wrong = _cli("config", "keys", "nope")
    assert wrong.returncode == 1 and "no config section 'nope'" in wrong.stderr
    near = _cli("config", "keys", "polcy")
    assert near.returncode == 1 and "no config section 'polcy'; did you mean 'policy'?" in near.stderr, near.stderr
    assert "overrides" not in near.stderr and "source" not in near.stderr  # where a config came from: no key


def test_config_show_prints_the_config_with_overrides_as_toml(tmp_path):
    import tomllib

    config = tmp_path / "c.toml"
    config.write_text('[agent]\nfunction = "m:f"\n')
    out = _cli("config", "show", str(config), "train.steps=3", "agent.agents=['a', 'b']")
    assert out.returncode == 0, out.stderr
    table = tomllib.loads(out.stdout)
    assert table["train"]["steps"] == 3
    assert table["agent"]["function"] == "m:f" and table["agent"]["agents"] == ["a", "b"]
    from lit_trainer.config import from_dict
    assert from_dict(table).train.steps == 3  # what it prints is a config lit reads back
    assert "# api_key is not set" in out.stdout and "api_key" not in table["inference"]  # not the key "None"
    assert from_dict(table).inference.api_key is None
    # a role table, and the adapters it serves (an inline table), print and read back too
    (tmp_path / "judge").mkdir()
    (tmp_path / "judge" / "adapter_config.json").write_text("{}")
    roles = _cli("config", "show", str(config), "policy.lora_rank=8", "roles.writer=own",
                 f"roles.judge='{tmp_path}/judge'")
    assert roles.returncode == 0, roles.stderr
    back = from_dict(tomllib.loads(roles.stdout))
    assert back.roles == {"writer": "own", "judge": f"{tmp_path}/judge"}
    assert back.inference.lora_modules == {"policy-judge": str((tmp_path / "judge").resolve())}


def test_config_show_ends_with_what_the_policy_needs_in_memory(tmp_path, tiny_model):
    config = tmp_path / "c.toml"
    config.write_text(f'model = "{tiny_model}"\n[agent]\nfunction = "m:f"\n')
    out = _cli("config", "show", str(config), "loss.kl_beta=0.1")
    last = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0 and last.startswith("# the policy (0.0M parameters") and "KL reference" in last, last
    assert "one process on cpu, fp32" in last
    missing = _cli("config", "show", str(config), f"model='{tmp_path / 'nowhere'}'")
    assert "# the policy's memory is not known here: no model at" in missing.stdout


def test_help_says_where_the_config_keys_are():
    for args in (["--help"], ["train", "--help"], ["eval", "--help"]):
        out = _cli(*args)
        assert out.returncode == 0 and "lit config keys" in out.stdout, args


def test_a_missing_extra_gives_the_install_command_not_a_traceback(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[agent]\nfunction = "m:f"\n')
    for command in (["train", str(config)], ["eval", str(config)], ["config", "keys"]):
        out = _cli(*command, block="torch")
        assert out.returncode == 1, (command, out.stderr)
        assert "Traceback" not in out.stderr and pip_install("trainer") in out.stderr, out.stderr


@pytest.mark.parametrize(("agent", "words"), [
    ("def solve(task, llm):\n    return 1.0\n", "my_agent:solve is not decorated with @lit.trace"),
    ("import lit_sdk as lit\n\n@lit.trace\ndef solve(task):\n    return 1.0\n", "must take (task, llm)"),
])
def test_lit_train_names_a_broken_agent_before_the_model_or_vllm_start(tmp_path, agent, words):
    """An agent without ``@lit.trace`` or with another signature used to start vLLM and fail every rollout of
    every step; now ``lit train`` stops in one line, before it loads the model or opens the store."""
    tasks = "\n\ndef tasks(split, n):\n    return [{'id': i} for i in range(n)]\n"
    (tmp_path / "my_agent.py").write_text(agent + tasks)
    config = tmp_path / "c.toml"
    config.write_text('[agent]\nfunction = "my_agent:solve"\n[data]\ntasks = "my_agent:tasks"\ntrain_size = 4\n'
                      f'val_size = 2\n[train]\noutput_dir = "{tmp_path / "run"}"\n')
    code = "import sys\nfrom lit_trainer.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # this lit, from the agent's folder
    out = subprocess.run([sys.executable, "-c", code, "train", str(config)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit: error:")]
    assert out.returncode == 1 and "Traceback" not in out.stderr and len(errors) == 1, out.stderr[-3000:]
    assert words in errors[0], errors
    assert not (tmp_path / "run" / "lit.sqlite").exists()  # nothing started: no store, no vLLM


def test_train_check_makes_the_checks_before_the_model_loads_says_what_they_found_and_trains_nothing(
        tmp_path, prepared_model):
    run = tmp_path / "run"
    config = tmp_path / "c.toml"
    config.write_text(f'model = "{prepared_model}"\n[agent]\nfunction = "rollout_agents:reply_length_parity"\n'
                      '[data]\ntasks = "rollout_agents:parity_tasks"\ntrain_size = 8\nval_size = 4\n'
                      f'[train]\noutput_dir = "{run}"\n')
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}  # rollout_agents

    def check(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(config), "--check", *overrides],
                              env=env, capture_output=True, text=True)

    ok = check()
    assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr[-3000:]
    for line in ("lit: tasks: 8 for training, 4 held out",
                 "lit: agent: rollout_agents:reply_length_parity (imports; @lit.trace; takes (task, llm))",
                 f"lit: model: {prepared_model} (its config and tokenizer; vLLM's max_model_len fits it)",
                 f"lit: run folder: {run}: starts at step 1",
                 "lit: --check: every check made before the model loads passed; nothing was trained"):
        assert line in ok.stderr.splitlines(), (line, ok.stderr)
    assert "lit: policy: the policy (134.5M parameters" in ok.stderr and not run.exists()  # the folder not made
    for overrides, message in (
            (["agent.function=rollout_agents:no_such_agent"], "has no function 'no_such_agent'"),
            (["inference.max_model_len=65536"], "max_model_len = 65536"),
            (["data.tasks=rollout_agents:nowhere"], "nowhere")):
        wrong = check(*overrides)
        assert wrong.returncode == 1 and "Traceback" not in wrong.stderr, wrong.stderr[-3000:]
        assert message in wrong.stderr and "lit: --check" not in wrong.stderr, (overrides, wrong.stderr[-3000:])
    assert not run.exists()
    with socket.socket() as taken:  # a port another process listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for overrides, message in (
                ([f"collector.endpoint=tcp://127.0.0.1:{port}"],
                 f"the run cannot listen on tcp://127.0.0.1:{port} (collector.endpoint): another process listens "
                 "there"),
                ([f"dispatch_endpoint.endpoint=tcp://127.0.0.1:{port}"], "(dispatch_endpoint.endpoint)"),
                ([f"inference.port={port}"], f"port {port} on 127.0.0.1 is in use (inference.port)")):
            busy = check(*overrides)
            assert busy.returncode == 1 and message in busy.stderr, (overrides, busy.stderr[-3000:])
    same = check(f"collector.endpoint=tcp://127.0.0.1:{port}", f"dispatch_endpoint.endpoint=tcp://127.0.0.1:{port}")
    assert same.returncode == 1 and (f"collector.endpoint and dispatch_endpoint.endpoint are both "
                                     f"tcp://127.0.0.1:{port}: give each an address of its own") in same.stderr, \
        same.stderr[-3000:]
    import shutil

    from lit_trainer.results.runs import RunFolder

    checkpoint = RunFolder(run).checkpoint(2)  # what a run stopped after step 2 left (the model's config: its shape)
    checkpoint.model_dir.mkdir(parents=True)
    shutil.copy2(prepared_model / "config.json", checkpoint.model_dir)
    (checkpoint.path / "DONE").write_text("step 2\n")
    again = check()
    assert again.returncode == 1 and "already holds checkpoints (latest: step 2)" in again.stderr, again.stderr
    resumed = check("--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"lit: run folder: {run}: resumes from step 2 ({checkpoint.path})" in resumed.stderr.splitlines()
