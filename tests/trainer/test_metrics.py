"""metrics: the step line, the JSONL log (a kill mid-write loses only the cut line), and the PNG curve."""

from __future__ import annotations

import json
import math

import pytest
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

from lit_trainer.results.memory_usage import memory_gb
from lit_trainer.results.metrics import MetricsLog, read, step_line
from lit_trainer.results.plots import plot_comparison, plot_curve


def test_step_line_formats_each_figure_and_marks_missing_ones():
    m = {"reward/mean": 0.5, "accuracy": 0.5, "rollouts/succeeded": 63.0, "rollouts/requested": 64.0,
         "rollouts/failed": 1.0, "loss/approx_kl": 0.000012, "loss/clip_frac": 0.25, "time/rollout": 12.4,
         "time/update": 80.6, "time/sync": 0.44}  # fmt: skip
    line = step_line(3, 40, m)
    assert line == ("step 3/40  reward 0.500  acc 0.500  rollouts 63/64 (failed 1)  kl 1.2e-05  clip 0.250  "
                    "gap -  time rollout 12s update 81s sync 0.4s")  # fmt: skip
    assert "acc -" in step_line(1, 2, {"accuracy": math.nan})
    more = step_line(3, 40, {**m, "sampling/extra_rollouts": 16.0})  # dynamic sampling drew 16 more
    assert "rollouts 63/64 (failed 1) +16 drawn more  kl" in more
    assert "drawn more" not in step_line(3, 40, {**m, "sampling/extra_rollouts": 0.0})
    rested = step_line(3, 40, {**m, "sampling/extra_rollouts": 16.0, "curriculum/resting_tasks": 500.0})
    assert "(failed 1) +16 drawn more 500 resting  kl" in rested  # the curriculum left 500 tasks out
    assert "resting" not in step_line(3, 40, {**m, "curriculum/resting_tasks": 0.0})
    guided = step_line(3, 40, {**m, "guidance/groups": 2.0, "guidance/failed_groups": 3.0})
    assert "(failed 1) 2 guided  kl" in guided  # off-policy guidance gave 2 failed groups a reference
    assert "guided" not in step_line(3, 40, {**m, "guidance/groups": 0.0})


def test_log_appends_records_and_read_skips_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.log(1, {"accuracy": 0.25})
    log.log(1, {"accuracy": 0.5}, kind="validation")
    log.close()
    with path.open("a") as f:
        f.write('{"kind": "train", "step": 2, "accu')  # the process died here
    records = read(path)
    assert [(r["kind"], r["step"], r["accuracy"]) for r in records] == [("train", 1, 0.25), ("validation", 1, 0.5)]
    assert read(tmp_path / "absent.jsonl") == []
    resumed = MetricsLog(path)  # --resume: the next record goes after the last whole one
    resumed.log(2, {"accuracy": 0.75})
    assert [(r["step"], r["accuracy"]) for r in read(path)] == [(1, 0.25), (1, 0.5), (2, 0.75)]


