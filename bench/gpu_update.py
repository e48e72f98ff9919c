"""GPU policy-update throughput: lit's learner in fp32 and in bf16 vs a plain bf16 PyTorch update, on one GPU.

What it measures. Whole optimizer steps (``Policy.update``: micro-batching, token logprobs, the clipped loss,
backward, clipping, AdamW) of a random-init model of Qwen2-1.5B's shape (1.544 B parameters, tied embeddings),
built from a config and saved to a temporary folder once (nothing is downloaded), on two batches:

* agent: 8 groups x 8 rollouts, each group sharing a 1024-token prompt, 256-token responses (16384 response tokens);
* long context: one group of 8 rollouts sharing an 8192-token prompt, 512-token responses.

The runs, most wanted first (the time budget cuts from the end): lit bf16 on the agent batch with the device's
default micro-batch budget (``max_tokens_per_micro_batch = 0``) and with ``--budget-tokens``; lit bf16 on the long
context; the plain baseline on the agent batch; on a GPU, lit bf16 under ``policy.compile`` on the agent batch at both
budgets (its warm-up compiles); lit fp32 on the agent batch, then on the long context. The plain
baseline is what one writes by hand: every row padded whole (``make_micro_batches(share_prompts=False)`` under
``--budget-tokens``, halved once on CUDA OOM), the model's forward under ``torch.autocast(bfloat16)`` over fp32
weights, an fp32 log-softmax of the full logits, lit's clipped loss (``step_loss``), backward, gradient clipping and
a fused AdamW step. Each run: one warm-up update, then up to ``--reps`` timed ones (their median).

The columns. s/update; response tok/s (the response tokens the step trains on, per second); computed tok/s (the
positions the decoder runs: lit runs each shared prompt once, the baseline every padded row whole); TFLOP/s and MFU
against the GPU's dense bf16 peak (``PEAK_BF16_TFLOPS`` by device name, or ``--peak-tflops``), counting the model
FLOPs of one update (forward + backward) as

    6 * N_body * P  +  6 * V * H * R  +  12 * L * H * A

N_body the parameters outside the (tied) embedding, P the computed positions, V x H the embedding the LM head
multiplies by, R the positions that go through the head (lit: the response tokens; the baseline: every position),
L layers of width H, A the (query, key) pairs the attention masks allow (causal; in lit's packed groups a response
sees its prompt and itself). Gradient checkpointing's second forward is not counted. The JSON also has ``mfu_6n``:
``6 * params * P`` alone. Peak GiB: ``torch.cuda.max_memory_allocated`` over the warm-up and the timed updates
(weights, gradients and AdamW state included), reset between runs; on a CPU the process's peak RSS. Also: the
difference between lit's bf16 and fp32 token logprobs of one agent micro-batch on the same weights (max, mean).

Targets on one H100/H200 (the issue): lit bf16 >= 2.5x the plain bf16 baseline's response tok/s on the agent batch
and >= 30 % MFU; the agent batch in <= 40 GiB; the long-context batch within 80 GB (80e9 bytes). All of it should
take about 4 minutes there; ``--budget-s`` (330 s) skips, with a note, the runs that would not fit in what is left,
so that it ends in under 6 minutes whatever the card.

    python bench/gpu_update.py --out DIR                    # on a GPU; bench/gpu/run_on_device.sh runs it there
    .venv/bin/python bench/gpu_update.py --tiny --out DIR   # all small, on the CPU here (bf16: CPU autocast)

``--out`` writes ``gpu_update.json`` (every run, skipped and failed ones with their reason) and ``gpu_update.md``
(the table for bench/README.md, with the date, the card and the versions).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import itertools
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config

from lit_trainer.algorithm.loss import LossConfig, step_loss
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner import logprobs
from lit_trainer.learner.batching import BatchingConfig, MicroBatch, budget_for, make_micro_batches
from lit_trainer.learner.policy import Policy, PolicyConfig

GIB = 2**30
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
"""Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, by a substring of the device name; the first match counts."""
LEARNING_RATE = 1e-6


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


@dataclasses.dataclass(frozen=True)
class Batch:
    groups: int
    rollouts: int
    prompt: int
    response: int


QWEN2_1_5B = Shape(vocab=151936, hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960)
BATCHES = {"agent": Batch(groups=8, rollouts=8, prompt=1024, response=256),
           "long": Batch(groups=1, rollouts=8, prompt=8192, response=512)}
TINY = Shape(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
TINY_BATCHES = {"agent": Batch(groups=2, rollouts=4, prompt=64, response=16),
                "long": Batch(groups=1, rollouts=4, prompt=2048, response=64)}
"""--tiny: the long prompt is over the CPU's default micro-batch budget, so that group runs whole and checkpointed."""


