"""Layer 1, stateful: coordinator + workers on SimNetwork under hypothesis fault schedules.

Invariants (checked after every rule):
  * at most one valid lease per work item at any instant;
  * no result is accepted from an expired or fenced lease, and none twice
    (checked against a reference model built from what the coordinator granted);
  * liveness never reports a reachable peer lost: every PeerLost follows a
    disruption (crash, partition, or a dropped message) of that worker within
    the loss window;
  * at teardown, with faults healed and a worker alive, every item completes
    exactly once.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aurora.protocol import RestartBudget
from aurora.testing.leasesim import COORD, Coordinator, Worker
from aurora.testing.simnet import Faults, SimNetwork

WORKERS = ["w0", "w1", "w2"]
LOST_AFTER_S = 3.0


class LeaseCluster(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16), n_items=st.integers(1, 30))
    def setup(self, seed: int, n_items: int) -> None:
        self.net = SimNetwork(seed=seed, faults=Faults(delay_s=0.01, jitter_s=0.02))
        self.coord = Coordinator(list(range(n_items)), ttl_s=2.0, lost_after_s=LOST_AFTER_S, seed=seed)
        self.net.add(self.coord)
        self.incarnation = dict.fromkeys(WORKERS, 0)
        self.disrupted = dict.fromkeys(WORKERS, -1e9)
        self.net.on_drop = self._on_drop
        for i, w in enumerate(WORKERS):
            self.net.add(Worker(w, work_s=0.1 + 0.1 * i, seed=seed + i))
        self.checked_accepts = 0

    def _on_drop(self, src: str, dst: str, msg: Any) -> None:
        for w in (src, dst):
            if w in self.disrupted:
                self.disrupted[w] = self.net.now

    def _mark(self, w: str) -> None:
        self.disrupted[w] = self.net.now

    @rule(w=st.sampled_from(WORKERS))
    def crash(self, w: str) -> None:
        self.net.faults.crashed.add(w)
        self._mark(w)

    @precondition(lambda self: bool(self.net.faults.crashed))
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(sorted(self.net.faults.crashed)))
        self.net.faults.crashed.discard(w)
        self.incarnation[w] += 1
        self.net.replace(Worker(w, incarnation=self.incarnation[w], work_s=0.15))
        self._mark(w)

    @rule(w=st.sampled_from(WORKERS))
    def partition(self, w: str) -> None:
        self.net.faults.partitions.add(frozenset((w, COORD)))
        self._mark(w)

    @rule(w=st.sampled_from(WORKERS))
    def heal(self, w: str) -> None:
        if frozenset((w, COORD)) in self.net.faults.partitions:
            self.net.faults.partitions.discard(frozenset((w, COORD)))
            self._mark(w)

    @rule(p=st.sampled_from([0.0, 0.05, 0.3]))
    def drop(self, p: float) -> None:
        self.net.faults.drop = p

    @rule(p=st.sampled_from([0.0, 0.1]))
    def duplicate(self, p: float) -> None:
        self.net.faults.duplicate = p

    @rule(j=st.sampled_from([0.0, 0.05, 0.2]))
    def delay(self, j: float) -> None:
        self.net.faults.jitter_s = j

    @rule(dt=st.floats(0.01, 1.5))
    def advance(self, dt: float) -> None:
        self.net.advance(dt)

    @rule()
    def expire(self) -> None:
        self.net.advance(self.coord.table.ttl_s + 0.1)  # long enough for any un-renewed lease to lapse

    @invariant()
    def one_valid_lease_per_item(self) -> None:
        valid = self.coord.table.valid_leases(self.net.now)
        items = [lease.item for lease in valid]
        assert len(items) == len(set(items))

    @invariant()
    def accepted_only_under_current_unexpired_lease(self) -> None:
        log = self.coord.log
        latest: dict[Any, bytes] = {}
        expiry: dict[bytes, float] = {}
        events = sorted([(t, 0, lease) for t, lease in log.granted] + [(t, 1, lease) for t, lease in log.renewed],
                        key=lambda e: (e[0], e[1]))  # fmt: skip
        seen: set[Any] = set()
        for acc in log.accepted:
            lease = acc.lease
            for t, _kind, g in events:
                if t > acc.at:
                    break
                latest[g.item] = max(latest.get(g.item, bytes(16)), g.token)  # the sim's counter tokens sort
                expiry[g.token] = g.expires_at
            assert lease.token == latest[lease.item], "accepted a fenced lease"
            assert acc.at < expiry[lease.token], "accepted an expired lease"
            assert lease.item not in seen, "accepted twice"
            seen.add(lease.item)

    @invariant()
    def lost_only_after_a_disruption(self) -> None:
        for t, ev in self.coord.log.lost:
            assert self.disrupted[ev.peer] >= t - LOST_AFTER_S - 0.5, f"{ev.peer} lost at {t} while reachable"

    def teardown(self) -> None:
        if not hasattr(self, "net"):
            return
        f = self.net.faults
        f.partitions.clear()
        f.drop = 0.0
        for w in sorted(f.crashed):
            f.crashed.discard(w)
            self.incarnation[w] += 1
            self.net.replace(Worker(w, incarnation=self.incarnation[w], work_s=0.15))
        self.net.advance(200.0)
        table = self.coord.table
        assert table.finished, f"{table.pending} pending, {table.in_flight} in flight"
        accepted = [a.lease.item for a in self.coord.log.accepted]
        assert sorted(accepted) == sorted(set(accepted)) == sorted(table.done)


TestLeaseCluster = LeaseCluster.TestCase
TestLeaseCluster.settings = settings(stateful_step_count=40, deadline=None)


def test_a_failing_seed_replays_exactly() -> None:
    def run(seed: int) -> tuple[int, int, list[Any]]:
        net = SimNetwork(seed=seed, faults=Faults(drop=0.2, duplicate=0.1, jitter_s=0.1))
        coord = Coordinator(list(range(20)), ttl_s=2.0, seed=seed)
        net.add(coord)
        for i, w in enumerate(WORKERS):
            net.add(Worker(w, work_s=0.1 * (i + 1), seed=i))
        net.advance(5.0)
        net.faults.partitions.add(frozenset(("w1", COORD)))
        net.advance(30.0)
        return net.delivered, net.dropped, [(a.lease.item, a.lease.worker, a.at) for a in coord.log.accepted]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_partitioned_worker_is_lost_and_its_work_reassigned() -> None:
    net = SimNetwork(seed=1)
    coord = Coordinator(list(range(40)), ttl_s=2.0, seed=1)
    net.add(coord)
    for w in WORKERS:
        net.add(Worker(w, work_s=0.2))
    net.advance(2.0)
    net.faults.partitions.add(frozenset(("w0", COORD)))
    net.advance(60.0)
    assert coord.table.finished
    assert [ev.peer for _, ev in coord.log.lost] == ["w0"]
    late = [a for a in coord.log.accepted if a.lease.worker == "w0" and a.at > 2.0 + 0.05]
    assert not late  # nothing from the cut-off worker counted


def test_restart_budget_never_allows_more_than_intensity() -> None:
    from hypothesis import given

    @given(st.lists(st.floats(0, 100), max_size=60), st.integers(0, 5), st.floats(0.5, 20))
    def prop(times: list[float], n: int, within: float) -> None:
        b = RestartBudget(max_restarts=n, within_s=within)
        allowed = [t for t in sorted(times) if b.allow(t)]
        for t in allowed:  # no window holds more than n allowed restarts
            assert sum(1 for u in allowed if t - within < u <= t) <= n

    prop()
