"""Weight sync and the logprob consistency check: the shared-memory checkpoint, the order of the calls against a
local fake of vLLM's routes, the CPU-side wiring of the GPU path, the logprob math on a tiny model, and (marked
``vllm``) a real sync of perturbed weights into the session server."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import requests
import torch

from lit_trainer.engine.config import WeightSyncConfig
from lit_trainer.engine.logprob_check import Sample, check_logprobs, logprob_gap, sample_from_vllm, trainer_logprobs
from lit_trainer.engine.owned_folders import remove_abandoned
from lit_trainer.engine.server import InferenceServer
from lit_trainer.engine.weight_sync import (
    FOLDER_PREFIX,
    Adapters,
    ShmCheckpoint,
    WeightSync,
    WeightSyncError,
    separate_aliases,
    transfer_init_info,
)


def test_aliases_get_their_own_copy():
    embed = torch.randn(4, 3)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "norm.weight": torch.ones(3)}
    separate = separate_aliases(state)
    assert list(separate) == list(state)
    assert separate["norm.weight"].data_ptr() == state["norm.weight"].data_ptr()  # no alias: no copy
    assert separate["lm_head.weight"].data_ptr() != embed.data_ptr()
    torch.testing.assert_close(separate["lm_head.weight"], embed)
    halves = separate_aliases({"a": embed[:2], "b": embed[2:]})  # same storage, different slices: no copy
    assert halves["b"].data_ptr() == embed[2:].data_ptr()


def test_tied_checkpoint_is_written_with_both_names(tmp_path: Path):
    from safetensors.torch import load_file

    embed = torch.randn(4, 3)
    checkpoint = ShmCheckpoint(tmp_path / "w")
    checkpoint.write({"model.embed_tokens.weight": embed, "lm_head.weight": embed})
    embed.mul_(2)  # the trainer's step updates the shared tensor in place
    checkpoint.write({"model.embed_tokens.weight": embed, "lm_head.weight": embed})
    loaded = load_file(str(checkpoint.path))
    torch.testing.assert_close(loaded["lm_head.weight"], embed)
    torch.testing.assert_close(loaded["model.embed_tokens.weight"], embed)
    checkpoint.close()


def test_shm_checkpoint_updates_the_file_in_place(tmp_path: Path):
    from safetensors.torch import load_file

    checkpoint = ShmCheckpoint(tmp_path / "w")
    first = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64)}
    checkpoint.write(first)
    inode = checkpoint.path.stat().st_ino
    second = {"a": torch.randn(3, 4), "b": torch.arange(5, 10, dtype=torch.int64)}
    checkpoint.write(second)
    assert checkpoint.path.stat().st_ino == inode  # no new file: the mapped pages were overwritten
    loaded = load_file(str(checkpoint.path))
    torch.testing.assert_close(loaded["a"], second["a"])
    torch.testing.assert_close(loaded["b"], second["b"])
    checkpoint.write({"a": torch.zeros(2)})  # a new layout rewrites the file
    assert list(load_file(str(checkpoint.path))) == ["a"]
    checkpoint.close()


class _FakeVLLM(BaseHTTPRequestHandler):
    """Answers vLLM's weight-sync routes with 200 and records them; ``fail`` names a route that answers 500."""

    calls: ClassVar[list[tuple[str, dict]]] = []
    fail: ClassVar[str] = ""

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        route = self.path.split("?")[0]
        self.calls.append((self.path, json.loads(body) if body else {}))
        answer = {"success": True} if route == "/reset_prefix_cache" else {}
        self._send(500 if route == self.fail else 200, answer)

    def do_GET(self):
        self._send(200, {"world_size": 1} if self.path.startswith("/get_world_size") else {"weight_version": "7"})

    def _send(self, status: int, answer: dict):
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_vllm() -> Iterator[str]:
    _FakeVLLM.calls, _FakeVLLM.fail = [], ""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVLLM)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_sync_calls_the_routes_in_order(fake_vllm: str, tmp_path: Path):
    model = torch.nn.Linear(3, 2)
    with WeightSync(fake_vllm, WeightSyncConfig(shm_dir=str(tmp_path))) as sync:
        report = sync.push_weights(model)
        folder = sync.checkpoint.folder
        assert (folder / "model.safetensors").is_file()
    assert not folder.exists()  # close() frees the shared memory
    assert [path for path, _ in _FakeVLLM.calls] == [
        "/pause?mode=keep",
        "/collective_rpc",
        "/reset_prefix_cache?reset_running_requests=true",
        "/update_weight_version",
        "/resume",
    ]
    assert _FakeVLLM.calls[1][1] == {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
    assert _FakeVLLM.calls[3][1] == {"new_version": "1"}
    assert report.version == "1"
    assert list(report.seconds) == ["serialize", "pause", "reload", "reset_cache", "version", "resume"]


HOLDER = """
import sys, time
import torch
from lit_trainer.engine.config import WeightSyncConfig
from lit_trainer.engine.weight_sync import WeightSync
sync = WeightSync("http://127.0.0.1:9", WeightSyncConfig(shm_dir=sys.argv[1]))
sync.checkpoint.write({"w": torch.zeros(1000)})
print(sync.folder, flush=True)
time.sleep(600)
"""


def test_the_weights_a_killed_trainer_left_in_shared_memory_are_removed_by_the_next(tmp_path: Path):
    holders = [subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        dead, live = (Path(h.stdout.readline().strip()) for h in holders)
        holders[0].send_signal(signal.SIGKILL)  # close() never runs
        holders[0].wait()
        assert (dead / "full" / "model.safetensors").is_file()
        with WeightSync("http://127.0.0.1:9", WeightSyncConfig(shm_dir=str(tmp_path))) as sync:
            assert not dead.exists()  # its owner died: removed
            assert live.exists() and sync.folder.exists()  # a live trainer's, and our own, stay
            assert remove_abandoned(tmp_path, FOLDER_PREFIX) == 0  # a sweep passes over folders that are held
        assert not sync.folder.exists()
        holders[1].send_signal(signal.SIGKILL)
        holders[1].wait()
        assert remove_abandoned(tmp_path, FOLDER_PREFIX) > 4000 and not live.exists()  # 1000 float32 and the header
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def test_failed_reload_still_resumes_the_server(fake_vllm: str, tmp_path: Path):
    _FakeVLLM.fail = "/collective_rpc"
    sync = WeightSync(fake_vllm, WeightSyncConfig(shm_dir=str(tmp_path)))
    with sync, pytest.raises(WeightSyncError, match="HTTP 500"):
        sync.push_weights({"w": torch.ones(2)})
    assert [path for path, _ in _FakeVLLM.calls][-1] == "/resume"


def test_lora_push_hot_loads_the_adapter_in_place(fake_vllm: str, tmp_path: Path):
    config = WeightSyncConfig(mode="lora", shm_dir=str(tmp_path), lora_name="policy-lora")
    with WeightSync(fake_vllm, config) as sync:
        with pytest.raises(WeightSyncError, match="push_lora"):
            sync.push_weights({"w": torch.ones(2)})
        sync.push_lora(tmp_path / "adapter", version="step-3")
    body = dict(_FakeVLLM.calls)["/v1/load_lora_adapter"]
    assert body == {"lora_name": "policy-lora", "lora_path": str(tmp_path / "adapter"), "load_inplace": True}
    assert dict(_FakeVLLM.calls)["/update_weight_version"] == {"new_version": "step-3"}


def test_a_roles_adapters_are_written_and_loaded_in_place_in_one_paused_round(fake_vllm: str, tmp_path: Path):
    from safetensors.torch import load_file

    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
    adapters = Adapters({"policy-writer": (config, {"a.lora_A.weight": torch.ones(4, 2)}),
                         "policy-rewriter": (config, {"a.lora_A.weight": torch.zeros(4, 2)})})
    with WeightSync(fake_vllm, WeightSyncConfig(shm_dir=str(tmp_path))) as sync:
        report = sync.push_adapters(adapters, version="5")
        loads = [body for path, body in _FakeVLLM.calls if path == "/v1/load_lora_adapter"]
        assert [(b["lora_name"], b["load_inplace"]) for b in loads] == [("policy-writer", True),
                                                                       ("policy-rewriter", True)]
        for body, value in zip(loads, (1.0, 0.0), strict=True):  # what vLLM reads: peft's two files
            folder = Path(body["lora_path"])
            assert json.loads((folder / "adapter_config.json").read_text()) == config
            assert torch.equal(load_file(str(folder / "adapter_model.safetensors"))["a.lora_A.weight"],
                               torch.full((4, 2), value))
    routes = [path.split("?")[0] for path, _ in _FakeVLLM.calls]
    assert routes == ["/pause", "/v1/load_lora_adapter", "/v1/load_lora_adapter", "/reset_prefix_cache",
                      "/update_weight_version", "/resume"]
    assert report.version == "5" and dict(_FakeVLLM.calls)["/update_weight_version"] == {"new_version": "5"}


def test_nccl_group_holds_the_trainer_and_every_vllm_worker(vllm_modules):
    info = transfer_init_info(WeightSyncConfig(transport="nccl", nccl_master_port=29600), inference_world_size=4)
    assert (info.world_size, info.rank, info.master_port, info.is_sender) == (5, 0, 29600, True)


def test_gpu_transport_wiring(vllm_modules, fake_vllm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The CPU-testable part of the GPU path: lit asks vLLM's world size, hands vLLM's trainer factory the init
    info, an HTTP client for this server and a source of the latest pushed weights (a state dict, as ``Fleet``
    pushes, or a model's parameters), then runs each sync's transfer between pause and resume.
    vLLM's engines themselves need CUDA (they touch the device when built), so the factory is stubbed here."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    opened: dict = {}

    class Engine:
        def send_weights(self):
            _FakeVLLM.calls.append(("<nccl broadcast>", {}))

        def shutdown(self):
            opened["shutdown"] = True

    def trainer_init(init_info, *, client, source):
        opened.update(init_info=init_info, url=client.base_url, names=[m.name for m in source.metadata()],
                      source=source)
        return Engine()

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", trainer_init)
    with WeightSync(fake_vllm, WeightSyncConfig(transport="nccl", shm_dir=str(tmp_path))) as sync:
        first = {"w": torch.ones(2), "b": torch.zeros(1, dtype=torch.bfloat16)}  # a state dict, as Fleet pushes
        sync.push_weights(first)
        assert [(n, t.dtype) for n, t in opened["source"]] == [("w", torch.float32), ("b", torch.bfloat16)]
        _FakeVLLM.calls.clear()
        report = sync.push_weights({"w": torch.full((2,), 2.0), "b": torch.ones(1, dtype=torch.bfloat16)})
        # the engine, opened once, sends each round what the latest push gave
        assert [t.tolist() for _, t in opened["source"]] == [[2.0, 2.0], [1.0]]
        sync.push_weights(torch.nn.Linear(2, 2))  # a model: its parameters
        assert [n for n, _ in opened["source"]] == ["weight", "bias"]
    assert (opened["init_info"].world_size, opened["url"], opened["names"]) == (2, fake_vllm, ["w", "b"])
    assert opened["shutdown"]
    assert [path.split("?")[0] for path, _ in _FakeVLLM.calls] == [
        "/pause",
        "<nccl broadcast>",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/resume",
    ] * 2
    assert list(report.seconds) == ["pause", "transfer", "reset_cache", "version", "resume"]


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_trainer_logprobs_match_a_token_by_token_reference():
    model = _tiny_llama()
    prompt, response = [3, 7, 1], [4, 9, 2, 2]
    got = trainer_logprobs(model, prompt, response)
    expected = []
    for j, token in enumerate(response):  # naive: one forward per response token, on its prefix only
        prefix = torch.tensor([prompt + response[:j]])
        with torch.no_grad():
            expected.append(torch.log_softmax(model(input_ids=prefix).logits[0, -1], -1)[token])
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_logprob_gap_is_max_and_mean_over_all_tokens():
    samples = [Sample([1], [5, 6], [-1.0, -2.0]), Sample([2], [7], [-0.5])]
    trainer = [torch.tensor([-1.0, -2.5]), torch.tensor([-0.25])]
    gap = logprob_gap(samples, trainer, tolerance=0.3)
    assert (gap.max_abs, gap.mean_abs, gap.n_tokens) == (0.5, 0.25, 3)
    assert not gap.ok
    assert logprob_gap(samples, trainer, tolerance=0.5).ok


@pytest.mark.vllm
@pytest.mark.slow
def test_synced_weights_change_outputs_and_pass_the_consistency_check(
    vllm_server: InferenceServer, trainer_model, check_prompts: list[list[int]]
):
    url, name, tolerance = vllm_server.base_url, vllm_server.model_name, WeightSyncConfig().logprob_tolerance
    key = vllm_server.api_key
    before = check_logprobs(url, name, trainer_model, check_prompts, tolerance, api_key=key)
    assert before.ok, before
    old_samples = sample_from_vllm(url, name, check_prompts, api_key=key)
    perturbed = copy.deepcopy(trainer_model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # noise on every weight, the tied embedding included (it is also the output head)
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05 * param.std())
    with WeightSync(url, WeightSyncConfig(), credentials=vllm_server.credentials) as sync:
        try:
            report = sync.push_weights(perturbed, version="perturbed")
            assert sync.weight_version() == "perturbed" == report.version
            new_samples = sample_from_vllm(url, name, check_prompts, api_key=key)
            assert [s.response_ids for s in new_samples] != [s.response_ids for s in old_samples]
            after = check_logprobs(url, name, perturbed, check_prompts, tolerance, api_key=key)
            assert after.ok, after
            stale = check_logprobs(url, name, trainer_model, check_prompts, tolerance, api_key=key)
            assert not stale.ok, f"the old weights still match the server after the sync: {stale}"
        finally:
            sync.push_weights(trainer_model, version="original")
    assert check_logprobs(url, name, trainer_model, check_prompts, tolerance, api_key=key).ok


@pytest.mark.vllm
def test_request_in_flight_during_a_sync_is_kept(vllm_server: InferenceServer, trainer_model):
    """A streamed request that began before a sync and ends after it completes in full.

    The overlap is proven from the stream's own timestamps (a chunk before the sync began, the last one after it
    ended), not from a fixed sleep: 400 tokens take 15-40 s on these CPUs (one stream at 10-26 tokens/s), a sync of
    the 135M model that updates the shared-memory file in place about one second (a first push, which writes it,
    took 16 s once in CI, longer than the request).
    """
    max_tokens = 400
    body = {"model": vllm_server.model_name, "prompt": "Tell me a story.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunk_times: list[float] = []
    events: list[dict] = []
    first_chunk = threading.Event()

    def read_stream() -> None:
        with requests.post(f"{vllm_server.openai_url}/completions", json=body, stream=True, timeout=600) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                events.append(json.loads(line[len(b"data: ") :]))
                chunk_times.append(time.monotonic())
                first_chunk.set()

    thread = threading.Thread(target=read_stream)
    with WeightSync(vllm_server.base_url, WeightSyncConfig(), credentials=vllm_server.credentials) as sync:
        # The first push writes the shared-memory file (seconds on a loaded 2-core machine, and the request could
        # end meanwhile, before the pause); the one under test updates it in place.
        sync.push_weights(trainer_model)
        thread.start()
        assert first_chunk.wait(timeout=120), "the server sent no token within 120 s"
        sync_began = time.monotonic()
        sync.push_weights(trainer_model)
        sync_ended = time.monotonic()
    thread.join(timeout=600)
    assert not thread.is_alive(), "the streamed request did not finish"
    assert chunk_times[0] < sync_began and chunk_times[-1] > sync_ended, "the request did not span the sync"
    finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert finish == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == max_tokens


@pytest.mark.vllm
def test_completions_carry_the_weight_version_they_arrived_under(vllm_server: InferenceServer, trainer_model):
    """The route guard adds the server's weight version to every completion's JSON answer: the one the server
    started with ("0"; the last sync's when an earlier test synced), then the version a sync tags. Streamed
    answers are left as vLLM sends them. The weights pushed are the ones the server started with."""
    headers = {"Authorization": f"Bearer {vllm_server.api_key}"} if vllm_server.api_key else {}
    chat = {"model": vllm_server.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    text = {"model": vllm_server.model_name, "prompt": "Hi", "max_tokens": 2}

    def versions() -> list[str]:
        answers = [requests.post(f"{vllm_server.openai_url}/{route}", json=body, headers=headers, timeout=120)
                   for route, body in (("chat/completions", chat), ("completions", text))]
        for answer in answers:
            answer.raise_for_status()
        return [answer.json()["lit_weight_version"] for answer in answers]

    with WeightSync(vllm_server.base_url, WeightSyncConfig(), credentials=vllm_server.credentials) as sync:
        engine = sync.weight_version()
        assert versions() == ["0" if engine == "default" else engine] * 2
        sync.push_weights(trainer_model, version="7")
        assert sync.weight_version() == "7"
        assert versions() == ["7", "7"]
    streamed = requests.post(f"{vllm_server.openai_url}/chat/completions", json={**chat, "stream": True},
                             headers=headers, timeout=120)
    streamed.raise_for_status()
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "lit_weight_version" not in streamed.text
    assert all(json.loads(line[len("data: "):])["object"] == "chat.completion.chunk" for line in events[:-1])