@dataclasses.dataclass(frozen=True)
class Run:
    path: str  # "lit" (Policy.update), "compiled" (the same under policy.compile) or "plain" (the baseline)
    precision: str  # "fp32" or "bf16"
    batch: str  # "agent" or "long"
    budget: int  # max_tokens_per_micro_batch; 0: the device's default
    need_s: float  # about how long it takes at full size, loading its model included when it is first to use it

    def tokens(self, device: torch.device) -> int:
        """The micro-batch budget on ``device``: ``budget``, or the device's default for 0."""
        config = budget_for(BatchingConfig(max_tokens_per_micro_batch=self.budget), device.type)
        return config.max_tokens_per_micro_batch

    def label(self, device: torch.device) -> str:
        path = {"lit": "lit", "compiled": "lit", "plain": "plain (padded rows)"}[self.path]
        compiled = " compiled (policy.compile)" if self.path == "compiled" else ""
        default = "default " if self.budget == 0 else ""
        return f"{self.batch}: {path} {self.precision}{compiled}, {default}{self.tokens(device)}-token micro-batches"


def plan(budget_tokens: int, compiled: bool) -> list[Run]:
    """The runs, most wanted first; consecutive runs of one (path, precision) share one loaded model. ``compiled``:
    with lit bf16 under ``policy.compile`` too (on a GPU, where it pays; its first update compiles)."""
    with_compile = [Run("compiled", "bf16", "agent", 0, 60), Run("compiled", "bf16", "agent", budget_tokens, 10)]
    return [Run("lit", "bf16", "agent", 0, 45), Run("lit", "bf16", "agent", budget_tokens, 10),
            Run("lit", "bf16", "long", 0, 10), Run("plain", "bf16", "agent", budget_tokens, 40),
            *(with_compile if compiled else []), Run("lit", "fp32", "agent", 0, 55), Run("lit", "fp32", "long", 0, 25)]


@dataclasses.dataclass(frozen=True)
class Work:
    """What one update computes, for the rates: response tokens, positions the decoder runs (P), positions through
    the LM head (R), attention (query, key) pairs the masks allow (A)."""

    micro_batches: int
    over_budget: int
    response_tokens: int
    computed_positions: int
    head_positions: int
    attention_pairs: int


class Clock:
    def __init__(self, budget_s: float):
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------- model and batches

def qwen2_config(shape: Shape) -> Qwen2Config:
    return Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                       intermediate_size=shape.intermediate, max_position_embeddings=32768,
                       tie_word_embeddings=True, use_sliding_window=False)


def save_random_model(shape: Shape, folder: Path, device: torch.device) -> int:
    """A random-init Qwen2 of ``shape`` saved to ``folder`` (built on ``device``: faster than the CPU's init);
    its parameter count."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen2_config(shape), dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    free_memory()
    return n_params


def make_transitions(batch: Batch, vocab: int, seed: int) -> tuple[list[Transition], list[float]]:
    """``batch.groups`` prompts of random tokens, ``batch.rollouts`` responses each; behaviour logprobs near a
    random-init model's (about -ln V), so the importance ratios are near 1; advantages +1/-1 in each group."""
    rng = random.Random(seed)
    uniform = -math.log(vocab)
    transitions, advantages = [], []
    for g in range(batch.groups):
        prompt = [rng.randrange(1, vocab) for _ in range(batch.prompt)]
        for r in range(batch.rollouts):
            response = [rng.randrange(1, vocab) for _ in range(batch.response)]
            behaviour = [uniform + rng.gauss(0.0, 0.1) for _ in response]
            transitions.append(Transition(list(prompt), response, behaviour, None, "agent", f"g{g}-r{r}", f"task{g}",
                                          0, f"span{g}-{r}"))
            advantages.append(1.0 if r % 2 == 0 else -1.0)
    return transitions, advantages


