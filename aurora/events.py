"""The names of the log events that code other than their emitter reads, one constant each.

`aurora run` follows nodes' logs (`aurora.run`), the metrics are joined from the trainer's
(`aurora.metrics`), the benches time versions and switches from them (`aurora.bench.sync`,
`aurora.bench.rl`), and the tests assert on them. Emitters and readers both name an event
through its constant here, so renaming one changes every side at once, and a reader of a
name that is gone fails at import instead of silently matching nothing.

Invariants: the value of each constant is its name in lower case (snake_case, as structlog
events are named); every event here is logged through its constant, and no module logs or
matches one as a string literal (tests/test_layout.py holds both). Events that nothing reads
but a person stay string literals at their one call. Kernel: no imports, no I/O.
"""

from __future__ import annotations

# -- a node's life (aurora.actors.node)
NODE_STARTED = "node_started"
"""A node is listening and its actors are started: ``listen``, ``parent``, ``actors``."""
NODE_RESUMED = "node_resumed"
"""A relay or rollout resumed from its store: ``version``, ``store``."""
TRAINER_RESUMED = "trainer_resumed"
"""The trainer resumed from its store: ``version``, ``store``."""
STORE_VERSION_UNUSABLE = "store_version_unusable"
"""A stored version could not be resumed from (unreadable, or its seal does not verify): ``version``, ``error``."""

# -- the tree (aurora.actors.node)
PARENT_ATTACHED = "parent_attached"
"""A node attached under a parent: ``parent``, ``version``, ``path``, ``planned``."""
PARENT_LOST = "parent_lost"
"""The parent went silent or closed: ``parent``, ``reason``."""
PARENT_FAILED = "parent_failed"
"""The parent's stream failed (verification, protocol): ``parent``, ``error``; it is quarantined."""
PARENT_RETURN = "parent_return"
"""A node leaves a fallback parent for its planned one: ``parent``, ``to``."""
CHILD_ATTACHED = "child_attached"
"""A child attached here: ``child``, ``version``."""
WEBRTC_PARENT_CONNECTED = "webrtc_parent_connected"
"""A WebRTC channel to the parent is open: ``parent``."""

# -- versions (aurora.actors.flow, aurora.actors.node, aurora.actors.coding)
VERSION_PUBLISHED = "version_published"
"""The trainer published a version: ``version``, ``bytes``, ``density``, ``publish_s``, ``seal_s``, ``digest``."""
VERSION_COMMITTED = "version_committed"
"""A relay or rollout committed a version: ``version``, ``verified``, ``verify_s``, ``digest``."""
VERSION_SYNCED = "version_synced"
"""The trainer heard that every node holds a version: ``version``, ``sync_s``."""
CATCH_UP_SENT = "catch_up_sent"
CATCH_UP_STORE_FAILED = "catch_up_store_failed"
"""A composed catch-up could not read the child's version (``base``) from the store (``error``): the next
way (a replay from the history, or a snapshot) goes instead, and that stored version is not tried again."""
"""A behind child was sent the versions it lacks (``versions``) or one composed delta (``composed``)."""
SNAPSHOT_SENT = "snapshot_sent"
"""A child was sent a snapshot: ``child``, ``version``."""
ANCHOR_NOT_WRITTEN = "anchor_not_written"
"""A stored version could not be made an anchor (it stays a delta): ``version``, ``error``."""
CODING_CHOSEN = "coding_chosen"
"""The trainer chose each tensor's coding for a link: ``sparse``, ``conditioned``."""

