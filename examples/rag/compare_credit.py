"""Credit across calls, measured: train the RAG agent once per credit mode (same seed, same minutes) and draw the
three held-out curves in one figure.

    python examples/rag/compare_credit.py                         # 3 runs of examples/rag/config.toml, then the PNG
    python examples/rag/compare_credit.py --plot-only             # the PNG again from the finished runs

Each run is ``lit train examples/rag/config.toml credit.mode=MODE train.max_minutes=MINUTES
train.output_dir=runs/rag-credit-MODE``, one after the other (each needs the whole machine); everything else,
the seed included, is the config's. The figure (``examples/rag/credit_curves.png``) plots the held-out mean reward
(0.9 x answer F1 + 0.1 x format) against minutes of training.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from lit_trainer.results.plots import plot_comparison

MODES = ("identical", "discounted", "intermediate")
HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(HERE / "config.toml"))
    parser.add_argument("--minutes", type=float, default=30.0, help="train.max_minutes of each run")
    parser.add_argument("--runs", default="runs", help="folder of the three output_dirs")
    parser.add_argument("--png", default=str(HERE / "credit_curves.png"))
    parser.add_argument("--plot-only", action="store_true", help="draw the figure from finished runs")
    args = parser.parse_args()
    dirs = {mode: Path(args.runs) / f"rag-credit-{mode}" for mode in MODES}
    if not args.plot_only:
        for mode, out in dirs.items():
            command = ["lit", "train", args.config, f"credit.mode={mode}", f"train.max_minutes={args.minutes}",
                       f"train.output_dir={out}"]
            print("+", " ".join(command), flush=True)
            subprocess.run(command, check=True)
    png = plot_comparison({mode: out / "metrics.jsonl" for mode, out in dirs.items()}, Path(args.png),
                          metric="reward/mean", title=f"RAG agent, credit modes, {args.minutes:g} min each")
    print(f"wrote {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