def test_read_refuses_a_damaged_line_before_the_last(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\nnot json\n{"kind": "train", "step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON record"):
        read(path)


class _RecordingTracker(GeneralTracker):
    """A tracker in accelerate's own plug-in API that keeps what it is given, to check how lit names what it logs
    (the accelerator and its routing are the real ones; tests/trainer/test_trackers.py logs to TensorBoard and W&B)."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.config: dict = {}
        self.logged: list[tuple[dict, int]] = []
        self.ended = False

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values):
        self.config = dict(values)

    def log(self, values, step=None, **kwargs):
        self.logged.append((dict(values), step))

    def finish(self):
        self.ended = True


def test_trackers_get_every_name_under_its_kind_and_a_flat_config(tmp_path):
    tracker = _RecordingTracker()
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    log = MetricsLog(tmp_path / "m.jsonl", accelerator, ["recording"], {"train": {"steps": 40}, "model": "x"})
    log.log(5, {"rollouts/failed": 1.0})
    log.log(5, {"rollouts/failed": 0.0, "accuracy": 0.5}, kind="validation")
    log.close()
    assert tracker.config == {"train.steps": 40, "model": "x"}
    assert tracker.logged == [({"train/rollouts/failed": 1.0}, 5),
                              ({"validation/rollouts/failed": 0.0, "validation/accuracy": 0.5}, 5)]  # fmt: skip
    assert tracker.ended
    assert MetricsLog(tmp_path / "n.jsonl", accelerator, []).accelerator is None  # no trackers named: none used


def test_tensorboard_hides_what_a_stopped_run_logged_of_the_steps_a_resumed_run_logs_again(tmp_path):
    """The stopped run logged steps 1-3, its checkpoint was of step 2: the resumed run logs step 3 again, and
    TensorBoard shows each step once, step 3 as the resumed run logged it (both event files are kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for first_step, values in ((0, {1: 0.1, 2: 0.2, 3: 0.3}), (3, {3: 0.9})):
        accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
        log = MetricsLog(tmp_path / "metrics.jsonl", accelerator, ["tensorboard"], {}, first_step=first_step)
        for step, value in values.items():
            log.log(step, {"reward/mean": value})
        log.close()
    events = EventAccumulator(str(tmp_path / "lit"))
    events.Reload()
    shown = [(e.step, round(e.value, 3)) for e in events.Scalars("train/reward/mean")]
    assert shown == [(1, 0.1), (2, 0.2), (3, 0.9)], shown
    assert len(list((tmp_path / "lit").glob("events.out.tfevents.*"))) == 2


def test_plot_curve_writes_a_png_and_nothing_without_data(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert plot_curve(path, tmp_path / "none.png") is None
    records = [{"kind": "validation", "step": 0, "minutes": 0.0, "accuracy": 0.2},
               {"kind": "train", "step": 1, "minutes": 2.0, "accuracy": 0.3},
               {"kind": "validation", "step": 1, "minutes": 2.0, "accuracy": 0.5}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    png = plot_curve(path, tmp_path / "curve.png", title="t")
    assert png == tmp_path / "curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_a_run_with_sft_steps_shades_them_and_draws_their_loss(tmp_path, monkeypatch):
    """The SFT steps (kind ``sft``) span minutes 0 to the last one's, and their NLL is drawn (capped at 1)."""
    import matplotlib.axes

    path = tmp_path / "metrics.jsonl"
    records = [{"kind": "validation", "step": 0, "minutes": 0.0, "accuracy": 0.1},
               {"kind": "sft", "step": 1, "minutes": 1.5, "sft/nll": 2.5},
               {"kind": "sft", "step": 2, "minutes": 2.0, "sft/nll": 0.4},
               {"kind": "validation", "step": 2, "minutes": 2.0, "accuracy": 0.6},
               {"kind": "train", "step": 3, "minutes": 3.0, "accuracy": 0.7}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    spans, lines = [], []
    span, plot = matplotlib.axes.Axes.axvspan, matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "axvspan", lambda ax, *a, **k: spans.append(a) or span(ax, *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **k: lines.append((k.get("label"), a[:2])) or
                        plot(ax, *a, **k))
    assert plot_curve(path, tmp_path / "curve.png") == tmp_path / "curve.png"
    assert spans == [(0, 2.0)]
    assert ("SFT loss (NLL per token, capped at 1)", ([1.5, 2.0], [1.0, 0.4])) in lines


def test_memory_figures_are_this_process_peak_and_the_servers_largest_processes():
    import subprocess
    import sys
    import time

    import psutil

    ballast = bytearray(64 * 2**20)  # 64 MiB touched: this process's peak is at least that much
    assert memory_gb()["memory/trainer_peak_gb"] >= 64 / 1024
    assert "memory/vllm_gb" not in memory_gb()
    # A stand-in "server" whose child holds 200 MiB: the figure is its largest process, the child.
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; b = bytearray(200 * 2**20); time.sleep(60)']); time.sleep(60)")
    server = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            children = psutil.Process(server.pid).children()
            if children and children[0].memory_info().rss > 190 * 2**20:
                break
            time.sleep(0.1)
        assert memory_gb([server.pid])["memory/vllm_gb"] == pytest.approx(200 / 1024, rel=0.15)
        # several servers: each one's largest process, added up (here the same one twice); one gone counts 0
        assert memory_gb([server.pid, server.pid])["memory/vllm_gb"] == pytest.approx(400 / 1024, rel=0.15)
        assert memory_gb([server.pid, 2**22 + 7])["memory/vllm_gb"] == pytest.approx(200 / 1024, rel=0.15)
    finally:
        for proc in psutil.Process(server.pid).children(recursive=True):
            proc.kill()
        server.kill()
        server.wait()
    del ballast


def test_plot_comparison_draws_each_runs_validation_and_names_a_run_without_it(tmp_path):
    runs = {}
    for label, values in (("identical", [0.2, 0.4]), ("discounted", [0.2, 0.5])):
        path = runs[label] = tmp_path / f"{label}.jsonl"
        path.write_text("".join(json.dumps({"kind": "validation", "step": i, "minutes": 2.0 * i, "reward/mean": v})
                                + "\n" for i, v in enumerate(values)))
    png = plot_comparison(runs, tmp_path / "credit.png", metric="reward/mean", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"kind": "train", "step": 1, "minutes": 1.0, "reward/mean": 0.1}) + "\n")
    with pytest.raises(ValueError, match="empty.jsonl: no validation records with 'reward/mean'"):
        plot_comparison({**runs, "intermediate": empty}, tmp_path / "x.png", metric="reward/mean")