# -- the learner and the work (aurora.actors.node, aurora.actors.work)
STEP = "step"
"""The learner made and published a version: ``version``, the learner's figures, the pool's counts."""
EVALUATED = "evaluated"
"""The trainer evaluated a version on held-out prompts (`aurora.rl.evaluate`): ``version``, ``eval_accuracy``,
``eval_prompts``, ``eval_s``."""
REWARD_FAILED = "reward_failed"
"""A reward function raised or returned something not in [0, 1]; the sample scored 0 (throttled):
``reward``, ``error``, ``errors`` (so far), ``suppressed``."""
ENGINE_SWITCHED = "engine_switched"
"""A rollout's engine moved to a version: ``version``, ``from_version``, ``switch_ms`` (the time generation
was stopped for it: the whole switch of a batch engine, the pause of a continuous one)."""
ENGINE_CHECKED = "engine_checked"
"""A continuous engine's check of a version it switched to, after generation resumed: ``version``, ``ok``,
``check_ms`` (a failed one drops that version's results and reloads it whole)."""
ENGINE_SERVER_LAUNCHED = "engine_server_launched"
"""A rollout started the ``vllm serve`` its engine runs on: ``url``, ``pid``, ``log`` (the server's own log)."""
ENGINE_SERVER_READY = "engine_server_ready"
"""A rollout's ``vllm serve`` answered: ``url``, ``wait_s``."""
ENGINE_SERVER_STOPPED = "engine_server_stopped"
"""A rollout stopped the ``vllm serve`` it started: ``url``, ``rc``."""
WORK_STARTED = "work_started"
"""A rollout got its first leases since it started: ``leases``."""
BATCH_GENERATED = "batch_generated"
"""A rollout generated a batch of its leased prompts (``prompts``, ``version``, ``generate_ms``); a
continuous one logs each prompt as it is done (``prompts`` 1, ``version`` its oldest, ``versions``)."""
LEASES_GRANTED = "leases_granted"
"""A rollout was granted leases (debug): ``leases`` as ``[item, token]`` pairs."""
RESULT_SENT = "result_sent"
"""A rollout sent a result (debug): ``item``, ``token``."""
LEASE_GIVEN_UP = "lease_given_up"
"""A rollout gave up a lease — one it could not renew in time, or held when its worker restarted (then
with ``reason``): ``item``, ``token``."""
LEASE_RENEWED = "lease_renewed"
"""A worker's renewal came back: ``leases`` renewed, ``rtt_ms`` from its `Renew` to this `Renewed` (what
`aurora bench sync` reports as the renewal latency under load)."""
LEASE_EXPIRED = "lease_expired"
"""The trainer let a lease expire: ``worker``, ``item``, ``token``."""
RESULT_ACCEPTED = "result_accepted"
"""The trainer accepted a result, journalled before its verdict left (debug): ``worker``, ``item``, ``version``
(the result's), ``current`` (the trainer's)."""
BATCH_TAKEN = "batch_taken"
"""The learner took results at version ``at`` (to make ``at + 1``) (debug): ``items``, ``versions``, and the
``dropped`` items the staleness rule dropped meanwhile."""
BATCH_RETURNED = "batch_returned"
"""The learner's step failed: the results it took are back in the pool, untrained (debug): ``items``."""
RESULTS_RESTORED = "results_restored"
"""A resumed trainer took back the acknowledged results no stored version trained on (its result journal,
`aurora.store.journal`): ``items``, ``next`` (the first prompt id it issues), ``done``."""

# -- supervision (aurora.runtime.supervisor)
CHILD_EXITED = "child_exited"
"""A supervised actor ended: ``supervisor``, ``child``, ``exit``, ``error``."""
CHILD_RESTARTING = "child_restarting"
"""A supervisor restarts a child (and its group): ``supervisor``, ``child``, ``backoff_s``."""
CHILD_SHUTDOWN_TIMEOUT = "child_shutdown_timeout"
"""A child did not stop in time at shutdown: ``supervisor``, ``child``."""
RESTART_INTENSITY_EXCEEDED = "restart_intensity_exceeded"
"""A supervisor gave up (too many restarts in its window): ``supervisor``, ``child``."""

# -- elastic pools (aurora.actors.node, on the trainer)
POOL_MEMBER_JOINED = "pool_member_joined"
"""A pool member got a place in its pool: ``member``, ``pool``, ``members`` (each pool's)."""
POOL_MEMBER_LEFT = "pool_member_left"
"""A pool member lost its place (not heard from): ``member``, ``reason``."""
POOL_MEMBER_REFUSED = "pool_member_refused"
"""A pool member got no place (its pool is full): ``member``, ``reason``."""

# -- links (aurora.transport)
BAD_MESSAGE = "bad_message"
"""A peer sent a message out of place (`Channel.fault`): ``peer``, ``reason``."""
BAD_FRAME = "bad_frame"
"""A ZeroMQ frame could not be read or was not the sender's to send: ``source``, ``reason``."""
CHANNEL_CLOSED = "channel_closed"
"""A channel closed: ``peer``, ``reason``."""
CURVE_CLIENT_REFUSED = "curve_client_refused"
"""A ZeroMQ server refused a CurveZMQ client key it does not know: ``client_key``."""
WEBRTC_ACCEPTED = "webrtc_accepted"
"""A WebRTC channel from a child is open: ``peer``."""
WEBRTC_FINGERPRINT_MISMATCH = "webrtc_fingerprint_mismatch"
"""A WebRTC answer's DTLS fingerprint is not the one announced: ``peer``."""
BULK_STREAM_DROPPED = "bulk_stream_dropped"
"""One stream of a bulk transfer failed or stalled (the others carry on): ``transfer``, ``peer``."""
BULK_FRAME_REJECTED = "bulk_frame_rejected"
"""A bulk frame failed its check: ``transfer``, ``peer``, ``error``."""
BULK_RESUMED = "bulk_resumed"
"""A bulk transfer resumed with the frames already held: ``transfer``, ``held_frames``."""
