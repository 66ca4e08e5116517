"""A `Deployment` as each engine's own files: a Compose file, Kubernetes manifests, SkyPilot tasks.

Each renderer returns ``{path: text}`` relative to the output directory, which also holds the bundle
(``bundle/``) and each node's secrets (``secrets/NODE/``) that `aurora.deploy.write` puts there. Every
engine restarts a node whose process ends (Aurora's protocol re-attaches it and catches it up), gives
it its own secrets only, and the public bundle to all.
"""

from __future__ import annotations

import base64
import re
import shlex
from typing import Any

import yaml

from aurora.deploy.plan import CONF, MODEL, SECRET, STORE, Deployment, Unit, service
from aurora.errors import ConfigError

LABEL = "aurora.dev/node"
REGION_LABEL = "topology.kubernetes.io/region"
RESTARTS = 10
"""SkyPilot: restarts of a managed job after its process failed (a preemption is recovered anyway)."""
CONFIGMAP_MAX = 200 * 1024
"""The bundle's encoded bytes a ConfigMap may take: `kubectl apply` keeps a copy of the object in an
annotation of at most 256 KiB."""
SECRET_FILES = "secrets/"
"""Files of the engine's whose path holds this hold secrets: `aurora.deploy.write` makes them 0600."""


def _dump(docs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False) if len(docs) > 1 else yaml.safe_dump(docs[0], sort_keys=False)


# -- Docker Compose: the whole topology on one Docker host
def compose(d: Deployment) -> dict[str, str]:
    services: dict[str, Any] = {}
    volumes: dict[str, Any] = {}
    for u in d.units:
        mounts = [f"./bundle:{CONF}:ro", f"./secrets/{u.name}:{SECRET}:ro", f"store-{u.dns}:{STORE}"]
        if d.model_dir is not None:
            mounts.append(f"{d.model_dir}:{MODEL}:ro")
        elif d.model:
            mounts.append(f"model-{u.dns}:{MODEL}")
            volumes[f"model-{u.dns}"] = {}
        volumes[f"store-{u.dns}"] = {}
        svc: dict[str, Any] = {"image": u.image, "command": list(u.argv), "restart": "unless-stopped"}
        svc["volumes"] = mounts
        if u.port is not None:
            svc["expose"] = [str(u.port)]
        if u.parent is not None:
            svc["depends_on"] = [u.parent]
        if u.gpus:
            svc["deploy"] = {
                "resources": {
                    "reservations": {"devices": [{"driver": "nvidia", "count": u.gpus, "capabilities": ["gpu"]}]}
                }
            }
        services[u.dns] = svc
    doc = {"name": f"aurora-{d.name}", "services": services, "volumes": volumes}
    return {"compose.yaml": yaml.safe_dump(doc, sort_keys=False)}


# -- Kubernetes: one Deployment per node, a Service per listening node, a Secret per node
def _meta(d: Deployment, name: str, u: Unit | None = None) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "aurora", "app.kubernetes.io/instance": d.name}
    if u is not None:
        labels[LABEL] = u.dns
    return {"name": name, "labels": labels}


_CONFIGMAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def _bundle_key(path: str) -> str:
    """A bundle path as a ConfigMap key (keys may not hold '/')."""
    return path.replace("/", "__")


