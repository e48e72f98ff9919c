"""The ``[security]`` section: binding the collector, the dispatcher or vLLM beyond loopback needs keys, refused
before anything starts with the setting named and the command that makes them; the API key stays out of
``config.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_trainer.config import ConfigError, load


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text('[agent]\nfunction = "m:f"\n' + text)
    return path


@pytest.mark.parametrize("section", ["collector", "dispatch_endpoint"])
@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:7373", "tcp://*:7373", "tcp://192.0.2.7:7373"])
def test_a_non_loopback_endpoint_without_keys_is_refused(tmp_path: Path, section: str, endpoint: str):
    path = _config(tmp_path, f'[{section}]\nendpoint = "{endpoint}"\n')
    with pytest.raises(ConfigError, match=rf"{section}\.endpoint.*lit keys generate.*\[security\] keys_dir"):
        load(path)
    cfg = load(path, ["security.keys_dir=/etc/lit/keys"])
    assert getattr(cfg, section).endpoint == endpoint and cfg.security.keys_dir == "/etc/lit/keys"


def test_loopback_endpoints_need_no_keys(tmp_path: Path):
    cfg = load(_config(tmp_path, '[collector]\nendpoint = "tcp://127.0.0.1:7373"\n'))
    assert cfg.security.keys_dir == "" and cfg.inference.api_key_file == ""


def test_the_keys_folder_gives_vllm_its_api_key(tmp_path: Path):
    path = _config(tmp_path, '[inference]\nhost = "0.0.0.0"\n')
    with pytest.raises(ConfigError, match=r"inference.api_key .*lit keys generate"):
        load(path)
    cfg = load(path, ["security.keys_dir=~/keys"])
    assert cfg.inference.api_key_file == str(Path("~/keys").expanduser() / "api_key")
    assert load(path, ["security.keys_dir=~/keys", "inference.api_key_file=/k"]).inference.api_key_file == "/k"


def test_an_api_key_in_the_config_is_not_written_out(tmp_path: Path):
    cfg = load(_config(tmp_path, '[inference]\napi_key = "sk-secret"\n'))
    assert cfg.inference.api_key == "sk-secret"
    assert cfg.to_dict()["inference"]["api_key"] == "***"
    assert load(_config(tmp_path, "")).to_dict()["inference"]["api_key"] is None
    given = load(_config(tmp_path, ""), ["inference.api_key=sk-secret", "train.steps=3"])
    assert given.inference.api_key == "sk-secret"
    assert given.overrides == ("inference.api_key=sk-secret", "train.steps=3")
    assert given.to_dict()["overrides"] == ["inference.api_key=***", "train.steps=3"]  # as config.json keeps them
    assert "sk-secret" not in json.dumps(given.to_dict())
