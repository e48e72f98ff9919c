"""Policy-update throughput: response tokens/s of ``Policy.update`` vs a raw forward+backward of the same batch, and
of the shared-prompt, response-only logprobs (``learner/logprobs.py``) vs the plain full-logits path.

Figure 1 (``--figure overhead``). The batch is 8 transitions of 256 tokens (128 prompt + 128 response) on the
prepared SmolLM2-135M. The baseline, measured in the same run on the same model object, is the least a training step
must do: one forward pass, the token logprobs of the batch, their sum, one backward pass. The figure is lit's whole
update on the same batch: micro-batching, token-space logprobs, the LightningRL loss (clipped ratio, optional
entropy), gradient accumulation, clipping and the AdamW step. Both are timed as the median of ``--reps`` runs after
a warm-up. Full fine-tune and LoRA (rank 16) are measured separately.

Figure 2 (``--figure paths``). A whole update (full fine-tune, entropy off) with ``Policy.token_logprobs`` replaced by
``logprobs.plain_token_logprobs`` (the full (B, T, V) logits of every padded row: the update before
``logprobs.token_logprobs``) or by ``logprobs.token_logprobs``, each in a fresh process, so that its peak resident
memory (VmHWM: model, gradients, AdamW state and the update's peak together) is its own. Two batches: the calc example's
step (``examples/calc``: 8 tasks x 8 rollouts, each group sharing its task's real prompt, rendered with lit's chat
template and the agent's system message, worked examples and tool, each question with its numbers line, about 800
tokens since the agent shows seven worked examples (the night of 2026-11-27; about 567 with five and no numbers
line, about 358 with the two it had before, when bench/README.md's figure was taken); responses are
calculator calls as the agent writes them, about 34 tokens; temperature 0.7; micro-batch budget 2048 as in
``examples/calc/config.toml``) and figure 1's 8x256 batch (distinct prompts: nothing to share). The plain path's
micro-batches count rows x padded length (``make_micro_batches(share_prompts=False)``), the new path's the tokens it
computes (each prompt once, and the start the calc prompts have in common once per micro-batch: 4 groups at 2048),
under the same budget. Extra rows show the new path's memory with a budget of 1024 (one
prompt group per micro-batch) and with ``policy.gradient_checkpointing``.

Figure 3 (``--figure compile``). ``policy.compile`` (learner/compiling.py) on the calc batch of figure 2, as the
calc config trains it (full fine-tune, gradient checkpointing, 2048-token micro-batches): the first update of a
compiled policy (it compiles), then whole updates alternately eager (``compiling.uncompile_decoder``) and compiled
(the compiled code is cached: no second compilation), ``--reps`` each; the medians and their ratio.

    .venv/bin/python bench/update_throughput.py [--reps 3] [--path-reps 1] [--figure all|overhead|paths|compile]

Targets: lit's update >= 85 % of the raw forward+backward tokens/s; the new path at least 2x the plain path's
tokens/s on the calc batch, with a peak RSS well under 4 GB.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lit_trainer.algorithm.loss import LossConfig, step_loss
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner import logprobs
from lit_trainer.learner.batching import BatchingConfig, MicroBatch, make_micro_batches
from lit_trainer.learner.policy import Policy, PolicyConfig

ROWS, PROMPT, RESPONSE = 8, 128, 128
CALC_TASKS, CALC_GROUP, CALC_TEMPERATURE, CALC_BUDGET = 8, 8, 0.7, 2048
"""The calc example's step: tasks_per_step, group_size, temperature, max_tokens_per_micro_batch of its config."""
PATHS = {"plain": logprobs.plain_token_logprobs, "new": logprobs.token_logprobs}


def make_batch(seed: int = 0) -> list[Transition]:
    rng = random.Random(seed)
    return [
        Transition([rng.randrange(1, 49000) for _ in range(PROMPT)], [rng.randrange(1, 49000) for _ in range(RESPONSE)],
                   [-rng.random() * 3 for _ in range(RESPONSE)], None, "a", f"r{i}", "t", 0, "s")
        for i in range(ROWS)
    ]


