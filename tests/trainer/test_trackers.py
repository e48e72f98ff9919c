"""train.trackers: a tracker lit does not offer, or one whose package is missing, stops the config with the fix; the
offered ones (TensorBoard, W&B offline) really log every metric, under the run's output folder."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from accelerate import Accelerator
from wandb_offline import go_offline, run_ids

from lit_sdk.install import pip_install
from lit_trainer.config import ConfigError, load
from lit_trainer.results.metrics import MetricsLog


def _config(tmp_path: Path, trackers: list[str]) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(f"[train]\ntrackers = {json.dumps(trackers)}\n")
    return path


def test_an_unknown_tracker_stops_the_config_and_lists_the_supported_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown tracker 'mlflow'; lit supports tensorboard, wandb"):
        load(_config(tmp_path, ["tensorboard", "mlflow"]))


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_tracker_without_its_package_stops_the_config_with_the_pip_command(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # what importlib sees when the package is not installed
    with pytest.raises(ConfigError) as caught:
        load(_config(tmp_path, [name]))
    wanted = f"""train.trackers = ["{name}"] needs the {name} package: {pip_install(name)}"""
    assert wanted in str(caught.value)


def test_an_accelerator_without_the_tracker_is_an_error_not_silence(tmp_path):
    with pytest.raises(RuntimeError, match=r"did not start the tracker\(s\) \['tensorboard'\]"):
        MetricsLog(tmp_path / "metrics.jsonl", Accelerator(cpu=True), ["tensorboard"])


def _log_two_steps(out: Path, tracker: str) -> None:
    """What ``lit train`` does: the policy's Accelerator logs under the output folder, MetricsLog feeds it."""
    accelerator = Accelerator(cpu=True, log_with=[tracker], project_dir=str(out))
    log = MetricsLog(out / "metrics.jsonl", accelerator, [tracker], {"train": {"steps": 2}, "model": "m"})
    log.log(0, {"accuracy": 0.25}, kind="validation")
    log.log(1, {"reward/mean": 0.5, "loss/policy": -0.125})
    log.log(2, {"reward/mean": 0.75, "loss/policy": 0.0625})
    log.log(2, {"accuracy": 0.5}, kind="validation")
    log.close()


def test_tensorboard_logs_every_metric_in_the_output_folder(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    out.mkdir()
    _log_two_steps(out, "tensorboard")
    events = EventAccumulator(str(out / "lit"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars == {"validation/accuracy": [(0, 0.25), (2, 0.5)], "train/reward/mean": [(1, 0.5), (2, 0.75)],
                       "train/loss/policy": [(1, -0.125), (2, 0.0625)]}  # fmt: skip
    hparams = next(out.glob("lit/*/hparams.yml")).read_text()
    assert "train.steps: 2" in hparams and "model: m" in hparams


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch) -> None:
    go_offline(monkeypatch, tmp_path)


def _history(run_file: Path) -> list[dict]:
    """The rows of an offline W&B run file, each with its step, once wandb-core has written them all."""
    deadline = time.monotonic() + 30
    while not (rows := _wandb_history(run_file)) and time.monotonic() < deadline:
        time.sleep(0.2)  # wandb-core writes the file behind finish(): its last records land a moment later
    return [{k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]}
            for row in rows or []]  # fmt: skip


def test_wandb_offline_logs_every_metric_in_the_output_folder(tmp_path, wandb_offline):
    out = tmp_path / "run"
    out.mkdir()
    _log_two_steps(out, "wandb")
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    assert _history(run_file) == [{"step": 0, "validation/accuracy": 0.25},
                                  {"step": 1, "train/reward/mean": 0.5, "train/loss/policy": -0.125},
                                  {"step": 2, "train/reward/mean": 0.75, "train/loss/policy": 0.0625,
                                   "validation/accuracy": 0.5}]  # fmt: skip


def test_a_resumed_run_logs_to_the_same_wandb_run(tmp_path, wandb_offline):
    """``--resume`` passes the folder's W&B run id (RunFolder.wandb_run) with resume="allow": offline, each
    ``lit train`` writes a run folder of its own under the same id, which ``wandb sync`` uploads as one run."""
    out = tmp_path / "run"
    out.mkdir()
    for steps, first_step in (((1, 2), 0), ((3,), 3)):  # a run, then its resume from step 2's checkpoint
        accelerator = Accelerator(cpu=True, log_with=["wandb"], project_dir=str(out))
        log = MetricsLog(out / "metrics.jsonl", accelerator, ["wandb"], {}, first_step=first_step,
                         wandb_id="lit0run0id")
        for step in steps:
            log.log(step, {"reward/mean": step / 4})
        log.close()
        time.sleep(1.1)  # wandb names an offline run's folder by its start to the second, and the run's id
    files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert run_ids(out) == ["lit0run0id"] * 2 and [f.name for f in files] == ["run-lit0run0id.wandb"] * 2
    assert [_history(f) for f in files] == [[{"step": 1, "train/reward/mean": 0.25},
                                             {"step": 2, "train/reward/mean": 0.5}],
                                            [{"step": 3, "train/reward/mean": 0.75}]]  # fmt: skip


def _wandb_history(path: Path) -> list[dict] | None:
    """The logged rows of an offline W&B run file, or None until its ``exit`` record is written. The file is a
    LevelDB-style log (a 7-byte file header, 32 KiB blocks of records each behind a crc32/length/type header, a
    record cut into FIRST..LAST pieces at a block's end) of ``Record`` protobufs; wandb ships no Python reader."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, pos, piece, rows = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4) and pos <= len(data):  # FULL or LAST, written to its end: the record is whole
            record = Record.FromString(piece)
            piece = b""
            if record.WhichOneof("record_type") == "exit":
                return rows
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return None


@pytest.mark.parametrize("mode, words", [
    (None, 'train.trackers = ["wandb"] logs to W&B online, which has no API key here (No API key configured. Use '
           "`wandb login` to log in.): run `wandb login` or set WANDB_API_KEY, or log offline with WANDB_MODE=offline "
           "(`wandb sync` uploads the run later)"),
    ("ofline", 'train.trackers = ["wandb"]: W&B cannot read its settings (1 validation error for Settings): set '
               "WANDB_MODE to online, offline or disabled")])  # fmt: skip
def test_wandb_without_an_account_stops_lit_train_before_vllm_starts(tmp_path, mode, words):
    """wandb.init used to stop the run with a traceback once the tracker started, after vLLM had."""
    pytest.importorskip("wandb")
    config = tmp_path / "c.toml"
    config.write_text('[agent]\nfunction = "rollout_agents:reply_length_parity"\n[data]\n'
                      'tasks = "rollout_agents:parity_tasks"\n[train]\ntrackers = ["wandb"]\n'
                      f'output_dir = "{tmp_path / "run"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),  # no key in ~/.netrc
            "PYTHONPATH": str(Path(__file__).parents[1]), **({"WANDB_MODE": mode} if mode else {})}
    done = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(config)], capture_output=True,
                          text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == f"lit: error: {words}", done.stderr[-3000:]
    assert "starting vLLM" not in done.stderr and not (tmp_path / "run" / "lit.sqlite").exists()
