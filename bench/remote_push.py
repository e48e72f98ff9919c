"""Bytes and seconds of a weight push to a vLLM server on another host (``inference.remote``, ``lit serve``).

``lit serve`` starts here with the prepared SmolLM2-135M (its own process and vLLM, as on another host), listening
on ``--listen``; this script connects as a trainer (``RemoteServer``, the trainer's keys) and pushes the model's
weights ``--pushes`` times, as ``Fleet`` does each step (``for_serving``: float32). For each push: the bytes sent,
the whole round trip, and its parts: ``send`` (packing, CURVE encryption, the transfer, unpacking on the other
side) and what ``lit serve`` did with them, which is a local trainer's own push into its vLLM (writing the shared
memory file, pause, reload, cache reset, version, resume): the baseline, measured in the same push. The figure:
median seconds, and the round trip as a multiple of the local push.

    .venv/bin/python bench/remote_push.py                       # loopback, 3 pushes
    .venv/bin/python bench/remote_push.py --listen tcp://10.0.0.2:7400 --pushes 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="tcp://127.0.0.1:7411", help="where lit serve listens")
    parser.add_argument("--port", type=int, default=8011, help="lit serve's vLLM port")
    parser.add_argument("--pushes", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from lit_sdk.processes import start_child, stop_child
    from lit_sdk.protocol import security
    from lit_trainer.engine.fleet import for_serving
    from lit_trainer.engine.remote import RemoteServer
    from lit_trainer.models.embedded import prepare_default_model

    model_dir = prepare_default_model().path
    work = Path(tempfile.mkdtemp(prefix="lit-bench-remote-"))
    keys = work / "keys"
    security.generate_keys(keys)
    config = work / "config.toml"
    config.write_text(f'model = "{model_dir}"\n[agent]\nfunction = "x:y"\n[inference]\ncpu_kv_cache_gb = 1\n'
                      'extra_args = ["--enforce-eager"]\n')
    log = work / "serve.log"
    with log.open("w") as sink:
        serve = start_child([sys.executable, "-m", "lit_trainer.cli", "serve", str(config), "--listen", args.listen,
                             "--host", "127.0.0.1", "--port", str(args.port), "--keys", str(keys)],
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, stdout=sink,
                            stderr=subprocess.STDOUT)
    try:
        while "lit serve: vLLM serves" not in log.read_text():
            if serve.poll() is not None:
                raise SystemExit(f"lit serve stopped:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        served = for_serving(state, "float32")
        sent = sum(t.numel() * t.element_size() for t in served.values())
        remote = RemoteServer(args.listen, security.load_engine_link_keys(keys)[1],
                              security.read_api_key(keys / security.API_KEY), timeout_s=600).connect()
        reports = []
        for version in range(1, args.pushes + 1):
            t0 = time.perf_counter()
            report = remote.push_weights(served, str(version))
            reports.append({"round_trip": time.perf_counter() - t0, **report.seconds})
            print(json.dumps({k: round(v, 3) for k, v in reports[-1].items()}), flush=True)
        remote.close()
    finally:
        stop_child(serve, 30, name="lit serve")
    median = {k: statistics.median(r[k] for r in reports) for k in reports[0]}
    local = sum(v for k, v in median.items() if k.startswith("remote_"))
    print(f"\n{len(served)} tensors, {sent / 1e6:.0f} MB a push (float32), {args.pushes} pushes, median:")
    print(f"round trip {median['round_trip']:.2f} s = send {median['send']:.2f} s "
          f"({sent / 1e6 / median['send']:.0f} MB/s) + lit serve's local push {local:.2f} s "
          f"({', '.join(f'{k[7:]} {v:.2f}' for k, v in median.items() if k.startswith('remote_'))}); "
          f"{median['round_trip'] / local:.2f}x the local push")


if __name__ == "__main__":
    main()
