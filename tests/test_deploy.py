"""deploy/kubernetes: the core objects validate against Kubernetes' schemas (kubernetes-validate),
KEDA's objects against the documented fields (deploy/kubernetes/keda-schema.json), and the
manifests agree with batchline: probes, grace period, inbox, streams, consumer group, targets.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import uuid
from collections.abc import Callable
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
# keda-cluster.yaml for a Redis Cluster; each with its TriggerAuthentication. Each has KEDA's
# list trigger on the inbox and its streams triggers on the work streams, of its topology.
SINGLE, CLUSTER = "batchline-worker", "batchline-worker-cluster"
TYPES = {SINGLE: ("redis", "redis-streams"), CLUSTER: ("redis-cluster", "redis-cluster-streams")}
CONNECTION = {"address", "addresses"}  # where the two differ, besides the triggers' types


def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DEPLOY / "keda-schema.json").read_text())
    return loaded


def copy(obj: dict[str, Any]) -> dict[str, Any]:
    copied: dict[str, Any] = json.loads(json.dumps(obj))
    return copied


def refused(obj: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(obj, schema())
    except jsonschema.ValidationError:
        return True
    return False


def test_keda_objects_match_the_documented_schema() -> None:
    keda = [o for o in objects() if o["apiVersion"].startswith("keda.sh/")]
    assert sorted(o["kind"] for o in keda) == ["ScaledObject"] * 2 + ["TriggerAuthentication"] * 2
    for obj in keda:
        jsonschema.validate(obj, schema())
    for name, (list_type, streams_type) in TYPES.items():
        scaled = one("ScaledObject", name)
        types = [t["type"] for t in scaled["spec"]["triggers"]]
        assert types.count(list_type) == 2, types  # on the inbox and on the wake list
        assert set(types) == {list_type, streams_type}, types
        for field in ("listLength", "lagCount", "pendingEntriesCount"):
            bad = copy(scaled)
            (meta, *_) = [t["metadata"] for t in bad["spec"]["triggers"] if field in t["metadata"]]
            meta[field] = int(meta[field])  # KEDA wants strings
            assert refused(bad), (name, field)


@pytest.mark.parametrize("name", [SINGLE, CLUSTER])
@pytest.mark.slow
def test_each_trigger_takes_only_its_own_fields(name: str) -> None:
    """redis and redis-streams name one server (``address``); redis-cluster and
    redis-cluster-streams the cluster's nodes (``addresses``, host:port, comma-separated): the
    schema refuses one in the other's place, and a list trigger's field on a stream trigger or
    the reverse."""
    scaled = one("ScaledObject", name)
    triggers = scaled["spec"]["triggers"]
    wanted, other = ("address", "addresses") if name == SINGLE else ("addresses", "address")
    assert all(wanted in t["metadata"] and other not in t["metadata"] for t in triggers)
    for index, trigger in enumerate(triggers):
        listing = "listName" in trigger["metadata"]
        changes: list[dict[str, str | None]] = [
            {wanted: None, other: "redis:6379"},  # the other topology's connection field
            {"lagCount": "256"} if listing else {"listLength": "256"},  # the other scaler's
            {"listName": None} if listing else {"stream": None},  # what it must name
        ]
        if name == CLUSTER:
            changes.append({"addresses": "node-0 node-1"})  # not host:port
        for change in changes:
            bad = copy(scaled)
            meta = bad["spec"]["triggers"][index]["metadata"]
            for field, value in change.items():
                if value is None:
                    del meta[field]
                else:
                    meta[field] = value
            assert refused(bad), (trigger["type"], change)


def test_the_cluster_scaled_object_scales_as_the_single_server_one() -> None:
    """The same targets, limits and behaviour; only the triggers' types and their connection
    differ."""

    def policy(name: str) -> dict[str, Any]:
        spec = copy(one("ScaledObject", name)["spec"])
        for trigger in spec["triggers"]:
            trigger["type"] = TYPES[name].index(trigger["type"])  # list 0, streams 1
            del trigger["authenticationRef"]
            for field in CONNECTION:
                trigger["metadata"].pop(field, None)
        return spec

    assert policy(CLUSTER) == policy(SINGLE)


@pytest.mark.parametrize("name", [SINGLE, CLUSTER])
def test_the_scaled_object_watches_the_inbox_and_every_work_stream_of_the_queue(
    name: str,
) -> None:
    worker = one("Deployment", "batchline-worker")
    env = {e["name"]: e for e in worker["spec"]["template"]["spec"]["containers"][0]["env"]}
    keys = QueueKeys(env["BATCHLINE_QUEUE"]["value"])
    scaled = one("ScaledObject", name)["spec"]
    assert scaled["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    assert scaled["minReplicaCount"] == 0  # an idle queue scales to zero
    auths = {o["metadata"]["name"]: o for o in objects() if o["kind"] == "TriggerAuthentication"}
    lists, lag, pending = {}, {}, {}
    for trigger in scaled["triggers"]:
        meta = trigger["metadata"]
        auth = auths[trigger["authenticationRef"]["name"]]
        secrets = {(r["parameter"], r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
        for parameter in ("username", "password"):  # the ACL user of secret.yaml
            assert (parameter, "batchline-redis", parameter) in secrets
            assert parameter in one("Secret", "batchline-redis")["stringData"]
        if "listName" in meta:
            # Requests wait in the inbox (a tenant's: a wake on the wake list) while no worker
            # runs: one starts a worker from zero.
            assert meta["activationListLength"] == "0"
            lists[meta["listName"]] = int(meta["listLength"])
            continue
        assert meta["consumerGroup"] == GROUP
        if "lagCount" in meta:
            assert meta["activationLagCount"] == "0"  # one unread entry starts a worker
            lag[meta["stream"]] = int(meta["lagCount"])
        else:
            pending[meta["stream"]] = int(meta["pendingEntriesCount"])
    assert list(lists) == [keys.inbox, keys.wakes]
    assert sorted(lag) == sorted(pending) == sorted(keys.streams)
    # A backlog asks for as many workers in the inbox as once admitted, in the lag.
    assert set(lists.values()) == set(lag.values()), (lists, lag)
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


def test_the_replicated_compose_variant_hangs_together() -> None:
    """docker/compose.ha.yaml: workers and the API name the three sentinels by the service
    the sentinels monitor, with durability replicated; a quorum of 2 of 3; the primary
    refuses writes without a replica in sync, and so does a replica once promoted; every
    Redis keeps an AOF. (The failover itself is proved with local processes:
    tests/e2e/test_failover.py.)"""
    from batchline.redis_url import parse_sentinel_url

    root = DEPLOY.parent.parent / "docker"
    base = yaml.safe_load((root / "compose.yaml").read_text())
    ha = yaml.safe_load((root / "compose.ha.yaml").read_text())
    services = ha["services"]
    sentinels = sorted(name for name in services if name.startswith("sentinel-"))
    assert sentinels == ["sentinel-1", "sentinel-2", "sentinel-3"]
    script = services["sentinel-1"]["entrypoint"][2]
    monitor = re.search(r"sentinel monitor (\S+) (\S+) 6379 (\d+)", script)
    assert monitor is not None
    service, primary, quorum = monitor.groups()
    assert (primary, int(quorum)) == ("redis", 2)
    assert primary in base["services"]
    for role in ("worker", "api"):
        env = services[role]["environment"]
        url = env["BATCHLINE_REDIS_URL"].replace(
            "${REDIS_PASSWORD:?set REDIS_PASSWORD in docker/.env}", "pw"
        )
        spec = parse_sentinel_url(url)
        assert spec.service == service
        assert sorted(h for h, _ in spec.sentinels) == sentinels
        assert spec.sentinel_kwargs["password"] == "pw"
        assert (env["BATCHLINE_DURABILITY"], env["BATCHLINE_MIN_REPLICAS"]) == ("replicated", "1")
        assert set(services[role]["depends_on"]) >= {"sentinel-1", "redis-replica-1"}
    for name in ("redis", "redis-replica-1", "redis-replica-2"):
        args = services[name]["command"]
        assert args[args.index("--appendonly") + 1] == "yes", name
        # On every server, so that whichever is primary after a failover keeps the rule.
        assert args[args.index("--min-replicas-to-write") + 1] == "1", name
        assert args[args.index("--min-replicas-max-lag") + 1] == "10", name


def test_the_compose_tracing_collector_is_optional_and_off_by_default() -> None:
    """docker/compose.yaml: Jaeger only under the ``tracing`` profile (``up`` without
    ``--profile tracing`` starts none of it), nothing depends on it, tracing off unless
    BATCHLINE_OTEL=1, and the spans' endpoint is Jaeger's OTLP/HTTP port."""
    compose = yaml.safe_load((DEPLOY.parent.parent / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert services["jaeger"]["profiles"] == ["tracing"]
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for name in ("redis", "worker", "api"):
        assert "profiles" not in services[name]
        assert "jaeger" not in services[name].get("depends_on", {})
    for name in ("worker", "api"):
        env = services[name]["environment"]
        assert env["BATCHLINE_OTEL"] == "${BATCHLINE_OTEL:-0}"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith("-http://jaeger:4318}")
        assert env["OTEL_SERVICE_NAME"] == f"batchline-{name}"
        assert services[name]["build"]["args"]["EXTRAS"].endswith("${TRACING_EXTRA:-}")
    from batchline.tracing import wanted

    assert not wanted({"BATCHLINE_OTEL": "0", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"})


# -- deploy/kubernetes/several-queues: one pod serving several queues ---------------------------

SEVERAL = DEPLOY / "several-queues"


def several() -> dict[str, dict[str, Any]]:
    """The example's objects by kind (one of each)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(SEVERAL.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in found, doc["kind"]
            found[doc["kind"]] = doc
    assert sorted(found) == ["Deployment", "ScaledObject"]
    return found


