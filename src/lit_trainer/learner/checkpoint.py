"""Checkpoints: the model in Hugging Face format (loadable by transformers and vLLM as is) plus what ``--resume``
needs to continue exactly: the optimizer state, the step, the RNG states and the data position.

    <output_dir>/checkpoints/step-000012/
        model/               config.json, model.safetensors, tokenizer files
        adapter/             LoRA only: adapter_config.json, adapter_model.safetensors (peft's format)
        adapters/<name>/     a [roles] table's adapters instead, one folder each (peft's format); model/ then
                             holds the base model's config and tokenizer only: vLLM serves the base model with
                             these adapters
        optimizer/           the AdamW moments and step counts by parameter name (torch.distributed.checkpoint:
                             .metadata, *.distcp); the learning rate and the like come from the config
        trainer_state.pt     the training state (``TrainState``) and the RNG states
        DONE                 written last: a folder without it is an interrupted save and is ignored

With LoRA (``policy.lora_rank > 0``) ``model/`` is the full model with the adapter merged in, so ``lit eval
--checkpoint``, vLLM and transformers load it as a plain model, like a full fine-tune's; ``--resume`` instead
rebuilds the policy from the base model and loads ``adapter/`` on top (the optimizer state is the adapter's).

Sharded policies (``policy.shard``, learner/sharding.py): every process calls ``save`` and ``restore``. ``model/``
is the whole model, gathered layer by layer into the main process, which alone writes it; each process writes its
own shard of the optimizer state into ``optimizer/``. Because ``optimizer/`` names parameters, not positions, and
records each tensor's full shape, a checkpoint resumes on any number of processes, sharded or not: 2 sharded
processes can be continued by 1, and the reverse.

A checkpoint is written into a temporary folder and renamed into place, so a kill mid-save leaves the previous
checkpoint as the latest. Room on the disk: ``lit train`` checks before vLLM starts that one checkpoint fits
(``check_room``: the model in float32 plus AdamW's state, 1.6 GB for SmolLM2-135M) and warns when all it will keep
at once may not; a save that still runs out of room removes its unfinished folder and stops the run with
``NoRoomForCheckpoint``, the latest complete checkpoint and the store untouched.
"""

from __future__ import annotations

import contextlib
import errno
import json
import random
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lit_trainer.learner import lora
from lit_trainer.learner.memory import GB
from lit_trainer.learner.policy import Policy
from lit_trainer.models import folders as models
from lit_trainer.results.runs import Checkpoint, RunFolder

TOKENIZER_FILES = (*models.TOKENIZER_FILES, "tokenizer_config.json", "special_tokens_map.json", "merges.txt",
                   "added_tokens.json", "generation_config.json", "chat_template.jinja")
"""What a checkpoint's model folder takes from the base model beside the weights: the tokenizer (in any of the forms
``models.check_model_folder`` accepts, a sentencepiece one too), its settings, the chat template."""


@dataclass(frozen=True)
class TrainState:
    """Where a run stands, beside the weights and the optimizer: what a checkpoint saves and ``--resume`` reads."""

    step: int = 0
    """Steps trained. Also the data position: step s draws the tasks of (``train.seed``, s), so the same ones again
    after a resume."""
    minutes: float = 0.0
    """Minutes the steps took, which ``train.max_minutes`` counts."""
    weight_version: str = "0"
    """The version of the weights in vLLM (the step that trained them); a resumed run pushes its weights under it."""
    curriculum: dict[str, Any] | None = None
    """What rested when the checkpoint was written (``rollouts/curriculum.py``); None without a curriculum."""
    phase: str = "rl"
    """Which phase the last step was: ``sft`` (a step on demonstrations, ``[sft]``) or ``rl``."""


