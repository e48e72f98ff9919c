"""FSDP2's layer sharding (learner/sharding.py) in a one-process group, the model built sharded as the policy
builds it (learner/sharded_load.py), against the same model whole: the same buffers, logits, gradients, clipped
norm and gathered weights. With one GPU this is the most of the sharded path that can run
on CUDA: NCCL refuses two processes on one device, and lit's own ``policy.shard`` changes nothing in one process.
test_cuda.py runs it on the GPU over NCCL, test_distributed.py here on the CPU over gloo."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.testing import assert_close

from lit_trainer.learner import sharded_load, sharding


def check(model_dir: Path, device: str, backend: str, compile_: bool = False) -> None:
    """``compile_``: the sharded model's layers compiled too (``policy.compile`` with ``policy.shard``), after the
    sharding, as the policy does."""
    from transformers import AutoModelForCausalLM

    from lit_trainer.learner import compiling

    dist = torch.distributed
    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group(backend, init_method=f"file://{rendezvous}/store", rank=0, world_size=1,
                                device_id=torch.device(device) if device != "cpu" else None)
        try:
            whole = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
            # built sharded on the meta device, each tensor read from the file as it is loaded (sharded_load)
            sharded = sharded_load.load_sharded(model_dir, torch.float32, torch.device(device))
            assert len(sharding.decoder_layers(sharded)) == len(sharding.decoder_layers(whole)) > 0
            assert [name for name, _ in sharded.named_buffers()] == [name for name, _ in whole.named_buffers()]
            for (name, buffer), (_, expected) in zip(sharded.named_buffers(), whole.named_buffers(), strict=True):
                assert torch.equal(buffer.cpu(), expected), name  # the rotary frequencies, computed, not read
            if whole.config.tie_word_embeddings:
                assert sharded.lm_head.weight is sharded.get_input_embeddings().weight
            if compile_:  # the sharded layers are still found as the model's layers (FSDP2 subclasses them)
                assert compiling.compile_decoder(sharded) == len(compiling.decoder_modules(whole))
            whole.to(device)
            sharded.to(device)  # the embeddings and head: whole, like the layers' shards already there
            assert any(sharding.is_sharded(p) for p in sharded.parameters())
            ids = torch.randint(0, whole.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
            ids = ids.to(device)
            losses = []
            for model in (whole, sharded):
                for length in (13, 16):  # two lengths: the compiled graph is shape-generic (dynamic=True)
                    model.zero_grad(set_to_none=True)
                    out = model(input_ids=ids[:, :length], labels=ids[:, :length])
                    out.loss.backward()
                losses.append(out.logits)
            assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
            norm_whole = torch.nn.utils.clip_grad_norm_(list(whole.parameters()), 0.5)
            norm_sharded = sharding.clip(list(sharded.parameters()), 0.5)
            assert_close(torch.tensor(norm_sharded), norm_whole.cpu(), rtol=1e-4, atol=0)
            grads = dict(whole.named_parameters())
            for name, p in sharded.named_parameters():
                g = p.grad.full_tensor() if sharding.is_sharded(p.grad) else p.grad
                assert_close(g, grads[name].grad, rtol=1e-4, atol=1e-6)
            if compile_:
                assert all(m._compiled_call_impl is not None for m in compiling.decoder_modules(sharded))
            gathered = sharding.full_state_dict(sharded, dtype=torch.bfloat16, device="cpu")
            for name, t in whole.state_dict().items():
                assert gathered[name].device.type == "cpu" and gathered[name].dtype == torch.bfloat16
                assert torch.equal(gathered[name], t.cpu().to(torch.bfloat16)), name
        finally:
            dist.destroy_process_group()
