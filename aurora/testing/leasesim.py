"""The shipped work coordinator (`aurora.protocol.workpool.WorkPool`) and model workers, simulated.

`SimTrainer` is the trainer's side as `aurora.actors.work.Coordinator` drives it: the
`WorkPool` answering the workers' messages (`WorkPool.handle`), expiring leases and
answering parked wants (`expire`, `unpark`), plus a learner that takes a batch at its
version (`take`), trains for ``train_s`` and publishes the next one. `SimWorker` is a
rollout worker as `aurora.actors.work.Worker` behaves: it asks for prompts with the
version it generates with, renews its leases by its own clock (`LeaseHolder`), takes
``work_s`` a prompt (or ``work_s`` a batch whatever its size: ``batched``), sends each result
under its lease, and moves to the newest version it has only between batches. Both are
`SimNode`s for `SimNetwork`, and every
message they send is a real one (`aurora.protocol.messages`), encoded and decoded on
the way as a link would.

The version stream is not simulated, only its end: for each version it publishes the
trainer sends each of its ``children`` (the workers) that version's `DeltaSeal` (the
message a node commits a version on; the seal here is blank), and sends the latest one
again every ``announce_s``, as a relay catches up a child that fell behind.

The trainer keeps a log (`TrainerLog`) of every lease it granted or renewed, every
result it accepted or rejected and every batch its learner took, so the tests can check
the pool's invariants against a reference model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from aurora.protocol.leases import Lease, LeaseHolder
from aurora.protocol.messages import (
    AppMessage,
    DeltaSeal,
    Grant,
    Renew,
    Renewed,
    Result,
    SampleWire,
    SealWire,
    Want,
    decode_app,
    encode,
)
from aurora.protocol.workpool import (
    Accepted,
    PoolSettings,
    Rejected,
    ResultRules,
    WorkPool,
    leases_in,
    renew_messages,
)
from aurora.rl.types import Prompt

TRAINER = "trainer"
RULES = ResultRules(vocab_size=128, max_new_tokens=8)
BLANK_SEAL = SealWire(b"", bytes(64))
"""What the simulated version stream's seals carry (nothing is signed here)."""


def prompts() -> Iterator[Prompt]:
    """An endless task of prompts, each tokenized as the trainer would."""
    i = 0
    while True:
        yield Prompt(i, f"{i % 10}+1=", str(i % 10 + 1), tokens=(1, 3 + i % 10, 4))
        i += 1


def wire(msg: AppMessage) -> AppMessage:
    """``msg`` as the other end of a link gets it: encoded and decoded (a message out of its
    bounds raises `BadMessage` here, as it would on a real link)."""
    return decode_app(encode(msg))


@dataclass(frozen=True, slots=True)
class Acceptance:
    at: float
    worker: str
    item: int
    token: bytes
    version: int
    """The version the result was made with."""
    current: int
    """The trainer's version when it was accepted."""


@dataclass(frozen=True, slots=True)
class Release:
    """A result too stale to use: its lease ended at ``at`` and its prompt went back to the pool."""

    at: float
    worker: str
    item: int
    token: bytes


@dataclass(slots=True)
class TrainerLog:
    granted: list[tuple[float, Lease]] = field(default_factory=list)
    renewed: list[tuple[float, Lease]] = field(default_factory=list)
    accepted: list[Acceptance] = field(default_factory=list)
    rejected: list[tuple[float, str, Rejected]] = field(default_factory=list)
    released: list[Release] = field(default_factory=list)
    expired: list[tuple[float, Lease]] = field(default_factory=list)
    taken: list[tuple[int, list[int]]] = field(default_factory=list)
    """Per take: the learner's version and the versions of the results it took."""


