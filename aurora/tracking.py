"""Metrics where people look: TensorBoard event files, and Weights & Biases when it is installed and
configured. The trainer records each version's figures as they happen (`Tracker.record`); a run's
``metrics.jsonl`` and ``metrics.png`` are still made from its log at the end (`aurora.metrics`).

What goes where (the TensorBoard tag; W&B takes the same names):

- ``train/…``: the learner's step: reward, accuracy, loss, kl, clip_frac, grad_norm, staleness,
  tokens, learn_s, reward_errors, score_us (the scoring's µs per sample);
- ``eval/accuracy``, ``eval/seconds``: the held-out evaluation (`aurora.rl.evaluate`);
- ``delta/bytes``, ``delta/density``, ``delta/seal_s``: the version as it went out;
- ``sync/seconds``: from publication until every node held it;
- ``rollouts/tokens_per_s`` (all rollouts together) and ``rollouts/switch_ms`` (their mean pause per
  version switch), from the nodes' last status reports.

Each figure is logged at its version as the step. TensorBoard's files go to ``DIR/tensorboard``
(``DIR``: the trainer's store; `aurora run` puts it under the run's state directory, so
``tensorboard --logdir runs/`` finds every run). W&B is used when the trainer has a store, the
``wandb`` package imports and ``WANDB_PROJECT`` is set (``WANDB_MODE=offline`` writes its files
locally, without a network); off otherwise. A trainer without a store tracks nothing.

Invariant: a tracker never raises into its caller; one that fails logs it once and goes quiet.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import structlog

log = structlog.get_logger("aurora.tracking")

TAGS: dict[str, str] = {
    "reward": "train/reward",
    "accuracy": "train/accuracy",
    "loss": "train/loss",
    "kl": "train/kl",
    "clip_frac": "train/clip_frac",
    "grad_norm": "train/grad_norm",
    "staleness": "train/staleness",
    "tokens": "train/tokens",
    "learn_s": "train/learn_s",
    "reward_errors": "train/reward_errors",
    "score_us": "train/score_us",
    "eval_accuracy": "eval/accuracy",
    "eval_s": "eval/seconds",
    "bytes": "delta/bytes",
    "density": "delta/density",
    "seal_s": "delta/seal_s",
    "sync_s": "sync/seconds",
    "rollout_tok_s": "rollouts/tokens_per_s",
    "switch_ms": "rollouts/switch_ms",
}
"""The figures tracked, by the name they have in the trainer's events, and their tag."""


class Tracker(Protocol):
    def record(self, version: int, figures: Mapping[str, Any]) -> None:
        """Log the known figures (`TAGS`) of ``figures`` at step ``version``; others are ignored."""
        ...

    def close(self) -> None: ...


def scalars(figures: Mapping[str, Any]) -> dict[str, float]:
    """The tracked figures of ``figures`` that are numbers, by tag."""
    return {
        TAGS[k]: float(v)
        for k, v in figures.items()
        if k in TAGS and isinstance(v, int | float) and not isinstance(v, bool)
    }


class _Guarded:
    """Calls into a backend; after its first error, logs it and does nothing more."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.failed = False

    def _fail(self, e: Exception) -> None:
        if not self.failed:
            log.warning("tracking_failed", backend=self.name, error=repr(e)[:300])
        self.failed = True


class TensorBoard(_Guarded):
    def __init__(self, logdir: Path) -> None:
        super().__init__("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = logdir
        self.writer = SummaryWriter(log_dir=str(logdir), flush_secs=5)

    def record(self, version: int, figures: Mapping[str, Any]) -> None:
        if self.failed:
            return
        try:
            for tag, value in scalars(figures).items():
                self.writer.add_scalar(tag, value, global_step=version)
        except Exception as e:  # noqa: BLE001  (a full disk must not stop training)
            self._fail(e)

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception as e:  # noqa: BLE001
            self._fail(e)


class WandB(_Guarded):
    def __init__(self, run_dir: Path, name: str, config: Mapping[str, Any]) -> None:
        super().__init__("wandb")
        import wandb

        self.run = wandb.init(
            dir=str(run_dir),
            name=name,
            config=dict(config),
            reinit="finish_previous",
            settings=wandb.Settings(console="off"),  # the node's stderr is its JSON log: not wrapped
        )

    def record(self, version: int, figures: Mapping[str, Any]) -> None:
        if self.failed:
            return
        try:
            self.run.log(scalars(figures), step=version)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def close(self) -> None:
        try:
            self.run.finish()
        except Exception as e:  # noqa: BLE001
            self._fail(e)


class Trackers:
    """Every tracker a trainer has (possibly none): records go to each."""

    def __init__(self, trackers: list[Tracker] | None = None) -> None:
        self.trackers = trackers or []

    def record(self, version: int, figures: Mapping[str, Any]) -> None:
        for t in self.trackers:
            t.record(version, figures)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def wandb_configured() -> bool:
    return importlib.util.find_spec("wandb") is not None and bool(os.environ.get("WANDB_PROJECT"))


def open_trackers(state: Path | None, name: str, config: Mapping[str, Any]) -> Trackers:
    """TensorBoard under ``state/tensorboard``, and W&B when configured; none without ``state``."""
    out: list[Tracker] = []
    if state is None:
        return Trackers(out)
    try:
        out.append(TensorBoard(state / "tensorboard"))
    except Exception as e:  # noqa: BLE001  (tensorboard missing or its directory unwritable)
        log.warning("tracking_failed", backend="tensorboard", error=repr(e)[:300])
    if wandb_configured():
        try:
            out.append(WandB(state, name, config))
        except Exception as e:  # noqa: BLE001
            log.warning("tracking_failed", backend="wandb", error=repr(e)[:300])
    if out:
        log.info("tracking", backends=[type(t).__name__.lower() for t in out], dir=str(state) if state else None)
    return Trackers(out)
