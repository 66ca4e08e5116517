"""`Ranks`: a learner's torch.distributed job — one process, or N ranks under torch's launcher.

A sharded learner (``learner.ranks: N``) runs as N processes started by
``torch.distributed.run`` (the trainer node relaunches itself under it, or you
run ``torchrun``): rank 0 hosts the trainer node and drives; every other rank
*follows* (`follow`): it waits for rank 0's next command and runs the same
code on its shards, so that every collective is entered by every rank in the
same order. The model is sharded with FSDP2 (`fully_shard`: each decoder layer,
then the root): fp32 master weights, gradients and AdamW state live 1/N on
each rank; gloo on CPUs, NCCL on GPUs.

One rank (``Ranks.single()``, no process group) is the same code with every
collective the identity: a learner of one rank computes exactly what it did
before ranks existed.

Invariants: only rank 0 issues commands (`command`), and a follower runs each
one whole before it takes the next; a rank that fails inside a command ends the
job (a follower by its exception, rank 0 by `lockstep`), so no rank is ever left
waiting in a collective that another will not enter; a rank's share of a step's rows is
``rows[rank::size]``, every rank gets at least one row while there are any
(a rank that would get none trains on a row weighted 0), and the weights of a
row sum to the step's whole (`share`); the process group's timeout is long
(a follower waits on rank 0 between steps for as long as rollouts take):
a rank that dies is noticed by the launcher, which ends the others.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import structlog
import torch
import torch.distributed as tdist

log = structlog.get_logger("aurora.ranks")

T = TypeVar("T")

WAIT = datetime.timedelta(days=7)
"""How long a collective may wait: a follower waits between steps for as long as rank 0 takes."""


def rank_here() -> int | None:
    """This process's rank under torch's launcher (None: not under it)."""
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def launch_argv(ranks: int, restarts: int, args: Sequence[str]) -> list[str]:
    """The command that runs ``aurora ARGS`` as ``ranks`` processes under torch's launcher
    (``torch.distributed.run``, by `aurora.rl.learners.launch`; standalone: its rendezvous on a free local
    port), every rank started
    again up to ``restarts`` times after one fails."""
    import sys

    launcher = [sys.executable, "-m", "aurora.rl.learners.launch", "--standalone", f"--nproc-per-node={ranks}"]
    return [*launcher, f"--max-restarts={restarts}", "-m", "aurora", *args]


class Ranks:
    """The job's ranks (module docstring)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.closed = False

    @classmethod
    def single(cls) -> Ranks:
        return cls(0, 1)

    @classmethod
    def join(cls, want: int) -> Ranks:
        """This process's place in a job of ``want`` ranks started by torch's launcher (its environment:
        ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...). ``want`` 1 outside a launcher: `single`."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if want == 1 and size == 1:
            return cls.single()
        if size != want:
            from aurora.errors import ConfigError

            raise ConfigError(
                f"the learner has {want} ranks but torch's launcher started {size} (WORLD_SIZE)", path="learner.ranks"
            )
        if not tdist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            tdist.init_process_group(backend, timeout=WAIT)
        ranks = cls(tdist.get_rank(), tdist.get_world_size())
        if ranks.rank == 0:
            atexit.register(ranks.close)
        return ranks

    @property
    def device(self) -> torch.device:
        """This rank's GPU (the launcher's ``LOCAL_RANK``-th) where there is one, else the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device() if self.size > 1 else 0)
        return torch.device("cpu")

    # -- the model
    def shard(self, model: torch.nn.Module) -> None:
        """FSDP2 over the job: each decoder layer, then the root. Parameters stay gathered from a forward
        to its backward (a step runs several forwards, stage by stage, before one backward); `settle`
        shards them again."""
        if self.size == 1:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        layers = getattr(getattr(model, "model", None), "layers", None) or []
        for layer in layers:
            fully_shard(layer, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        assert isinstance(model, FSDPModule)
        model.set_reshard_after_backward(False)

    def settle(self, model: torch.nn.Module) -> None:
        """After a backward (or a forward with none): every FSDP unit back to its shards."""
        if self.size == 1:
            return
        from torch.distributed.fsdp import FSDPModule

        for mod in model.modules():
            if isinstance(mod, FSDPModule):
                mod.reshard()

    def full(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every parameter whole, on rank 0 (a collective; a follower gets nothing). Gathered one tensor
        at a time and moved to the CPU, so no rank holds more than one whole tensor beside its shards."""
        if self.size == 1:
            return params
        from torch.distributed.tensor import DTensor

        out = {}
        for n, p in params.items():
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            if self.rank == 0:
                out[n] = whole.detach().to("cpu", copy=True)
            del whole
        return out

    @staticmethod
    def local(t: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``t`` (``t`` itself when it is not sharded)."""
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    def scalar(self, t: torch.Tensor | float) -> float:
        """A number every rank agrees on: a DTensor's full value, or a plain one."""
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t.full_tensor()
        return float(t)

    # -- the work
    def share(self, rows: Sequence[T]) -> tuple[list[T], float]:
        """This rank's rows of a step and their weight in it: ``rows[rank::size]``; a rank that would get
        none gets ``rows[:1]`` weighted 0 (it must still enter every collective)."""
        mine = list(rows[self.rank :: self.size])
        if rows and not mine:
            return list(rows[:1]), 0.0
        return mine, 1.0

    def sum(self, x: float) -> float:
        """``x`` summed over the ranks."""
        if self.size == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t)
        return float(t[0])

    def every(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank."""
        if self.size == 1:
            return ok
        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
        return bool(t[0])

    def same(self, obj: Any) -> Any:
        """Rank 0's ``obj``, on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        tdist.broadcast_object_list(
            box, src=0, device=torch.device("cpu") if self.device.type == "cpu" else self.device
        )
        return box[0]

    # -- driving
    @contextlib.contextmanager
    def lockstep(self, *safe: type[BaseException]) -> Iterator[None]:
        """Around rank 0's part of a command: an exception there (other than one of ``safe``, raised only
        once every rank is done with the command) would leave the followers inside a collective that
        rank 0 never enters, so it ends this process at once and the launcher ends and restarts the job."""
        try:
            yield
        except safe:
            raise
        except BaseException as e:
            if self.size == 1:
                raise
            log.error("rank_failed", rank=self.rank, error=repr(e), detail="the job ends: the launcher starts it again")
            os._exit(1)

    def command(self, name: str, *args: Any) -> None:
        """Rank 0: tell the followers to run ``name`` with ``args`` (they then enter what rank 0 enters)."""
        if self.size > 1:
            assert self.rank == 0, "only rank 0 drives"
            self.same((name, args))

    def follow(self, handlers: dict[str, Callable[..., Any]]) -> None:
        """A follower: run rank 0's commands until it says ``stop`` (or the job ends)."""
        assert self.rank > 0
        log.info("rank_following", rank=self.rank, of=self.size)
        while True:
            name, args = self.same(None)
            if name == "stop":
                break
            handlers[name](*args)
        log.info("rank_stopped", rank=self.rank)
        with contextlib.suppress(Exception):
            tdist.destroy_process_group()

    def close(self) -> None:
        """Rank 0: the followers stop (at most once; also at exit)."""
        if self.closed or self.size == 1 or not tdist.is_initialized():
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self.command("stop")
            tdist.destroy_process_group()