class SimTrainer:
    """The trainer's coordinator and learner (see the module docstring)."""

    def __init__(
        self,
        settings: PoolSettings,
        *,
        batch: int,
        steps: int,
        children: Sequence[str],
        group_size: int = 1,
        train_s: float = 0.3,
        announce_s: float = 0.5,
    ) -> None:
        self.name = TRAINER
        self.pool = WorkPool(settings, prompts(), RULES, group_size=group_size, batch=batch, steps=steps)
        self.batch = batch
        self.steps = steps
        self.train_s = train_s
        self.announce_s = announce_s
        self.current = 0
        """The version the trainer holds (its flow's: what the pool is told)."""
        self.training_until: float | None = None
        self.next_announce = 0.0
        self.children = sorted(children)
        """The workers the version stream reaches (the tree below the trainer)."""
        self.log = TrainerLog()
        self._out: list[tuple[str, AppMessage]] = []

    @property
    def finished(self) -> bool:
        """The learner has taken every step's batch."""
        return len(self.log.taken) == self.steps

    def handle(self, src: str, msg: Any, now: float) -> None:
        if not isinstance(msg, Want | Renew | Result):
            return
        answer = self.pool.handle(msg, now, self.current)
        if isinstance(answer.reply, Grant):
            self.log.granted += [(now, self._lease(g.item)) for g in answer.reply.leases]
        elif isinstance(answer.reply, Renewed):
            self.log.renewed += [(now, self._lease(r.item)) for r in answer.reply.leases]
        if isinstance(answer.outcome, Accepted) and isinstance(msg, Result):
            self.log.accepted.append(Acceptance(now, msg.w, msg.item, msg.token, msg.v, self.current))
        elif isinstance(answer.outcome, Rejected) and isinstance(msg, Result):
            self.log.rejected.append((now, src, answer.outcome))
            if answer.outcome.kind == "stale":  # the pool gave the prompt back: its lease ended now
                self.log.released.append(Release(now, msg.w, msg.item, msg.token))
        if answer.reply is not None:
            self._out.append((src, answer.reply))

    def _lease(self, item: int) -> Lease:
        lease = self.pool.table.current(item)
        assert lease is not None, "a lease just granted or renewed is current"
        return lease

    def tick(self, now: float) -> None:
        self.log.expired += [(now, e.lease) for e in self.pool.expire(now)]
        if self.training_until is not None and now >= self.training_until:
            self.training_until = None
            self.current += 1  # the learner publishes the version it trained
            self.next_announce = now
        if self.training_until is None and not self.finished:
            taken = self.pool.take(self.batch, self.current)
            if taken is not None:
                self.log.taken.append((self.current, [c.version for _, c in taken]))
                self.training_until = now + self.train_s
        for w, granted in self.pool.unpark(now, self.current).items():
            self.log.granted += [(now, lease) for lease, _ in granted]
            self._out.append((w, self.pool.grant_message(w, granted)))
        if now >= self.next_announce:
            self._out += [(w, DeltaSeal(target=self.current, seal=BLANK_SEAL)) for w in self.children]
            self.next_announce = now + self.announce_s

    def next_deadline(self) -> float | None:
        ds = [self.pool.next_deadline(), self.training_until, self.next_announce]
        return min((d for d in ds if d is not None), default=None)

    def outbox(self) -> list[tuple[str, Any]]:
        out, self._out = [(dst, wire(m)) for dst, m in self._out], []
        return out


class SimWorker:
    """A rollout worker (see the module docstring); a restart is a new one under the same name."""

    def __init__(
        self,
        name: str,
        *,
        work_s: float = 0.2,
        prompts_per_lease: int = 2,
        want_every_s: float = 1.0,
        renew_fraction: float = 0.5,
        batched: bool = False,
    ) -> None:
        self.name = name
        self.work_s = work_s
        self.batched = batched
        """A batch takes ``work_s`` whatever its size (an engine that generates a batch at once, as vLLM
        and the synthetic engine do); False: ``work_s`` a prompt."""
        self.prompts_per_lease = prompts_per_lease
        self.want_every_s = want_every_s
        """How long a want waits for a grant or a new version before it is sent again."""
        self.holder = LeaseHolder(name, renew_fraction=renew_fraction)
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.group_size = 1
        self.node_version: int | None = None
        """The newest version this worker's node has committed."""
        self.version: int | None = None
        """The version its engine generates with (moves to ``node_version`` between batches)."""
        self.batch: tuple[float, list[int], int] | None = None
        """Generating: (until when, the prompts, with which version)."""
        self.next_want = 0.0
        self._out: list[tuple[str, AppMessage]] = []

    def handle(self, src: str, msg: Any, now: float) -> None:
        if isinstance(msg, Grant):
            self.holder.on_granted(leases_in(msg, self.name, now), now)
            self.prompts.update((g.item, tuple(g.tokens)) for g in msg.leases)
            self.group_size = msg.n
            self.next_want = now
        elif isinstance(msg, Renewed):
            self.holder.on_renewed(leases_in(msg, self.name, now), now)
        elif isinstance(msg, DeltaSeal) and (self.node_version is None or msg.target > self.node_version):
            self.node_version = msg.target
            self.next_want = now  # a want waits for a grant or a new version

    def tick(self, now: float) -> None:
        self.holder.tick(now)
        for ev in self.holder.events():  # given up by its own clock: the trainer leases it again
            self.prompts.pop(cast(int, ev.lease.item), None)
        self._out.extend((TRAINER, renew) for renew in renew_messages(self.name, self.holder.renewals_due(now)))
        if self.batch is not None and now >= self.batch[0]:
            _, items, version = self.batch
            self.batch = None
            for item in items:
                lease = self.holder.take(item)
                self.prompts.pop(item, None)
                if lease is not None:  # still held: its result goes up under its lease
                    samples = [SampleWire([5, 6], [-0.5, -0.25])] * self.group_size
                    self._out.append(
                        (TRAINER, Result(w=self.name, item=item, token=lease.token, v=version, samples=samples))
                    )
        if self.batch is not None or self.node_version is None:
            return
        self.version = self.node_version  # between batches: the newest version the node holds
        held = [i for i in self.prompts if self.holder.lease(i) is not None]
        if held:
            self.batch = (now + self.work_s * (1 if self.batched else len(held)), held, self.version)
        elif now >= self.next_want:
            self._out.append((TRAINER, Want(w=self.name, n=self.prompts_per_lease, v=self.version)))
            self.next_want = now + self.want_every_s

    def next_deadline(self) -> float | None:
        ds = [self.holder.next_deadline(), None if self.batch is None else self.batch[0]]
        if self.batch is None and self.node_version is not None:
            ds.append(self.next_want)
        return min((d for d in ds if d is not None), default=None)

    def outbox(self) -> list[tuple[str, Any]]:
        out, self._out = [(dst, wire(m)) for dst, m in self._out], []
        return out


