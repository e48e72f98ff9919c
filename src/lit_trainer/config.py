"""The training config: one TOML file, one section per part of the trainer, plus ``section.key=value`` overrides
from the command line.

    model = "smollm2-135m"            # the policy, served by vLLM and trained (sets inference.model, policy.model)
    [agent]    function = "examples.calc.agent:calc_agent"
    [data]     tasks = "examples.calc.tasks:make_tasks"
    [train]    steps = 20   output_dir = "runs/calc"
    [rollouts] tasks_per_step = 8   group_size = 8
    [sft]      source = "references"   steps = 10   # demonstrations before (and beside) RL
    [policy]   learning_rate = 1e-5
    [inference] [weight_sync] [loss] [update] [credit] [advantages] [batching] [dispatch] [collector]
    [security] keys_dir = "~/.lit/keys"   # needed to bind anything but loopback (`lit keys generate`)

Every key maps onto a field of a config dataclass (each documents its own); an unknown key or a value of the wrong
type is an error that names the key, the file and the expected type, before anything starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_sdk.protocol.security import API_KEY, HOW_TO_MAKE, check_bind, is_local_endpoint
from lit_trainer.algorithm.advantages import AdvantageConfig
from lit_trainer.algorithm.credit import CreditConfig
from lit_trainer.algorithm.loss import LossConfig
from lit_trainer.engine.config import InferenceConfig, WeightSyncConfig
from lit_trainer.learner.batching import BatchingConfig
from lit_trainer.learner.policy import PolicyConfig
from lit_trainer.learner.schedule import UpdateConfig
from lit_trainer.results.trackers import check_trackers
from lit_trainer.roles import Roles
from lit_trainer.rollouts.demonstrations import SftConfig
from lit_trainer.rollouts.dispatcher import DispatchConfig
from lit_trainer.rollouts.runner import AgentConfig
from lit_trainer.rollouts.sampling import RolloutsConfig
from lit_trainer.rollouts.tasks import DataConfig
from lit_trainer.settings import at_least, check, finite


class ConfigError(ValueError):
    """The config file or an override is wrong; the message names the key and the fix."""


@dataclass(frozen=True)
class TrainLoopConfig:
    SECTION = "train"
    RULES = {"steps": at_least(1), "val_every": at_least(0, "(0: never)"),
             "checkpoint_every": at_least(0, "(0: only after the last step)"),
             "keep_checkpoints": at_least(0, "(0: keep all)"), "check_sync_every": at_least(0, "(0: never)"),
             "success_reward": finite(), "max_minutes": at_least(0, "(0: no limit)")}

    steps: int = 20
    """Training steps (each: rollouts, the optimizer steps of ``[update]`` (one by default), one weight sync)."""
    seed: int = 0
    """Seeds task sampling and torch; the same seed and step give the same tasks, also after ``--resume``."""
    output_dir: str = "runs/lit"
    """Where the store, metrics, checkpoints and the curve go. ``lit eval`` writes beside the run it evaluates
    (``RUN/eval/step-N``; the base model: ``OUTPUT_DIR/eval/base``) unless ``train.output_dir=`` is given on its
    command line, which then names the folder it writes into."""
    val_every: int = 5
    """Validate every this many steps, and before the first and after the last step (0: never)."""
    checkpoint_every: int = 5
    """Write a checkpoint every this many steps, and after the last (0: only after the last)."""
    keep_checkpoints: int = 2
    """Older checkpoints than the last this many are deleted (0: none is). A save writes the new one before it deletes
    the oldest, so this many plus one are on the disk at the peak; ``lit train`` checks the room first."""
    check_sync_every: int = 10
    """After the weight sync of step 1 and of every this many steps, compare vLLM's logprobs on two of the step's
    prompts with the trainer's (``sync/logprob_gap_max``) and stop if they differ by more than
    ``weight_sync.logprob_tolerance``: the sync did not land. 0: never."""
    success_reward: float = 1.0
    """A rollout whose return is at least this counts as correct (the ``accuracy`` metrics)."""
    max_minutes: float = 0.0
    """Stop (with validation and a checkpoint) once a step ends past this many minutes of training; 0: no limit."""
    trackers: tuple[str, ...] = ()
    """Also log to ``["tensorboard"]`` and/or ``["wandb"]`` (lit's extras of the same names),
    under ``output_dir``; a missing package is an error at start. W&B without an account: ``WANDB_MODE=offline``."""

    def __post_init__(self) -> None:
        check_trackers(self.trackers)
        check(self)
        if not self.output_dir.strip():
            raise ValueError("train.output_dir is empty: name the run's folder (e.g. \"runs/calc\")")


@dataclass(frozen=True)
class EndpointConfig:
    SECTION = "endpoint"  # serves [collector] and [dispatch_endpoint]: the loader names the one a value came from

    endpoint: str = "tcp://127.0.0.1:0"
    """ZeroMQ endpoint to bind; port 0 picks a free one. Bind ``tcp://0.0.0.0:PORT`` for workers on other hosts,
    which needs ``[security] keys_dir``."""


@dataclass(frozen=True)
class SecurityConfig:
    SECTION = "security"

    keys_dir: str = ""
    """The folder ``lit keys generate`` wrote: with it, the span and dispatch channels use CURVE (encrypted, and
    only peers holding its client key get in, on loopback too) and vLLM the folder's ``api_key`` (unless
    ``inference.api_key`` or ``api_key_file`` is set). Local workers get it as ``LIT_KEYS_DIR``; hosts that run
    ``lit worker`` need a copy of its ``client.key_secret`` and ``server.key``. Empty: the run makes keys of its
    own in ``<output_dir>/keys`` (0700, kept for a resume; ``services.with_keys``), and every endpoint must be
    loopback (remote workers need the shared folder)."""


@dataclass(frozen=True)
class TrainConfig:
    model: str = "smollm2-135m"
    """The policy: a Hugging Face model folder, or ``smollm2-135m`` (the embedded default, ``lit model prepare``);
    sets ``policy.model`` and ``inference.model`` unless those sections name their own."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    rollouts: RolloutsConfig = field(default_factory=RolloutsConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    credit: CreditConfig = field(default_factory=CreditConfig)
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    dispatch_endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    collector: EndpointConfig = field(default_factory=EndpointConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    roles: dict[str, str] = field(default_factory=dict)
    """Agent name -> ``own`` (a LoRA adapter of its own), ``shared`` (one adapter for all ``shared`` agents), ``base``
    (the base model, not trained) or an adapter folder (served, not trained); lit_trainer/roles.py. Empty: every
    selected agent trains one policy. A table needs ``policy.lora_rank`` > 0, and sets ``agent.agents`` (the ``own``
    and ``shared`` agents) and the LoRA settings of ``[inference]``."""
    source: str = ""
    """The file this config was read from (set by ``load``)."""
    overrides: tuple[str, ...] = ()
    """The ``section.key=value`` overrides given with it on the command line (set by ``load``), so that the
    commands lit suggests (``--resume``, ``lit eval``) read the same config."""

    def __post_init__(self) -> None:
        # Settings of one section that only make sense with another section's.
        if self.rollouts.max_staleness and (self.loss.is_correction == "none" or
                                            not self.update.recompute_old_logprobs):
            raise ValueError(f"rollouts.max_staleness = {self.rollouts.max_staleness} trains on calls sampled by older "
                             "weights than the policy's: set update.recompute_old_logprobs = true and "
                             "loss.is_correction = 'truncate' (or 'mask') to correct for them, or "
                             "rollouts.max_staleness = 0")
        if self.loss.is_correction != "none" and not self.update.recompute_old_logprobs:
            raise ValueError(f"loss.is_correction = {self.loss.is_correction!r} corrects π_old (the trainer's "
                             "recomputed logprobs) towards vLLM's: set update.recompute_old_logprobs = true, or "
                             "loss.is_correction = 'none'")
        if self.sft.steps > self.train.steps:
            raise ValueError(f"sft.steps = {self.sft.steps} is more than train.steps = {self.train.steps}: the SFT "
                             "steps are the first of train.steps (equal: SFT only)")
        if self.collector.endpoint == self.dispatch_endpoint.endpoint and not self.collector.endpoint.endswith(":0"):
            raise ValueError(f"collector.endpoint and dispatch_endpoint.endpoint are both "
                             f"{self.collector.endpoint}: give each an address of its own (port 0 picks a free one)")
        for what, setting, endpoint in (
            ("the collector", "collector.endpoint", self.collector.endpoint),
            ("the dispatcher", "dispatch_endpoint.endpoint", self.dispatch_endpoint.endpoint),
        ):
            try:
                is_local_endpoint(endpoint)
            except ValueError as exc:  # which of the two, in the words of the key
                raise ValueError(f"{setting}: {exc}") from None
            if not self.security.keys_dir:
                check_bind(endpoint, None, what, setting)
        if self.weight_sync.nccl_master_port + self.inference.servers - 1 > 65535:
            raise ValueError(f"weight_sync.nccl_master_port = {self.weight_sync.nccl_master_port} + inference.servers "
                             f"= {self.inference.servers} runs past port 65535 (server i meets on that port + i): "
                             "lower weight_sync.nccl_master_port")
        if self.inference.layout == "colocated" and self.rollouts.max_staleness:
            raise ValueError(f"inference.layout = 'colocated' puts vLLM to sleep during each update, and "
                             f"rollouts.max_staleness = {self.rollouts.max_staleness} generates meanwhile: set "
                             "max_staleness = 0, or layout = 'dedicated' (vLLM on GPUs of its own)")
        if self.inference.remote and not self.security.keys_dir:
            raise ValueError("inference.remote needs [security] keys_dir: the weights travel to the other hosts "
                             f"encrypted with its keys ({HOW_TO_MAKE}, and copy that folder to each host that runs "
                             "`lit serve`)")
        if self.inference.remote and self.weight_sync.transport != "shm":
            raise ValueError(f"inference.remote takes weights over the network, and weight_sync.transport = "
                             f"{self.weight_sync.transport!r} (a GPU transport of local servers) has not been run "
                             "beside it: set weight_sync.transport = 'shm'")
        if self.weight_sync.transport != "shm" and \
                self.inference.weight_transfer_backend != self.weight_sync.transport:
            raise ValueError(f"weight_sync.transport = {self.weight_sync.transport!r} needs vLLM started with the same "
                             f"weight transfer: set inference.weight_transfer_backend = "
                             f"{self.weight_sync.transport!r} (it is {self.inference.weight_transfer_backend!r})")
        if self.weight_sync.mode == "lora":
            raise ValueError("weight_sync.mode = 'lora' is not supported by lit train: a LoRA policy "
                             "(policy.lora_rank > 0) is pushed as merged full weights, the fast path on CPU; "
                             "a [roles] table pushes one adapter per role. Leave weight_sync.mode = 'full'")
        if self.roles:
            self._take_roles()

    @functools.cached_property  # not a field: never compared or saved
    def role_table(self) -> Roles | None:
        """The ``[roles]`` table, checked (its fixed adapters' folders too) once per config; None without one."""
        return Roles(self.roles, self.inference.served_model_name) if self.roles else None

    def _take_roles(self) -> None:
        """Check the role table against the other sections, and set what it implies: the trained agents and vLLM's
        LoRA serving (each time the config is built, so a changed table changes them)."""
        roles = self.role_table
        assert roles is not None
        if not self.policy.lora_rank:
            raise ValueError("a [roles] table trains one LoRA adapter per role: set policy.lora_rank (e.g. 16), or "
                             "remove the table")
        if roles.served_adapters > self.inference.max_loras:
            raise ValueError(f"the [roles] table serves {roles.served_adapters} LoRA adapters but vLLM serves at most "
                             f"inference.max_loras = {self.inference.max_loras}: raise it, or share adapters "
                             "(\"shared\")")
        if self.agent.agents and set(self.agent.agents) != set(roles.trained_agents):
            raise ValueError(f"agent.agents = {list(self.agent.agents)} and the [roles] table both choose what trains: "
                             f"leave agent.agents out (the table trains {list(roles.trained_agents)})")
        if self.weight_sync.transport != "shm":
            raise ValueError("a [roles] table loads each adapter into vLLM from shared memory: set "
                             "weight_sync.transport = 'shm'")
        inference = dataclasses.replace(self.inference, enable_lora=True, lora_modules=roles.fixed,
                                        max_lora_rank=max(self.inference.max_lora_rank, self.policy.lora_rank))
        object.__setattr__(self, "inference", inference)
        object.__setattr__(self, "agent", dataclasses.replace(self.agent, agents=roles.trained_agents))

    def to_dict(self) -> dict[str, Any]:
        """Every setting, for ``config.json`` and the trackers; an API key written in the config shows as ``***``."""
        table = dataclasses.asdict(self)
        if table["inference"]["api_key"]:
            table["inference"]["api_key"] = "***"
        table["overrides"] = list(self.shown_overrides())
        return table

    def shown_overrides(self) -> tuple[str, ...]:
        """The command-line overrides as lit writes and prints them: an API key given there shows as ``***``."""
        return tuple("inference.api_key=***" if override_key(item) == "inference.api_key" else item
                     for item in self.overrides)


def changed_settings(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The keys whose value differs between two ``TrainConfig.to_dict()`` tables (e.g. the run that stopped and
    the one resuming it), each as ``section.key: old -> new``, in the config's order; where a config came from
    (``NOT_KEYS``) is no setting. A key only one side has (a config.json of an older lit) shows as ``(none)``."""
    def flat(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in table.items():
            if not prefix and name in NOT_KEYS:
                continue
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{name}."))
            else:
                out[prefix + name] = list(value) if isinstance(value, tuple) else value
        return out

    old, new = flat(before), flat(after)
    missing = object()
    return [f"{key}: {_shown(old.get(key, missing), missing)} -> {_shown(new.get(key, missing), missing)}"
            for key in [*new, *(k for k in old if k not in new)] if old.get(key, missing) != new.get(key, missing)]


def _shown(value: Any, missing: object) -> str:
    return "(none)" if value is missing else json.dumps(value, default=str)


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a TOML config and apply ``section.key=value`` overrides (values in TOML syntax; bare words are text)."""
    path = Path(path)
    try:
        table = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config file at {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    for item in overrides:
        _apply_override(table, item)
    table["source"], table["overrides"] = str(path), list(overrides)
    return from_dict(table, where=str(path))


def from_dict(table: dict[str, Any], where: str = "config") -> TrainConfig:
    table = dict(table)
    _refuse_moved(table, where)
    model = table.get("model", TrainConfig.model)
    for section in ("policy", "inference"):  # one model for both, unless a section names its own
        table[section] = {"model": model, **table.get(section, {})}
    keys_dir = table.get("security", {}).get("keys_dir") if isinstance(table.get("security"), dict) else None
    inference = table["inference"]
    if keys_dir and isinstance(keys_dir, str) and not inference.get("api_key") and not inference.get("api_key_file"):
        inference["api_key_file"] = str(Path(keys_dir).expanduser() / API_KEY)  # the key `lit keys generate` wrote
    return _build(TrainConfig, table, where)


def _refuse_moved(table: dict[str, Any], where: str) -> None:
    """Rollout sampling left ``[train]`` for ``[rollouts]``: a config written before says where its keys went."""
    train = table.get("train")
    moved = sorted(set(train) & {f.name for f in dataclasses.fields(RolloutsConfig)}) if isinstance(train, dict) else []
    if moved:
        raise ConfigError(f"{where}: {', '.join(f'train.{key}' for key in moved)} moved to the [rollouts] section: "
                          f"write {', '.join(f'rollouts.{key}' for key in moved)} instead")


def override_key(item: str) -> str:
    """The ``section.key`` an override ``section.key=value`` sets."""
    return item.partition("=")[0].strip()


def _apply_override(table: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=3)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    *sections, last = key.strip().split(".")
    node = table
    for name in sections:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {name!r} is a value, not a section")
    node[last] = value


def _build(cls: type, table: dict[str, Any], where: str, section: str = "") -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a section (a TOML table), got {table!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        known = sorted(set(fields) - set(NOT_KEYS))
        close = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
        hint = "".join(f"; did you mean {near[0]!r} for {name!r}?" for name, near in close.items() if near)
        raise ConfigError(f"{where}: unknown key(s) {unknown}{hint} ({f'[{section}]' if section else 'the top level'} "
                          f"has {known})")
    kwargs = {}
    for name, value in table.items():
        default = _default(fields[name])
        key = f"{where}: {name}"
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, f"{where} [{name}]", name)
        else:
            kwargs[name] = _coerce(value, default, key, ints="[int]" in str(fields[name].type))
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        message, named = str(exc), getattr(cls, "SECTION", section)
        if section and named != section:  # a class serving several sections: name the one the value came from
            message = re.sub(rf"(?<![\w.]){re.escape(named)}\.", f"{section}.", message)
        raise ConfigError(f"{where}: {message}") from None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _coerce(value: Any, default: Any, key: str, ints: bool = False) -> Any:
    """Check ``value`` against the type of the field's default (TOML has no tuples and writes 1 for 1.0); a list
    holds texts, or integers where the field says so (``ints``: ``list[int]``)."""
    if default is None:
        return value
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, (tuple, list)):
        item_ok = (lambda i: isinstance(i, int) and not isinstance(i, bool)) if ints else (
            lambda i: isinstance(i, str))
        ok = isinstance(value, list) and all(item_ok(item) for item in value)
        value = type(default)(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        items = "integers" if ints else "texts"
        like = f"a list of {items}" if isinstance(default, (tuple, list)) else type(default).__name__
        raise ConfigError(f"{key} must be {like} (like {default!r}), got {value!r}")
    return value


@dataclass(frozen=True)
class ConfigKey:
    """One settable key of the config, for ``lit config keys``."""

    name: str
    """``section.key`` (or ``key`` at the top level)."""
    default: Any
    doc: str


NOT_KEYS = ("source", "overrides")
"""Fields of ``TrainConfig`` that record where a config came from: no key a config file sets."""


def config_keys(cls: type = TrainConfig, prefix: str = "") -> list[ConfigKey]:
    """Every key of the config with its default and the docstring under its field, in file order; the source of
    ``lit config keys``. Sections are the fields whose default is a dataclass."""
    docs = _field_docs(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if not prefix and f.name in NOT_KEYS:  # a section's own key may share the name (sft.source)
            continue
        default = _default(f)
        if dataclasses.is_dataclass(default):
            keys.extend(config_keys(type(default), f"{prefix}{f.name}."))
        else:
            keys.append(ConfigKey(prefix + f.name, default, docs.get(f.name, "")))
    return keys


def _field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (the convention of every config class here)."""
    import ast
    import inspect
    import itertools
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for field_node, after in itertools.pairwise(body):
        if (isinstance(field_node, ast.AnnAssign) and isinstance(field_node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[field_node.target.id] = " ".join(after.value.value.split())
    return docs
