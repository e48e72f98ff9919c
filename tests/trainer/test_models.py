"""The offline default model: preparation, resolution of names and paths, and a real generation."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_trainer.models import embedded as default_model
from lit_trainer.models import folders as models
from lit_trainer.models.folders import DEFAULT_MODEL, MARKER, ModelError, resolve_model


def _lit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lit_trainer.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)


@pytest.mark.slow
def test_prepared_model_is_a_complete_hf_folder(prepared_model: Path):
    names = {p.name for p in prepared_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", MARKER} <= names
    assert resolve_model(DEFAULT_MODEL) == prepared_model


@pytest.mark.slow
def test_second_prepare_is_a_no_op(prepared_model: Path):
    before = {p.name: p.stat().st_mtime_ns for p in prepared_model.iterdir()}
    again = default_model.prepare_default_model()
    assert again.created is False
    assert again.path == prepared_model
    assert {p.name: p.stat().st_mtime_ns for p in prepared_model.iterdir()} == before


@pytest.mark.slow
def test_second_prepare_through_the_cli_says_so(prepared_model: Path):
    out = _lit("model", "prepare")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(prepared_model)
    assert "already prepared" in out.stderr


@pytest.mark.slow
def test_prepared_model_answers_a_simple_question(prepared_model: Path):
    reply = models.greedy_reply(prepared_model, "What is the capital of France?", max_new_tokens=24)
    assert "paris" in reply.lower(), reply


@pytest.mark.slow
def test_prepared_model_loads_as_fp32_llama_with_tied_embeddings(prepared_model: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(prepared_model)
    assert model.config.model_type == "llama"
    assert model.config.tie_word_embeddings
    assert model.dtype == torch.float32
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000


def test_bad_model_path_gives_one_line_error_naming_the_path(tmp_path: Path):
    bad = tmp_path / "no-such-model"
    out = _lit("model", "check", str(bad))
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("lit: error:") and str(bad) in lines[0]


def test_folder_without_config_is_rejected_with_its_path(tmp_path: Path):
    with pytest.raises(ModelError, match="no config.json") as info:
        resolve_model(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_any_hf_causal_lm_folder_is_accepted(tmp_path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    assert resolve_model(str(tmp_path / "tiny")) == tmp_path / "tiny"


def test_unprepared_default_names_the_prepare_command(tmp_path: Path):
    with pytest.raises(ModelError, match="lit model prepare"):
        resolve_model(DEFAULT_MODEL, cache=tmp_path)


def test_interrupted_preparation_is_not_taken_for_a_model(tmp_path: Path):
    # A folder that has the files but not the marker (the process died mid-save) is not a prepared model.
    folder = models.default_model_dir(tmp_path)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert not models.is_prepared(folder)
    with pytest.raises(ModelError, match="not prepared"):
        resolve_model(DEFAULT_MODEL, cache=tmp_path)


def test_cache_dir_follows_lit_cache_dir(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("LIT_CACHE_DIR", str(tmp_path / "c"))
    assert models.default_model_dir() == tmp_path / "c" / "models" / models.SMOLLM2_FOLDER
    monkeypatch.delenv("LIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "x" / "lit"


def test_a_model_folder_transformers_cannot_load_is_named_with_what_it_lacks(tmp_path: Path, prepared_model: Path):
    """transformers said these as a traceback (a config that is not JSON), or as advice to install sentencepiece
    (no tokenizer files); lit model check and lit train now say what the folder lacks, in one line."""
    folder = tmp_path / "mine"
    folder.mkdir()
    cases = [("{bad", "cannot read .*config.json as JSON"), ('{"hidden_size": 8}', "names no model_type"),
             ((prepared_model / "config.json").read_text(), r"holds no weights \(\*.safetensors or \*.bin\)")]
    for config, error in cases:
        (folder / "config.json").write_text(config)
        with pytest.raises(ModelError, match=error):
            models.check_model_folder(folder)
    (folder / "model.safetensors").symlink_to(prepared_model / "model.safetensors")
    with pytest.raises(ModelError, match="holds no tokenizer .*tokenizer.save_pretrained"):
        models.check_model_folder(folder)
    models.check_model_folder(folder, tokenizer=False)  # what the update needs
    out = _lit("model", "check", str(folder))
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"lit: error: '{folder}' holds no tokenizer (one of tokenizer.json, tokenizer.model, vocab.json, "
        "spiece.model, vocab.txt): save the model's tokenizer into it too (tokenizer.save_pretrained)"], out.stderr
    (folder / "config.json").write_text('{"hidden_size": 8}')
    config = tmp_path / "config.toml"
    config.write_text(f'model = "{folder}"\n[agent]\nfunction = "examples.calc.agent:calc_agent"\n[data]\n'
                      f'tasks = "examples.calc.tasks:make_tasks"\n[train]\noutput_dir = "{tmp_path / "run"}"\n')
    out = _lit("train", str(config))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"lit: error: {folder / 'config.json'} names no model_type, so transformers cannot tell the model's "
        "architecture (a Hugging Face causal-LM's config.json has one, e.g. \"llama\")"), out.stderr[-3000:]
    assert "starting vLLM" not in out.stderr
    (folder / "config.json").write_text((prepared_model / "config.json").read_text())  # only the tokenizer lacks
    out = _lit("train", str(config))
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
        f"lit: error: '{folder}' holds no tokenizer (one of tokenizer.json, tokenizer.model, vocab.json, "
        "spiece.model, vocab.txt): save the model's tokenizer into it too (tokenizer.save_pretrained)"), out.stderr
    assert "starting vLLM" not in out.stderr and "lit: the policy" not in out.stderr  # before the weights load
    out = _lit("eval", str(config))  # the base model, as vLLM would serve it
    assert out.returncode == 1 and "holds no tokenizer" in out.stderr.strip().splitlines()[-1], out.stderr[-3000:]
    assert "starting vLLM" not in out.stderr


@pytest.mark.parametrize("fields, longest", [
    ({"max_position_embeddings": 1024}, (1024, "max_position_embeddings")),
    ({"n_positions": 1024, "max_position_embeddings": 4096}, (1024, "n_positions")),  # GPT-2's: the smallest
    ({"text_config": {"max_position_embeddings": 512}}, (512, "max_position_embeddings")),
    ({"max_position_embeddings": 1024, "model_max_length": 4096}, (4096, "model_max_length")),
    ({"max_position_embeddings": 1024, "rope_scaling": {"type": "linear", "factor": 4.0}}, None),  # vLLM scales
    ({"max_position_embeddings": 1024, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     (1024, "max_position_embeddings")),
    ({}, None)])  # fmt: skip
def test_the_longest_sequence_a_model_was_made_for_is_read_as_vllm_reads_it(tmp_path: Path, fields: dict, longest):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    assert models.max_positions(tmp_path) == longest
    if longest:
        models.check_context(tmp_path, longest[0])
        with pytest.raises(ModelError, match=rf"inference.max_model_len = {longest[0] + 1} is longer .*"
                                             rf"\({longest[1]} = {longest[0]} in its config.json\)"):
            models.check_context(tmp_path, longest[0] + 1)


def test_a_max_model_len_longer_than_the_model_stops_lit_train_and_eval_before_vllm_starts(
        tmp_path: Path, prepared_model: Path, monkeypatch: pytest.MonkeyPatch):
    """vLLM refused it at start, after the policy had loaded; vLLM's own override is honoured."""
    folder = tmp_path / "short"  # the default model, made for 1024 positions
    folder.mkdir()
    config = json.loads((prepared_model / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    shutil.copy(prepared_model / "tokenizer.json", folder)
    (folder / "model.safetensors").symlink_to(prepared_model / "model.safetensors")  # lit eval checks the weights
    toml = tmp_path / "config.toml"
    toml.write_text(f'model = "{folder}"\n[agent]\nfunction = "rollout_agents:reply_length_parity"\n[data]\n'
                    f'tasks = "rollout_agents:parity_tasks"\n[train]\noutput_dir = "{tmp_path / "run"}"\n')
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    for command in ("train", "eval"):
        out = _lit(command, str(toml))
        assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
            f"lit: error: inference.max_model_len = 2048 is longer than the model in '{folder}' was made for "
            "(max_position_embeddings = 1024 in its config.json), which vLLM refuses: set inference.max_model_len = "
            "1024 or less"), out.stderr[-3000:]
        assert "starting vLLM" not in out.stderr
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    models.check_context(folder, 2048)


def test_a_cache_dir_that_cannot_hold_folders_is_one_line_naming_the_fix(tmp_path: Path):
    """`lit model prepare --cache-dir FILE` printed a NotADirectoryError traceback."""
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "model", "prepare", "--cache-dir", str(a_file)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip() == (f"lit: error: cannot make the models folder {a_file / 'models'}: Not a directory. "
                                  "Give a folder lit can write: --cache-dir, or $LIT_CACHE_DIR")
