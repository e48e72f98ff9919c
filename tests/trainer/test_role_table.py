"""The ``[roles]`` table (lit_trainer/roles.py): the names it gives (adapters, vLLM's served names, the gateway's
routes), what it sets in the other sections, and the tables refused at load in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_trainer.config import ConfigError, from_dict, load
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.engine.launch import build_command
from lit_trainer.roles import Roles

TABLE = {"writer": "own", "rewriter": "own", "checker": "base"}


def adapter_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return folder


def test_each_trained_role_gets_an_adapter_and_a_served_name(tmp_path: Path):
    judge = adapter_folder(tmp_path / "judge-lora")
    roles = Roles({**TABLE, "summary": "shared", "notes": "shared", "judge": str(judge)}, served="policy")
    assert roles.adapters == ("writer", "rewriter", "shared")
    assert roles.trained_agents == ("writer", "rewriter", "summary", "notes")
    assert roles.routes() == {"writer": "policy-writer", "rewriter": "policy-rewriter", "checker": "policy",
                              "summary": "policy-shared", "notes": "policy-shared", "judge": "policy-judge-lora"}
    assert roles.served_name("an agent the table does not name") == roles.served_name(None) == "policy"
    assert roles.fixed == {"policy-judge-lora": str(judge.resolve())}
    assert roles.served_adapters == 4
    assert roles.adapter_map() == {"writer": "writer", "rewriter": "rewriter", "summary": "shared", "notes": "shared"}
    # names peft and vLLM take: what is not a letter, digit, _ or - becomes _
    assert Roles({"Writer Agent.v2": "own"}).adapter_of("Writer Agent.v2") == "Writer_Agent_v2"


def test_evaluation_serves_each_trained_adapter_from_its_folder_under_the_same_name(tmp_path: Path):
    roles = Roles({**TABLE, "summary": "shared", "notes": "shared"})
    folders = {name: adapter_folder(tmp_path / "adapters" / name) for name in roles.adapters}
    frozen = roles.frozen_into(folders)
    assert frozen.adapters == () and frozen.routes() == roles.routes()
    assert frozen.fixed == {f"policy-{name}": str(folder.resolve()) for name, folder in folders.items()}
    # the base model's evaluation: every trained agent on the base
    assert set(roles.on_base().routes().values()) == {"policy"} and roles.on_base().served_adapters == 0
    # a checkpoint without the table's adapters (another run's) is refused, naming both
    from lit_trainer.results.runs import Checkpoint
    from lit_trainer.run.evaluation import _frozen_roles

    (tmp_path / "other" / "adapters" / "writer").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"holds no adapter \['rewriter', 'shared'\] of the \[roles\] table "
                                         r"\(it holds \['writer'\]\)"):
        _frozen_roles(roles, Checkpoint(tmp_path / "other", 3))


@pytest.mark.parametrize(("table", "message"), [
    ({"writer": "mine"}, "roles.writer = 'mine' is neither \"own\", \"shared\" nor \"base\", and no adapter folder"),
    ({"writer": 3}, "roles.writer must be \"own\", \"shared\", \"base\" or an adapter folder, got 3"),
])
def test_a_value_that_is_no_role_is_refused(table: dict, message: str):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Roles(table)


def test_two_roles_served_under_one_name_are_refused(tmp_path: Path):
    a, b = adapter_folder(tmp_path / "a" / "judge"), adapter_folder(tmp_path / "b" / "judge")
    with pytest.raises(ValueError, match="would both be served as adapter 'judge'"):
        Roles({"first": str(a), "second": str(b)})


def test_the_table_sets_the_trained_agents_and_vllms_lora_serving(tmp_path: Path):
    judge = adapter_folder(tmp_path / "judge")
    cfg = from_dict({"roles": {**TABLE, "judge": str(judge)}, "policy": {"lora_rank": 32}})
    assert cfg.agent.agents == ("writer", "rewriter")
    assert cfg.inference.enable_lora and cfg.inference.max_lora_rank == 32
    assert cfg.inference.lora_modules == {"policy-judge": str(judge.resolve())}
    command = build_command(cfg.inference, tmp_path, 8000, "python")
    at = command.index("--enable-lora")
    assert command[at:at + 8] == ["--enable-lora", "--max-lora-rank", "32", "--max-loras", "4", "--lora-modules",
                                  f"policy-judge={judge.resolve()}", "--distributed-executor-backend"]
    # the same agent.agents as the table's trained ones may stay (the SQL example names them)
    assert from_dict({"roles": TABLE, "policy": {"lora_rank": 8},
                      "agent": {"agents": ["rewriter", "writer"]}}).agent.agents == ("writer", "rewriter")
    assert not from_dict({}).inference.enable_lora and InferenceConfig().lora_modules == {}


@pytest.mark.parametrize(("settings", "message"), [
    ({"roles": TABLE}, "a [roles] table trains one LoRA adapter per role: set policy.lora_rank (e.g. 16), or remove "
                       "the table"),
    ({"roles": {"a": "own", "b": "own", "c": "own"}, "policy": {"lora_rank": 8}, "inference": {"max_loras": 2}},
     "the [roles] table serves 3 LoRA adapters but vLLM serves at most inference.max_loras = 2: raise it, or share "
     "adapters"),
    ({"roles": TABLE, "policy": {"lora_rank": 8}, "agent": {"agents": ["writer"]}},
     "agent.agents = ['writer'] and the [roles] table both choose what trains: leave agent.agents out (the table "
     "trains ['writer', 'rewriter'])"),
    ({"roles": TABLE, "policy": {"lora_rank": 8}, "weight_sync": {"transport": "nccl"},
      "inference": {"weight_transfer_backend": "nccl", "device": "cuda"}},
     "a [roles] table loads each adapter into vLLM from shared memory"),
    ({"roles": TABLE, "policy": {"lora_rank": 8, "shard": True}}, "policy.shard shards a full fine-tune"),
])
def test_a_table_the_run_cannot_serve_stops_at_load_in_one_line(settings: dict, message: str):
    with pytest.raises(ConfigError) as info:
        from_dict(settings)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_role_is_set_from_the_command_line(tmp_path: Path):
    config = tmp_path / "config.toml"
    config.write_text("[policy]\nlora_rank = 8\n")
    cfg = load(config, ["roles.writer=own", "roles.checker=base"])
    assert cfg.roles == {"writer": "own", "checker": "base"} and cfg.agent.agents == ("writer",)
