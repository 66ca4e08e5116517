"""Your own training loop on Aurora's network: `TrainerLoop` runs a trainer node around a loop you write.

Aurora's trainer node does the network's work — the coordinator that leases prompts and checks
results, the publisher that turns each version into a verified delta down the relay tree, the store —
and asks a *learner* for each next version (`aurora.rl.learners.base.Learner`: the built-in GRPO
learner is one). `TrainerLoop` is that learner turned inside out, for a loop that is not Aurora's (a
plain PyTorch loop, or one inside another framework)::

    with TrainerLoop("topology.yaml", model, tokenizer) as loop:   # learner: {kind: loop, ...}
        for batch in loop.batches():           # each step's accepted groups (prompts_per_step of them)
            loss = my_loss(model, batch)       # your loss, your optimiser
            loss.backward(); opt.step(); opt.zero_grad()
            loop.publish({"loss": float(loss)})   # the module's parameters, cast to bf16: the next version

It runs the trainer node (`aurora.node.run_node`, as ``aurora node`` would) in a thread of its own
with an asyncio loop of its own, and hands over through two queues: the node's publisher gives a batch
and waits; `batches` yields it to your loop; `publish` gives back the next version. Everything the
built-in learner gets, your loop gets: each `Group` is a leased prompt (the trainer's own tokenization),
the samples the worker returned (token ids and behaviour log-probabilities, checked by the
coordinator's result rules), their texts and their rewards under the topology's task. A version is
the module's ``named_parameters`` cast to bf16, under their names (the names the rollouts' model
directory uses); version 0 is the module as given, or the store's newest when it resumes.

Invariants: a version is published only from your loop's `publish` (one per batch, in order), as a
copy of the module's parameters; the node's thread ends when the loop is left (also at interpreter
exit, and on an exception in your loop, which is never hidden by one of the node's); an exception in
the node is raised in your loop, at `batches`, `publish` or the end of the ``with``; your model is
read at the start and in `publish`, and written only at a resume, in `start` (all in your thread;
the node's thread only keeps the resumed version); your tokenizer is never used by the node (it uses a copy, under a lock).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from aurora.codec import Weights
from aurora.config.plan import plan
from aurora.config.rl import LoopSpec
from aurora.config.topology import Topology, load_topology
from aurora.errors import AuroraError, ConfigError, LearnerError
from aurora.rl.learners.base import bf16_weights
from aurora.rl.model import Tokenizer
from aurora.rl.tasks import make_task
from aurora.rl.types import Completion, Prompt

POLL_S = 0.2
"""How often a wait looks whether the other side has failed or closed."""


def cast_tensor(v: object) -> torch.Tensor:
    """A state dict's value that must be a tensor (a parameter's)."""
    if not isinstance(v, torch.Tensor):
        raise AuroraError(f"a parameter's state is a {type(v).__name__}, not a tensor")
    return v


def _scalar(key: object, v: object) -> bool | int | float | str | None:
    """A stat as the step log takes it: a number, a short string, or a one-element tensor or array."""
    if v is None or isinstance(v, bool | int | float | str):
        return v
    item = getattr(v, "item", None)
    if item is not None:
        try:
            got = item()
        except (ValueError, RuntimeError):
            got = None
        if isinstance(got, bool | int | float):
            return got
    raise AuroraError(f"stat {key!r}: {type(v).__name__} is not a number or a string")


@dataclass(frozen=True, slots=True)
class Group:
    """One accepted result: a prompt and its group of samples, all made with weights ``version``."""

    prompt: Prompt
    """The prompt (``tokens``: as the trainer tokenized it; ``answer``: the task's reference answer)."""
    completion: Completion
    """The samples (``samples[i].tokens``, ``samples[i].logprobs``: each token's behaviour log-probability)."""
    texts: list[str]
    """Each sample's text (its token ids decoded)."""
    rewards: list[float]
    """Each sample's reward under the topology's task."""

    @property
    def version(self) -> int:
        return self.completion.version


class _Handover:
    """The `Learner` the node's publisher drives: each `step` hands its batch to the loop's thread and
    waits for the version the loop publishes."""

    def __init__(self, loop: TrainerLoop, spec: LoopSpec, vocab_size: int) -> None:
        self.owner = loop
        self.batch_size = spec.prompts_per_step
        self.interval_s = 0.0
        self.group_size = spec.group_size
        self.seed = spec.seed
        self.stats: dict[str, Any] = {}
        self._vocab_size = vocab_size

    def initial(self) -> Weights:
        initial = self.owner._initial
        assert initial is not None, "start() reads the module before the node starts"
        return initial

    def step(self, batch: Sequence[Any]) -> Weights:
        """In the node's worker thread: the groups (texts and rewards made here) to the loop, then wait
        for its version; a loop that closes ends the wait (`LearnerError`)."""
        owner = self.owner
        owner._batches.put([owner._group(p, c) for p, c in batch])
        while True:
            if owner._closing.is_set():
                raise LearnerError("the training loop stopped")
            try:
                got = owner._versions.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if got is None:
                raise LearnerError("the training loop stopped")
            weights, stats = got
            self.stats = stats
            return weights

    def evaluate(self, version: int) -> dict[str, Any] | None:
        return None

    def restore(self, weights: Weights, version: int) -> None:
        self.owner._restore(weights, version)

    def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        return self.owner._tokenize(prompt)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size


class TrainerLoop:
    """A trainer node driven by your training loop (see the module docstring).

    ``topology``: the topology file; its ``learner`` section is ``{kind: loop, prompts_per_step,
    group_size}``. ``model``: the module you train (a ``torch.nn.Module`` whose ``named_parameters`` are
    the rollouts' model's tensor names, checked at start). Under torch.distributed (``torchrun``), make
    a `TrainerLoop` on every rank, with the module sharded (FSDP2 ``fully_shard``) or not: rank 0 runs
    the node; every rank gets each batch (split it among the ranks yourself) and calls `publish`,
    where the version is gathered whole on rank 0 (``get_model_state_dict``: rank 0 holds the whole
    model for a moment — versions made where the shards are is not built yet). ``tokenizer``: a ``transformers`` tokenizer (or `aurora.rl.model.Tokenizer`) of the rollouts'
    model; the node uses a copy of its own. ``store``: the trainer's version store: a loop started
    again resumes from its newest version, and the module's parameters are set to that version's
    (bf16) values — keep your own checkpoints of fp32 weights and optimiser state, and load them
    after `start` (``version`` says which). ``name``: the trainer's node name (default: the
    topology's)."""

    def __init__(
        self,
        topology: str | Path,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        store: str | Path | None = None,
        name: str | None = None,
        insecure: bool = False,
    ) -> None:
        self.file = str(topology)
        self.topo: Topology = load_topology(topology)
        if not isinstance(self.topo.learner, LoopSpec):
            raise ConfigError(
                f"learner kind {self.topo.learner.kind!r}: a training loop of your own needs "
                "learner: {kind: loop, prompts_per_step: N, group_size: G}",
                file=self.file,
                path="learner.kind",
            )
        self.spec: LoopSpec = self.topo.learner
        self.name = name or self.topo.trainer.name
        if self.topo.node(self.name).role != "trainer":
            raise ConfigError(f"{self.name!r} is not the trainer", file=self.file)
        self.model = model
        hf = tokenizer.hf if isinstance(tokenizer, Tokenizer) else tokenizer
        self.tok = Tokenizer(copy.deepcopy(hf))  # the node's own copy: yours stays yours, in your thread
        self._tok_lock = threading.Lock()
        """The node's threads (its event loop's, the worker's that hands batches over) share its copy."""
        self.task = make_task(self.topo.task)
        self._check_names()
        self.store = None if store is None else Path(store)
        self.insecure = insecure
        self.steps = self.topo.run.steps
        self.sync_wait_s = 60.0
        """Leaving the ``with`` normally waits up to this long for every node to hold the last version."""
        self.version = 0
        """The version the module's weights are: the last published (or resumed from)."""
        self._batches: queue.Queue[list[Group]] = queue.Queue()
        self._closing = threading.Event()
        self._versions: queue.Queue[tuple[Weights, dict[str, Any]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._node: Any = None
        self._waiting = False
        self._initial: Weights | None = None
        self._resumed: Weights | None = None
        self._dist = tdist.is_available() and tdist.is_initialized()
        self.rank = tdist.get_rank() if self._dist else 0
        """This process's rank when your loop runs under torch.distributed (rank 0 runs the node)."""

    # ---------------------------------------------------------------- your loop's side
    def __enter__(self) -> TrainerLoop:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        ok = exc[0] is None
        self.close(wait_synced_s=self.sync_wait_s if ok else 0.0, raise_errors=ok)  # never hides your error

    def start(self) -> None:
        """Start the trainer node (on rank 0, in a thread of its own); returns once it listens and its
        actors run — with the module set to the store's newest version when it resumes — or raises why
        it cannot (a port in use, a store it cannot resume from, ...), on every rank."""
        initial = self._weights()  # every rank: a collective when the module is sharded
        if self.rank != 0:
            tag, value = self._share(None)
            if tag == "failed":
                raise AuroraError(f"rank 0's trainer node did not start: {value}")
            self.version = int(value)
        else:
            self._initial = initial
            try:
                self._start_node()
            except BaseException as e:
                self._share(("failed", str(e)))
                raise
            self._share(("started", self.version))
        if self.version:
            self._apply_resumed()

    def _start_node(self) -> None:
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="aurora-trainer", daemon=True)
        atexit.register(self._abandon)
        try:
            self._thread.start()
            while not started.wait(POLL_S):
                self._check()
            self._check()
        except BaseException:
            self.close(raise_errors=False)
            raise

    def batches(self) -> Iterator[list[Group]]:
        """Each step's batch of accepted groups, until the run's ``run.steps`` versions are published;
        `publish` the next version before asking for the next batch."""
        while self.version < self.steps:
            if self._waiting:
                raise AuroraError("publish() the version of the last batch before taking another")
            if self.rank == 0:
                try:
                    batch = self._get()
                except AuroraError as e:
                    self._share(("failed", str(e)))
                    raise
                self._share(("batch", batch))
            else:
                tag, value = self._share(None)
                if tag == "failed":
                    raise AuroraError(f"rank 0: {value}")
                batch = value
            self._waiting = True
            yield batch

    def publish(self, stats: dict[str, Any] | None = None) -> int:
        """The module's parameters, cast to bf16, become the next version (with ``stats`` in the trainer's
        step log: numbers and short strings); returns its number."""
        if not self._waiting:
            raise AuroraError("publish() follows a batch from batches()")
        self._check()
        clean = {str(k): _scalar(k, v) for k, v in (stats or {}).items()} if self.rank == 0 else {}
        weights = self._weights()  # every rank: a collective when the module is sharded
        self._waiting = False
        self.version += 1
        if weights is not None:
            self._versions.put((weights, clean))
        return self.version

    def synced(self) -> bool:
        """Does every named node hold the last published version?"""
        node = self._node
        return node is not None and self.version in node.status.sync_s

    def close(self, wait_synced_s: float = 0.0, *, raise_errors: bool = True) -> None:
        """Stop the node, after waiting up to ``wait_synced_s`` for every node to hold the last version.
        Raises (with ``raise_errors``) what stopped the node, or a node that published other versions
        than this loop did."""
        thread = self._thread
        if thread is None:
            return
        try:
            pause = threading.Event()
            waited = 0.0
            while wait_synced_s > waited and self._error is None and thread.is_alive() and not self.synced():
                pause.wait(POLL_S)
                waited += POLL_S
        finally:
            self._abandon()
            thread.join()
            self._thread = None
            atexit.unregister(self._abandon)
        if not raise_errors:
            return
        if self._error is not None and not isinstance(self._error, LearnerError):
            raise AuroraError(f"the trainer node failed: {self._error}") from self._error
        published = None if self._node is None else self._node.flow.version
        if published is not None and published != self.version:
            raise AuroraError(f"the trainer node holds version {published}, but this loop published {self.version}")

    def _abandon(self) -> None:
        """Stop without waiting: the publisher's wait for a version ends, and the node stops."""
        self._closing.set()
        self._versions.put(None)
        aio, stop = self._aio, self._stop
        if aio is not None and stop is not None and not aio.is_closed():
            with contextlib.suppress(RuntimeError):  # its loop ended meanwhile
                aio.call_soon_threadsafe(stop.set)

    # ---------------------------------------------------------------- the handover
    def _get(self) -> list[Group]:
        while True:
            self._check()
            try:
                return self._batches.get(timeout=POLL_S)
            except queue.Empty:
                continue

    def _check(self) -> None:
        if self._error is not None:
            raise AuroraError(f"the trainer node failed: {self._error}") from self._error
        if self._thread is not None and not self._thread.is_alive():
            raise AuroraError("the trainer node stopped")

    def _group(self, prompt: Prompt, completion: Completion) -> Group:
        with self._tok_lock:
            texts = [self.tok.decode(s.tokens) for s in completion.samples]
        rewards = [float(self.task.score(prompt, t).reward) for t in texts]
        return Group(prompt, completion, texts, rewards)

    def _share(self, obj: Any) -> Any:
        """Rank 0's ``obj``, on every rank (itself without torch.distributed)."""
        if not self._dist:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def _weights(self) -> Weights | None:
        """The module's parameters cast to bf16, in memory of their own (never the module's: a version
        must not change when your optimiser steps). A sharded module's are gathered whole on rank 0 (a
        collective every rank joins; None on the others)."""
        names = [n for n, _ in self.model.named_parameters()]
        if self._dist:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.rank != 0:
                return None
            tensors = {n: cast_tensor(full[n]) for n in names}
        else:
            tensors = dict(self.model.named_parameters())
        return bf16_weights(tensors, "the module")

    def _restore(self, weights: Weights, version: int) -> None:
        """In the node's thread, at its start: the store's newest version (`start` then sets the module)."""
        if set(weights) != {n for n, _ in self.model.named_parameters()}:
            raise ConfigError("the stored version does not fit the module (different tensors)", path="model")
        self._resumed = weights
        self.version = version

    def _apply_resumed(self) -> None:
        """The module's parameters set to the resumed version's values (every rank; from rank 0's)."""
        params = dict(self.model.named_parameters())
        full = {}
        if self._resumed is not None:
            full = {n: t.to(params[n].dtype) for n, t in self._resumed.to_tensors().items()}
        if self._dist:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
            set_model_state_dict(self.model, dict(full), options=options)  # type: ignore[arg-type]
            return
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(full[n])

    def _tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        with self._tok_lock:
            if self.topo.task.chat:
                return tuple(self.tok.chat(prompt.text, getattr(self.task, "system_prompt", None)))
            return tuple(self.tok.encode(prompt.text))

    def _check_names(self) -> None:
        """The module's parameter names are the rollouts' model's tensor names (a prefix from a wrapper —
        ``module.``, ``_orig_mod.`` — would make every version one no rollout can take)."""
        spec = self.topo.model
        if spec is None or spec.path is None:
            return
        d = Path(spec.resolved(self.file).directory())
        files = sorted(d.glob("*.safetensors"))
        if not files:
            return
        from safetensors import safe_open

        want: set[str] = set()
        for f in files:
            with safe_open(str(f), "pt") as st:
                want |= set(st.keys())
        have = {n for n, _ in self.model.named_parameters()}
        if have != want:
            extra, missing = sorted(have - want), sorted(want - have)
            raise ConfigError(
                f"the module's parameters are not the tensors of the model in {d}: "
                + (f"not in the model: {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}; " if extra else "")
                + (
                    f"not in the module: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
                    if missing
                    else ""
                ),
                file=self.file,
                path="model",
            )

    def _vocab(self) -> int:
        emb: Callable[[], Any] | None = getattr(self.model, "get_input_embeddings", None)
        if emb is not None:
            return int(emb().num_embeddings)
        return len(self.tok.hf)

    def _run(self, started: threading.Event) -> None:
        from aurora.node import run_node

        async def main() -> None:
            self._aio = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            learner = _Handover(self, self.spec, self._vocab())

            def observe(node: Any) -> None:
                self._node = node

            await run_node(
                self.topo,
                plan(self.topo, self.file),
                self.name,
                self._stop,
                file=self.file,
                store=self.store,
                observe=observe,
                insecure=self.insecure,
                learner=learner,
                ready=started.set,
            )

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001  (raised in your loop's thread, at its next call)
            self._error = e
        finally:
            started.set()
