"""The ``lit`` command line. Each subcommand imports what it needs only when it runs, so ``lit --help`` is instant
and never imports torch.

Errors that a user can fix (a bad path, a missing extra) end the command with one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

from lit_sdk.install import pip_install
from lit_sdk.processes import TERMINATED, sigterm_as_interrupt
from lit_trainer import __version__
from lit_trainer.models.folders import DEFAULT_MODEL, ModelError
from lit_trainer.progress import quiet_library_bars
from lit_trainer.results.metrics import STEP_LINE_LEGEND

CHECK_PROMPT = "What is the capital of France? Answer in one sentence."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # the worker has its own parser (and stays free of torch)
        return _worker_main(argv[1:])
    quiet_library_bars()  # transformers' own bars, in a log: off before it is imported
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides may come after options too: lit eval CFG --checkpoint runs/calc train.seed=3
        if not hasattr(args, "overrides") or any("=" not in item or item.startswith("-") for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except (ModelError, ValueError, FileNotFoundError, RuntimeError) as exc:
        # Config, model, checkpoint, port and server errors: their messages name the fix.
        print(f"lit: error: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        install = _INSTALL_FOR.get((exc.name or "").partition(".")[0])
        if install is None:
            raise
        print(f"lit: error: this command needs {exc.name}, which is not installed; install it with\n    {install}\n"
              "(torch first: see docs/install.md for the CPU and the GPU build)", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        if exc.args == (TERMINATED,):
            print("lit: stopped by SIGTERM", file=sys.stderr)
            return 128 + signal.SIGTERM
        print("lit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lit config keys | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


_TRAINER_MODULES = ("torch", "transformers", "accelerate", "peft", "safetensors", "gguf", "sentencepiece", "tqdm",
                    "numpy", "requests", "matplotlib", "msgspec", "psutil")
_INSTALL_FOR = {name: pip_install("trainer") for name in _TRAINER_MODULES}
"""The install command for a top-level module of the trainer's extras, which lit without extras (the SDK alone)
lacks: ``lit train``, ``eval``, ``model`` and ``config`` say it instead of a traceback (lit_sdk/install.py: from
where this lit was installed)."""
CONFIG_HELP = ("Every config key, with its default and meaning: `lit config keys` (the dataclasses in "
               "src/lit_trainer/config.py and the classes it names). Overrides are section.key=value in TOML syntax, "
               "before or after the options.")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lit",
        description="Train any AI agent with reinforcement learning, without changing the agent's code.",
        epilog=CONFIG_HELP,
    )
    parser.add_argument("--version", action="version", version=f"lit {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    model = commands.add_parser("model", help="prepare and check models")
    model_commands = model.add_subparsers(title="model commands", metavar="COMMAND")
    prepare = model_commands.add_parser(
        "prepare", help="install and convert the embedded default model (SmolLM2-135M) once"
    )
    prepare.add_argument(
        "--cache-dir", type=Path,
        help="where models are kept (default: $LIT_CACHE_DIR, else $XDG_CACHE_HOME/lit, else ~/.cache/lit)"
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

    train = commands.add_parser("train", help="train an agent from a config file",
                                epilog=f"{CONFIG_HELP} The console: {STEP_LINE_LEGEND}.")
    train.add_argument("config", type=Path, help="a TOML config (see examples/calc/config.toml)")
    train.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                       help="change config values")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    train.add_argument("--check", action="store_true",
                       help="only make the checks that come before the model loads and vLLM starts (config, data, "
                            "agent, model folder, run folder, W&B credentials, ports), say what they found, and the "
                            "policy's memory; train nothing")
    train.set_defaults(run=_train)
    evaluate = commands.add_parser(
        "eval", help="run validation of a checkpoint (or of the base model)",
        epilog=f"It writes its store, result (eval.jsonl) and config beside the evaluated run, in RUN/eval/step-N "
        "(the base model's: eval/base in the config's train.output_dir), or into train.output_dir when given on "
        f"this command line; `lit show --run` that folder lists its rollouts. {CONFIG_HELP}")
    evaluate.add_argument("config", type=Path)
    evaluate.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                          help="change config values")
    evaluate.add_argument("--checkpoint", help="a checkpoints/step-N folder or a run's output_dir; "
                          "default: the config's base model")
    evaluate.add_argument("--output", type=Path, help="also write the result as JSON here")
    evaluate.set_defaults(run=_eval)
    config = commands.add_parser("config", help="list the config keys, or show a config with its overrides applied")
    config_commands = config.add_subparsers(title="config commands", metavar="COMMAND")
    keys_list = config_commands.add_parser("keys", help="every config key with its default and meaning")
    keys_list.add_argument("section", nargs="?", help="only this section (e.g. train)")
    keys_list.set_defaults(run=_config_keys)
    show_config = config_commands.add_parser("show", help="the full config a train or eval command would use")
    show_config.add_argument("config", type=Path)
    show_config.add_argument("overrides", nargs="*", default=[], metavar="section.key=value")
    show_config.set_defaults(run=_config_show)
    config.set_defaults(run=lambda _args: (config.print_help(), 2)[1])
    keys = commands.add_parser("keys", help="make the keys that let workers on other hosts in")
    keys_commands = keys.add_subparsers(title="keys commands", metavar="COMMAND")
    generate = keys_commands.add_parser(
        "generate", help="write CURVE keypairs for the span and dispatch channels and an API key for vLLM"
    )
    generate.add_argument("folder", nargs="?", type=Path, default=Path("~/.lit/keys"),
                          help="where to write them (created 0700; default %(default)s); never overwritten")
    generate.set_defaults(run=_keys_generate)
    keys.set_defaults(run=lambda _args: (keys.print_help(), 2)[1])
    show = commands.add_parser("show", help="write one rollout as an HTML page: its spans, tokens, advantages and "
                               "rewards (docs/viewer.md); without an id, list the rollouts of a step")
    show.add_argument("rollout_id", nargs="?",
                      help="a rollout id; without one, list the rollouts of the last training step")
    show.add_argument("--run", dest="run_dir", type=Path, required=True,
                      help="the run's train.output_dir (the folder holding its store), or the folder lit eval wrote")
    show.add_argument("--output", type=Path, help="where to write the page (default: RUN/rollouts/ROLLOUT_ID.html)")
    show.add_argument("--step", type=int, metavar="N", help="list training step N's rollouts (from 1, as the "
                      "console's `step N/STEPS` counts) instead of the last one's")
    show.add_argument("--validation", action="store_true",
                      help="list a validation's rollouts instead: the last one, or with --step N the one after step "
                      "N (0: before training); a folder of lit eval has only these")
    show.set_defaults(run=_show)
    serve = commands.add_parser(
        "serve", help="run a vLLM server on this host for a trainer on another (its inference.remote)",
        epilog="It needs the trainer's keys folder (lit keys generate; [security] keys_dir), all of it: the link to "
        "the trainer is encrypted with the trainer's own keypair, and the server takes the run's API key. "
        f"{CONFIG_HELP}")
    serve.add_argument("config", type=Path, help="the run's config: its [inference] section sets the server")
    serve.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                       help="change config values (inference.model: the model's folder on this host)")
    serve.add_argument("--listen", default="tcp://0.0.0.0:7400",
                       help="where the trainer connects (default %(default)s)")
    serve.add_argument("--host", default="0.0.0.0", help="address vLLM binds (default %(default)s)")
    serve.add_argument("--port", type=int, default=8000,
                       help="vLLM's port (default %(default)s; a fixed one, so that the trainer finds the server "
                       "at the same address when it comes back)")
    serve.add_argument("--keys", help="the trainer's keys folder (default: the config's [security] keys_dir, else "
                       "$LIT_KEYS_DIR)")
    serve.set_defaults(run=_serve)
    worker = commands.add_parser("worker", help="run agent rollouts for a trainer", add_help=False)
    worker.add_argument("rest", nargs=argparse.REMAINDER)
    worker.set_defaults(run=lambda args: _worker_main(args.rest))
    return parser


def _model_prepare(args: argparse.Namespace) -> int:
    from lit_trainer.models.embedded import prepare_default_model

    prepared = prepare_default_model(cache=args.cache_dir, force=args.force)
    if not prepared.created:
        print(f"model already prepared: {prepared.path}", file=sys.stderr)
    print(prepared.path)
    return 0


def _model_path(args: argparse.Namespace) -> int:
    from lit_trainer.models.folders import resolve_model

    print(resolve_model(args.model, cache=args.cache_dir))
    return 0


def _model_check(args: argparse.Namespace) -> int:
    from lit_trainer.models.folders import greedy_reply, resolve_model

    folder = resolve_model(args.model, cache=args.cache_dir)
    t0 = time.perf_counter()
    reply = greedy_reply(folder, args.prompt, max_new_tokens=args.max_new_tokens)
    print(f"model:  {folder}", file=sys.stderr)
    print(f"prompt: {args.prompt}", file=sys.stderr)
    print(f"reply:  {reply}")
    print(f"({time.perf_counter() - t0:.1f} s including loading)", file=sys.stderr)
    return 0


def _train(args: argparse.Namespace) -> int:
    import lit_trainer
    from lit_trainer.learner import distributed
    from lit_trainer.run.evaluation import accuracy_line

    config = lit_trainer.load_config(args.config, args.overrides)
    if args.check:
        from lit_trainer.results.runs import RunFolder
        from lit_trainer.run.preflight import preflight

        for line in preflight(config, args.resume, RunFolder(config.train.output_dir)).lines(config):
            print(f"lit: {line}", file=sys.stderr)
        print("lit: --check: every check made before the model loads passed; nothing was trained", file=sys.stderr)
        return 0
    with sigterm_as_interrupt():  # stops as Ctrl-C does
        run = lit_trainer.train(config, resume=args.resume)
    validations = run.validations()
    if validations and distributed.is_launch_main():  # under torchrun, the main process says it
        print(f"final held-out {accuracy_line(validations[-1])}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import lit_trainer
    from lit_trainer.config import override_key

    config = lit_trainer.load_config(args.config, args.overrides)
    # train.output_dir given here names the eval's folder; the config file's is the run's, not written into
    explicit = any(override_key(item) == "train.output_dir" for item in args.overrides)
    with sigterm_as_interrupt():  # stops as Ctrl-C does
        result = lit_trainer.evaluate(config, args.checkpoint, args.output,
                                      config.train.output_dir if explicit else None)
    # the result line itself was printed by the validation: "checkpoint ... (step N): accuracy"
    written = f"; result also written to {args.output}" if args.output else ""
    print(f"lit: {result['evaluated']} evaluated into {result['output_dir']}{written}; its rollouts: "
          f"lit show --run {result['output_dir']}", file=sys.stderr)
    return 0


def _config_keys(args: argparse.Namespace) -> int:
    from lit_trainer.config import config_keys

    keys = [k for k in config_keys() if not args.section or k.name.startswith(f"{args.section}.")]
    if not keys:
        sections = sorted({k.name.split(".")[0] for k in config_keys() if "." in k.name})
        near = difflib.get_close_matches(args.section, sections, n=1)
        raise ValueError(f"no config section {args.section!r}{f'; did you mean {near[0]!r}?' if near else ''} "
                         f"(the sections are {sections})")
    for key in keys:
        print(_toml_line(key.name, key.default))
        if key.doc:
            print(textwrap.fill(key.doc, width=100, initial_indent="    ", subsequent_indent="    "))
    return 0


def _config_show(args: argparse.Namespace) -> int:
    import lit_trainer
    from lit_trainer.config import NOT_KEYS
    from lit_trainer.run.preflight import memory_of

    config = lit_trainer.load_config(args.config, args.overrides)
    table = config.to_dict()
    for name in NOT_KEYS:
        table.pop(name, None)
    for name, value in table.items():
        if not isinstance(value, dict):
            print(_toml_line(name, value))
    for name, value in table.items():
        if isinstance(value, dict):
            print(f"\n[{name}]")
            for key, item in value.items():
                print(_toml_line(key, item))
    print(f"\n# {memory_of(config)}")
    return 0


def _toml_line(key: str, value: object) -> str:
    """``key = value``; a key that is not set (None: TOML has no null) as a comment, so that the printed config
    reads back with it unset, not set to the text "None"."""
    return f"# {key} is not set" if value is None else f"{key} = {_toml_value(value)}"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table: inference.lora_modules
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def _serve(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import lit_trainer
    from lit_sdk.protocol.security import API_KEY, HOW_TO_MAKE, keys_dir_from_env
    from lit_trainer.engine.serve import serve

    config = lit_trainer.load_config(args.config, args.overrides)
    keys = args.keys or config.security.keys_dir or keys_dir_from_env()
    if not keys:
        raise ValueError(f"lit serve needs the trainer's keys: {HOW_TO_MAKE}, copy that folder here and give it "
                         "with --keys (or [security] keys_dir, or $LIT_KEYS_DIR)")
    key = {} if config.inference.api_key or config.inference.api_key_file else {
        "api_key_file": str(Path(keys).expanduser() / API_KEY)}  # the run's, which its agents send
    inference = replace(config.inference, host=args.host, port=args.port, **key)
    with sigterm_as_interrupt():
        try:
            serve(inference, config.weight_sync, str(keys), args.listen)
        except KeyboardInterrupt:
            print("lit serve: stopped", file=sys.stderr)
    return 0


def _keys_generate(args: argparse.Namespace) -> int:
    from lit_sdk.protocol.security import CLIENT_SECRET, KEYS_ENV, SERVER_PUBLIC, generate_keys

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
server.key_secret and api_key go to no worker host. A host that runs `lit serve` for the trainer (a vLLM server
that takes its weights) gets the whole folder, as the trainer's own.""", file=sys.stderr)
    return 0


