"""Building a model sharded (learner/sharded_load.py): the safetensors files read one tensor at a time give what
safetensors itself reads, one file or several with an index, and a model with tied embeddings (as SmolLM2's) built
sharded in a one-process group holds exactly the file's weights, its head still the embeddings. The sharded update
on a model built so: test_distributed.py (2 processes, the same steps as 1) and one_rank_shard.py."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lit_trainer.learner import sharding
from lit_trainer.learner.sharded_load import load_sharded, read_tensors


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama with tied embeddings, saved as one file and as several with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=True))
    one, several = tmp_path_factory.mktemp("one-file"), tmp_path_factory.mktemp("several-files")
    model.save_pretrained(one)
    model.save_pretrained(several, max_shard_size="40KB")
    return one, several


def test_the_files_are_read_tensor_by_tensor_as_safetensors_reads_them(tied_model: tuple[Path, Path]):
    one, several = tied_model
    assert len(list(several.glob("*.safetensors"))) > 1 and (several / "model.safetensors.index.json").is_file()
    expected = load_file(one / "model.safetensors")
    for folder in (one, several):
        read = dict(read_tensors(folder))
        assert read.keys() == expected.keys() and "lm_head.weight" not in read  # tied: the file has no head
        assert all(read[k].dtype == v.dtype and torch.equal(read[k], v) for k, v in expected.items())


def test_a_tied_model_built_sharded_holds_the_files_weights(tied_model: tuple[Path, Path]):
    from transformers import AutoModelForCausalLM

    folder = tied_model[1]
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    dist = torch.distributed
    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1)
        try:
            model = load_sharded(folder, torch.bfloat16, torch.device("cpu"))
            assert sum(sharding.is_sharded(p) for p in model.parameters()) == 3 * 9  # every layer's weights
            assert model.lm_head.weight is model.get_input_embeddings().weight
            gathered = sharding.full_state_dict(model, dtype=torch.bfloat16, device="cpu")
            for name, tensor in whole.state_dict().items():
                assert torch.equal(gathered[name], tensor.to(torch.bfloat16)), name
        finally:
            dist.destroy_process_group()


def test_a_folder_missing_weights_is_named(tied_model: tuple[Path, Path], tmp_path: Path):
    from safetensors.torch import save_file

    one = tied_model[0]
    for name in ("config.json", "generation_config.json"):
        if (one / name).exists():
            (tmp_path / name).write_bytes((one / name).read_bytes())
    weights = load_file(one / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.2." not in k}, str(tmp_path / "model.safetensors"))
    dist = torch.distributed
    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1)
        try:
            with pytest.raises(ValueError, match=r"lack 9 of the model's weights, e.g. \['model.layers.2"):
                load_sharded(tmp_path, torch.float32, torch.device("cpu"))
        finally:
            dist.destroy_process_group()