class ContinuousSimWorker(SimWorker):
    """A rollout worker on a continuous engine (`aurora.actors.work.ContinuousWorker` on vLLM's async
    engine): each granted prompt is a request of its own, started when granted and done ``work_s``
    later whatever else runs beside it (up to ``prompts_per_lease`` at once), its result sent then;
    it asks for more whenever fewer than ``prompts_per_lease`` run, and a new version is taken at
    once (no batch barrier: a request is labelled with the version it started on, its oldest)."""

    def __init__(self, name: str, *, work_s: float = 0.2, prompts_per_lease: int = 2, want_every_s: float = 1.0):
        super().__init__(name, work_s=work_s, prompts_per_lease=prompts_per_lease, want_every_s=want_every_s)
        self.running: dict[int, tuple[float, int]] = {}
        """Per request: (when it is done, the version it started on)."""

    def tick(self, now: float) -> None:
        self.holder.tick(now)
        for ev in self.holder.events():
            self.prompts.pop(cast(int, ev.lease.item), None)
            self.running.pop(cast(int, ev.lease.item), None)
        self._out.extend((TRAINER, renew) for renew in renew_messages(self.name, self.holder.renewals_due(now)))
        for item, (until, version) in list(self.running.items()):
            if now >= until:
                del self.running[item]
                self.prompts.pop(item, None)
                lease = self.holder.take(item)
                if lease is not None:
                    samples = [SampleWire([5, 6], [-0.5, -0.25])] * self.group_size
                    self._out.append(
                        (TRAINER, Result(w=self.name, item=item, token=lease.token, v=version, samples=samples))
                    )
                self.next_want = now
        if self.node_version is None:
            return
        self.version = self.node_version
        for item in self.prompts:
            if item not in self.running and self.holder.lease(item) is not None:
                self.running[item] = (now + self.work_s, self.version)
        if len(self.running) < self.prompts_per_lease and now >= self.next_want:
            n = self.prompts_per_lease - len(self.running)
            self._out.append((TRAINER, Want(w=self.name, n=n, v=self.version)))
            self.next_want = now + self.want_every_s

    def next_deadline(self) -> float | None:
        ds = [self.holder.next_deadline(), *(u for u, _ in self.running.values())]
        if self.node_version is not None and len(self.running) < self.prompts_per_lease:
            ds.append(self.next_want)
        return min((d for d in ds if d is not None), default=None)


class HoardingWorker(SimWorker):
    """A hostile worker: it answers its first ``honest`` prompts at once (so that it is measured as
    fast and granted many), then only renews what it holds and asks for more, answering nothing —
    the lease hoarding that a lease's lifetime bound answers (`aurora.protocol.leases`)."""

    def __init__(self, name: str, *, honest: int = 3, prompts_per_lease: int = 8) -> None:
        super().__init__(name, work_s=0.01, prompts_per_lease=prompts_per_lease)
        self.honest = honest
        self.answered = 0

    def tick(self, now: float) -> None:
        if self.answered < self.honest:
            super().tick(now)
            self.answered += sum(isinstance(m, Result) for _, m in self._out)
            return
        self.batch = None
        self.holder.tick(now)
        for ev in self.holder.events():
            self.prompts.pop(cast(int, ev.lease.item), None)
        self._out.extend((TRAINER, renew) for renew in renew_messages(self.name, self.holder.renewals_due(now)))
        if self.node_version is not None and now >= self.next_want and len(self.holder.items) < self.prompts_per_lease:
            self._out.append((TRAINER, Want(w=self.name, n=self.prompts_per_lease, v=self.node_version)))
            self.next_want = now + self.want_every_s

    def next_deadline(self) -> float | None:
        if self.answered < self.honest:
            return super().next_deadline()
        ds = [self.holder.next_deadline(), self.next_want if self.node_version is not None else None]
        return min((d for d in ds if d is not None), default=None)