def micro_batches(data: tuple[list[Transition], list[float]], budget: int, share_prompts: bool) -> list[MicroBatch]:
    """The micro-batches (on the CPU) of ``budget`` tokens each; the prompt limit raised to the longest prompt."""
    transitions, advantages = data
    config = BatchingConfig(max_tokens_per_micro_batch=budget,
                            max_prompt_tokens=max(len(t.prompt_ids) for t in transitions))
    return make_micro_batches(transitions, advantages, config, pad_id=0, share_prompts=share_prompts)


def lit_work(batches: Sequence[MicroBatch]) -> Work:
    """What lit's path computes: each micro-batch's prompt groups packed (``logprobs.pack_rows``), the head on the
    response positions only."""
    positions = head = pairs = 0
    for mb in batches:
        layout = logprobs.pack_rows(mb)
        positions += layout.input_ids.numel()
        head += layout.source.numel()
        real = (layout.segment >= -1)[:, :, None]  # (G, L, 1): the queries that are tokens, not padding
        for g in range(layout.input_ids.shape[0]):  # the (query, key) pairs the packed mask lets attend
            mask = logprobs._group_mask(layout.segment[g:g + 1], layout.group[g:g + 1], torch.float32, "sdpa")
            pairs += int((mask[:, 0] & real[g:g + 1]).sum())
    return Work(len(batches), sum(mb.over_budget for mb in batches),
                sum(mb.n_response_tokens for mb in batches), positions, head, pairs)


