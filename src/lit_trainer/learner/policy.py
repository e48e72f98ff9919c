"""The policy being trained: any Hugging Face causal LM (the prepared SmolLM2 by default), its per-token logprobs,
and the optimizer step under accelerate (gradient accumulation over micro-batches, optional gradient checkpointing,
optional LoRA through peft), in float32 or bf16 autocast (``precision``: learner/precision.py).

Device placement happens here and only here: the learner computes where its weights are (``device``), and every
micro-batch goes there (``place``) before the logprobs, the loss or the reference touch it, whatever device the
batching made it on (the CPU).

``update`` takes the loss as a function, so the objective lives in ``algorithm/`` as pure tensor math and this
module holds only state: the model, the optimizer, the accelerator. It also reports how far its own logprobs are
from the behaviour logprobs vLLM returned for the same tokens (``policy/vllm_logprob_gap``): with the same weights
in both they agree closely in fp32 (bench/README.md), so a large gap means the weight sync or the token ids are
wrong.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lit_trainer.learner import compiling, distributed, logprobs, lora, memory, precision, sharded_load, sharding
from lit_trainer.learner.batching import MicroBatch
from lit_trainer.learner.schedule import LR_SCHEDULES
from lit_trainer.models.folders import check_model_folder, resolve_model
from lit_trainer.settings import at_least, between, check, one_of, positive

log = logging.getLogger("lit")

LossFn = Callable[[torch.Tensor, MicroBatch, torch.Tensor | None, torch.Tensor | None],
                  tuple[torch.Tensor, dict[str, float]]]
"""``loss_fn(logprobs (B, T), batch, entropy (B, T) | None, ref_logprobs (B, T) | None) -> (loss, metrics)`` for one
micro-batch (``ref_logprobs``: the reference policy's, when the policy has one). The loss is
the micro-batch's term of the step's loss (normalised by the whole step, e.g. ``policy_loss(normalizer=
step_normalizer(...))``): the terms of all micro-batches add up to the step's loss, whatever the micro-batching."""


@dataclass(frozen=True)
class PolicyConfig:
    SECTION = "policy"
    RULES = {"learning_rate": positive(), "lr_schedule": one_of(LR_SCHEDULES), "warmup_steps": at_least(0),
             "min_lr_ratio": between(0, 1), "weight_decay": at_least(0),
             "max_grad_norm": at_least(0, "(0 disables clipping)"), "precision": one_of(precision.PRECISIONS),
             "lora_rank": at_least(0, "(0: full fine-tune)")}

    model: str = "smollm2-135m"
    """A Hugging Face causal-LM folder, or ``smollm2-135m`` for the prepared default."""
    learning_rate: float = 1e-6
    """AdamW learning rate (the peak, when ``lr_schedule`` changes it over the run)."""
    lr_schedule: str = "constant"
    """How the learning rate moves over ``train.steps`` (learner/schedule.py ``learning_rate_at``): ``constant``,
    ``linear`` or ``cosine`` decay from ``learning_rate`` after the warm-up towards ``min_lr_ratio`` times it (the
    last step runs just above that). Each step's rate follows from its number alone, so ``--resume`` continues on
    the curve; a run stopped by ``train.max_minutes`` ends before the curve does."""
    warmup_steps: int = 0
    """Steps over which the rate rises linearly to ``learning_rate`` (step k of W: k/W of it) before the schedule."""
    min_lr_ratio: float = 0.0
    """Where ``linear`` and ``cosine`` end, as a share of ``learning_rate``; in [0, 1]."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm (0 disables clipping)."""
    precision: str = "auto"
    """``fp32``, ``bf16`` (autocast over the decoder; float32 master weights, optimizer state, LM head, log-softmax
    and loss) or ``auto``: bf16 on a GPU with native bfloat16, fp32 elsewhere (learner/precision.py). This is what
    accelerate calls ``mixed_precision``; accelerate's own setting is refused, this one is lit's."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass in every micro-batch: less memory for more compute
    (bench/README.md). Without it, only a micro-batch over ``batching.max_tokens_per_micro_batch`` (a prompt group
    too long to split) recomputes."""
    lora_rank: int = 0
    """0 trains every weight; > 0 trains LoRA adapters of this rank only (peft): W' = W + (alpha / rank)·B·A with W
    frozen. vLLM gets W' merged (``state_dict``), checkpoints hold W' and the adapter (learner/checkpoint.py), and
    the KL reference is W (the adapter switched off). The paper trains full weights; LoRA is lit's option."""
    lora_alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Which linear layers get adapters."""
    shard: bool = False
    """With several trainer processes (``torchrun --nproc_per_node N``), shard the decoder layers of the policy
    and of its KL reference across them (FSDP2, learner/sharding.py): each process holds 1/N of the layers'
    weights, gradients and AdamW state, so models too large for one device train. Every use of the weights is
    then collective (the loop runs it in every process); checkpoints resume on any number of processes. With
    one process there is nothing to shard and this changes nothing. Full fine-tune only: LoRA is not sharded."""
    compile: bool = False
    """Compile the decoder's layers with ``torch.compile`` (learner/compiling.py): the same update, for a first one
    that compiles. Worth it on a GPU (bench/README.md: on one H200 a 1.5B model's bf16 update 18 % shorter at the
    default micro-batch budget and 21 % at 8192 tokens, with less memory, after 12-20 s of compilation); on a 2-core
    CPU the calc update was no faster (1.01x). On the CPU it needs a C++ compiler. With ``shard`` each process
    compiles its sharded layers (tested against the whole model on gloo and, on one GPU, over NCCL)."""
    compute_entropy: bool = False
    """Also give the loss each response token's entropy (the ``loss/entropy`` metric). It costs one more pass over
    the response positions' logits (bench/update_throughput.py measures how much), so it is off by default; an
    entropy bonus (``loss.entropy_coef`` > 0) computes it whatever this says."""

    def __post_init__(self) -> None:
        check(self)
        if self.lora_rank and self.lora_alpha <= 0:
            raise ValueError(f"policy.lora_alpha must be positive with policy.lora_rank > 0 (the adapter's update is "
                             f"scaled by alpha / rank: 0 trains nothing), got {self.lora_alpha}")
        if self.lora_rank and not self.lora_target_modules:
            raise ValueError("policy.lora_target_modules names no layer for the LoRA adapters (policy.lora_rank > 0): "
                             "name some, e.g. [\"q_proj\", \"v_proj\"]")
        if self.shard and self.lora_rank:
            raise ValueError("policy.shard shards a full fine-tune; a LoRA policy (lora_rank > 0) is not "
                             "sharded: its trained part is small, and every process holds the frozen base whole "
                             "(in bf16 under policy.precision = \"bf16\"). Set shard = false, or lora_rank = 0")


class Policy:
    def __init__(self, config: PolicyConfig, trackers: Sequence[str] = (), project_dir: str | None = None,
                 reference: str | None = None, adapters: Mapping[str, str] | None = None):
        """``trackers`` (e.g. ``["tensorboard"]``) go to accelerate's ``log_with``, logging under ``project_dir``.

        ``reference``: a model folder (or ``smollm2-135m``) whose frozen logprobs the loss's KL term compares with
        (``loss.kl_beta > 0``; the training loop passes the initial weights). With LoRA the reference is the base
        model under the adapter, computed with the adapter switched off: no extra memory, and ``reference`` only
        has to be given to turn it on.

        ``config.shard``: with several processes, shard the decoder layers of the policy and of the reference
        across them (learner/sharding.py); ``state_dict``, ``token_logprobs`` and ``update`` are then collectives:
        every process calls them, in the same order.

        ``adapters``: agent name -> LoRA adapter (a ``[roles]`` table's, lit_trainer/roles.py): one adapter per
        name on the one frozen base, each micro-batch computed with its rows' agent's (``adapter_for``), one
        optimizer over them all. Needs ``config.lora_rank``."""
        self.config = config
        self.adapters = dict(adapters or {})
        """Agent name -> the adapter its calls train (empty: one policy)."""
        self.adapter_names = tuple(dict.fromkeys(self.adapters.values()))
        if self.adapters and not config.lora_rank:
            raise ValueError("one adapter per role needs policy.lora_rank > 0")
        self.accelerator = _accelerator(trackers, project_dir)
        device = self.accelerator.device
        self.precision = precision.resolve(config.precision, device)
        """``fp32`` or ``bf16``: ``config.precision`` resolved for this device."""
        _check_device(config, self.precision, device, self.accelerator.is_main_process)
        self.sharded = config.shard and self.accelerator.num_processes > 1
        """Whether the decoder layers are sharded across the processes (``config.shard``)."""
        self.memory = memory_plan(config, self.precision, reference is not None, self.accelerator.num_processes,
                                  self.sharded, max(len(self.adapter_names), 1))
        """What this process holds for the policy before activations (learner/memory.py)."""
        free = memory.available(device)
        memory.check_fits(self.memory, free, device)  # before any weight is read
        if self.accelerator.is_main_process:
            room = f"; {free / memory.GB:.1f} GB free on {device}" if free is not None else ""
            print(f"lit: {self.memory.describe()}{room}", file=sys.stderr)
        model = _build_model(config, self.precision, device if self.sharded else None, self.adapter_names)
        # Not wrapped in DDP: the processes sum their gradients themselves (learner/distributed.py says why).
        self.model = self.accelerator.prepare_model(model, evaluation_mode=self.accelerator.num_processes > 1)
        self.optimizer = self.accelerator.prepare_optimizer(_optimizer(model, config))
        if config.compile:
            compiled = compiling.compile_decoder(self.unwrapped())
            if self.accelerator.is_main_process:
                print(f"lit: policy.compile: {compiled} decoder modules compile on their first use (torch.compile): "
                      "the first updates take longer", file=sys.stderr)
        self.has_reference = reference is not None
        self.reference: torch.nn.Module | None = None
        if reference is not None and not config.lora_rank:  # LoRA's reference is the base under the adapter
            folder, dtype = _model_config(reference)[0], precision.weights_dtype(self.precision, frozen=True)
            frozen = _load(folder, dtype, device if self.sharded else None)
            self.reference = frozen.to(device).eval().requires_grad_(False)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def device(self) -> torch.device:
        """Where the learner computes: where its weights are (accelerate put them on its device)."""
        return next(self.model.parameters()).device

    def place(self, batch: MicroBatch) -> MicroBatch:
        """``batch`` with every tensor on the learner's ``device`` (the same batch when they are there already)."""
        return batch.to(self.device)

    def token_logprobs(self, batch: MicroBatch, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token logprobs in token space (position t: log p(token t | tokens < t) at the row's sampling
        temperature; 0 where no response token sits), and optionally the entropy of the distribution each response
        token was drawn from (0 elsewhere). Both (B, T), on the learner's device, computed in its precision."""
        return self._logprobs(self.model, self.place(batch), with_entropy)

    def adapter_for(self, agent: str) -> str | None:
        """The adapter that trains ``agent``'s calls (None: the one policy)."""
        return self.adapters.get(agent)

    def use_adapter(self, name: str | None) -> None:
        """Compute the next forward passes with adapter ``name`` (one of ``adapter_names``; None with one policy)."""
        if name is not None:
            lora.activate(self.unwrapped(), name)
        elif self.adapters:
            raise ValueError("a micro-batch of no role's adapter: every row of a policy of one adapter per role must "
                             f"come from an agent of the [roles] table that trains ({sorted(self.adapters)})")

    def _logprobs(self, model: torch.nn.Module, batch: MicroBatch, with_entropy: bool = False,
                  entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.use_adapter(batch.adapter)
        with precision.autocast(self.device, self.precision):
            return logprobs.token_logprobs(model, batch, with_entropy=with_entropy, entropy_grad=entropy_grad)

    def set_learning_rate(self, rate: float) -> None:
        """The rate of the next optimizer steps (``policy.lr_schedule``: the loop sets each step's)."""
        for group in self.optimizer.param_groups:
            group["lr"] = rate

    def update(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn,
               keep_logprobs: dict[int, list[float]] | None = None, with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step over all micro-batches: the gradients of their loss terms add up (see ``LossFn``), so
        the step is that of the whole batch as one. Metrics are averaged over micro-batches by response tokens.
        ``keep_logprobs``: filled with the trainer's logprob of each response token before the step, by row
        (``MicroBatch.index``), for the rollout viewer's trainer-vs-engine gap. ``with_entropy``: give ``loss_fn``
        the response tokens' entropy, with its gradient (an entropy bonus), whatever ``compute_entropy`` says.

        Under several processes each computes its share of the micro-batches (``distributed.assign``, by tokens)
        and the gradients are summed across them before the step; every process gets the whole step's metrics and
        logprobs."""
        assert micro_batches, "update() needs at least one micro-batch"
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(mb.n_response_tokens for mb in micro_batches)
        assert total_tokens > 0, "every micro-batch is fully masked: nothing to train on"
        demo_tokens = sum(mb.n_response_tokens for mb in micro_batches if mb.demonstrations)
        sums: dict[str, float] = {}
        gap_sum, gap_tokens = 0.0, 0
        kept: dict[int, list[float]] = {}
        with precision.tf32_matmuls(self.device, self.precision):
            for mb, real in self.my_share(micro_batches):
                mb = self.place(mb)
                # each kind's metrics averaged over its own tokens (demonstrations and rollouts)
                weight = mb.n_response_tokens / (demo_tokens if mb.demonstrations else total_tokens - demo_tokens)
                self._recompute(self.config.gradient_checkpointing or mb.over_budget)
                logp, entropy = self._logprobs(self.model, mb, with_entropy=self.config.compute_entropy,
                                               entropy_grad=with_entropy)
                loss, metrics = loss_fn(logp, mb, entropy, self.reference_logprobs(mb) if self.has_reference else None)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"the loss is {loss.item()} on micro-batch rows {mb.index}")
                if not real:  # a sharded process's padding: the same collectives, no gradient
                    self.accelerator.backward(loss * 0.0)
                    continue
                self.accelerator.backward(loss)
                mask = mb.response_mask
                if mb.demonstrations:  # no behaviour logprobs to compare, no rollout row to keep them for
                    _add(sums, metrics, weight)
                    continue
                if keep_logprobs is not None:
                    for b, row in enumerate(mb.index):
                        kept[row] = logp[b].detach()[mask[b].bool()].tolist()
                gap_sum += ((logp.detach() - mb.old_logprobs).abs() * mask).sum().item()
                gap_tokens += int(mask.sum().item())
                _add(sums, metrics, weight)
        distributed.sum_gradients([p for p in self.trainable if not sharding.is_sharded(p)])  # shards: summed
        sums, gap_sum, gap_tokens = _add_up(distributed.gather((sums, gap_sum, gap_tokens, kept)), keep_logprobs)
        grad_norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**sums, "policy/grad_norm": grad_norm, "policy/vllm_logprob_gap": gap_sum / max(gap_tokens, 1),
                "policy/response_tokens": float(total_tokens - demo_tokens), "sft/tokens": float(demo_tokens)}

    def my_share(self, micro_batches: Sequence[MicroBatch]) -> list[tuple[MicroBatch, bool]]:
        """The micro-batches this process computes, as (micro-batch, real): all of them in one process, else its
        ``distributed.assign`` share by the tokens each computes. Sharded, every process runs as many as the
        largest share (``sharding.padded_share``): the padding is not real, its loss is to be zeroed."""
        rank, processes = distributed.world(self.accelerator)
        if processes == 1:
            return [(mb, True) for mb in micro_batches]
        shares = distributed.assign([mb.input_ids.numel() for mb in micro_batches], processes)
        if not self.sharded:
            return [(micro_batches[i], True) for i in shares[rank]]
        longest = max(len(share) for share in shares)
        return [(micro_batches[i], real) for i, real in sharding.padded_share(shares[rank], longest)]

    @torch.no_grad()
    def reference_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        """The reference policy's token logprobs (B, T) for the KL term: the frozen copy, or with LoRA the base
        model with the adapter switched off."""
        if not self.has_reference:
            raise RuntimeError("this Policy has no reference model: build it with reference=<model folder>")
        batch = self.place(batch)
        if self.reference is None:  # LoRA: the base weights are the reference
            with lora.adapters_off(self.unwrapped()):
                return self._logprobs(self.model, batch)[0]
        return self._logprobs(self.reference, batch)[0]

    def _recompute(self, on: bool) -> None:
        """Gradient checkpointing on or off for the next forward pass (``gradient_checkpointing``, or a micro-batch
        over the token budget)."""
        model = self.unwrapped()
        if on == model.is_gradient_checkpointing:
            return
        if on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()

    def _clip(self) -> float:
        if self.sharded:
            return sharding.clip(self.trainable, self.config.max_grad_norm)
        if self.config.max_grad_norm > 0:
            return float(self.accelerator.clip_grad_norm_(self.trainable, self.config.max_grad_norm))
        norms = [p.grad.norm() for p in self.trainable if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def unwrapped(self) -> torch.nn.Module:
        """The model without accelerate's wrapper: a transformers model, or a peft model when LoRA is on."""
        return self.accelerator.unwrap_model(self.model)

    def state_dict(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
                   ) -> dict[str, torch.Tensor]:
        """The full model's weights, as ``WeightSync.push_weights`` sends them to vLLM; with LoRA, the base weights
        with the adapter merged in (vLLM then serves a plain model through the same reload path, which on CPU is
        twice as fast as its LoRA mode). Sharded: gathered (a collective: every process calls it) into the main
        process alone ({} elsewhere), cast to ``dtype`` and moved to ``device`` tensor by tensor when given;
        unsharded both are left to the caller (the policy's own tensors are returned, no copy)."""
        if self.adapters:
            raise RuntimeError("a policy of one adapter per role has no one model: push adapter_states()")
        if self.config.lora_rank:
            return lora.merged_state_dict(self.unwrapped())
        if self.sharded:
            return sharding.full_state_dict(self.unwrapped(), keep=self.accelerator.is_main_process, dtype=dtype,
                                            device=device)
        return self.unwrapped().state_dict()

    def adapter_states(self) -> dict[str, tuple[dict[str, object], dict[str, torch.Tensor]]]:
        """Each adapter's ``adapter_config.json`` and weights (peft's keys), by adapter name, for vLLM."""
        model = self.unwrapped()
        return {name: (lora.adapter_config(model, name), lora.adapter_state(model, name))
                for name in self.adapter_names}

    @contextlib.contextmanager
    def in_float32(self) -> Iterator[torch.nn.Module]:
        """The unwrapped model computing in float32 while this lasts, for the weight-sync check against vLLM: the
        weights pushed to vLLM are what it computes with. Float32 weights stay as they are; bfloat16 ones (a LoRA
        policy's frozen base under bf16) are cast to float32 one module at a time, for that module's forward
        only, and back (exact: every bfloat16 value is a float32 value), so no float32 copy of the model is
        ever whole in memory."""
        model = self.unwrapped()
        handles = []
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p.dtype == torch.bfloat16]
            if own:
                handles.append(module.register_forward_pre_hook(_cast_hook(own, torch.float32)))
                handles.append(module.register_forward_hook(_cast_hook(own, torch.bfloat16), always_call=True))
        try:
            yield model
        finally:
            for handle in handles:
                handle.remove()


def _cast_hook(params: list[torch.nn.Parameter], dtype: torch.dtype) -> Callable[..., None]:
    def hook(*_: object) -> None:
        for p in params:
            p.data = p.data.to(dtype)
    return hook


def memory_plan(config: PolicyConfig, used: str, reference: bool, processes: int = 1,
                sharded: bool = False, adapters: int = 1) -> memory.MemoryPlan:
    """What one trainer process holds for a policy of ``config`` trained in ``used`` precision, before activations
    (learner/memory.py), from the model's config alone: no weight is read. ``reference``: with a KL reference.
    ``adapters``: LoRA adapters on the base (one per role of a ``[roles]`` table)."""
    _, model_config = _model_config(config.model)
    parameters, layers, trained = memory.count(model_config, config.lora_rank, config.lora_target_modules)
    return memory.plan(parameters, layers, trained * adapters, precision=used,
                       lora=bool(config.lora_rank), reference=reference and not config.lora_rank,
                       processes=processes, sharded=sharded)


def _accelerator(trackers: Sequence[str], project_dir: str | None):
    """accelerate's ``Accelerator`` for this process, refusing a launch lit does not support."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    # The other processes wait in a collective while the main one runs the rollouts and validation.
    wait = InitProcessGroupKwargs(timeout=distributed.COLLECTIVE_TIMEOUT)
    accelerator = Accelerator(log_with=list(trackers) or None, project_dir=project_dir, kwargs_handlers=[wait],
                              cpu=distributed.on_cpu_processes())
    refused = distributed.unsupported_launch(accelerator.distributed_type.value, str(accelerator.mixed_precision))
    if refused:
        raise ValueError(refused)
    return accelerator


def _check_device(config: PolicyConfig, used: str, device: torch.device, main: bool) -> None:
    """Whether ``device`` can train in ``used`` precision (and compile, with ``config.compile``); a warning when it
    would be slow."""
    precision.check(used, device)
    if config.compile and (missing := compiling.missing_compiler(device)):
        raise ValueError(missing)
    slow = precision.slow_on(used, device)
    if slow and main:
        log.warning("lit: %s", slow)


def _build_model(config: PolicyConfig, used: str, sharded_on: torch.device | None, adapters: Sequence[str] = ()
                 ) -> torch.nn.Module:
    """The model to train: its trained weights are float32 masters (a LoRA policy's frozen base may live in
    bfloat16), with LoRA adapters when ``config.lora_rank``; with ``sharded_on`` (a full fine-tune), built sharded
    on that device, each process reading only what it keeps (``sharded_load``)."""
    folder, _ = _model_config(config.model)
    dtype = precision.weights_dtype(used, frozen=bool(config.lora_rank))
    model = _load(folder, dtype, sharded_on)
    model.config.use_cache = False  # no KV cache in training; gradient checkpointing refuses one
    if config.lora_rank:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                 target_modules=list(config.lora_target_modules), task_type="CAUSAL_LM")
        model = lora.add_adapters(model, lora_config, adapters) if adapters else get_peft_model(model, lora_config)
    return model


def _optimizer(model: torch.nn.Module, config: PolicyConfig) -> torch.optim.Optimizer:
    """AdamW over the trained weights: one group of shards, one of whole tensors (a fused step takes a group's
    tensors in one kernel call); the fused kernel where the device has it (bench/README.md: several times faster
    on CPU than the default loop)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    params = [{"params": group} for group in ([p for p in trained if sharding.is_sharded(p)],
                                              [p for p in trained if not sharding.is_sharded(p)]) if group]
    try:
        return torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay, fused=True)
    except (RuntimeError, TypeError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)


def _model_config(model: str) -> tuple[Path, object]:
    """The folder of ``model`` (a folder or ``smollm2-135m``) and its transformers config; PrecisionError for a
    quantized model."""
    from transformers import AutoConfig

    folder = Path(resolve_model(model))
    check_model_folder(folder, weights=False, tokenizer=False)  # weights: _load, after the memory check
    config = AutoConfig.from_pretrained(folder)
    precision.check_model_dtype(config, str(folder))
    return folder, config


def _load(folder: Path, dtype: torch.dtype, sharded_on: torch.device | None = None) -> torch.nn.Module:
    """The causal LM in ``folder`` with its weights in ``dtype``; with ``sharded_on``, its decoder layers sharded
    across the processes on that device, each reading only what it keeps (``sharded_load``)."""
    from transformers import AutoModelForCausalLM

    check_model_folder(folder, tokenizer=False)  # the update needs no tokenizer; vLLM's start checks it
    if sharded_on is not None:
        return sharded_load.load_sharded(folder, dtype, sharded_on)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)


def _add(sums: dict[str, float], metrics: dict[str, float], weight: float) -> None:
    for key, value in metrics.items():
        sums[key] = sums.get(key, 0.0) + float(value) * weight


def _add_up(parts: list[tuple[dict[str, float], float, int, dict[int, list[float]]]],
            keep_logprobs: dict[int, list[float]] | None) -> tuple[dict[str, float], float, int]:
    """The processes' (metric sums, logprob gap sum, gap tokens, kept logprobs) as the whole step's; the kept
    logprobs go into ``keep_logprobs``."""
    sums: dict[str, float] = {}
    gap_sum, gap_tokens = 0.0, 0
    for part_sums, part_gap, part_tokens, kept in parts:
        for key, value in part_sums.items():
            sums[key] = sums.get(key, 0.0) + value
        gap_sum += part_gap
        gap_tokens += part_tokens
        if keep_logprobs is not None:
            keep_logprobs.update(kept)
    return sums, gap_sum, gap_tokens