def save(output_dir: str | Path, policy: Policy, base_model_dir: Path, state: TrainState,
         keep: int = 2) -> Checkpoint:
    """Write the checkpoint of ``state.step`` atomically and delete all but the newest ``keep``. Called by the main
    process, or by every process when the policy is sharded (the weights and the optimizer state are gathered and
    written collectively); only the main process writes the model and renames the folder into place."""
    run, step = RunFolder(output_dir), state.step
    checkpoint = run.checkpoint(step)
    staging = Checkpoint(checkpoint.path.with_name(f".tmp-{checkpoint.path.name}"), step)
    main = policy.accelerator.is_main_process
    try:
        _write(staging, policy, base_model_dir, state, main)
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if main:  # an unfinished folder is of no use and may hold GBs
            shutil.rmtree(staging.path, ignore_errors=True)
        size = size_estimate(policy.memory.parameters, policy.memory.trained)
        reason = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else _room_error(exc, run.dir, size)
        if reason is not None:
            latest = run.latest_checkpoint()
            kept = f"The latest complete checkpoint (step {latest.step}) and" if latest else "No checkpoint was " \
                "complete yet, but"
            raise NoRoomForCheckpoint(
                f"the checkpoint of step {step} did not fit on the disk of {run.dir} "
                f"({reason}; {_amount(shutil.disk_usage(run.dir).free)} free there "
                f"now that the unfinished one is removed, and a checkpoint of this policy takes about "
                f"{_amount(size)}). {kept} the store of every rollout are intact. Make room (or lower "
                "train.keep_checkpoints, or move train.output_dir to a larger disk), then continue the run with "
                "`lit train CONFIG --resume`") from exc
        raise
    if not main:
        return checkpoint
    shutil.rmtree(checkpoint.path, ignore_errors=True)
    staging.path.rename(checkpoint.path)
    complete = run.checkpoints()
    for old in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(old.path, ignore_errors=True)
    return checkpoint


def _write(staging: Checkpoint, policy: Policy, base_model_dir: Path, state: TrainState, main: bool) -> None:
    """Everything of the checkpoint into ``staging``, ``DONE`` last (the main process's part, or another's)."""
    if main:  # before the first collective below: the other processes write into it only after that
        shutil.rmtree(staging.path, ignore_errors=True)
        staging.model_dir.mkdir(parents=True)
    if policy.adapters:  # peft writes each adapter but "default" into a folder of its name
        policy.unwrapped().save_pretrained(str(staging.adapters_path), selected_adapters=list(policy.adapter_names),
                                           safe_serialization=True)
    elif policy.config.lora_rank:
        lora.save_merged(policy.unwrapped(), staging.model_dir)
        lora.save_adapter(policy.unwrapped(), staging.adapter_path)
    else:
        weights = policy.state_dict()  # sharded: gathered into the main process (a collective), {} elsewhere
        if main:
            policy.unwrapped().save_pretrained(staging.model_dir, state_dict=weights, safe_serialization=True)
    # Every process that holds a part of the optimizer state writes it; unsharded, the main process holds it whole.
    # Its hyperparameters (param_groups) come from the config: sharded and whole tensors sit in groups of their own.
    with _one_process_is_meant():
        dcp.save({"optimizer": get_optimizer_state_dict(policy.model, policy.optimizer)["state"]},
                 checkpoint_id=staging.optimizer_dir, no_dist=not policy.sharded)
    if not main:
        return
    for name in (*TOKENIZER_FILES, "config.json") if policy.adapters else TOKENIZER_FILES:  # the base it is on
        if (base_model_dir / name).exists():
            shutil.copy2(base_model_dir / name, staging.model_dir / name)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save({**asdict(state), "rng": rng}, staging.state_file)
    staging.done_file.write_text(f"step {state.step}\n")  # last: the folder is complete


class NoRoomForCheckpoint(RuntimeError):
    """A checkpoint does not fit on the disk of the run's folder; the message says how much and what to do."""


ROOM_ERRORS = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
               errno.EFBIG: "File too large"}
"""The errors of a write that ran out of room (the disk, the user's quota, a file size limit), with the text that
stands for them where a library reports them only in words (safetensors: "File too large (os error 27)")."""


def size_estimate(parameters: int, trained: int) -> int:
    """About the bytes of one checkpoint of a policy of ``parameters`` with ``trained`` of them trained: the whole
    model in float32 (LoRA: merged) and AdamW's two float32 moments per trained parameter; the tokenizer, the
    adapter and the trainer state are small beside them."""
    return parameters * 4 + trained * 8


def saves_left(step: int, steps: int, every: int) -> int:
    """How many checkpoints a run at ``step`` of ``steps`` still writes: one every ``every`` steps (0: none) and one
    at its last step."""
    if step >= steps:
        return 0
    periodic = sum(1 for s in range(step + 1, steps + 1) if every and s % every == 0)
    last_is_periodic = every > 0 and steps % every == 0
    return periodic + (0 if last_is_periodic else 1)


def room_needed(size: int, keep: int, existing: int, saves: int) -> int:
    """The bytes a run's checkpoints will take on top of what its ``existing`` ones take now, when it writes
    ``saves`` more of ``size`` bytes each and keeps the newest ``keep`` (0: all). A save writes the new checkpoint
    before it deletes the oldest, so ``keep`` of them plus the one being written are on the disk at the peak."""
    if saves <= 0:
        return 0
    peak = existing + saves if keep <= 0 else min(keep, existing + saves - 1) + 1
    return max(size, (peak - existing) * size)