def test_the_several_queues_pod_validates_and_serves_the_queues_it_names() -> None:
    objs = several()
    kubernetes_validate.validate(objs["Deployment"], K8S_VERSION, strict=True)
    jsonschema.validate(objs["ScaledObject"], schema())
    (container,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    settings = WorkerSettings(
        serve=env["BATCHLINE_SERVE"], metrics_port=env["BATCHLINE_METRICS_PORT"]
    )
    served = settings.served()
    assert [s.queue for s in served] == ["embed", "classify"]
    ports = sorted(p["containerPort"] for p in container["ports"])
    assert ports == sorted(s.metrics_port for s in served)  # a metrics port a queue
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # checks every queue
        assert container[probe]["exec"]["command"] == ["batchline", "worker", "--check"]


def test_the_several_queues_pod_scales_on_the_sum_of_every_queues_backlog() -> None:
    """One trigger per inbox, wake list and work stream of every queue served (lag and
    pending); the formula sums the backlogs (lists and lags) against the target, the pending
    entries against 600 per pod, as the one-queue ScaledObject's targets do; it names every
    trigger once."""
    objs = several()
    scaled = objs["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == objs["Deployment"]["metadata"]["name"]
    modifiers = scaled["advanced"]["scalingModifiers"]
    assert (modifiers["target"], modifiers["activationTarget"]) == ("256", "0")
    env = {
        e["name"]: e.get("value")
        for e in objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    wanted_lists, wanted_lag, wanted_pending = set(), set(), set()
    for served in WorkerSettings(serve=env["BATCHLINE_SERVE"]).served():
        keys = served.keys
        wanted_lists |= {keys.inbox, keys.wakes}
        wanted_lag |= set(keys.streams)
        wanted_pending |= set(keys.streams)
    backlog, pending, names = {}, {}, []
    for trigger in scaled["triggers"]:
        meta, name = trigger["metadata"], trigger["name"]
        names.append(name)
        if "listName" in meta:
            assert meta["listLength"] == modifiers["target"]
            backlog[name] = meta["listName"]
        elif "lagCount" in meta:
            assert meta["consumerGroup"] == GROUP
            backlog[name] = meta["stream"]
        else:
            assert meta["consumerGroup"] == GROUP
            pending[name] = (meta["stream"], int(meta["pendingEntriesCount"]))
    assert {v for n, v in backlog.items() if "_lag" not in n} == wanted_lists
    assert {v for n, v in backlog.items() if "_lag" in n} == wanted_lag
    assert {s for s, _ in pending.values()} == wanted_pending
    (per_pod,) = {limit for _, limit in pending.values()}
    formula = " ".join(modifiers["formula"].split())
    summed = " + ".join(backlog)
    held = " + ".join(pending)
    assert formula == f"max({summed}, ({held}) * {modifiers['target']} / {per_pod})", formula
    assert len(set(names)) == len(names)
    settings = WorkerSettings()
    assert per_pod > settings.read_ahead * settings.batch_size + settings.batch_size


def test_the_compose_and_kubernetes_apis_require_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/tenants.md: the compose and Kubernetes files require keys (the tenant store's),
    where a fresh install's API is open for local use."""
    from batchline.config import WebSettings

    root = DEPLOY.parent.parent / "docker"
    envs = {
        name: yaml.safe_load((root / name).read_text())["services"]["api"]["environment"]
        for name in ("compose.yaml", "compose.ha.yaml")
    }
    (api,) = one("Deployment", "batchline-api")["spec"]["template"]["spec"]["containers"]
    envs["kubernetes"] = {e["name"]: e.get("value") for e in api["env"]}
    monkeypatch.delenv("BATCHLINE_API_KEYS", raising=False)
    assert not WebSettings().api_keys  # the default: open
    for name, env in envs.items():
        monkeypatch.setenv("BATCHLINE_API_KEYS", str(env.get("BATCHLINE_API_KEYS")))
        assert WebSettings().api_keys, name


def test_the_compose_workers_and_api_run_read_only_with_a_tmpfs_as_the_check_runs_them() -> None:
    """docker/compose.yaml's workers and API: a read-only root filesystem and /tmp a tmpfs, as
    on Kubernetes (readOnlyRootFilesystem, an emptyDir on /tmp); the container check takes
    both from the file (it adds none of its own), so it runs what ships."""
    from checks.containers._stack import filesystem

    compose = yaml.safe_load((DEPLOY.parent.parent / "docker" / "compose.yaml").read_text())
    for name in ("worker", "api"):
        service = compose["services"][name]
        assert service.get("read_only") is True, name
        assert filesystem(service) == {"read_only": True, "tmpfs": {"/tmp": ""}}, name
    assert filesystem({"tmpfs": "/run:size=64m"}) == {
        "read_only": False,
        "tmpfs": {"/run": "size=64m"},
    }
    for name in ("batchline-worker", "batchline-api"):
        (container,) = one("Deployment", name)["spec"]["template"]["spec"]["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert [m["mountPath"] for m in container["volumeMounts"]] == ["/tmp"]


def test_a_dead_workers_requests_are_claimed_well_within_the_apis_wait() -> None:
    """The compose and Kubernetes workers set the same claim_idle_ms, short enough that the
    requests a dead worker held are claimed by another (after claim_idle_ms, and at most a
    second more: each worker looks every second) and run well before the API stops waiting
    (request_timeout_s, then 504). The container check runs with the file's value (it sets
    none of its own), killing a worker under load."""
    import inspect

    from batchline.config import WebSettings
    from checks.containers import _stack

    def env(container: dict[str, Any]) -> dict[str, Any]:
        return {e["name"]: e.get("value") for e in container["env"]}

    compose = yaml.safe_load((DEPLOY.parent.parent / "docker" / "compose.yaml").read_text())
    services = _stack.substitute(compose["services"], {"REDIS_PASSWORD": "pw"})
    values = {"compose.yaml": services["worker"]["environment"].get("BATCHLINE_CLAIM_IDLE_MS")}
    workers = {
        "worker.yaml": one("Deployment", "batchline-worker"),
        "several-queues": several()["Deployment"],
    }
    for name, deployment in workers.items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        values[name] = env(container).get("BATCHLINE_CLAIM_IDLE_MS")
    (value,) = set(values.values())
    assert value is not None, values
    claim_s = WorkerSettings(claim_idle_ms=value).claim_idle_ms / 1000
    # The API's wait is the default one, in compose and on Kubernetes alike.
    (api,) = one("Deployment", "batchline-api")["spec"]["template"]["spec"]["containers"]
    for api_env in (env(api), services["api"]["environment"]):
        assert "BATCHLINE_REQUEST_TIMEOUT_S" not in api_env
    wait_s = WebSettings().request_timeout_s
    assert claim_s + 1 <= wait_s / 2, (claim_s, wait_s)
    assert "CLAIM_IDLE" not in inspect.getsource(_stack)


# -- The ACL user of secret.yaml and redis.yaml ---------------------------------------------------


def manifest_user_rules() -> list[str]:
    """The rules redis.yaml's Redis gives the Secret's user (after its name, ``on`` and its
    password), checked equal to those secret.yaml's comment prints."""
    (stateful,) = [o for o in objects() if o["kind"] == "StatefulSet"]
    (container,) = stateful["spec"]["template"]["spec"]["containers"]
    args = shlex.split(container["command"][-1])
    start = args.index("$REDIS_USERNAME") + 1
    assert args[start : start + 2] == ["on", ">$REDIS_PASSWORD"], args
    rules = list(itertools.takewhile(lambda a: not a.startswith("--"), args[start + 2 :]))
    comment = [
        line.removeprefix("#").strip()
        for line in (DEPLOY / "secret.yaml").read_text().splitlines()
        if line.startswith("#   ")
    ]
    line = " ".join(comment)
    found = re.search(r"ACL SETUSER batchline on >PASSWORD (.*?)(?: \(|$)", line)
    assert found is not None, line
    assert found.group(1).split() == rules, (found.group(1), rules)
    return rules


def test_the_cluster_file_names_the_rules_a_cluster_client_needs_beyond_the_users() -> None:
    """keda-cluster.yaml says what to add to secret.yaml's user on a Redis Cluster: every
    rule without a key that ``batchline acl`` gives each of its users (redis-py's cluster
    client reads the slot map and, as it starts, the command table) and the user lacks."""
    from batchline.acl import ROLES, acl_rules

    keys = QueueKeys("default")
    given = set.intersection(*(set(acl_rules(keys, role)) for role in ROLES))
    missing = sorted(r for r in given if r.startswith("+") and r not in manifest_user_rules())
    assert "+command" in missing, missing
    header = " ".join(
        line.removeprefix("#").strip()
        for line in (DEPLOY / "keda-cluster.yaml").read_text().splitlines()
        if line.startswith("#")
    )
    found = re.search(r"\((\+cluster\|slots[^,)]*)", header)
    assert found is not None, header
    assert sorted(found.group(1).split()) == missing


def test_batchline_keys_runs_under_the_manifests_acl_user(
    acl_user: Callable[[list[str]], str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``batchline keys`` (as docs/deploying.md runs it, in the API's pod) under the Secret's
    user, on a real Redis: create, list, set, rotate and revoke, and an unknown id refused
    with its message and exit 2 (a change given up sends UNWATCH: without +unwatch that
    refusal was a NoPermissionError)."""
    from batchline.cli import main
    from batchline.transport import KEY_PATTERN

    prefix = f"d{uuid.uuid4().hex[:10]}"
    rules = [f"~{prefix}:*" if r == "~batchline:*" else r for r in manifest_user_rules()]
    assert f"~{prefix}:*" in rules
    monkeypatch.setenv("BATCHLINE_REDIS_URL", acl_user(["on", ">PASSWORD", *rules]))
    monkeypatch.setenv("BATCHLINE_PREFIX", prefix)

    def run(*args: str) -> tuple[int, str, str]:
        status = main(["keys", *args])
        out, err = capsys.readouterr()
        return status, out, err

    status, out, err = run("create", "--tenant", "me")
    assert status == 0, err
    match = KEY_PATTERN.fullmatch(out.strip())
    assert match is not None, out
    key_id = match.group(1)
    assert run("list")[0] == 0
    assert run("set", "--tenant", "me", "--weight", "2")[0] == 0
    status, out, err = run("rotate", key_id, "--json")
    assert status == 0, err
    assert run("revoke", json.loads(out)["id"])[0] == 0
    for command in ("revoke", "rotate"):
        status, _, err = run(command, "deadbeef")
        assert status == 2, err
        assert "no key with the id 'deadbeef'" in err, err


def test_the_fallback_redis_refuses_writes_when_full_rather_than_grow_past_its_limit() -> None:
    """redis.yaml: ``maxmemory`` below the container's memory limit, with ``noeviction``, as
    docs/deploying.md asks of any Redis (a full one refuses new requests with
    ServiceUnavailable; without maxmemory it grows until the kubelet kills it)."""
    (stateful,) = [o for o in objects() if o["kind"] == "StatefulSet"]
    (container,) = stateful["spec"]["template"]["spec"]["containers"]
    args = shlex.split(container["command"][-1])
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    maxmemory = re.fullmatch(r"(\d+)(mb|gb)", args[args.index("--maxmemory") + 1])
    assert maxmemory is not None, args
    number, unit = maxmemory.groups()
    limit = re.fullmatch(r"(\d+)(Mi|Gi)", container["resources"]["limits"]["memory"])
    assert limit is not None
    mib = {"mb": 1, "gb": 1024, "Mi": 1, "Gi": 1024}  # Redis's mb and gb are 2**20 and 2**30
    limit_mib = int(limit.group(1)) * mib[limit.group(2)]
    assert 0.5 * limit_mib <= int(number) * mib[unit] <= 0.8 * limit_mib