def plain_work(batches: Sequence[MicroBatch]) -> Work:
    """What the plain path computes: every padded row whole, the head on every position."""
    positions = sum(mb.input_ids.numel() for mb in batches)
    pairs = sum(mb.input_ids.shape[0] * mb.input_ids.shape[1] * (mb.input_ids.shape[1] + 1) // 2 for mb in batches)
    return Work(len(batches), 0, sum(mb.n_response_tokens for mb in batches), positions, positions, pairs)


def update_flops(work: Work, shape: Shape, n_params: int) -> float:
    """The model FLOPs of one update, forward + backward (module docstring)."""
    embedding = shape.vocab * shape.hidden
    return (6.0 * (n_params - embedding) * work.computed_positions + 6.0 * embedding * work.head_positions
            + 12.0 * shape.layers * shape.hidden * work.attention_pairs)


# ---------------------------------------------------------------------------------------------- measuring

def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets the process's peak RSS (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / GIB
    return float("nan")


def time_updates(update: Callable[[], dict[str, float]], reps: int, clock: Clock, device: torch.device) -> dict:
    """One warm-up update, then up to ``reps`` timed ones (at least one), stopping early when the next would end
    past the time budget; the peak memory over all of them, and the last update's loss and gradient norm."""
    reset_peak(device)
    before = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
    start = time.perf_counter()
    metrics = update()
    sync(device)
    warmup = time.perf_counter() - start
    times: list[float] = []
    while len(times) < reps and (not times or clock.left() > 1.2 * times[-1]):
        start = time.perf_counter()
        metrics = update()
        sync(device)
        times.append(time.perf_counter() - start)
    return {"warmup_s": round(warmup, 4), "times_s": [round(t, 4) for t in times],
            "s_per_update": statistics.median(times), "peak_gib": round(peak_gib(device), 3),
            "allocated_before_gib": None if before is None else round(before, 3),
            "loss": metrics.get("loss/policy"), "grad_norm": metrics.get("policy/grad_norm")}


def rates(seconds: float, work: Work, flops: float, n_params: int, peak_tflops: float | None) -> dict:
    """Per-second figures of one update, to 4 significant digits; MFU None without a peak."""
    tflop_s = flops / seconds / 1e12
    simple = 6.0 * n_params * work.computed_positions / seconds / 1e12
    return {"response_tok_s": digits(work.response_tokens / seconds),
            "computed_tok_s": digits(work.computed_positions / seconds), "tflop_s": digits(tflop_s),
            "mfu": digits(tflop_s / peak_tflops) if peak_tflops else None,
            "mfu_6n": digits(simple / peak_tflops) if peak_tflops else None}


def digits(x: float) -> float:
    return float(f"{x:.4g}")


def precision_gap(policy: Policy, mb: MicroBatch) -> dict:
    """lit's token logprobs of ``mb`` under the policy's precision (bf16) against fp32 on the same weights
    (``logprobs.token_logprobs`` outside any autocast), over the response tokens."""
    mb = policy.place(mb)
    with torch.no_grad():
        low, _ = policy.token_logprobs(mb)
        high, _ = logprobs.token_logprobs(policy.model, mb)
    mask = mb.response_mask.bool()
    diff = (low.float() - high.float())[mask].abs()
    return {"tokens": int(mask.sum()), "max": float(diff.max()), "mean": float(diff.mean())}


def plain_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[MicroBatch],
                 precision: str, device: torch.device) -> dict[str, float]:
    """The baseline's update (module docstring): padded rows, autocast forward, fp32 log-softmax of all logits, the
    same loss, backward, clipping, AdamW."""
    loss_fn = step_loss(LossConfig(), batches)
    model.train()
    total = torch.zeros((), device=device)
    for mb in batches:
        mb = mb.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        picked = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, mb.input_ids[:, 1:, None])[..., 0]
        logp = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)  # (B, T): token space
        loss, _ = loss_fn(logp, mb)
        loss.backward()
        total += loss.detach()
        del logits, picked, logp, loss  # else they live on through the next micro-batch's forward
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss/policy": float(total), "policy/grad_norm": float(grad_norm)}


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, lr=LEARNING_RATE)


@dataclasses.dataclass
class Bench:
    clock: Clock
    device: torch.device
    shape: Shape
    n_params: int
    peak_tflops: float | None
    reps: int
    scale: float  # need_s multiplier: 1 at full size, 0 with --tiny
    data: dict[str, tuple[list[Transition], list[float]]]


def measure_lit(bench: Bench, policy: Policy, run: Run) -> dict:
    batches = micro_batches(bench.data[run.batch], run.tokens(bench.device), share_prompts=True)
    work = lit_work(batches)
    loss_fn = step_loss(LossConfig(), batches)
    timing = time_updates(lambda: policy.update(batches, loss_fn), bench.reps, bench.clock, bench.device)
    return {**summarise(bench, work, timing), "policy_precision": policy.precision, "policy_device": str(policy.device)}