def check_room(run: RunFolder, size: int, keep: int, saves: int) -> str | None:
    """Before a run starts vLLM: ``NoRoomForCheckpoint`` when not even one checkpoint of ``size`` bytes fits on
    the disk of its folder; a warning (text) when the most it will hold at once (``room_needed``) may not."""
    if saves <= 0:
        return None
    free = shutil.disk_usage(run.dir).free
    if free < size:
        raise NoRoomForCheckpoint(
            f"{run.dir} is on a disk with {_amount(free)} free, and one checkpoint of this policy takes about "
            f"{_amount(size)} (the model in float32 and the optimizer state): make room there, or choose a "
            "train.output_dir on a larger disk")
    need = room_needed(size, keep, len(run.checkpoints()), saves)
    if free >= need:
        return None
    kept = f"keeps the newest {keep} (train.keep_checkpoints) and writes each new one before it deletes the " \
        "oldest" if keep > 0 else "keeps all of them (train.keep_checkpoints = 0)"
    return (f"this run writes {saves} more checkpoint{'s' if saves > 1 else ''} of about {_amount(size)} and "
            f"{kept}: up to {_amount(need)} more, and the disk of {run.dir} has {_amount(free)} free. If it "
            "runs out, the run stops with an error and its latest complete checkpoint stays; lower "
            "train.keep_checkpoints or make room to avoid that")


def _amount(size: int) -> str:
    """Bytes in words: GB from 0.1 GB up, MB below."""
    return f"{size / GB:.2f} GB" if size >= GB / 10 else f"{size / 1e6:.1f} MB"


def _failures(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes and contexts, and the per-process failures torch.distributed.checkpoint gathers."""
    seen: list[BaseException] = []
    todo: list[object] = [exc]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or any(item is s for s in seen):
            continue
        seen.append(item)
        todo += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)  # CheckpointException's: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return seen


def _room_error(exc: BaseException, folder: Path, size: int) -> str | None:
    """Why a failed save ran out of room, in words; None if it did not: an error of ``ROOM_ERRORS`` (as an errno
    or in the words libraries use), or less than a checkpoint's ``size`` free (torch's own writer reports a full
    disk only as "unexpected pos")."""
    reason = _reason(exc)
    if reason is not None:
        return reason
    with contextlib.suppress(OSError):
        if shutil.disk_usage(folder).free < size:
            return "the disk is full"
    return None


def _reason(exc: BaseException) -> str | None:
    """The words of the first room error among ``exc``'s failures; None if there is none."""
    for item in _failures(exc):
        if isinstance(item, OSError) and item.errno in ROOM_ERRORS:
            return ROOM_ERRORS[item.errno]
        for words in ROOM_ERRORS.values():
            if words.lower() in str(item).lower():
                return words
    return None


ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size")
"""What a model's config.json says of its shape: a checkpoint resumes only onto a model that says the same."""


def other_model(checkpoint: Checkpoint, model_dir: Path) -> str | None:
    """Why ``checkpoint`` cannot go on from the model in ``model_dir`` (the run's ``model``, which vLLM serves and a
    LoRA adapter sits on), in words naming the fix; None when the two have one shape (``ARCHITECTURE_KEYS``).
    Without this, a config whose ``model`` was changed between a run and its ``--resume`` failed once vLLM had
    started, at the first weight push or the adapter's load."""
    def shape(folder: Path) -> dict[str, Any]:
        config = json.loads((folder / "config.json").read_text())
        return {key: models.config_field(config, key) for key in ARCHITECTURE_KEYS}

    trained, given = shape(checkpoint.model_dir), shape(model_dir)
    # a key one config leaves out is not compared: save_pretrained writes the defaults a hand-written config omits
    differ = [f"{key} {trained[key]} there, {given[key]} here" for key in ARCHITECTURE_KEYS
              if None not in (trained[key], given[key]) and trained[key] != given[key]]
    if not differ:
        return None
    return (f"{checkpoint.path} was trained from another model than model = '{model_dir}' ({'; '.join(differ)}): "
            "resume with the model the run started from, or choose another train.output_dir for this one")


def saved_state(checkpoint: Checkpoint) -> TrainState:
    """The training state ``checkpoint`` holds, without loading its weights (``lit eval`` names its phase)."""
    return _train_state(_read_state(checkpoint))


