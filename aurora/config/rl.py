"""The RL sections of a topology, typed: ``model``, ``task``, ``learner`` and ``engine``.

These are descriptions only (frozen dataclasses, checked on load); `aurora.rl`
builds the models, tasks, learners and engines they describe. Loading them with
the topology (`aurora.config.topology.load_topology`) means that a typo under
``learner:`` is an error naming its path at ``aurora topology check``, not when
a node starts. Relative paths (``model.path``, ``task.path``) are made absolute
against the topology file's directory at load (`resolve_paths`).

A ``task`` or ``learner`` mapping without ``kind`` is the first kind of its
union: ``arithmetic``, and ``synthetic``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

from aurora.errors import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    # ~150k parameters: fast enough for many processes on a 2-core machine (head_dim 32: the
    # smallest that vLLM's CPU attention supports)
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    # ~4.8M parameters
    "small": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
    },
}
"""Architectures of the random Qwen3 models `aurora model init` builds (`aurora.rl.model`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    path: str | None = None
    """A Hugging Face model directory (relative paths: to the topology file). None: build ``preset`` in memory."""
    preset: str = "tiny"
    """Without ``path``: the architecture to build. With it: what ``aurora run`` creates there if it is missing."""
    seed: int = 0
    max_positions: int = 256
    fetch: str | None = None
    """A known pretrained model (``aurora model fetch --list``) that ``aurora run`` fetches into ``path``
    when it is missing, instead of building ``preset``."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r} (presets: {', '.join(PRESETS)})", path="preset")
        if self.max_positions < 8:
            raise ConfigError("must be >= 8", path="max_positions")
        if self.fetch is not None and self.path is None:
            raise ConfigError("fetch needs a path to fetch the model into", path="fetch")

    def resolved(self, file: str | None) -> ModelSpec:
        """With ``path`` made absolute against the directory of ``file`` (a topology file)."""
        if self.path is None or Path(self.path).is_absolute():
            return self
        base = Path(file).parent if file else Path()
        return replace(self, path=str((base / self.path).resolve()))

    def directory(self) -> Path:
        """The model directory, checked to hold a config (a clear error otherwise)."""
        assert self.path is not None
        p = Path(self.path)
        if not (p / "config.json").is_file():
            how = (
                f"aurora model fetch {self.fetch} {p}"
                if self.fetch is not None
                else f"aurora model init {p} --preset {self.preset}"
            )
            raise ConfigError(
                f"{p} is not a model directory (no config.json); create one with `{how}`", path="model.path"
            )
        return p


@dataclass(frozen=True, slots=True, kw_only=True)
class ArithmeticSpec:
    """``a+b=`` → ``a+b`` in decimal, operands uniform in [0, max_operand]."""

    kind: Literal["arithmetic"] = "arithmetic"
    max_operand: int = 9
    operands: int = 2
    """How many numbers are added."""
    chat: bool = False
    """Ask in words through the model's chat template, and read the answer as the last number of the
    reply (for instruction-tuned models); False: the bare ``a+b=`` prompt, answer the whole reply."""
    concise: bool = False
    """With ``chat``: ask for only the number, and give full credit only to a reply that is just the
    number (half to the right number among other words)."""
    heldout: float = 0.1
    """The fraction of sums never asked in training (chosen by a hash of the expression): the held-out
    prompts of ``learner.eval``, at most 256 of them."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.heldout) and 0 <= self.heldout <= 0.5):
            raise ConfigError("must be a fraction in [0, 0.5]", path="heldout")
        if self.max_operand < 1:
            raise ConfigError("must be >= 1", path="max_operand")
        if not 2 <= self.operands <= 8:
            raise ConfigError("must be in [2, 8]", path="operands")


@dataclass(frozen=True, slots=True, kw_only=True)
class JsonlSpec:
    """Prompts and answers from a JSONL file."""

    kind: Literal["jsonl"] = "jsonl"
    path: str = ""
    """A JSONL file; relative paths are relative to the topology file."""
    chat: bool = False
    """As for arithmetic: prompts through the chat template, the answer read from the reply's last number."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("a jsonl task needs a path", path="path")


REWARDS = ("exact", "number", "math")
"""The built-in rewards of a dataset task; anything else is ``module:function``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetSpec:
    """Prompts and answers from a local dataset file, read with Hugging Face `datasets`
    (`aurora.rl.data`), and how replies are scored (`aurora.rl.rewards`)."""

    kind: Literal["dataset"] = "dataset"
    path: str = ""
    """A JSONL/JSON, Parquet or CSV file; relative paths are relative to the topology file."""
    format: Literal["auto", "json", "parquet", "csv"] = "auto"
    """``auto``: by the file's extension (``.jsonl``/``.json``, ``.parquet``, ``.csv``)."""
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    chat: bool = False
    """Put each prompt through the model's chat template as a user turn."""
    system_prompt: str | None = None
    """With ``chat``: a system turn before each prompt."""
    heldout: float = 0.1
    """Prompts kept out of training for evaluation (every row of each): a fraction in [0, 0.5] of the distinct
    prompts, or a count when >= 1. Which ones is fixed by the prompts' text (a hash), not by the run's seed,
    so every run evaluates the same ones."""
    reward: str = "exact"
    """``exact`` (the reply, stripped, is the answer), ``number`` (the reply's last number is the answer's),
    ``math`` (math-verify: ``\\boxed{}``, numeric and symbolic equivalence) or ``module:function``, a
    function ``fn(prompt: str, completion: str, answer: str) -> float`` in [0, 1] (imported on the trainer
    only, ``reward_dir`` first on the module path)."""
    reward_dir: str | None = None
    """Where a ``module:function`` reward's module is looked for first; default the topology file's directory."""
    reward_timeout_s: float = 5.0
    """How long one call of a ``math`` or ``module:function`` reward may take (it runs in a worker process);
    past it the sample scores 0."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("a dataset task needs a path", path="path")
        if not self.prompt_field or not self.answer_field:
            raise ConfigError("must name a field", path="prompt_field" if not self.prompt_field else "answer_field")
        h = self.heldout
        if not math.isfinite(h) or h < 0 or 0.5 < h < 1 or (h >= 1 and h != int(h)):
            raise ConfigError("must be a fraction in [0, 0.5] or a whole count >= 1", path="heldout")
        if self.reward not in REWARDS:
            mod, sep, fn = self.reward.partition(":")
            if not sep or not mod or not fn.isidentifier() or not all(p.isidentifier() for p in mod.split(".")):
                raise ConfigError(
                    f"{self.reward!r} is not a reward: one of {', '.join(REWARDS)}, or module:function", path="reward"
                )
        if not (math.isfinite(self.reward_timeout_s) and self.reward_timeout_s > 0):
            raise ConfigError("must be > 0", path="reward_timeout_s")
        if self.system_prompt is not None and not self.chat:
            raise ConfigError("a system prompt needs chat: true", path="system_prompt")


TaskSpec = ArithmeticSpec | JsonlSpec | DatasetSpec

ENGINE_KINDS = ("torch", "vllm", "synthetic")


LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSpec:
    """A ``vllm serve`` on the rollout's host that the rollout feeds (`aurora.rl.engines.vllm_served`)."""

    url: str = "http://127.0.0.1:8100"
    """Where it listens: ``http://HOST:PORT`` on loopback (it reads the rollout's staged files on this host,
    and its weight-update endpoints have no authentication)."""
    launch: bool = True
    """The rollout starts it (with Aurora's backend and the engine's settings) and stops it; False: it is
    started by you (``aurora topology check`` prints the command) and the rollout waits for it."""
    start_timeout_s: float = 600.0
    """How long the rollout waits for it to answer ``/health``."""

    def __post_init__(self) -> None:
        from urllib.parse import urlsplit

        try:
            u = urlsplit(self.url)
            port = u.port
        except ValueError as e:
            raise ConfigError(f"{self.url!r} is not a URL ({e})", path="url") from None
        if (
            u.scheme != "http"
            or u.hostname is None
            or not port
            or u.path not in ("", "/")
            or u.query
            or u.fragment
            or u.username is not None
        ):
            raise ConfigError(f"must be http://HOST:PORT, not {self.url!r}", path="url")
        if u.hostname not in LOOPBACK:
            raise ConfigError(
                f"{u.hostname} is not loopback: the server reads staged files on this host and its weight-update "
                "endpoints have no authentication, so it must listen on 127.0.0.1 or ::1",
                path="url",
            )
        if not self.start_timeout_s > 0:
            raise ConfigError("must be > 0", path="start_timeout_s")

    @property
    def host_port(self) -> tuple[str, int]:
        from urllib.parse import urlsplit

        u = urlsplit(self.url)
        return cast(str, u.hostname), cast(int, u.port)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    kind: Literal["torch", "vllm", "synthetic"] = "torch"
    """``torch`` (`TorchEngine`), ``vllm`` (`VllmEngine`) or ``synthetic`` (a load generator)."""
    model: ModelSpec | None = None
    """None: the topology's ``model``."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    """0 samples greedily."""
    seed: int = 0
    fixed_length: bool = False
    """Always generate ``max_new_tokens`` (ignore end-of-sequence): for benchmarks whose work must not depend on the weights."""
    token_s: float = 0.0
    """synthetic only: seconds per generated token position of a batch (a stand-in for compute)."""
    kv_cache_mb: int = 64
    """vllm only: KV cache size (the CPU build's default memory check does not fit small machines)."""
    continuous: bool = True
    """vllm only: a rollout generates continuously on vLLM's async engine (each leased prompt a request
    of its own, a version switch pauses it without draining: `AsyncVllmEngine`); False: in batches on
    the in-process engine (`VllmEngine`, switching between batches)."""
    kv_on_switch: Literal["keep", "recompute"] = "keep"
    """continuous vllm only: at a version switch, a request in flight keeps the KV its earlier tokens
    computed under the old version (``keep``), or has it computed again under the new one (``recompute``)."""
    tensor_parallel: int = 1
    """continuous vllm only: the engine's tensor-parallel size (vLLM's ``tensor_parallel_size``: one
    worker process per rank, each holding its shards; versions go in and are checked the same way)."""
    serve: ServeSpec | None = None
    """continuous vllm only: generate on a ``vllm serve`` on this host (an OpenAI-compatible server that
    agent and environment code can use too) instead of an engine in the rollout's process."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError("must be >= 1", path="max_new_tokens")
        if self.temperature < 0:
            raise ConfigError("must be >= 0", path="temperature")
        if self.kv_cache_mb < 1:
            raise ConfigError("must be >= 1", path="kv_cache_mb")
        if self.token_s < 0:
            raise ConfigError("must be >= 0", path="token_s")
        if self.kv_on_switch not in ("keep", "recompute"):
            raise ConfigError(f"must be keep or recompute, not {self.kv_on_switch!r}", path="kv_on_switch")
        if self.tensor_parallel < 1:
            raise ConfigError("must be >= 1", path="tensor_parallel")
        if self.tensor_parallel > 1 and not (self.kind == "vllm" and self.continuous):
            raise ConfigError(
                "only a continuous vllm engine (kind: vllm, continuous: true) is tensor-parallel",
                path="tensor_parallel",
            )
        if self.serve is not None and not (self.kind == "vllm" and self.continuous):
            raise ConfigError(
                "only a continuous vllm engine (kind: vllm, continuous: true) runs on a server", path="serve"
            )

    @property
    def the_model(self) -> ModelSpec:
        return self.model or ModelSpec()


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticSpec:
    """A load generator that stands in for RL (`aurora.rl.learners.synthetic`)."""

    kind: Literal["synthetic"] = "synthetic"
    params: int = 1_000_000
    """Total bf16 parameters, split over ``tensors`` tensors."""
    tensors: int = 4
    density: float = 0.02
    """Fraction of elements changed per step."""
    interval_s: float = 1.0
    """Seconds between published versions (when ``samples_per_step`` is 0)."""
    samples_per_step: int = 0
    """Step after this many accepted rollout results instead of on a timer."""
    step_s: float = 0.0
    """Seconds each step takes (a stand-in for the training compute a real learner spends)."""
    seed: int = 0
    model: ModelSpec | None = None
    """Start from this locally built model's weights (``params``/``tensors`` are then unused), so
    that rollout engines on the same model serve every version."""

    def __post_init__(self) -> None:
        if self.params < self.tensors or self.tensors < 1:
            raise ConfigError("need params >= tensors >= 1", path="params")
        if not 0 < self.density <= 1:
            raise ConfigError("must be in (0, 1]", path="density")
        if self.interval_s <= 0:
            raise ConfigError("must be > 0", path="interval_s")
        if self.step_s < 0:
            raise ConfigError("must be >= 0", path="step_s")
        if self.samples_per_step < 0:
            raise ConfigError("must be >= 0", path="samples_per_step")


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalSpec:
    """Held-out evaluation of published versions, on the trainer (`aurora.rl.evaluate`): greedy replies
    to the task's held-out prompts, scored for correctness only."""

    every: int = 0
    """Evaluate every this many versions (and version 0); 0: never."""
    prompts: int = 32
    """How many held-out prompts (the same ones each time; fewer if the task holds fewer)."""
    max_new_tokens: int | None = None
    """None: the engine's."""
    batch: int = 16
    """Prompts generated at once."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError("must be >= 0", path="every")
        for name in ("prompts", "batch"):
            if getattr(self, name) < 1:
                raise ConfigError("must be >= 1", path=name)
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError("must be >= 1", path="max_new_tokens")


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpoSpec:
    """Group-relative policy optimisation (`aurora.rl.learners.grpo`)."""

    kind: Literal["grpo"] = "grpo"
    group_size: int = 8
    """Samples per prompt (G)."""
    prompts_per_step: int = 8
    """Groups per step."""
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    """0: no reference model."""
    max_grad_norm: float = 1.0
    epochs: int = 1
    """AdamW steps on each step's samples."""
    checkpoint_every: int = 10
    """Versions between checkpoints of master weights and optimiser state (0: never)."""
    warm_start_steps: int = 0
    """Supervised steps on the task's answers before version 0 (for randomly initialised models)."""
    warm_start_lr: float = 3e-3
    warm_start_batch: int = 64
    skip_flat_groups: bool = True
    """Skip groups whose samples all scored the same (no signal). False: train on them with
    advantage 0 too, so every step costs the same whatever the rewards (`aurora bench rl`)."""
    seed: int = 0
    eval: EvalSpec = field(default_factory=EvalSpec)
    """Held-out evaluation (off by default)."""
    ranks: int = 1
    """Processes the learner runs as (torch.distributed: gloo on CPUs, NCCL on GPUs), the model sharded
    over them with FSDP2; the trainer node starts them under torch's launcher (``aurora.rl.learners.ranks``)."""
    restarts: int = 3
    """With ``ranks`` > 1: how often torch's launcher starts every rank again after one fails (the trainer
    then resumes from its store and newest checkpoint)."""

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ConfigError("must be >= 1", path="ranks")
        if self.restarts < 0:
            raise ConfigError("must be >= 0", path="restarts")
        if self.ranks > 1 and self.kl_coef > 0:
            raise ConfigError(
                "a KL term (kl_coef > 0) needs a reference model, which a sharded learner does not keep yet: "
                "use ranks 1, or kl_coef 0",
                path="ranks",
            )
        for name in ("group_size", "prompts_per_step", "epochs", "warm_start_batch"):
            if getattr(self, name) < 1:
                raise ConfigError("must be >= 1", path=name)
        if self.group_size < 2:
            raise ConfigError("GRPO needs at least 2 samples per prompt", path="group_size")
        for name in ("lr", "warm_start_lr", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ConfigError("must be > 0", path=name)
        if not 0 < self.clip_eps < 1:
            raise ConfigError("must be in (0, 1)", path="clip_eps")
        for name in ("kl_coef", "weight_decay", "checkpoint_every", "warm_start_steps"):
            if getattr(self, name) < 0:
                raise ConfigError("must be >= 0", path=name)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopSpec:
    """Your own training loop drives the trainer (`aurora.loop.TrainerLoop`): it takes each step's
    accepted groups and publishes the versions; ``aurora node``/``aurora run`` do not run such a trainer."""

    kind: Literal["loop"] = "loop"
    group_size: int = 8
    """Samples per prompt the workers make."""
    prompts_per_step: int = 8
    """Groups in each batch the loop gets."""
    seed: int = 0
    """The task's prompt order."""

    def __post_init__(self) -> None:
        for name in ("group_size", "prompts_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError("must be >= 1", path=name)


@dataclass(frozen=True, slots=True, kw_only=True)
class PythonSpec:
    """A learner of your own (`aurora.rl.learners.base.Learner`, the interface the built-in learners
    implement), made by ``factory`` — ``module:function`` taking a `aurora.rl.learners.base.LearnerContext`,
    as the built-in learners' own factories do; ``aurora node`` and ``aurora run`` drive it."""

    kind: Literal["python"] = "python"
    factory: str
    """``module:function``; the module is looked for first in ``module_dir``."""
    module_dir: str | None = None
    """Where ``factory``'s module is looked for first; default the topology file's directory."""
    options: dict[str, float | str | bool] = field(default_factory=dict)
    """Passed to the factory as they are (``LearnerContext.options``)."""

    def __post_init__(self) -> None:
        mod, colon, fn = self.factory.partition(":")
        if not colon or not mod or not fn.isidentifier():
            raise ConfigError(f"{self.factory!r} is not module:function", path="factory")


LearnerSpec = SyntheticSpec | GrpoSpec | LoopSpec | PythonSpec


def resolve_paths(
    task: TaskSpec, model: ModelSpec | None, learner: LearnerSpec, engine: EngineSpec | None, file: str | None
) -> tuple[TaskSpec, ModelSpec | None, LearnerSpec, EngineSpec | None]:
    """The sections with relative paths made absolute against ``file``'s directory, and the engine's
    model defaulting to the topology's."""
    if isinstance(task, JsonlSpec | DatasetSpec) and not Path(task.path).is_absolute() and file:
        task = replace(task, path=str(Path(file).parent / task.path))
    if isinstance(task, DatasetSpec):
        base = Path(file).parent if file else Path()
        task = replace(task, reward_dir=str((base / (task.reward_dir or ".")).resolve()))
    model = model.resolved(file) if model is not None else None
    if isinstance(learner, SyntheticSpec) and learner.model is not None:
        learner = replace(learner, model=learner.model.resolved(file))
    if isinstance(learner, PythonSpec):
        base = Path(file).parent if file else Path()
        learner = replace(learner, module_dir=str((base / (learner.module_dir or ".")).resolve()))
    if engine is not None:
        engine = replace(engine, model=(engine.model.resolved(file) if engine.model is not None else model))
    return task, model, learner, engine