def measure_plain(bench: Bench, loaded: tuple[torch.nn.Module, torch.optim.Optimizer], run: Run) -> dict:
    """The baseline at its budget, or after a CUDA OOM once more at half of it."""
    model, optimizer = loaded
    budget = run.tokens(bench.device)
    try:
        return plain_at(bench, model, optimizer, run, budget)
    except torch.cuda.OutOfMemoryError:
        pass  # retried below, once the failed update's tensors (held by the exception) are gone
    note = f"CUDA OOM at {budget}-token micro-batches: measured at {budget // 2}"
    bench.clock.log(note)
    optimizer.zero_grad(set_to_none=True)
    free_memory()
    return {**plain_at(bench, model, optimizer, run, budget // 2), "note": note}


def plain_at(bench: Bench, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run: Run, budget: int) -> dict:
    batches = micro_batches(bench.data[run.batch], budget, share_prompts=False)
    timing = time_updates(lambda: plain_update(model, optimizer, batches, run.precision, bench.device), bench.reps,
                          bench.clock, bench.device)
    return {**summarise(bench, plain_work(batches), timing), "micro_batch_budget": budget}


def summarise(bench: Bench, work: Work, timing: dict) -> dict:
    flops = update_flops(work, bench.shape, bench.n_params)
    return {**dataclasses.asdict(work), "flops_per_update": flops, **timing,
            **rates(timing["s_per_update"], work, flops, bench.n_params, bench.peak_tflops)}


Loaded = Policy | tuple[torch.nn.Module, torch.optim.Optimizer]
"""What a run measures: lit's Policy, or the baseline's model and optimizer."""


def load(bench: Bench, folder: Path, path: str, precision: str) -> Loaded:
    if path in ("lit", "compiled"):
        return Policy(PolicyConfig(model=str(folder), precision=precision, learning_rate=LEARNING_RATE,
                                   compile=path == "compiled"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(bench.device)
    return model, adamw([p for p in model.parameters() if p.requires_grad])


def run_all(bench: Bench, folder: Path, runs: list[Run], result: dict) -> None:
    """Every run, in order, one loaded model per (path, precision); each run's record goes into ``result["runs"]``
    as it ends: ok, skipped (the time budget) or failed (the error)."""
    records = result["runs"]
    for (path, precision), group in itertools.groupby(runs, key=lambda r: (r.path, r.precision)):
        group = list(group)
        if bench.clock.left() < group[0].need_s * bench.scale:
            records.extend(skipped(bench, run) for run in group)
            continue
        in_use = ""
        if bench.device.type == "cuda":  # what the previous group left behind: 0 when it was all freed
            in_use = f" ({torch.cuda.memory_allocated() / GIB:.2f} GiB of GPU memory in use)"
        bench.clock.log(f"loading the {path} {precision} model{in_use}")
        try:
            loaded = load(bench, folder, path, precision)
        except Exception as exc:  # every run of the group fails with it; the other groups still run
            traceback.print_exc()
            records.extend(failed(bench, run, exc) for run in group)
            continue
        if path == "lit" and precision == "bf16":
            result["logprob_bf16_vs_fp32"] = measure_gap(bench, loaded)
        for run in group:
            records.append(measure(bench, loaded, run))
            free_memory()  # after the except blocks: a failed run's tensors are held by its traceback until then
        del loaded
        free_memory()


def measure(bench: Bench, loaded: Loaded, run: Run) -> dict:
    """One run's record: measured, skipped or failed."""
    if bench.clock.left() < run.need_s * bench.scale:
        return skipped(bench, run)
    label = run.label(bench.device)
    bench.clock.log(f"{label} ...")
    try:
        m = (measure_plain if run.path == "plain" else measure_lit)(bench, loaded, run)
    except Exception as exc:
        traceback.print_exc()
        return failed(bench, run, exc)
    bench.clock.log(f"{label}: {m['s_per_update']:.3f} s/update, {m['response_tok_s']:.0f} response tok/s, "
                    f"{m['tflop_s']:.4g} TFLOP/s, peak {m['peak_gib']:.2f} GiB, {m['micro_batches']} micro-batches "
                    f"({m['over_budget']} over budget), timed {m['times_s']} after a {m['warmup_s']:.2f} s warm-up")
    return {**describe(bench, run), "status": "ok", **m}


def measure_gap(bench: Bench, policy: Policy) -> dict:
    """``precision_gap`` on the agent batch's first micro-batch, or the error."""
    try:
        tokens = budget_for(BatchingConfig(), bench.device.type).max_tokens_per_micro_batch
        gap = precision_gap(policy, micro_batches(bench.data["agent"], tokens, share_prompts=True)[0])
    except Exception as exc:
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    bench.clock.log(f"bf16 vs fp32 token logprobs on {gap['tokens']} tokens: max {gap['max']:.2e}, mean "
                    f"{gap['mean']:.2e}")
    return gap


def describe(bench: Bench, run: Run) -> dict:
    return {"label": run.label(bench.device), **dataclasses.asdict(run),
            "micro_batch_budget": run.tokens(bench.device)}


def skipped(bench: Bench, run: Run) -> dict:
    note = f"skipped: {bench.clock.left():.0f} s of the time budget left, it needs about {run.need_s:.0f} s"
    bench.clock.log(f"{run.label(bench.device)}: {note}")
    return {**describe(bench, run), "status": "skipped", "note": note}


def failed(bench: Bench, run: Run, exc: BaseException) -> dict:
    error = f"{type(exc).__name__}: {exc}"[:1000]
    bench.clock.log(f"{run.label(bench.device)}: FAILED {error}")
    return {**describe(bench, run), "status": "failed", "error": error}


# ---------------------------------------------------------------------------------------------- report

def peak_tflops_of(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_BF16_TFLOPS if part in name), None)


def find(records: list[dict], path: str, precision: str, batch: str, budget: int = 0) -> dict | None:
    return next((r for r in records if r["status"] == "ok" and (r["path"], r["precision"], r["batch"], r["budget"])
                 == (path, precision, batch, budget)), None)


def targets(records: list[dict], budget_tokens: int) -> dict:
    """The issue's acceptance figures, from the lit bf16 runs at the default budget: value, target, met (None where
    a run is missing)."""
    lit = find(records, "lit", "bf16", "agent")
    plain = find(records, "plain", "bf16", "agent", budget_tokens)
    long = find(records, "lit", "bf16", "long")
    return {"agent: lit bf16 / plain bf16 response tok/s": target(
                lit["response_tok_s"] / plain["response_tok_s"] if lit and plain else None, ">=", 2.5),
            "agent: lit bf16 MFU": target(lit["mfu"] if lit else None, ">=", 0.30),
            "agent: lit bf16 peak GiB": target(lit["peak_gib"] if lit else None, "<=", 40.0),
            "long context: lit bf16 peak GiB (80 GB)": target(long["peak_gib"] if long else None, "<=", 80e9 / GIB)}


def target(value: float | None, op: str, bound: float) -> dict:
    met = None if value is None else bool(value >= bound if op == ">=" else value <= bound)
    return {"value": value, "target": f"{op} {bound:.4g}", "met": met}


def markdown(result: dict) -> str:
    """The runs as a markdown table for bench/README.md, with what was run where, the targets and the notes."""
    env, model, b = result["environment"], result["model"], result["batches"]
    tiny = " --tiny (a tiny model on this machine: an API check, not the figure)" if result["tiny"] else ""
    peak = f"dense bf16 peak {env['peak_tflops']} TFLOP/s" if env["peak_tflops"] else "no bf16 peak known"
    lines = [f"`bench/gpu_update.py`{tiny}, {result['date']}: {env['device_name']} ({peak}), torch {env['torch']}, "
             f"transformers {env['transformers']}, accelerate {env['accelerate']}. "
             f"Random-init Qwen2, {params(model['params'])}; agent batch {b['agent']['groups']} groups x "
             f"{b['agent']['rollouts']} rollouts, {b['agent']['prompt']}-token shared prompts, "
             f"{b['agent']['response']}-token responses; long context {b['long']['prompt']}-token prompt + "
             f"{b['long']['rollouts']} x {b['long']['response']} responses. Median of up to {result['reps']} timed "
             "updates after a warm-up; TFLOP/s and MFU count 6 N_body P + 6 V H R + 12 L H A (bench/gpu_update.py).",
             "",
             "| update | s/update | response tok/s | peak GiB | computed tok/s | TFLOP/s | MFU |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["runs"]:
        if r["status"] != "ok":
            why = str(r.get("note") or r.get("error")).replace("|", "/").replace("\n", " ")[:300]
            lines.append(f"| {r['label']} | {r['status']}: {why} | | | | | |")
            continue
        checkpointed = f", {r['over_budget']} over budget: checkpointed" if r["over_budget"] else ""
        note = f"; {r['note']}" if "note" in r else ""
        count = f"{r['micro_batches']} micro-batch{'es' if r['micro_batches'] != 1 else ''}"
        label = f"{r['label']} ({count}{checkpointed}){note}"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        lines.append(f"| {label} | {r['s_per_update']:.3f} | {r['response_tok_s']:.0f} | {r['peak_gib']:.2f} | "
                     f"{r['computed_tok_s']:.0f} | {r['tflop_s']:.3g} | {mfu} |")
    lines.append("")
    for name, t in result["targets"].items():
        value = "not measured" if t["value"] is None else f"{t['value']:.3g}"
        met = {None: "", True: ": met", False: ": NOT met"}[t["met"]]
        lines.append(f"- {name}: {value} (target {t['target']}){met}")
    gap = result.get("logprob_bf16_vs_fp32") or {}
    if "max" in gap:
        lines.append(f"- bf16 vs fp32 token logprobs, same weights, one agent micro-batch ({gap['tokens']} tokens): "
                     f"max {gap['max']:.2e}, mean {gap['mean']:.2e}")
    lines.append(f"- elapsed {result['elapsed_s']:.0f} s (budget {result['budget_s']:.0f} s)")
    return "\n".join(lines) + "\n"


def params(n: int) -> str:
    return f"{n / 1e9:.3f} B params" if n >= 1e8 else f"{n / 1e6:.2f} M params"


def environment(device: torch.device, peak_tflops: float | None) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    return {"device": str(device), "device_name": name, "peak_tflops": peak_tflops, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "accelerate": importlib.metadata.version("accelerate"), "python": sys.version.split()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batches: an API check in seconds")
    parser.add_argument("--out", type=Path, help="write gpu_update.json and gpu_update.md into this folder")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="wall-clock budget: the runs that would not fit in what is left are skipped")
    parser.add_argument("--reps", type=int, default=None, help="timed updates per run, after one warm-up (3; tiny 1)")
    parser.add_argument("--budget-tokens", type=int, default=None,
                        help="micro-batch budget of the second lit bf16 run and of the plain baseline (8192; tiny 128)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak, TFLOP/s, for MFU (default: by device name)")
    args = parser.parse_args()
    clock = Clock(args.budget_s)
    shape, batches = (TINY, TINY_BATCHES) if args.tiny else (QWEN2_1_5B, BATCHES)
    budget_tokens = args.budget_tokens or (128 if args.tiny else 8192)
    reps = args.reps or (1 if args.tiny else 3)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak_tflops = args.peak_tflops or peak_tflops_of(device)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    result: dict = {"date": datetime.date.today().isoformat(), "tiny": args.tiny, "reps": reps,
                    "budget_s": args.budget_s, "budget_tokens": budget_tokens,
                    "environment": environment(device, peak_tflops),
                    "batches": {name: dataclasses.asdict(b) for name, b in batches.items()}, "runs": []}
    clock.log(f"{result['environment']['device_name']}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}, budget {args.budget_s:.0f} s")
    folder = Path(tempfile.mkdtemp(prefix="lit_gpu_update_"))
    try:
        n_params = save_random_model(shape, folder, device)
        result["model"] = {"params": n_params, "shape": dataclasses.asdict(shape)}
        clock.log(f"random-init Qwen2 of {params(n_params)} saved to {folder}")
        data = {name: make_transitions(b, shape.vocab, seed=i) for i, (name, b) in enumerate(batches.items())}
        bench = Bench(clock, device, shape, n_params, peak_tflops, reps, 0.0 if args.tiny else 1.0, data)
        run_all(bench, folder, plan(budget_tokens, compiled=device.type == "cuda"), result)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result["targets"] = targets(result["runs"], budget_tokens)
    result["elapsed_s"] = round(clock.elapsed(), 1)
    table = markdown(result)
    print("\n" + table, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_update.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "gpu_update.md").write_text(table)
    return 1 if any(r["status"] == "failed" for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