def _show(args: argparse.Namespace) -> int:
    from lit_trainer.results.runs import Run
    from lit_trainer.steps import step_name

    with Run(args.run_dir) as run:
        if args.rollout_id is not None:
            output = args.output or run.folder.rollout_page(args.rollout_id)
            print(run.show(args.rollout_id).save(output))
            return 0
        rows, validation = _listed_rollouts(run, args.step, args.validation)
        other = "--validation: the last validation's" if not validation else "without --validation: training's"
        print(f"rollouts of {step_name(rows[0].step, validation)} in {args.run_dir} (--step N: another step; "
              f"{other}); open one with: lit show ROLLOUT_ID --run {args.run_dir}", file=sys.stderr)
        width = max(len(r.rollout_id) for r in rows)
        print(f"{'rollout':<{width}}  {'task':<10} {'status':<10} return")
        for row in rows:
            episode_return = run.episode_return(row.rollout_id)
            shown = "-" if episode_return is None else f"{episode_return:+.3f}"
            print(f"{row.rollout_id:<{width}}  {row.task_id:<10} {row.status.value:<10} {shown}")
        if stale := run.rollouts(rows[0].step, validation, superseded=True):
            print(f"left out: {len(stale)} superseded rollout(s) of this step, made by a run that stopped before "
                  f"its next checkpoint (the step was trained again), e.g. {stale[0].rollout_id}", file=sys.stderr)
    return 0


def _listed_rollouts(run, step: int | None, validation: bool) -> tuple[list, bool]:
    """The rollouts ``lit show`` lists, and whether they are a validation's: those asked for, by default the last
    training step's, or where there is none (a folder of lit eval, a run stopped in its first validation) the last
    validation's."""
    from lit_trainer.steps import step_name

    if step is None and not validation and run.last_step() is None:
        validation = True
    rows = run.rollouts(step, validation)
    if not rows:
        last = run.last_step(validation)
        if last is None:
            raise ValueError(f"no {'validation ' if validation else ''}rollouts in {run.dir} yet")
        stale = run.rollouts(step, validation, superseded=True) if step is not None else []
        aside = (f" ({len(stale)} superseded: made by a run that stopped before its next checkpoint, e.g. "
                 f"{stale[0].rollout_id})") if stale else ""
        raise ValueError(f"no rollouts of {step_name(step, validation)} in {run.dir}{aside}; the last with any is "
                         f"{step_name(last, validation)}")
    return rows, validation


def _worker_main(rest: list[str]) -> int:
    from lit_sdk.worker import main as worker_main

    return worker_main(rest)


if __name__ == "__main__":
    sys.exit(main())