def make_calc_batch(seed: int = 0) -> list[Transition]:
    """The calc agent's step: 8 tasks x 8 rollouts, each task's rows sharing the prompt the agent sends (its system
    message, worked examples and tool in lit's chat template), each response a calculator call (module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from transformers import AutoTokenizer

    from examples.calc.agent import SHOTS, SYSTEM_MESSAGE, calculator, tool_call_text, with_numbers
    from examples.calc.tasks import make_tasks
    from lit_trainer.engine.served_model import TOOL_TEMPLATE
    from lit_trainer.models.folders import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    tool = {"type": "function", "function": {  # as AutoGen sends the agent's CompactTool
        "name": "calculator", "description": calculator.__doc__, "strict": False,
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
    rng = random.Random(seed)
    transitions = []
    for task in make_tasks("train", CALC_TASKS):
        messages = [{"role": "system", "content": SYSTEM_MESSAGE}]
        for question, expression in SHOTS:
            messages += [{"role": "user", "content": with_numbers(question)},
                         {"role": "assistant", "content": tool_call_text(expression)}]
        messages.append({"role": "user", "content": with_numbers(task["question"])})
        prompt = tokenizer.apply_chat_template(messages, tools=[tool], chat_template=TOOL_TEMPLATE.read_text(),
                                               add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for i in range(CALC_GROUP):
            numbers = [str(rng.randrange(1, 100)) for _ in range(rng.choice((2, 2, 3)))]
            expression = "".join(n + rng.choice("+-*/") for n in numbers[:-1]) + numbers[-1]
            response = tokenizer(tool_call_text(expression) + "<|im_end|>")["input_ids"]
            transitions.append(Transition(list(prompt), response, [-rng.random() for _ in response], None, "calc",
                                          f"{task['id']}-{i}", task["id"], 0, "s", temperature=CALC_TEMPERATURE))
    return transitions


def raw_step(policy: Policy, batches: list[MicroBatch]) -> None:
    """Forward, token logprobs, sum, backward: nothing lit adds."""
    model = policy.model
    model.train()
    for mb in batches:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, mb.input_ids[:, 1:, None])
        (logp[..., 0] * mb.response_mask[:, 1:]).sum().backward()
    model.zero_grad(set_to_none=True)


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def overhead_figure(reps: int) -> None:
    """Figure 1: lit's update vs a raw forward+backward, on the 8x256 batch (module docstring)."""
    transitions = make_batch()
    tokens = ROWS * RESPONSE
    rows = []
    for label, config in (
        ("full fine-tune (default)", PolicyConfig()),
        ("full fine-tune, entropy on", PolicyConfig(compute_entropy=True)),
        ("LoRA r=16, entropy off", PolicyConfig(compute_entropy=False, lora_rank=16)),
    ):
        policy = Policy(config)
        batches = make_micro_batches(transitions, [1.0, -1.0] * (ROWS // 2),
                                     BatchingConfig(max_tokens_per_micro_batch=ROWS * (PROMPT + RESPONSE)), pad_id=2)
        raw = median_seconds(lambda p=policy, b=batches: raw_step(p, b), reps)
        ours = median_seconds(lambda p=policy, b=batches: p.update(b, step_loss(LossConfig(), b)), reps)
        rows.append((label, tokens / ours, tokens / raw))
        print(f"{label}: update {ours:.2f} s, raw forward+backward {raw:.2f} s", flush=True)
    print(f"\n{ROWS}x{PROMPT + RESPONSE}-token transitions ({tokens} response tokens), median of {reps}")
    print(f"| {'update':28} | {'lit tok/s':>9} | {'raw fwd+bwd tok/s':>17} | {'ratio':>6} |")
    print(f"|{'-' * 30}|{'-' * 11}|{'-' * 19}|{'-' * 8}|")
    for label, ours, raw in rows:
        print(f"| {label:28} | {ours:9.1f} | {raw:17.1f} | {ours / raw:6.2f} |")
    print("target: ratio >= 0.85")


def path_update(batch: str, path: str, budget: int, checkpointing: bool, reps: int) -> dict[str, float]:
    """One process's figure 2 measurement: the median seconds of a whole update with ``Policy.token_logprobs``
    replaced by ``path``'s function, and this process's peak RSS."""
    fn = PATHS[path]
    Policy.token_logprobs = lambda self, mb, with_entropy=False: fn(self.model, mb, with_entropy=with_entropy)
    transitions = make_calc_batch() if batch == "calc" else make_batch()
    policy = Policy(PolicyConfig(gradient_checkpointing=checkpointing))
    advantages = [1.0, -1.0] * (len(transitions) // 2)
    batches = make_micro_batches(transitions, advantages, BatchingConfig(max_tokens_per_micro_batch=budget), pad_id=2,
                                 share_prompts=path == "new")
    seconds = median_seconds(lambda: policy.update(batches, step_loss(LossConfig(), batches)), reps)
    return {"seconds": seconds, "tokens": sum(mb.n_response_tokens for mb in batches), "micro_batches": len(batches),
            "prompt": statistics.median(len(t.prompt_ids) for t in transitions),
            "response": statistics.median(len(t.response_ids) for t in transitions),
            "peak_rss_gb": peak_rss_gb()}


def peak_rss_gb() -> float:
    """This process's peak resident memory. VmHWM, not ``ru_maxrss``: Linux carries ``ru_maxrss`` over ``fork`` and
    ``exec``, so a child started by a big parent would report at least the parent's size."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


PATH_RUNS = [  # (batch, path, micro-batch budget, gradient checkpointing)
    ("calc", "plain", CALC_BUDGET, False),
    ("calc", "new", CALC_BUDGET, False),
    ("calc", "new", CALC_BUDGET, True),
    ("calc", "new", 1024, False),  # one prompt group per micro-batch: nothing shared across groups
    ("calc", "new", 1024, True),
    ("8x256", "plain", ROWS * (PROMPT + RESPONSE), False),
    ("8x256", "new", ROWS * (PROMPT + RESPONSE), False),
]


def paths_figure(reps: int) -> None:
    """Figure 2: plain vs new logprobs in whole updates, each in its own process (module docstring)."""
    results = []
    for run in PATH_RUNS:
        child = ":".join(str(x) for x in run)
        out = subprocess.run([sys.executable, __file__, "--child", child, "--reps", str(reps)], check=True,
                             capture_output=True, text=True).stdout
        results.append((run, json.loads(out.strip().splitlines()[-1])))
        print(f"{child}: update {results[-1][1]['seconds']:.2f} s, peak RSS {results[-1][1]['peak_rss_gb']:.2f} GB",
              flush=True)
    calc = next(r for (batch, *_), r in results if batch == "calc")
    print(f"\nwhole update, full fine-tune, entropy off, median of {reps} after a warm-up; peak RSS of a fresh process"
          f"\ncalc: {CALC_TASKS} tasks x {CALC_GROUP} rollouts, prompt {calc['prompt']:.0f} + response "
          f"{calc['response']:.0f} tokens (medians), T = {CALC_TEMPERATURE}; 8x256: {ROWS} distinct prompts")
    print(f"| {'batch':5} | {'path':5} | {'budget':>6} | {'grad ckpt':9} | {'micro-b.':>8} | {'s/update':>8} | "
          f"{'tok/s':>6} | {'peak RSS':>8} |")
    print(f"|{'-' * 7}|{'-' * 7}|{'-' * 8}|{'-' * 11}|{'-' * 10}|{'-' * 10}|{'-' * 8}|{'-' * 10}|")
    for (batch, path, budget, checkpointing), r in results:
        ckpt = "yes" if checkpointing else "no"
        print(f"| {batch:5} | {path:5} | {budget:6d} | {ckpt:9} | {r['micro_batches']:8d} | {r['seconds']:8.2f} | "
              f"{r['tokens'] / r['seconds']:6.1f} | {r['peak_rss_gb']:5.2f} GB |")
    for batch in ("calc", "8x256"):
        plain, new = (next(r for (b, p, _, ckpt), r in results if (b, p, ckpt) == (batch, path, False))
                      for path in ("plain", "new"))
        print(f"{batch}, same budget: new/plain tokens/s {plain['seconds'] / new['seconds']:.2f}x, "
              f"peak RSS {new['peak_rss_gb']:.2f} vs {plain['peak_rss_gb']:.2f} GB")
    print("target (calc): new/plain >= 2x tokens/s; peak RSS well under 4 GB")


def compile_figure(reps: int) -> None:
    """Figure 3: eager vs compiled decoder layers in whole calc updates, alternating (module docstring)."""
    from lit_trainer.learner import compiling

    transitions = make_calc_batch()
    policy = Policy(PolicyConfig(gradient_checkpointing=True, compile=True))
    batches = make_micro_batches(transitions, [1.0, -1.0] * (len(transitions) // 2),
                                 BatchingConfig(max_tokens_per_micro_batch=CALC_BUDGET), pad_id=2)

    def update() -> float:
        t0 = time.perf_counter()
        policy.update(batches, step_loss(LossConfig(), batches))
        return time.perf_counter() - t0

    first = update()
    print(f"first compiled update (compiling): {first:.1f} s", flush=True)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(reps):
        for label in times:
            (compiling.compile_decoder if label == "compiled" else compiling.uncompile_decoder)(policy.unwrapped())
            times[label].append(update())
            print(f"{label}: {times[label][-1]:.1f} s", flush=True)
    eager, compiled = (statistics.median(times[label]) for label in ("eager", "compiled"))
    tokens = sum(mb.n_response_tokens for mb in batches)
    print(f"\ncalc update, full fine-tune, gradient checkpointing, {len(batches)} micro-batches, median of {reps} "
          f"alternating: eager {eager:.2f} s ({tokens / eager:.1f} tok/s), compiled {compiled:.2f} s "
          f"({tokens / compiled:.1f} tok/s): compiled/eager tokens/s {eager / compiled:.2f}x; the first compiled "
          f"update {first:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed runs of figure 1, after a warm-up")
    parser.add_argument("--path-reps", type=int, default=1,
                        help="timed updates of figure 2, after a warm-up (a plain calc update takes minutes)")
    parser.add_argument("--figure", choices=("all", "overhead", "paths", "compile"), default="all")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # BATCH:PATH:BUDGET:CHECKPOINTING, one figure 2 run
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.child:
        batch, path, budget, checkpointing = args.child.split(":")
        print(json.dumps(path_update(batch, path, int(budget), checkpointing == "True", args.reps)))
        return
    if args.figure in ("all", "overhead"):
        overhead_figure(args.reps)
    if args.figure in ("all", "paths"):
        paths_figure(args.path_reps)
    if args.figure in ("all", "compile"):
        compile_figure(args.reps)


if __name__ == "__main__":
    main()
