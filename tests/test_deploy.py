"""deploy/kubernetes: the core objects validate against Kubernetes' schemas (kubernetes-validate),
KEDA's objects against the documented fields (deploy/kubernetes/keda-schema.json), and the
manifests agree with batchline: probes, grace period, streams, consumer group, targets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from batchline.config import WorkerSettings
from batchline.keys import GROUP, QueueKeys

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"


def objects() -> list[dict[str, Any]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def test_core_objects_validate_against_kubernetes_schemas() -> None:
    core = [o for o in objects() if not o["apiVersion"].startswith("keda.sh/")]
    kinds = sorted({o["kind"] for o in core})
    assert kinds == [
        "Deployment",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "StatefulSet",
    ]
    for obj in core:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_a_wrong_field_fails_validation() -> None:
    """The validator is not vacuous: a misspelt field of the worker Deployment is refused."""
    worker = one("Deployment", "batchline-worker")
    worker["spec"]["template"]["spec"]["terminationGracePeriod"] = 120
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, K8S_VERSION, strict=True)


# One ScaledObject per Redis topology (apply one of them): keda.yaml for one Redis server,
# keda-cluster.yaml for a Redis Cluster; each with its TriggerAuthentication.
SCALED = {"redis-streams": "batchline-worker", "redis-cluster-streams": "batchline-worker-cluster"}
CONNECTION = {"address", "addresses"}  # where the two differ, besides the trigger's type


def test_keda_objects_match_the_documented_schema() -> None:
    schema = json.loads((DEPLOY / "keda-schema.json").read_text())
    keda = [o for o in objects() if o["apiVersion"].startswith("keda.sh/")]
    assert sorted(o["kind"] for o in keda) == ["ScaledObject"] * 2 + ["TriggerAuthentication"] * 2
    for obj in keda:
        jsonschema.validate(obj, schema)
    for kind, name in SCALED.items():
        scaled = one("ScaledObject", name)
        assert {t["type"] for t in scaled["spec"]["triggers"]} == {kind}
        bad = json.loads(json.dumps(scaled))
        bad["spec"]["triggers"][0]["metadata"]["lagCount"] = 256  # KEDA wants strings
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_each_stream_trigger_takes_only_its_own_connection_fields() -> None:
    """redis-streams names one server (``address``); redis-cluster-streams the cluster's nodes
    (``addresses``, host:port, comma-separated): the schema refuses one in the other's place."""
    schema = json.loads((DEPLOY / "keda-schema.json").read_text())
    single = one("ScaledObject", SCALED["redis-streams"])
    cluster = one("ScaledObject", SCALED["redis-cluster-streams"])
    assert all("addresses" in t["metadata"] for t in cluster["spec"]["triggers"])
    for obj, field, value in [
        (single, "addresses", "redis:6379"),
        (cluster, "address", "redis:6379"),
        (cluster, "addresses", "node-0 node-1"),  # not host:port
    ]:
        bad = json.loads(json.dumps(obj))
        meta = bad["spec"]["triggers"][0]["metadata"]
        meta.pop("address", None)
        meta.pop("addresses", None)
        meta[field] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_the_cluster_scaled_object_scales_as_the_single_server_one() -> None:
    """The same targets, limits and behaviour; only the trigger type and its connection differ."""

    def policy(name: str) -> dict[str, Any]:
        spec = json.loads(json.dumps(one("ScaledObject", name)["spec"]))
        for trigger in spec["triggers"]:
            del trigger["type"], trigger["authenticationRef"]
            for field in CONNECTION:
                trigger["metadata"].pop(field, None)
        return spec

    assert policy(SCALED["redis-cluster-streams"]) == policy(SCALED["redis-streams"])


@pytest.mark.parametrize("name", sorted(SCALED.values()))
def test_the_scaled_object_watches_every_work_stream_of_the_queue(name: str) -> None:
    worker = one("Deployment", "batchline-worker")
    env = {e["name"]: e for e in worker["spec"]["template"]["spec"]["containers"][0]["env"]}
    keys = QueueKeys(env["BATCHLINE_QUEUE"]["value"])
    scaled = one("ScaledObject", name)["spec"]
    assert scaled["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    assert scaled["minReplicaCount"] == 0  # an idle queue scales to zero
    auths = {o["metadata"]["name"]: o for o in objects() if o["kind"] == "TriggerAuthentication"}
    lag, pending = {}, {}
    for trigger in scaled["triggers"]:
        meta = trigger["metadata"]
        auth = auths[trigger["authenticationRef"]["name"]]
        secrets = {(r["parameter"], r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
        for parameter in ("username", "password"):  # the ACL user of secret.yaml
            assert (parameter, "batchline-redis", parameter) in secrets
            assert parameter in one("Secret", "batchline-redis")["stringData"]
        assert meta["consumerGroup"] == GROUP
        if "lagCount" in meta:
            assert meta["activationLagCount"] == "0"  # one unread entry starts a worker
            lag[meta["stream"]] = int(meta["lagCount"])
        else:
            pending[meta["stream"]] = int(meta["pendingEntriesCount"])
    assert sorted(lag) == sorted(pending) == sorted(keys.streams)
    # Work a worker holds (read ahead + the batch in the model) must not ask for another
    # worker by itself, or pending alone would scale up without end.
    settings = WorkerSettings()
    held = settings.read_ahead * settings.batch_size + settings.batch_size
    assert min(pending.values()) > held


def test_worker_pods_are_probed_by_the_worker_check_and_drain_in_their_grace_period() -> None:
    pod = one("Deployment", "batchline-worker")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == ["batchline", "worker", "--check"]
    compose = yaml.safe_load((DEPLOY.parent.parent / "docker" / "compose.yaml").read_text())
    compose_grace_s = int(compose["services"]["worker"]["stop_grace_period"].rstrip("s"))
    assert pod["terminationGracePeriodSeconds"] >= compose_grace_s
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert "limits" in container["resources"]
    assert "requests" in container["resources"]
    url = [e for e in container["env"] if e["name"] == "BATCHLINE_REDIS_URL"][0]
    secret = one("Secret", url["valueFrom"]["secretKeyRef"]["name"])
    assert url["valueFrom"]["secretKeyRef"]["key"] in secret["stringData"]
