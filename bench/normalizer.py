"""The loss normaliser N (``loss.normalizer``, algorithm/loss.py) measured on a finished run: how the weight 1/N of an
informative response token, and the gradient norm, vary from step to step under ``batch`` and under ``kept``.

    .venv/bin/python bench/normalizer.py RUN_DIR [--grad] [--recompute] [--steps N]

RUN_DIR is a run's ``train.output_dir``: its ``config.json`` (rebuilt with ``lit_trainer.config.from_dict``),
``lit.sqlite`` (the episodes of every rollout) and ``metrics.jsonl``. For every training step k of the run the script
rebuilds the step's (transition, advantage) pairs exactly as ``pipeline.prepare`` does: the succeeded rollouts of
the step (``store.rollouts_of_step(k - 1)``, train rollouts only, not the validation's, which share the step number;
after a ``--resume`` that re-ran the step, the last session's), their stored episodes in request order, groups
smaller than ``rollouts.min_group_size`` dropped, ``episode_advantages``, ``keep_usable``, ``mask_overlong``. It checks
the rebuild against the step's logged ``update/transitions`` and ``policy/response_tokens``.

Per step it reports the groups and those carrying signal (a nonzero advantage on some usable transition), the usable
transitions and those with signal, their response tokens, and 1/N under each normaliser (N as ``run_update``
computes it with one mini-batch: ``normalizer_of`` of every usable transition for ``batch``, of those with a nonzero
advantage for ``kept``; with ``aggregation = "seq_mean_token_sum"`` N counts sequences). ``sig tok`` is
N_kept / N_batch: under ``batch`` it is the total weight of the step's informative tokens, which is 1 under ``kept``
whatever the step's signal. Across the steps that trained (at least one nonzero advantage): the spread of 1/N under
each normaliser (max/min and coefficient of variation, the sample standard deviation over the mean) and its Pearson
correlation with the fraction of groups carrying signal.

Gradient norms before clipping, two sources:

- from the log (always, when the run used one mini-batch per step): the run's own ``policy/grad_norm`` (Policy.update
  logs the norm before clipping), under the normaliser the run used, on the run's actual weights; the other
  normaliser's norm at the same weights is that times N_run / N_other, exactly: the loss, and so its gradient, is
  linear in 1/N (the KL term too) and the forward pass does not depend on N. It is a counterfactual for that step
  only: a run trained under the other normaliser would have reached other weights.
- ``--grad``: on the run's INITIAL model (the config's ``policy`` with clipping and entropy off; LoRA as the run),
  one ``run_update`` per step with ``UpdateConfig()`` (one epoch, one mini-batch) and ``normalizer = "kept"``, the
  optimizer's step replaced by a no-op so the weights stay the initial ones (checked at the end); the ``batch`` norm
  is derived as above and checked against a second ``run_update`` with ``normalizer = "batch"`` on the first step.
  π_old is the behaviour policy μ of each step, as in the run: on later steps μ is the trained policy's, so the
  initial model's ratio π/μ moves away from 1 and PPO clipping zeroes some tokens' gradients (``clip`` column).
  ``--recompute`` takes π_old from the initial model instead (``recompute_old_logprobs``): ratio 1, the plain policy
  gradient of the step's data at fixed weights. Step 1 started from the initial weights in the run too: its norm
  under the run's normaliser is checked against the logged one. Cost: one forward+backward per trained step (about
  25 s for the calc example's 64 transitions on 2 busy CPU cores), one more for the check; ``--steps`` limits it.

A step's norm "clips" when it exceeds the run's ``policy.max_grad_norm`` (clipping would engage). Prints a markdown
table per step, a summary table, and a paragraph reading them. bench/README.md keeps the last measured figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lit_trainer.algorithm.advantages import episode_advantages
from lit_trainer.algorithm.loss import normalizer_of
from lit_trainer.config import TrainConfig, from_dict
from lit_trainer.intake.episodes import Episode, Transition
from lit_trainer.intake.rows import RolloutStatus
from lit_trainer.intake.store import SqliteStore
from lit_trainer.learner.batching import keep_usable
from lit_trainer.learner.schedule import mask_overlong
from lit_trainer.results.metrics import read as read_metrics

TRAIN_ROLLOUT = re.compile(r"^(?P<session>[^-]+)-s(?P<step>\d+)-t(?P<task>.*)-g(?P<g>\d+)-a(?P<attempt>\d+)$")
"""A training rollout's id: ``<session>-s<step from 0>-t<task>-g<index in group>-a<attempt>`` (``RolloutRunner.run``
and the dispatcher); validation rollouts are ``<session>-val<step>-...``."""


@dataclass
class Step:
    """One training step rebuilt from the store."""

    step: int
    """From 1, as in metrics.jsonl."""
    pairs: list[tuple[Transition, float]]
    groups: int
    signal_groups: int
    n_batch: float
    n_kept: float
    tokens_all: int
    tokens_kept: int
    sessions: int
    trained: bool
    logged: dict[str, Any] = field(default_factory=dict)
    grad: dict[str, float] = field(default_factory=dict)
    """``{"batch": norm, "kept": norm, "clip": clip_frac}`` from ``--grad``."""

    @property
    def usable(self) -> int:
        return len(self.pairs)

    @property
    def signal(self) -> int:
        return sum(1 for _, a in self.pairs if a != 0.0)

    @property
    def signal_fraction(self) -> float:
        return self.signal_groups / self.groups if self.groups else 0.0


def load_config(run: Path) -> tuple[TrainConfig, str]:
    """The run's config and the normaliser it trained with (config.json written before ``loss.normalizer`` existed
    had the old behaviour, ``kept``)."""
    table = json.loads((run / "config.json").read_text())
    used = table.get("loss", {}).get("normalizer", "kept")
    return from_dict(table, where=str(run / "config.json")), used


def step_episodes(store: SqliteStore, step: int) -> tuple[list[Episode], int]:
    """The episodes training step ``step`` (from 1) trained on, in request order, and how many sessions ran it."""
    rows = [r for r in store.rollouts_of_step(step - 1)
            if (m := TRAIN_ROLLOUT.match(r.rollout_id)) and int(m["step"]) == step - 1]
    sessions = list(dict.fromkeys(TRAIN_ROLLOUT.match(r.rollout_id)["session"] for r in rows))
    if not sessions:
        return [], 0
    last = sessions[-1]  # a resumed run re-ran the step: the last session's rollouts are the ones it trained on
    order: dict[str, int] = {}  # request key -> position of its first attempt: the dispatcher's outcome order
    succeeded: dict[str, str] = {}
    for r in rows:
        m = TRAIN_ROLLOUT.match(r.rollout_id)
        if m["session"] != last:
            continue
        key = r.rollout_id[: m.start("attempt") - 2]
        order.setdefault(key, len(order))
        if r.status is RolloutStatus.SUCCEEDED:
            succeeded[key] = r.rollout_id
    episodes = []
    for key in sorted(succeeded, key=order.__getitem__):
        row = store.get_episode(succeeded[key])
        if row is not None:  # a succeeded rollout that gave no usable episode has none
            episodes.append(Episode.from_dict(row.data))
    return episodes, len(sessions)


def rebuild(cfg: TrainConfig, step: int, episodes: list[Episode], sessions: int) -> Step:
    """The step's pairs as ``pipeline.prepare`` builds them, and their counts."""
    groups = collections.Counter(e.task_id for e in episodes)
    kept = [e for e in episodes if groups[e.task_id] >= cfg.rollouts.min_group_size]
    pairs: list[tuple[Transition, float]] = []
    if kept:
        advantages, _ = episode_advantages(kept, cfg.credit, cfg.advantages)
        pairs = [(t, float(a)) for e, adv in zip(kept, advantages, strict=True)
                 for t, a in zip(e.transitions, adv.tolist(), strict=True)]
        pairs, _ = keep_usable(pairs, cfg.batching)
        pairs, _ = mask_overlong(pairs, cfg.update)
    signal = [(t, a) for t, a in pairs if a != 0.0]
    agg = cfg.loss.aggregation
    trained = bool(pairs) and (cfg.loss.kl_beta > 0 or bool(signal))
    return Step(step, pairs, groups=len({e.task_id for e in kept}), signal_groups=len({t.task_id for t, _ in signal}),
                n_batch=normalizer_of([len(t.response_ids) for t, _ in pairs], agg),
                n_kept=normalizer_of([len(t.response_ids) for t, _ in signal], agg),
                tokens_all=sum(len(t.response_ids) for t, _ in pairs),
                tokens_kept=sum(len(t.response_ids) for t, _ in signal), sessions=sessions, trained=trained)