def kubernetes(d: Deployment) -> dict[str, str]:
    bundle = f"aurora-{d.name}-bundle"
    text: dict[str, str] = {}
    binary: dict[str, str] = {}
    for path, data in d.bundle.items():
        key = _bundle_key(path)
        if not _CONFIGMAP_KEY.fullmatch(key):
            raise ConfigError(f"{path}: a ConfigMap key holds letters, digits, '-', '_' and '.' only: rename it")
        try:
            text[key] = data.decode()
        except UnicodeDecodeError:
            binary[key] = base64.b64encode(data).decode()
    size = sum(map(len, text.values())) + sum(map(len, binary.values()))
    if size > CONFIGMAP_MAX:
        raise ConfigError(
            f"the bundle (topology, public keys, task files) takes {size} bytes in a ConfigMap; kubectl apply "
            f"takes at most {CONFIGMAP_MAX}: build the task's data into the image instead",
            path="task.path",
        )
    cm: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(d, bundle), "data": text}
    if binary:
        cm["binaryData"] = binary
    out = {"kubernetes/bundle.yaml": _dump([cm])}
    items = [{"key": _bundle_key(p), "path": p} for p in d.bundle]
    for u in d.units:
        secret = f"aurora-{d.name}-{u.dns}-keys"
        out[f"kubernetes/{SECRET_FILES}{u.dns}.yaml"] = _dump(
            [
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": _meta(d, secret, u),
                    "type": "Opaque",
                    "data": {k: base64.b64encode(v).decode() for k, v in u.secret_bytes().items()},
                }
            ]
        )
        docs: list[dict[str, Any]] = []
        volumes: list[dict[str, Any]] = [
            {"name": "bundle", "configMap": {"name": bundle, "items": items}},
            {"name": "secret", "secret": {"secretName": secret, "defaultMode": 0o400}},
        ]
        if d.model:
            volumes.append({"name": "model", "emptyDir": {}})
        if u.role == "trainer":  # its store outlives the pod: a rescheduled trainer resumes from it
            claim = f"aurora-{d.name}-{u.dns}-store"
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "metadata": _meta(d, claim, u),
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "50Gi"}}},
                }
            )
            volumes.append({"name": "store", "persistentVolumeClaim": {"claimName": claim}})
        else:
            volumes.append({"name": "store", "emptyDir": {}})
        container: dict[str, Any] = {
            "name": "node",
            "image": u.image,
            "command": list(u.argv),
            "volumeMounts": [
                {"name": "bundle", "mountPath": CONF, "readOnly": True},
                {"name": "secret", "mountPath": SECRET, "readOnly": True},
                {"name": "store", "mountPath": STORE},
                *([{"name": "model", "mountPath": MODEL}] if d.model else []),
            ],
        }
        if u.port is not None:
            container["ports"] = [{"name": "aurora", "containerPort": u.port, "protocol": "TCP"}]
        if u.gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": u.gpus}}
        selector = {"app.kubernetes.io/instance": d.name, LABEL: u.dns}
        docs.append(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": _meta(d, f"aurora-{d.name}-{u.dns}", u),
                "spec": {
                    "replicas": 1,
                    "strategy": {"type": "Recreate"},  # never two lives of one node at once
                    "selector": {"matchLabels": selector},
                    "template": {
                        "metadata": {"labels": _meta(d, "", u)["labels"]},
                        "spec": {
                            "restartPolicy": "Always",
                            **({"nodeSelector": {REGION_LABEL: u.cloud_region}} if u.cloud_region else {}),
                            "containers": [container],
                            "volumes": volumes,
                        },
                    },
                },
            }
        )
        if u.port is not None:  # its children dial tcp://DNS:PORT, the address in the shipped topology
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": _meta(d, service(d.name, u.dns, "kubernetes"), u),
                    "spec": {"selector": selector, "ports": [{"name": "aurora", "port": u.port, "targetPort": u.port}]},
                }
            )
        out[f"kubernetes/{u.dns}.yaml"] = _dump(docs)
    return out


# -- SkyPilot: one managed-job task per node, on its region's cloud
def skypilot(d: Deployment) -> dict[str, str]:
    out = {}
    for u in d.units:
        res: dict[str, Any] = {"image_id": f"docker:{u.image}", "job_recovery": {"max_restarts_on_errors": RESTARTS}}
        if u.cloud:
            res["cloud"] = u.cloud
        if u.cloud_region:
            res["region"] = u.cloud_region
        if u.gpus:
            if not d.accelerator:
                raise ConfigError(
                    f"{u.role} nodes ask for GPUs: name their type for SkyPilot (deploy.accelerator: L4, A100, ...)",
                    path="deploy.accelerator",
                )
            res["accelerators"] = f"{d.accelerator}:{u.gpus}"
        if u.port is not None:
            res["ports"] = [u.port]
        if u.spot:  # a pool member: preempted, SkyPilot relaunches it and it rejoins its pool
            res["use_spot"] = True
        mounts = {CONF: "./bundle", SECRET: f"./secrets/{u.name}"}
        if d.model_dir is not None:
            mounts[MODEL] = str(d.model_dir)
        task = {
            "name": f"aurora-{d.name}-{u.dns}",
            "resources": res,
            "file_mounts": mounts,
            # the bucket SkyPilot carries file mounts through leaves files others may read: Aurora refuses
            # such a secret key file
            "run": f"chmod -R go-rwx {SECRET} && exec {shlex.join(u.argv)}",
        }
        out[f"skypilot/{u.dns}.yaml"] = yaml.safe_dump(task, sort_keys=False)
    return out


RENDER = {"compose": compose, "kubernetes": kubernetes, "skypilot": skypilot}