def _read_state(checkpoint: Checkpoint) -> dict[str, Any]:
    """The training state file's contents: the ``TrainState`` fields and the RNG states."""
    # onto the CPU: under several GPU processes each would otherwise load it onto the device that saved it
    return torch.load(checkpoint.state_file, weights_only=False, map_location="cpu")


def _train_state(saved: dict[str, Any]) -> TrainState:
    """The ``TrainState`` of a state file's contents (a field an older lit did not write keeps its default)."""
    return TrainState(**{f.name: saved[f.name] for f in fields(TrainState) if f.name in saved})


def restore(checkpoint: Checkpoint, policy: Policy) -> TrainState:
    """Load the training state into ``policy`` and the RNG states; the saved ``TrainState``.

    The caller builds the policy first, with the run's ``PolicyConfig``:
    - full fine-tune: ``PolicyConfig.model = checkpoint.model_dir`` (the weights are loaded there);
    - LoRA (``lora_rank > 0``): ``PolicyConfig.model`` = the run's original base model, NOT ``checkpoint.model_dir``
      (which has the adapter merged in already); this loads the adapter from ``checkpoint.adapter_dir`` into it.
    Then the optimizer state (the adapter's, with LoRA), whatever the number of processes that wrote it and that
    read it (every process calls this). A LoRA checkpoint into a full policy, or the reverse, raises ValueError."""
    _check_kind(checkpoint, policy)
    if checkpoint.adapter_dir is not None:
        lora.load_adapter(policy.unwrapped(), checkpoint.adapter_dir)
    saved_adapters = checkpoint.adapter_folders()
    if set(saved_adapters) != set(policy.adapter_names):
        raise ValueError(f"{checkpoint.path} holds the adapters {sorted(saved_adapters) or 'of no role'} but the "
                         f"[roles] table trains {sorted(policy.adapter_names) or 'none'}: resume with the run's "
                         "[roles] table")
    for name, folder in saved_adapters.items():
        lora.load_adapter(policy.unwrapped(), folder, adapter=name)
    saved = _read_state(checkpoint)
    _load_optimizer(checkpoint.optimizer_dir, policy)
    random.setstate(saved["rng"]["python"])
    np.random.set_state(saved["rng"]["numpy"])
    torch.set_rng_state(saved["rng"]["torch"])
    return _train_state(saved)


def _load_optimizer(folder: Path, policy: Policy) -> None:
    """The optimizer state in ``folder`` into ``policy``'s optimizer: each process reads the part it holds (its
    shard, or the whole of each tensor), matched by parameter name."""
    # the optimizer's own state as the template of what to read (an empty one is first made by a zero step)
    own = get_optimizer_state_dict(policy.model, policy.optimizer)
    # a parameter that never had a gradient (the adapter of a role that has not called yet) has no saved state:
    # it starts fresh, as it would have had the run gone on
    saved = {key.split(".", 1)[1].rsplit(".", 1)[0]
             for key in dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata}
    into = {"optimizer": {name: state for name, state in own["state"].items() if name in saved}}
    with _one_process_is_meant():
        dcp.load(into, checkpoint_id=folder, no_dist=not policy.sharded)
    fresh = len(into["optimizer"]) < len(own["state"])
    set_optimizer_state_dict(policy.model, policy.optimizer, {"state": into["optimizer"],
                                                              "param_groups": own["param_groups"]},
                             options=StateDictOptions(strict=not fresh))


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """Without torch.distributed, torch.distributed.checkpoint warns at every save and load that it assumes one
    process: lit means it (``no_dist``), so the console stays quiet."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _check_kind(checkpoint: Checkpoint, policy: Policy) -> None:
    rank = policy.config.lora_rank
    if policy.adapters:
        return  # restore compares the adapters by name
    if rank and checkpoint.adapter_dir is None:
        raise ValueError(f"{checkpoint.path} is a full fine-tune's checkpoint (no adapter/) but policy.lora_rank = "
                         f"{rank}: resume it with policy.lora_rank = 0")
    if not rank and checkpoint.adapter_dir is not None:
        raise ValueError(f"{checkpoint.path} is a LoRA run's checkpoint (it holds adapter/) but policy.lora_rank = 0: "
                         "resume it with the run's policy.lora_rank, from the base model")
    if rank:
        base = policy.unwrapped().peft_config["default"].base_model_name_or_path
        if base and Path(base).resolve() == checkpoint.model_dir.resolve():
            raise ValueError(f"the LoRA policy was built from {checkpoint.model_dir}, which has the adapter merged "
                             "in: build it from the run's base model, restore() loads the adapter on top")