def check(cfg: TrainConfig, s: Step) -> list[str]:
    """Differences between the rebuild and what the run logged for the step."""
    if not s.sessions:
        return [f"step {s.step}: no training rollout of it in the store"]
    out = []
    logged = s.logged.get("update/transitions")
    if logged is not None and int(logged) != s.signal:
        out.append(f"step {s.step}: {s.signal} transitions with signal, the run logged {int(logged)}")
    logged = s.logged.get("policy/response_tokens")
    if s.trained and logged is not None:
        trained_tokens = s.tokens_all if cfg.loss.kl_beta > 0 else s.tokens_kept
        if int(logged) != trained_tokens * cfg.update.ppo_epochs:
            out.append(f"step {s.step}: {trained_tokens} response tokens trained on, the run logged {int(logged)}")
    return out


def _pad_id(policy: Any) -> int:
    """As ``loop._pad_id``."""
    config = policy.unwrapped().config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return int(pad[0] if isinstance(pad, list) else pad or 0)


def initial_grad_norms(cfg: TrainConfig, steps: list[Step], recompute: bool, used: str) -> str:
    """Fill ``Step.grad`` with the gradient norms of each trained step's loss on the initial model (module
    docstring); a line on the self-checks."""
    import torch

    from lit_trainer.learner.policy import Policy
    from lit_trainer.learner.schedule import UpdateConfig, run_update
    from lit_trainer.models.folders import resolve_model

    policy = Policy(replace(cfg.policy, max_grad_norm=0.0, compute_entropy=False),
                    reference=str(resolve_model(cfg.model)) if cfg.loss.kl_beta > 0 else None)
    policy.optimizer.step = lambda *args, **kwargs: None  # measure the gradient, never move the weights
    probe = policy.trainable[-1]
    before = probe.detach().clone()
    pad_id = _pad_id(policy)
    update = UpdateConfig(recompute_old_logprobs=recompute or cfg.update.recompute_old_logprobs)
    notes, t0 = [], time.perf_counter()
    for s in steps:
        if not s.trained:
            continue
        seed = cfg.train.seed * 100_003 + s.step
        m = run_update(policy, s.pairs, update, replace(cfg.loss, normalizer="kept"), cfg.batching, pad_id, seed)
        s.grad = {"kept": m["policy/grad_norm"], "batch": m["policy/grad_norm"] * s.n_kept / s.n_batch,
                  "clip": m.get("loss/clip_frac", 0.0)}
        if not notes:
            direct = run_update(policy, s.pairs, update, replace(cfg.loss, normalizer="batch"), cfg.batching, pad_id,
                                seed)["policy/grad_norm"]
            notes.append(f"step {s.step}: batch norm {direct:.6g} computed, {s.grad['batch']:.6g} derived "
                         f"(relative difference {abs(direct - s.grad['batch']) / max(direct, 1e-30):.1e})")
        print(f"  --grad step {s.step}: {len(s.pairs)} pairs, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    first = next((s for s in steps if s.grad), None)
    logged = first.logged.get("policy/grad_norm") if first is not None and first.step == 1 else None
    same = (cfg.update.ppo_epochs == 1 and cfg.update.mini_batches == 1
            and update.recompute_old_logprobs == cfg.update.recompute_old_logprobs)
    if logged is not None and same:  # step 1 of the run started from the initial weights too
        mine = first.grad[used]
        notes.append(f"step 1 under `{used}`: {mine:.6g} here, {logged:.6g} logged by the run (relative difference "
                     f"{abs(mine - logged) / max(logged, 1e-30):.1e})")
    if not torch.equal(before, probe.detach()):
        raise RuntimeError("the weights moved during --grad: the optimizer step was not disabled")
    notes.append(f"weights unchanged; {time.perf_counter() - t0:.0f} s on {policy.accelerator.device}")
    return "; ".join(notes)


def log_grad_norms(s: Step, used: str) -> dict[str, float]:
    """The run's logged pre-clip norm under its normaliser, and the other's at the same weights (module docstring)."""
    g = s.logged.get("policy/grad_norm")
    if g is None or not s.trained:
        return {}
    n = {"batch": s.n_batch, "kept": s.n_kept}
    return {name: g * n[used] / n[name] for name in n}


def spread(values: list[float]) -> dict[str, float]:
    """min, max, max/min and coefficient of variation (sample std / mean) of positive values."""
    if not values:
        return {}
    mean = statistics.fmean(values)
    cv = statistics.stdev(values) / mean if len(values) > 1 and mean else 0.0
    return {"min": min(values), "max": max(values), "ratio": max(values) / min(values) if min(values) else math.inf,
            "cv": cv, "mean": mean}


def correlation(x: list[float], y: list[float]) -> float:
    try:
        return statistics.correlation(x, y)
    except statistics.StatisticsError:  # fewer than two points, or a constant series
        return math.nan


def _g(x: float | None, fmt: str = "#.3g") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def per_step_table(steps: list[Step], used: str, has_log_grad: bool, has_grad: bool) -> list[str]:
    head = ["step", "groups", "signal groups", "usable", "with signal", "tokens all", "tokens kept", "sig tok",
            "1/N batch", "1/N kept"]
    if has_log_grad:
        head += [f"log ‖g‖ batch{' (run)' if used == 'batch' else ''}",
                 f"log ‖g‖ kept{' (run)' if used == 'kept' else ''}"]
    if has_grad:
        head += ["init ‖g‖ batch", "init ‖g‖ kept", "clip"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in steps:
        w = s.trained
        row = [str(s.step) + ("*" if s.sessions > 1 else ""), str(s.groups), str(s.signal_groups), str(s.usable),
               str(s.signal), str(s.tokens_all), str(s.tokens_kept),
               _g(s.tokens_kept / s.tokens_all if w and s.tokens_all else None, ".2f"),
               _g(1 / s.n_batch if w else None, ".2e"), _g(1 / s.n_kept if w else None, ".2e")]
        if has_log_grad:
            lg = log_grad_norms(s, used)
            row += [_g(lg.get("batch")), _g(lg.get("kept"))]
        if has_grad:
            row += [_g(s.grad.get("batch")), _g(s.grad.get("kept")), _g(s.grad.get("clip"), ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def summary(steps: list[Step], cfg: TrainConfig, used: str, recompute: bool) -> tuple[list[str], str]:
    """The summary table and the paragraph reading it."""
    trained = [s for s in steps if s.trained and s.signal]
    frac = [s.signal_fraction for s in trained]
    w = {"batch": [1 / s.n_batch for s in trained], "kept": [1 / s.n_kept for s in trained]}
    sp = {k: spread(v) for k, v in w.items()}
    corr = {k: correlation(v, frac) for k, v in w.items()}
    sig_tok = spread([s.n_kept / s.n_batch for s in trained])
    limit = cfg.policy.max_grad_norm
    sources = []
    log_norms = [log_grad_norms(s, used) for s in trained]
    if cfg.update.mini_batches == 1 and trained and all(log_norms):
        sources.append(("run's weights", f"the run's weights (logged under `{used}`)",
                        {k: [g[k] for g in log_norms] for k in ("batch", "kept")}))
    if trained and all(s.grad for s in trained):
        where = "the initial model" + (", π_old recomputed" if recompute else ", π_old = μ")
        sources.append(("initial model", where, {k: [s.grad[k] for s in trained] for k in ("batch", "kept")}))

    lines = ["| figure | batch | kept |", "|---|---|---|"]
    for k, label in (("min", "1/N min"), ("max", "1/N max")):
        lines.append(f"| {label} | {_g(sp['batch'].get(k), '.2e')} | {_g(sp['kept'].get(k), '.2e')} |")
    lines.append(f"| 1/N max/min | {_g(sp['batch'].get('ratio'), '.2f')} | {_g(sp['kept'].get('ratio'), '.2f')} |")
    lines.append(f"| 1/N coefficient of variation | {_g(sp['batch'].get('cv'), '.2f')} | "
                 f"{_g(sp['kept'].get('cv'), '.2f')} |")
    lines.append(f"| corr(1/N, fraction of groups with signal) | {_g(corr['batch'], '+.2f')} | "
                 f"{_g(corr['kept'], '+.2f')} |")
    lines.append(f"| total weight of a step's informative tokens (mean, min–max) | {_g(sig_tok.get('mean'), '.2f')}"
                 f" ({_g(sig_tok.get('min'), '.2f')}–{_g(sig_tok.get('max'), '.2f')}) | 1 |")
    for name, where, norms in sources:
        g = {k: spread(v) for k, v in norms.items()}
        over = {k: sum(1 for x in v if limit and x > limit) for k, v in norms.items()}
        lines.append(f"| ‖g‖ before clipping, {where}: min–max | {_g(g['batch']['min'])}–{_g(g['batch']['max'])} | "
                     f"{_g(g['kept']['min'])}–{_g(g['kept']['max'])} |")
        lines.append(f"| ‖g‖ on the {name}: max/min, CV | {_g(g['batch']['ratio'], '.2f')}, "
                     f"{_g(g['batch']['cv'], '.2f')} | {_g(g['kept']['ratio'], '.2f')}, {_g(g['kept']['cv'], '.2f')} |")
        lines.append(f"| ‖g‖ on the {name} > max_grad_norm = {limit:g} (clipping engages) | "
                     f"{over['batch']}/{len(trained)} | {over['kept']}/{len(trained)} |")

    if not trained:
        return lines, "No step of this run had a transition with a nonzero advantage: nothing to compare."
    idle = len(steps) - len(trained)
    unit = "token" if cfg.loss.aggregation == "token_mean" else "sequence"
    text = (f"Over the {len(trained)} steps that trained ({idle} without signal, not counted), the fraction of groups "
            f"carrying signal ranged {min(frac):.2f}–{max(frac):.2f}. Under `kept` the weight 1/N of an informative "
            f"{unit} ranged {sp['kept']['min']:.2e}–{sp['kept']['max']:.2e} (max/min {sp['kept']['ratio']:.2f}, "
            f"CV {sp['kept']['cv']:.2f}), correlation {_g(corr['kept'], '+.2f')} with the signal fraction: every "
            f"step's informative {unit}s weigh 1 in total, however few groups carry signal. Under `batch` it ranged "
            f"{sp['batch']['min']:.2e}–{sp['batch']['max']:.2e} (max/min {sp['batch']['ratio']:.2f}, CV "
            f"{sp['batch']['cv']:.2f}, correlation {_g(corr['batch'], '+.2f')}), set by the step's usable {unit}s "
            f"alone, and a step's informative {unit}s weigh the signal-{unit} fraction in total "
            f"({sig_tok['mean']:.2f} on average, {sig_tok['min']:.2f}–{sig_tok['max']:.2f}): a step with little signal "
            f"takes a proportionally smaller step.")
    if abs(sp["batch"]["cv"] - sp["kept"]["cv"]) > 0.01:
        steadier = "batch" if sp["batch"]["cv"] < sp["kept"]["cv"] else "kept"
        text += f" `{steadier}` has the steadier per-{unit} weight on this run."
    for _, where, norms in sources:
        g = {k: spread(v) for k, v in norms.items()}
        over = {k: sum(1 for x in v if limit and x > limit) for k, v in norms.items()}
        text += (f" Gradient norms before clipping on {where}: `batch` {g['batch']['min']:#.3g}–"
                 f"{g['batch']['max']:#.3g} (CV {g['batch']['cv']:.2f}), over max_grad_norm = {limit:g} on "
                 f"{over['batch']}/{len(trained)} steps; `kept` {g['kept']['min']:#.3g}–{g['kept']['max']:#.3g} "
                 f"(CV {g['kept']['cv']:.2f}), over it on {over['kept']}/{len(trained)}.")
        if abs(g["batch"]["cv"] - g["kept"]["cv"]) > 0.01:
            text += f" `{'batch' if g['batch']['cv'] < g['kept']['cv'] else 'kept'}` has the steadier norm there."
    if len(trained) < 8:
        text += f" With {len(trained)} steps these spreads and correlations are indicative only."
    return lines, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the run's train.output_dir (config.json, lit.sqlite, metrics.jsonl)")
    parser.add_argument("--grad", action="store_true", help="gradient norms on the run's initial model")
    parser.add_argument("--recompute", action="store_true", help="with --grad: π_old from the initial model (ratio 1)")
    parser.add_argument("--steps", type=int, default=0, help="only the first N training steps (0: all)")
    args = parser.parse_args()
    cfg, used = load_config(args.run)
    records = read_metrics(args.run / "metrics.jsonl")
    logged = {r["step"]: r for r in records if r.get("kind") == "train"}  # after a resume the last record wins
    numbers = sorted(logged)
    if args.steps:
        numbers = numbers[: args.steps]
    if not numbers:
        sys.exit(f"{args.run / 'metrics.jsonl'} holds no training step")
    steps = []
    with SqliteStore(args.run / "lit.sqlite") as store:
        for k in numbers:
            episodes, sessions = step_episodes(store, k)
            s = rebuild(cfg, k, episodes, sessions)
            s.logged = logged[k]
            steps.append(s)
    problems = [p for s in steps for p in check(cfg, s)]
    grad_note = initial_grad_norms(cfg, steps, args.recompute, used) if args.grad else ""

    print(f"run {args.run}: {len(steps)} steps, trained with loss.normalizer = `{used}`, aggregation "
          f"`{cfg.loss.aggregation}`, policy.max_grad_norm = {cfg.policy.max_grad_norm:g}, "
          f"update.mini_batches = {cfg.update.mini_batches}, ppo_epochs = {cfg.update.ppo_epochs}")
    if cfg.update.mini_batches != 1:
        print("(the run used several mini-batches per step: N is per mini-batch there, so 1/N and the logged norms "
              "below, computed for the whole step, are not the run's)")
    print("rebuild vs the run's log: " + ("; ".join(problems) if problems else "transitions and tokens match"))
    if grad_note:
        print("--grad: " + grad_note)
    if any(s.sessions > 1 for s in steps):
        print("*: the step ran in several sessions (resumed); the last session's rollouts are used")
    print()
    has_log = cfg.update.mini_batches == 1 and any(log_grad_norms(s, used) for s in steps)
    print("\n".join(per_step_table(steps, used, has_log, args.grad)))
    print()
    lines, text = summary(steps, cfg, used, args.recompute)
    print("\n".join(lines))
    print()
    print(text)


if __name__ == "__main__":
    main()
