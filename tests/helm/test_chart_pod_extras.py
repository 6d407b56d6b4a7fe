"""The chart's pod extras: ServiceAccount, pod labels and annotations, extra environment and volumes, and the
NetworkPolicies. Rendered with Helm's own engine and validated against Kubernetes' schemas, as in test_chart.py."""

from __future__ import annotations

from typing import Any

import pytest

from test_chart import (  # tests/helm is on sys.path: pytest puts a test file's folder there (rootdir conftest)
    MINIMAL,
    container,
    find,
    helm,
    one,
    pod_owners,
    render,
    triton,
    validate_all,
    with_minimal,
)

CHART_LABEL_PREFIX = "app.kubernetes.io/"


@pytest.fixture(scope="module")
def chart():
    from test_chart import CHART_DIR

    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def pod_spec(owner: dict[str, Any]) -> dict[str, Any]:
    return owner["spec"]["template"]["spec"]


def router(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")


def render_error(chart, values: dict[str, Any]) -> str:
    with pytest.raises((helm.HelmRenderError, helm.HelmValuesError)) as raised:
        render(chart, values)
    return str(raised.value)


# --- ServiceAccount ---------------------------------------------------------------------------


def test_by_default_the_pod_templates_name_no_account_and_no_token_setting(chart):
    """A field added to a pod template by default rolls every replica (draining its sessions) and the router on an
    upgrade that sets nothing new: the account fields appear only where set."""
    objects = render(chart, MINIMAL)
    assert not find(objects, "ServiceAccount")
    for owner in pod_owners(objects):
        spec = pod_spec(owner)
        assert "serviceAccountName" not in spec
        assert "automountServiceAccountToken" not in spec


def test_a_created_account_is_the_triton_pods_and_not_the_routers(chart):
    values = with_minimal(serviceAccount={"create": True, "annotations": {"iam.example.com/role": "engines"}})
    objects = render(chart, values)
    validate_all(objects)
    account = one(objects, "ServiceAccount")
    assert account["metadata"]["annotations"] == {"iam.example.com/role": "engines"}
    assert "automountServiceAccountToken" not in account
    assert pod_spec(one(objects, "StatefulSet"))["serviceAccountName"] == account["metadata"]["name"]
    assert "serviceAccountName" not in pod_spec(router(objects))  # the client-facing router gets no cloud identity


def test_named_accounts_and_the_token_setting_reach_their_pods(chart):
    values = with_minimal(serviceAccount={"name": "serving-sa", "automountToken": False},
                          router={"serviceAccountName": "router-sa"})
    objects = render(chart, values)
    validate_all(objects)
    assert not find(objects, "ServiceAccount")
    assert pod_spec(one(objects, "StatefulSet"))["serviceAccountName"] == "serving-sa"
    assert pod_spec(router(objects))["serviceAccountName"] == "router-sa"
    for owner in pod_owners(objects):
        assert pod_spec(owner)["automountServiceAccountToken"] is False
    values = with_minimal(serviceAccount={"name": "serving-sa", "create": True, "automountToken": False})
    created = one(render(chart, values), "ServiceAccount")
    assert created["metadata"]["name"] == "serving-sa" and created["automountServiceAccountToken"] is False


# --- labels and annotations -------------------------------------------------------------------


def test_pod_labels_reach_the_pods_and_leave_the_selectors_alone(chart):
    values = with_minimal(podLabels={"team": "ml", CHART_LABEL_PREFIX + "part-of": "assistants"},
                          router={"podLabels": {"tier": "edge"},
                                                             "podAnnotations": {"example.com/owner": "ml"}})
    objects = render(chart, values)
    validate_all(objects)
    statefulset, deployment = one(objects, "StatefulSet"), router(objects)
    assert statefulset["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    assert deployment["spec"]["template"]["metadata"]["labels"]["tier"] == "edge"
    assert "team" not in statefulset["spec"]["selector"]["matchLabels"]
    assert "tier" not in deployment["spec"]["selector"]["matchLabels"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["example.com/owner"] == "ml"
    assert "checksum/config" in annotations


@pytest.mark.parametrize("where", ["triton", "router"])
def test_a_pod_label_may_not_replace_the_charts_own(chart, where):
    labels = {CHART_LABEL_PREFIX + "component": "router" if where == "triton" else "triton"}
    values = with_minimal(podLabels=labels) if where == "triton" else with_minimal(router={"podLabels": labels})
    message = render_error(chart, values)
    assert f"podLabels sets {CHART_LABEL_PREFIX}component: the chart sets that label itself" in message


def test_the_routers_config_checksum_annotation_cannot_be_replaced(chart):
    message = render_error(chart, with_minimal(router={"podAnnotations": {"checksum/config": "pinned"}}))
    assert "router.podAnnotations sets checksum/config" in message
    validate_all(render(chart, with_minimal(router={"podAnnotations": None})))  # null: none


# --- extra environment ------------------------------------------------------------------------

SECRET_ENV = {"name": "HTTPS_PROXY", "valueFrom": {"secretKeyRef": {"name": "proxy", "key": "url"}}}


def test_extra_environment_reaches_its_container_after_the_charts_own(chart):
    values = with_minimal(extraEnv=[SECRET_ENV], engineBuild={"extraEnv": [{"name": "HF_HUB_OFFLINE", "value": "1"}]})
    objects = render(chart, values)
    validate_all(objects)
    triton_env = triton(objects)["env"]
    assert triton_env[-1] == SECRET_ENV
    assert triton_env[0]["name"] == "PREPOS_ENGINE_DIR"
    build = container(one(objects, "StatefulSet"), "engine-build")
    assert build["env"] == [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    assert SECRET_ENV not in build["env"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (with_minimal(extraEnv=[{"name": "PREPOS_ENGINE_DEVICE", "value": "cpu"}]),
         "extraEnv sets PREPOS_ENGINE_DEVICE: set prepos settings in prepos.env"),
        (with_minimal(auth={"enabled": True, "existingSecret": "token"}, extraEnv=[{"name": "TRITON_ACCESS_TOKEN",
                                                                                     "value": "x"}]),
         "extraEnv sets TRITON_ACCESS_TOKEN, which the chart sets itself in that container (from auth.enabled)"),
        (with_minimal(extraEnv=[SECRET_ENV, SECRET_ENV]), "extraEnv sets HTTPS_PROXY twice"),
        (with_minimal(securityContext={"readOnlyRootFilesystem": True},
                      engineBuild={"extraEnv": [{"name": "XDG_CACHE_HOME", "value": "/cache"}]}),
         "engineBuild.extraEnv sets XDG_CACHE_HOME, which the chart sets itself in that container"),
    ],
    ids=["prepos-setting", "access-token-variable", "twice", "cache-over-read-only-root"],
)
def test_extra_environment_may_not_take_a_name_the_chart_sets(chart, values, message):
    assert message in render_error(chart, values)


def test_a_cache_variable_is_the_users_where_the_chart_does_not_set_it(chart):
    values = with_minimal(engineBuild={"extraEnv": [{"name": "XDG_CACHE_HOME", "value": "/cache"}]})
    build = container(one(render(chart, values), "StatefulSet"), "engine-build")
    assert build["env"] == [{"name": "XDG_CACHE_HOME", "value": "/cache"}]


def test_the_build_container_takes_any_prepos_name_as_it_reads_no_prepos_setting(chart):
    values = with_minimal(engineBuild={"extraEnv": [{"name": "PREPOS_BUILD_NOTE", "value": "x"}]})
    build = container(one(render(chart, values), "StatefulSet"), "engine-build")
    assert build["env"] == [{"name": "PREPOS_BUILD_NOTE", "value": "x"}]


# --- extra volumes ----------------------------------------------------------------------------

CA_VOLUME = {"name": "ca", "secret": {"secretName": "corporate-ca"}}
CA_MOUNT = {"name": "ca", "mountPath": "/etc/ssl/custom", "readOnly": True}


def test_extra_volumes_reach_the_pod_and_their_mounts_the_containers_asked(chart):
    checkpoint = {"name": "ca", "mountPath": "/checkpoint-ca"}
    values = with_minimal(extraVolumes=[CA_VOLUME], extraVolumeMounts=[CA_MOUNT],
                          engineBuild={"extraVolumeMounts": [checkpoint]})
    objects = render(chart, values)
    validate_all(objects)
    statefulset = one(objects, "StatefulSet")
    assert CA_VOLUME in pod_spec(statefulset)["volumes"]
    assert CA_MOUNT in triton(objects)["volumeMounts"]
    build_mounts = container(statefulset, "engine-build")["volumeMounts"]
    assert checkpoint in build_mounts
    assert CA_MOUNT not in build_mounts
    assert "volumes" not in pod_spec(router(objects)) or CA_VOLUME not in pod_spec(router(objects))["volumes"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (with_minimal(extraVolumes=[{"name": "shm", "emptyDir": {}}]), "extraVolumes has a volume named shm"),
        (with_minimal(extraVolumes=[CA_VOLUME, CA_VOLUME]), "extraVolumes has a volume named ca"),
        (with_minimal(extraVolumes=[CA_VOLUME],
                      extraVolumeMounts=[{"name": "ca", "mountPath": "/var/lib/prepos/journal"}]),
         "journal.mountPath and extraVolumeMounts' ca would both be mounted at /var/lib/prepos/journal"),
        (with_minimal(extraVolumeMounts=[CA_MOUNT]),
         "extraVolumeMounts mounts a volume named ca, which the pod does not have: add it to extraVolumes"),
        (with_minimal(extraVolumes=[CA_VOLUME],
                      engineBuild={"extraVolumeMounts": [{"name": "ca", "mountPath": "/opt/prepos/engines/"}]}),
         "storage.mountPath and engineBuild.extraVolumeMounts' ca would both be mounted at /opt/prepos/engines"),
        (with_minimal(extraVolumeMounts=[{"name": "ca", "mountPath": "relative/path"}]),
         "at '/extraVolumeMounts/0/mountPath': 'relative/path' does not match pattern '^/'"),
    ],
    ids=["chart-volume-name", "volume-twice", "mount-over-the-journal", "mount-of-no-volume",
         "build-mount-over-the-engines", "relative-mount-path"],
)
def test_bad_extra_volumes_fail_naming_the_clash(chart, values, message):
    assert message in render_error(chart, values)


def test_an_engine_on_an_extra_volume_is_seen_by_the_engine_check_too(chart):
    """Without the build, the engine-check init container looks for prepos.engineDir: on an extra volume it saw
    nothing and stopped the pod at Init:Error."""
    values = with_minimal(engineBuild={"enabled": False}, prepos={"engineDir": "/models/engine"},
                          extraVolumes=[{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
                          extraVolumeMounts=[{"name": "models", "mountPath": "/models", "readOnly": True}])
    objects = render(chart, values)
    validate_all(objects)
    check = container(one(objects, "StatefulSet"), "engine-check")
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in check["volumeMounts"]


def test_the_engine_volume_may_be_mounted_again_elsewhere(chart):
    """A mount of a chart volume at a path of its own is allowed (e.g. the engine volume read-only at a second
    path)."""
    mount = {"name": "engines", "mountPath": "/models", "readOnly": True}
    objects = render(chart, with_minimal(extraVolumeMounts=[mount]))
    validate_all(objects)
    assert mount in triton(objects)["volumeMounts"]


# --- NetworkPolicies --------------------------------------------------------------------------


def policy_for(objects: list[dict[str, Any]], owner: dict[str, Any]) -> dict[str, Any]:
    """The NetworkPolicy whose pod selector selects `owner`'s pods."""
    pod_labels = owner["spec"]["template"]["metadata"]["labels"]
    matching = [p for p in find(objects, "NetworkPolicy")
                if p["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()]
    assert len(matching) == 1, [p["metadata"]["name"] for p in matching]
    return matching[0]


def rule_for_port(policy: dict[str, Any], port: str) -> dict[str, Any]:
    (rule,) = [r for r in policy["spec"]["ingress"] if any(p["port"] == port for p in r["ports"])]
    return rule


def ports_of(owner: dict[str, Any]) -> set[str]:
    return {p["name"] for c in pod_spec(owner)["containers"] for p in c.get("ports", [])}


def test_no_network_policy_by_default(chart):
    assert not find(render(chart, MINIMAL), "NetworkPolicy")


def test_replicas_take_grpc_and_health_checks_from_the_router_pods_only(chart):
    clients = [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    http_clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}]
    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    objects = render(chart, with_minimal(networkPolicy={"enabled": True, "clientsFrom": clients,
                                                        "httpFrom": http_clients, "metricsFrom": scrapers}))
    validate_all(objects)
    statefulset, deployment = one(objects, "StatefulSet"), router(objects)
    replica_policy, router_policy = policy_for(objects, statefulset), policy_for(objects, deployment)
    assert replica_policy["spec"]["policyTypes"] == ["Ingress"]
    # every port a rule names is a port of the pods it selects, and every replica port has a rule
    for policy, owner in ((replica_policy, statefulset), (router_policy, deployment)):
        named = {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]}
        assert named <= ports_of(owner)
    assert {p["port"] for r in replica_policy["spec"]["ingress"] for p in r["ports"]} == ports_of(statefulset)
    # gRPC and the health port: from the router's pods, selected by labels its pods carry
    router_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for port in ("grpc", "health"):
        (peer,) = rule_for_port(replica_policy, port)["from"]
        assert set(peer) == {"podSelector"}
        assert peer["podSelector"]["matchLabels"].items() <= router_labels.items()
        replica_labels = statefulset["spec"]["template"]["metadata"]["labels"]
        assert not peer["podSelector"]["matchLabels"].items() <= replica_labels.items()
    assert rule_for_port(replica_policy, "http")["from"] == http_clients
    assert rule_for_port(replica_policy, "metrics")["from"] == scrapers
    assert rule_for_port(router_policy, "grpc")["from"] == clients


def test_empty_peer_lists_let_any_source_in_and_no_metrics_rule_without_metrics(chart):
    objects = render(chart, with_minimal(networkPolicy={"enabled": True}, metrics={"enabled": False}))
    validate_all(objects)
    replica_policy = policy_for(objects, one(objects, "StatefulSet"))
    assert "from" not in rule_for_port(replica_policy, "http")
    assert "from" not in rule_for_port(policy_for(objects, router(objects)), "grpc")
    assert not [r for r in replica_policy["spec"]["ingress"] if any(p["port"] == "metrics" for p in r["ports"])]


def test_an_empty_peer_is_refused(chart):
    """An empty peer ({}) would read as "any source" in a list of otherwise narrow ones."""
    message = render_error(chart, with_minimal(networkPolicy={"enabled": True, "clientsFrom": [{}]}))
    assert "at '/networkPolicy/clientsFrom/0': minProperties" in message
