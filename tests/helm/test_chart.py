"""The Helm chart helm/prepos: lint, render, Kubernetes schema validation, routing contract.

Rendering uses Helm's own engine (the Helm v4 Go SDK through helm-python-sdk), so templates,
values.schema.json and `required`/`fail` checks behave as under `helm install`. Rendered objects
are checked against the Kubernetes API schemas shipped by kubernetes-validate. No cluster runs.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import helm_python as helm
except ModuleNotFoundError:
    pytest.skip("helm-python-sdk is not installed (install the test extras)", allow_module_level=True)
except Exception as exc:  # helm_python.HelmLibraryError, raised while the package loads libhelm_c
    if type(exc).__name__ != "HelmLibraryError":
        raise
    pytest.skip(f"helm-python-sdk cannot load its native library on this platform: {exc}", allow_module_level=True)

import kubernetes_validate  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "prepos"
PRODUCTION_VALUES = REPO_ROOT / "helm" / "values-production.yaml"

KUBE_VERSION = "1.33.0"  # Kubernetes API schemas to validate against (kubernetes-validate ships it)
RELEASE = "prepos"
NAMESPACE = "serving"
SESSION_HEADER = "prepos-session-id"

MINIMAL = {"image": {"repository": "registry.example.com/ml/prepos"}}
# Custom resources have no schema in kubernetes-validate; their fields are checked by hand below.
CUSTOM_KINDS = {"ServiceMonitor"}


def with_minimal(**overrides: Any) -> dict[str, Any]:
    """MINIMAL values deep-merged with `overrides`."""
    values = copy.deepcopy(MINIMAL)
    stack = [(values, overrides)]
    while stack:
        target, source = stack.pop()
        for key, value in source.items():
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                stack.append((target[key], value))
            else:
                target[key] = copy.deepcopy(value)
    return values


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def production_values() -> dict[str, Any]:
    return yaml.safe_load(PRODUCTION_VALUES.read_text())


def render_files(chart, values: dict[str, Any]) -> dict[str, str]:
    return chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def render(chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders for `values`."""
    objects = []
    for path, text in sorted(render_files(chart, values).items()):
        if path.endswith(".yaml"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(pod_owner: dict[str, Any], name: str) -> dict[str, Any]:
    spec = pod_owner["spec"]["template"]["spec"]
    matches = [c for c in spec.get("containers", []) + spec.get("initContainers", []) if c["name"] == name]
    assert len(matches) == 1, f"no container {name!r} in {pod_owner['metadata']['name']}"
    return matches[0]


def triton(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return container(one(objects, "StatefulSet"), "triton")


def envoy_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(one(objects, "ConfigMap")["data"]["envoy.yaml"])


def grpc_listener(config: dict[str, Any]) -> dict[str, Any]:
    (listener,) = [listener for listener in config["static_resources"]["listeners"] if listener["name"] == "grpc"]
    return listener


def connection_manager(config: dict[str, Any]) -> dict[str, Any]:
    (chain,) = grpc_listener(config)["filter_chains"]
    (hcm,) = chain["filters"]
    assert hcm["name"] == "envoy.filters.network.http_connection_manager"
    return hcm["typed_config"]


def triton_cluster(config: dict[str, Any]) -> dict[str, Any]:
    (cluster,) = config["static_resources"]["clusters"]
    return cluster


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def port_named(c: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return port


def pod_owners(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("StatefulSet", "Deployment")]


def comment_above(path: Path, line: str) -> str:
    """The comment right above the first line of the values file `path` that is `line`, in one line, without the
    '#' and '-- ' marks."""
    lines = path.read_text().splitlines()
    index = lines.index(line)
    comment: list[str] = []
    while index > 0 and lines[index - 1].lstrip().startswith("#"):
        index -= 1
        comment.insert(0, lines[index].strip().removeprefix("#").strip().removeprefix("-- "))
    return " ".join(comment)


def validate_all(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


# --- lint and validation ------------------------------------------------------------------


@pytest.mark.parametrize("values_name", ["minimal", "production"])
def test_lint_passes(values_name, production_values):
    values = MINIMAL if values_name == "minimal" else production_values
    report = helm.lint(CHART_DIR, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
    assert report["errors"] == [] and problems == [], report


def test_lint_reports_missing_image_repository():
    report = helm.lint(CHART_DIR)
    assert any("missing property 'repository'" in error for error in report["errors"]), report


VALIDATED_VALUES = {
    "minimal": MINIMAL,
    "maglev-journal-existing-claim": with_minimal(
        router={"lbPolicy": "MAGLEV"},
        journal={"enabled": True},
        storage={"existingClaim": "prepos-engines"},
        triton={"modelControlMode": "explicit", "modelRepository": "/opt/prepos/engines/model_repository"},
    ),
    "cpu-only-no-build": with_minimal(
        resources={"gpu": 0}, engineBuild={"enabled": False}, prepos={"env": {"PREPOS_ENGINE_DEVICE": "cpu"}},
        storage={"volumeClaimTemplate": {"enabled": False}}, podDisruptionBudget={"maxUnavailable": "50%"},
    ),
    "scheduling-and-exposure": with_minimal(
        priorityClassName="gpu-serving", runtimeClassName="nvidia", podAntiAffinity="soft",
        topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                    "whenUnsatisfiable": "ScheduleAnyway",
                                    "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "triton"}}}],
        resources={"requests": {"cpu": "4", "memory": "1e9", "ephemeral-storage": "10Gi"},
                   "limits": {"memory": "16Gi", "ephemeral-storage": "20Gi"}},
        storage={"volumeClaimTemplate": {"storageClass": "-"}}, image={"digest": "sha256:" + "0f" * 32},
        router={"service": {"type": "LoadBalancer", "externalTrafficPolicy": "Local",
                            "loadBalancerSourceRanges": ["10.0.0.0/8", "2001:db8::/32"]}},
        metrics={"serviceMonitor": {"enabled": True, "interval": "1m30s"}},
    ),
}


@pytest.mark.parametrize("values_name", [*VALIDATED_VALUES, "production"])
def test_renders_objects_valid_for_kubernetes(chart, production_values, values_name):
    values = production_values if values_name == "production" else VALIDATED_VALUES[values_name]
    objects = render(chart, values)
    kinds = {o["kind"] for o in objects}
    assert {"StatefulSet", "Service", "ConfigMap", "Deployment", "PodDisruptionBudget"} <= kinds
    for obj in objects:
        assert obj["metadata"]["namespace"] == NAMESPACE
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {error.message} at {list(error.path)}")


def test_scheduling_and_exposure_values_reach_the_objects(chart):
    values = VALIDATED_VALUES["scheduling-and-exposure"]
    objects = render(chart, values)
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("gpu-serving", "nvidia")
    assert pod["topologySpreadConstraints"] == values["topologySpreadConstraints"]
    assert triton(objects)["resources"]["limits"]["ephemeral-storage"] == "20Gi"
    service = one(objects, "Service", "prepos")["spec"]
    assert service["externalTrafficPolicy"] == "Local"
    assert service["loadBalancerSourceRanges"] == ["10.0.0.0/8", "2001:db8::/32"]
    assert one(objects, "ServiceMonitor")["spec"]["endpoints"][0]["interval"] == "1m30s"


def test_kubernetes_validation_catches_a_misspelt_field(chart):
    statefulset = one(render(chart, MINIMAL), "StatefulSet")
    statefulset["spec"]["template"]["spec"]["containers"][0]["resorces"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, KUBE_VERSION, strict=True)


def test_notes_name_the_entry_point_and_the_session_header(chart):
    notes = render_files(chart, MINIMAL)["prepos/templates/NOTES.txt"]
    assert f"{RELEASE}.{NAMESPACE}.svc.cluster.local:8001" in notes
    assert SESSION_HEADER in notes


@pytest.mark.parametrize("router", [{}, {"tls": {"enabled": True, "secretName": "grpc-cert"}}], ids=["plain", "tls"])
def test_notes_command_is_one_the_cli_takes(chart, router):
    """The NOTES' `prepos ask` line parses with the CLI's own parser, TLS flags included where the router has TLS."""
    import shlex

    from prepos_client.cli import build_parser

    values = with_minimal(router=router, auth={"enabled": True, "existingSecret": "token"})
    notes = render_files(chart, values)["prepos/templates/NOTES.txt"]
    (line,) = [line for line in notes.splitlines() if "prepos ask" in line]
    words = shlex.split(line.replace("<a name in the certificate>", "prepos.example.com"))
    args = build_parser().parse_args(words[words.index("prepos") + 1:])
    assert args.command == "ask" and args.url == "localhost:8001"
    assert (args.tls_ca, args.tls_server_name) == (("ca.pem", "prepos.example.com") if router else (None, None))


@pytest.mark.parametrize(("journal", "says"), [
    ({}, "takes its sessions back"),
    ({"existingClaim": "prepos-journals"}, "on the replica that takes them over"),
    ({"enabled": False}, "are lost"),
])
def test_notes_say_what_becomes_of_a_removed_replicas_sessions(chart, journal, says):
    notes = render_files(chart, with_minimal(journal=journal))["prepos/templates/NOTES.txt"]
    assert "first drains it" in notes and says in notes
    assert sum(phrase in notes for phrase in ("takes its sessions back", "takes them over",
                                              "are lost")) == 1


@pytest.mark.parametrize("build", [True, False], ids=["build", "no-build"])
def test_notes_say_how_the_engine_gets_there(chart, build):
    """The NOTES said "The first start builds the engine" with engineBuild off too, where nothing builds it."""
    notes = render_files(chart, with_minimal(engineBuild={"enabled": build}))["prepos/templates/NOTES.txt"]
    assert ("builds the engine" in notes) == build
    assert ("checks that /opt/prepos/engines/smollm2-135m-instruct holds an engine" in notes) == (not build)


@pytest.mark.parametrize(("release", "values"), [
    ("r" * 53, MINIMAL), (RELEASE, with_minimal(fullnameOverride="f" * 63))], ids=["long-release", "long-override"])
def test_long_names_still_give_pods_and_distinct_objects(chart, release, values):
    """A StatefulSet name over 52 characters gets no pods (its controller-revision-hash label passes 63), and names
    cut at 63 lost their suffixes, so that the router's and the replicas' objects shared names."""
    files = chart.render(values=values, name=release, namespace=NAMESPACE, is_install=True)
    objects = [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    assert len(one(objects, "StatefulSet")["metadata"]["name"]) <= 52
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), names


# --- bad values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "at '/image': missing property 'repository'"),
        (with_minimal(replicaCount=-1), "at '/replicaCount': minimum: got -1, want 1"),
        (with_minimal(router={"lbPolicy": "ROUND_ROBIN"}), "at '/router/lbPolicy': value must be one of 'RING_HASH', 'MAGLEV'"),
        (with_minimal(resources={"gpu": -1}), "at '/resources/gpu': minimum"),
        (with_minimal(prepos={"env": {"GATE_THRESHOLD": "0.8"}}), "invalid propertyName 'GATE_THRESHOLD'"),
        (with_minimal(image={"repository": "reg/prepos@sha256:" + "ab" * 32}), "at '/image/repository'"),
        (with_minimal(image={"digest": "ab" * 32}), "at '/image/digest'"),
        (with_minimal(fullnameOverride="MyPrepos"), "at '/fullnameOverride'"),
        (with_minimal(podDisruptionBudget={"maxUnavailable": "150%"}), "at '/podDisruptionBudget/maxUnavailable'"),
        (with_minimal(replicaCount=1025), "at '/replicaCount': maximum"),
        (with_minimal(metrics={"serviceMonitor": {"enabled": True, "interval": "30s1m"}}),
         "at '/metrics/serviceMonitor/interval'"),
        (with_minimal(nameOverride="pre.pos"), "at '/nameOverride'"),
        # null removes a default in Helm's merge: the router container would have no memory request
        (with_minimal(router={"resources": {"requests": {"memory": None}}}),
         "at '/router/resources/requests': missing property 'memory'"),
        # the API server refuses negative quantities and empty volumes
        (with_minimal(resources={"requests": {"cpu": -2}}), "at '/resources/requests/cpu': minimum: got -2, want 0"),
        (with_minimal(router={"resources": {"limits": {"memory": "-1Gi"}}}), "at '/router/resources/limits/memory'"),
        (with_minimal(journal={"size": "0"}), "at '/journal/size': '0' does not match pattern"),
        (with_minimal(storage={"volumeClaimTemplate": {"size": "0Gi"}}),
         "at '/storage/volumeClaimTemplate/size': '0Gi' does not match pattern"),
        (with_minimal(journal={"size": "0.0Mi"}), "at '/journal/size'"),
        (with_minimal(triton={"shmSize": "00"}), "at '/triton/shmSize'"),
        (with_minimal(autoscaling={"enabled": True, "targetAverageValue": -1}),
         "at '/autoscaling/targetAverageValue': minimum: got -1, want 0"),
    ],
    ids=["no-image-repository", "negative-replicas", "unknown-lb-policy", "negative-gpus", "env-without-prefix",
         "digest-in-repository", "digest-without-algorithm", "uppercase-fullname", "dotted-name",
         "pdb-over-100-percent", "too-many-replicas", "duration-units-out-of-order", "no-memory-request",
         "negative-cpu-request", "negative-memory-limit", "zero-journal-size", "zero-engine-volume-size",
         "zero-decimal-journal-size", "zero-shm-size", "negative-autoscaling-target"],
)
def test_bad_values_fail_with_the_schema_message(chart, values, message):
    with pytest.raises(helm.HelmValuesError) as raised:
        render(chart, values)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (with_minimal(router={"streamIdleTimeoutSeconds": 300}), "router.streamIdleTimeoutSeconds must exceed"),
        (with_minimal(triton={"exitTimeoutSeconds": 200}), "triton.exitTimeoutSeconds + 5 must be below"),
        (with_minimal(triton={"exitTimeoutSeconds": 111}), "triton.exitTimeoutSeconds + 5 must be below"),
        (with_minimal(prepos={"engineDir": "/models/engine"}), "prepos.engineDir must lie under storage.mountPath"),
        (with_minimal(autoscaling={"enabled": True, "minReplicas": 5, "maxReplicas": 2}), "minReplicas must not exceed"),
        (with_minimal(router={"ringHash": {"minimumRingSize": 65536, "maximumRingSize": 4096}}),
         "minimumRingSize must not exceed"),
        (with_minimal(preStopSleepSeconds=5), "preStopSleepSeconds (5) must be at least"),
        (with_minimal(triton={"healthPort": 8002}), "triton.healthPort (8002) must differ"),
        (with_minimal(router={"healthCheck": {"intervalSeconds": 10}}), "preStopSleepSeconds (15) must be at least"),
        (with_minimal(triton={"httpPort": 8001}), "triton.httpPort, triton.grpcPort and triton.metricsPort must differ"),
        (with_minimal(storage={"readOnly": True}), "storage.readOnly applies to storage.existingClaim only"),
        (with_minimal(router={"service": {"loadBalancerSourceRanges": ["10.0.0.0/8"]}}),
         "loadBalancerSourceRanges applies to a LoadBalancer Service only, not ClusterIP"),
        (with_minimal(router={"service": {"type": "NodePort", "loadBalancerSourceRanges": ["10.0.0.0/8"]}}),
         "loadBalancerSourceRanges applies to a LoadBalancer Service only, not NodePort"),
        (with_minimal(router={"service": {"externalTrafficPolicy": "Local"}}),
         "externalTrafficPolicy applies to a NodePort or LoadBalancer Service, not ClusterIP"),
        (with_minimal(router={"adminPort": 8001}), "router.port, router.adminPort and router.healthPort must differ"),
        (with_minimal(router={"healthPort": 9901}), "router.port, router.adminPort and router.healthPort must differ"),
        (with_minimal(router={"lbPolicy": "MAGLEV", "maglev": {"tableSize": 65536}}),
         "router.maglev.tableSize (65536) must be a prime (it divides by 2)"),
        (with_minimal(router={"lbPolicy": "MAGLEV", "maglev": {"tableSize": 4915073}}),  # 2213 * 2221
         "router.maglev.tableSize (4915073) must be a prime (it divides by 2213)"),
        (with_minimal(router={"terminationGracePeriodSeconds": 15}),
         "router.terminationGracePeriodSeconds (15) must exceed preStopSleepSeconds (15)"),
        # the schema refused these with only the path: the templates name what to set
        (with_minimal(router={"tls": {"enabled": True}}),
         "router.tls.secretName is required when router.tls.enabled: the name of a Secret of type kubernetes.io/tls"),
        (with_minimal(auth={"enabled": True}),
         "auth.existingSecret is required when auth.enabled: the name of a Secret holding the token"),
        (with_minimal(auth={"enabled": True, "existingSecret": ""}),
         "auth.existingSecret is required when auth.enabled"),
        (with_minimal(auth={"enabled": True, "existingSecret": "token"},
                      triton={"extraArgs": ["--grpc-restricted-protocol=trace:admin-key=secret"]}),
         "triton.extraArgs has --grpc-restricted-protocol=trace:admin-key=secret while auth.enabled restricts"),
        (with_minimal(auth={"enabled": True, "existingSecret": "token"},
                      triton={"extraArgs": ["--log-info=true", "--http-restricted-api=logging:k=v"]}),
         "triton.extraArgs has --http-restricted-api=logging:k=v while auth.enabled restricts"),
        (with_minimal(resources={"gpu": 0}),
         "resources.gpu is 0 but prepos.env.PREPOS_ENGINE_DEVICE is cuda (values.yaml sets cuda): the engine cannot "
         "start without a GPU; set prepos.env.PREPOS_ENGINE_DEVICE: cpu"),
        (with_minimal(resources={"gpu": 0}, prepos={"env": {"PREPOS_ENGINE_DEVICE": "cuda:1"}}),
         "prepos.env.PREPOS_ENGINE_DEVICE is cuda:1"),
        (with_minimal(resources={"requests": {"cpu": "16", "memory": "96Gi"}}),
         "resources.requests.cpu (16) must not exceed resources.limits.cpu (8)"),
        (with_minimal(resources={"requests": {"memory": "96Gi"}}),
         "resources.requests.memory (96Gi) must not exceed resources.limits.memory (64Gi)"),
        (with_minimal(router={"resources": {"requests": {"cpu": 2.5}}}),
         "router.resources.requests.cpu (2.5) must not exceed router.resources.limits.cpu (2)"),
        (with_minimal(router={"resources": {"requests": {"memory": "513Mi"}}}),
         "router.resources.requests.memory (513Mi) must not exceed router.resources.limits.memory (512Mi)"),
        (with_minimal(engineBuild={"resources": {"limits": {"memory": "7.5Gi"}}}),
         "engineBuild.resources.requests.memory (8Gi) must not exceed engineBuild.resources.limits.memory (7.5Gi)"),
        (with_minimal(resources={"requests": {"memory": "1e9", "ephemeral-storage": "2G"},
                                 "limits": {"memory": "900M", "ephemeral-storage": "1Gi"}}),
         "resources.requests.memory (1e9) must not exceed resources.limits.memory (900M)"),
        (with_minimal(resources={"requests": {"ephemeral-storage": "2G"}, "limits": {"ephemeral-storage": "1Gi"}}),
         "resources.requests.ephemeral-storage (2G) must not exceed resources.limits.ephemeral-storage (1Gi)"),
        (with_minimal(resources={"requests": {"cpu": "8001m"}}),
         "resources.requests.cpu (8001m) must not exceed resources.limits.cpu (8)"),
        (with_minimal(autoscaling={"enabled": True, "targetAverageValue": "0"}),
         "autoscaling.targetAverageValue (0) must be above 0"),
        (with_minimal(autoscaling={"enabled": True, "targetAverageValue": 0}),
         "autoscaling.targetAverageValue (0) must be above 0"),
        (with_minimal(autoscaling={"enabled": True, "targetAverageValue": "0m"}),
         "autoscaling.targetAverageValue (0m) must be above 0"),
        (with_minimal(autoscaling={"enabled": True}, metrics={"enabled": False}),
         "autoscaling.enabled needs metrics.enabled: the autoscaler scales on prepos_sessions"),
        (with_minimal(metrics={"enabled": False, "serviceMonitor": {"enabled": True}}),
         "metrics.serviceMonitor.enabled needs metrics.enabled"),
        (with_minimal(journal={"mountPath": "/opt/prepos/engines"}),
         "storage.mountPath and journal.mountPath would both be mounted at /opt/prepos/engines in the Triton "
         "container"),
        (with_minimal(journal={"mountPath": "/opt/prepos/engines/"}),
         "storage.mountPath and journal.mountPath would both be mounted at /opt/prepos/engines"),
        (with_minimal(journal={"mountPath": "/dev/shm"}),
         "/dev/shm (triton.shmSize's volume) and journal.mountPath would both be mounted at /dev/shm"),
        (with_minimal(storage={"mountPath": "/dev/shm/"}, prepos={"engineDir": "/dev/shm/engine"}),
         "storage.mountPath and /dev/shm (triton.shmSize's volume) would both be mounted at /dev/shm"),
        (with_minimal(securityContext={"readOnlyRootFilesystem": True}, journal={"mountPath": "/tmp"}),
         "journal.mountPath and /tmp (the writable folder of the drain and leaving files"),
        (with_minimal(image={"repository": "reg/prepos:0.1.0"}),
         "image.repository (reg/prepos:0.1.0) holds a tag: the chart appends image.tag (default: the chart's "
         "appVersion) itself, which would give reg/prepos:0.1.0:0.1.0; set the repository alone and the tag in "
         "image.tag"),
        (with_minimal(image={"repository": "reg:5000/ml/prepos:latest", "tag": "0.2.0"}),
         "image.repository (reg:5000/ml/prepos:latest) holds a tag"),
        (with_minimal(podDisruptionBudget={"maxUnavailable": 0}),
         "podDisruptionBudget.maxUnavailable (0) lets no pod go, so that every node drain waits forever"),
        (with_minimal(podDisruptionBudget={"maxUnavailable": "0%"}), "podDisruptionBudget.maxUnavailable (0%)"),
        (with_minimal(router={"podDisruptionBudget": {"maxUnavailable": 0}}),
         "router.podDisruptionBudget.maxUnavailable (0) lets no pod go"),
    ],
    ids=["stream-idle-below-session-idle", "exit-timeout-above-grace", "exit-timeout-and-stop-grace-above-grace",
         "engine-outside-volume", "hpa-min-above-max", "ring-min-above-max", "prestop-shorter-than-leaving",
         "health-port-taken",
         "health-interval-longer-than-prestop", "triton-ports-clash", "read-only-without-claim",
         "source-ranges-on-cluster-ip", "source-ranges-on-node-port", "traffic-policy-on-cluster-ip", "router-admin-port-clash",
         "router-health-port-clash", "maglev-even-table", "maglev-odd-composite-table", "router-grace-within-prestop",
         "tls-without-secret", "auth-without-secret", "auth-with-empty-secret", "auth-and-grpc-restriction-in-args",
         "auth-and-http-restriction-in-args", "no-gpu-on-cuda", "no-gpu-on-cuda-n", "cpu-request-above-default-limit",
         "memory-request-above-default-limit", "router-cpu-request-above-limit",
         "router-memory-request-above-limit", "build-memory-limit-below-request", "decimal-si-memory-above-limit",
         "ephemeral-storage-above-limit", "millicpu-above-limit", "hpa-target-zero", "hpa-target-number-zero",
         "hpa-target-zero-milli", "hpa-without-metrics", "service-monitor-without-metrics", "journal-on-engines",
         "journal-on-engines-trailing-slash", "journal-on-shm", "engines-on-shm", "journal-on-read-only-tmp",
         "tag-in-repository", "tag-in-repository-with-port", "pdb-zero", "pdb-zero-percent", "router-pdb-zero"],
)
def test_inconsistent_values_fail_in_the_templates(chart, values, message):
    with pytest.raises(helm.HelmRenderError) as raised:
        render(chart, values)
    assert message in str(raised.value)


# --- Triton replicas ----------------------------------------------------------------------


def test_triton_container_limits_and_requests_gpus(chart):
    resources = triton(render(chart, MINIMAL))["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1

    resources = triton(render(chart, with_minimal(resources={"gpu": 2, "gpuResourceName": "nvidia.com/mig-3g.40gb"})))[
        "resources"
    ]
    assert resources["limits"]["nvidia.com/mig-3g.40gb"] == 2 and "nvidia.com/gpu" not in resources["limits"]

    cpu_only = with_minimal(resources={"gpu": 0}, prepos={"env": {"PREPOS_ENGINE_DEVICE": "cpu"}})
    resources = triton(render(chart, cpu_only))["resources"]
    assert not any("gpu" in key for key in {**resources["requests"], **resources["limits"]})


def test_gpu_taint_tolerated_by_default(chart):
    pod = one(render(chart, MINIMAL), "StatefulSet")["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_probes_hit_triton_health_endpoints_on_the_http_port(chart):
    values = with_minimal(triton={"httpPort": 8080}, probes={"startup": {"periodSeconds": 20, "failureThreshold": 90}})
    c = triton(render(chart, values))
    assert "--http-port=8080" in c["args"] and port_named(c, "http") == 8080
    paths = {probe: c[probe]["httpGet"]["path"] for probe in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert paths == {
        "livenessProbe": "/v2/health/live",
        "readinessProbe": "/v2/health/ready",
        "startupProbe": "/v2/health/ready",
    }
    assert {c[probe]["httpGet"]["port"] for probe in paths} == {"http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1800


def test_triton_args_come_from_values(chart):
    args = triton(render(chart, with_minimal(triton={"modelControlMode": "explicit", "logVerbose": 2})))["args"]
    for arg in ("--grpc-port=8001", "--metrics-port=8002", "--allow-metrics=true", "--model-control-mode=explicit",
                "--load-model=prepos", "--log-verbose=2", "--exit-timeout-secs=100"):
        assert arg in args
    c = triton(render(chart, with_minimal(metrics={"enabled": False})))
    assert "--allow-metrics=false" in c["args"] and "command" not in c  # the image's entrypoint runs tritonserver


def test_tritonserver_runs_under_the_supervisor_which_drains_on_sigterm(chart):
    from prepos.supervise import drain_file_from

    c = triton(render(chart, with_minimal(triton={"modelRepository": "/opt/prepos/engines/repo"})))
    # the image's entrypoint, NVIDIA's setup script first, with the image's model repository left out
    entrypoint = [line for line in (REPO_ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", "").splitlines()
                  if line.startswith("ENTRYPOINT ")]
    (image_command,) = [json.loads(line.removeprefix("ENTRYPOINT ")) for line in entrypoint]
    assert c["command"] == [arg for arg in image_command if not arg.startswith("--model-repository=")]
    assert c["command"][0] == "/opt/nvidia/nvidia_entrypoint.sh"
    assert "--model-repository=/opt/prepos/engines/repo" in c["args"]
    assert drain_file_from(env_of(c)) is not None  # absolute: the supervisor can ask for the drain


def test_prepos_env_and_engine_dir(chart):
    values = with_minimal(prepos={"env": {"PREPOS_GATE_THRESHOLD": 0.8, "PREPOS_ENGINE_DEVICE": "cuda:0"}})
    env = env_of(triton(render(chart, values)))
    assert env["PREPOS_GATE_THRESHOLD"] == "0.8"
    assert env["PREPOS_ENGINE_DEVICE"] == "cuda:0"
    assert env["PREPOS_ENGINE_DIR"] == "/opt/prepos/engines/smollm2-135m-instruct"


def test_prepos_env_values_reach_prepos_as_it_reads_them(chart):
    """Helm reads a whole number in a values file as a float: quoted as it is, 8589934592 became
    '8.589934592e+09', which prepos refused as an integer setting."""
    from prepos.config import read_config
    values = with_minimal(prepos={"env": {"PREPOS_MEMORY_KV_BUDGET_BYTES": 8589934592, "PREPOS_GATE_THRESHOLD": 0.95,
                                          "PREPOS_SCHEDULER_MAX_PREFILL_BATCH_TOKENS": 1000000,
                                          "PREPOS_JOURNAL_FSYNC": True, "PREPOS_ENGINE_DEVICE": "cpu"}})
    env = {name: value for name, value in env_of(triton(render(chart, values))).items() if isinstance(value, str)}
    assert env["PREPOS_MEMORY_KV_BUDGET_BYTES"] == "8589934592"
    assert env["PREPOS_SCHEDULER_MAX_PREFILL_BATCH_TOKENS"] == "1000000"
    assert (env["PREPOS_GATE_THRESHOLD"], env["PREPOS_JOURNAL_FSYNC"]) == ("0.95", "true")
    config = read_config({}, env)
    assert config.memory.kv_budget_bytes == 8589934592
    # past int64's exact range a float is left as Helm writes it, not wrapped to a negative integer
    huge = env_of(triton(render(chart, with_minimal(prepos={"env": {"PREPOS_MEMORY_KV_BUDGET_BYTES": 1e20}}))))
    assert huge["PREPOS_MEMORY_KV_BUDGET_BYTES"] == "1e+20"
    assert config.scheduler.max_prefill_batch_tokens == 1000000
    assert config.journal.fsync is True


def test_prepos_env_overrides_the_charts_own_defaults_with_one_entry_each(chart):
    """The drain file and the leaving file have chart defaults that prepos.env may replace: listed twice, a server-
    side apply refuses the duplicate names, and a client-side one keeps whichever comes last."""
    overrides = {"PREPOS_SCHEDULER_DRAIN_FILE": "", "PREPOS_LEAVING_FILE": "/run/prepos/leaving"}
    for env in ({}, overrides):
        c = triton(render(chart, with_minimal(prepos={"env": env})))
        names = [e["name"] for e in c["env"]]
        assert len(names) == len(set(names)), names
        rendered = env_of(c)
        assert rendered["PREPOS_SCHEDULER_DRAIN_FILE"] == env.get("PREPOS_SCHEDULER_DRAIN_FILE", "/tmp/prepos-drain")
        assert rendered["PREPOS_LEAVING_FILE"] == env.get("PREPOS_LEAVING_FILE", "/tmp/prepos-leaving")


@pytest.mark.parametrize(("name", "instead"), [
    ("PREPOS_ENGINE_DIR", "set from prepos.engineDir"),
    ("PREPOS_JOURNAL_DIR", "set from journal.mountPath"),
    ("PREPOS_HEALTH_PORT", "set from triton.healthPort"),
    ("PREPOS_ACCESS_TOKEN", "set auth.enabled true and auth.existingSecret"),
])
def test_prepos_env_refuses_the_names_the_chart_sets_naming_the_value_to_use(chart, name, instead):
    """The schema refused the first three with "invalid propertyName ... 'not' failed" and no path, and let
    PREPOS_ACCESS_TOKEN through, though nothing in the pod reads it: the endpoints stayed open while the user
    believed them protected, and the token sat in the pod spec in plain text."""
    with pytest.raises(helm.HelmRenderError) as raised:
        render(chart, with_minimal(prepos={"env": {name: "x"}}))
    message = str(raised.value)
    assert f"prepos.env.{name} is not allowed: " in message and instead in message
    assert "propertyName" not in message


def test_restrictions_of_ones_own_in_extra_args_pass_with_auth_off(chart):
    """With auth on, the chart's restriction and one in triton.extraArgs name protocols twice (refused above)."""
    arg = "--grpc-restricted-protocol=trace:admin-key=secret"
    assert arg in triton(render(chart, with_minimal(triton={"extraArgs": [arg]})))["args"]


def test_without_gpus_the_pods_tolerate_no_gpu_taint(chart):
    """With resources.gpu 0 the default toleration of the GPU node taint stayed: CPU replicas took GPU nodes."""
    gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    mig_taint = {"key": "nvidia.com/mig-1g.10gb", "operator": "Exists", "effect": "NoSchedule"}
    own = {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
    cpu = {"gpu": 0, "gpuResourceName": "nvidia.com/mig-1g.10gb"}
    objects = render(chart, with_minimal(resources=cpu, prepos={"env": {"PREPOS_ENGINE_DEVICE": "cpu"}}))
    assert "tolerations" not in one(objects, "StatefulSet")["spec"]["template"]["spec"]
    validate_all(objects)
    for gpus, kept in ((0, [own]), (1, [gpu_taint, own, mig_taint])):
        values = with_minimal(resources={**cpu, "gpu": gpus}, tolerations=[gpu_taint, own, mig_taint],
                              prepos={"env": {"PREPOS_ENGINE_DEVICE": "cpu"}})
        assert one(render(chart, values), "StatefulSet")["spec"]["template"]["spec"]["tolerations"] == kept


@pytest.mark.parametrize(("smaller", "larger"), [
    ("999m", "1"), ("1e9", "1Gi"), ("1k", "1Ki"), ("1M", "1Mi"), ("1G", "1Gi"), ("1T", "1Ti"), ("1P", "1Pi"),
    ("1.5", "1501m"), (0.5, "1"), ("1023Mi", "1Gi"), ("1Ki", "1.1k"), ("2", 2.5), ("1E", "1Ei"), ("1e3", "1001"),
])
def test_a_request_above_its_limit_is_refused_in_any_unit(chart, smaller, larger):
    """A request merged with the chart's default limits (requests cpu 16 over the default limit 8) rendered a
    StatefulSet the API server refuses; the chart compares the quantities, whatever their units."""
    def router_resources(request, limit):
        return with_minimal(router={"resources": {"requests": {"cpu": request, "memory": request},
                                                  "limits": {"cpu": limit, "memory": limit}}})

    envoy = container(one(render(chart, router_resources(smaller, larger)), "Deployment"), "envoy")
    assert envoy["resources"]["requests"]["cpu"] == smaller
    with pytest.raises(helm.HelmRenderError) as raised:
        render(chart, router_resources(larger, smaller))
    assert f"router.resources.requests.cpu ({larger}) must not exceed router.resources.limits.cpu ({smaller})" in str(
        raised.value)


@pytest.mark.parametrize(("request_", "limit"), [
    ("8000m", "8"), ("2048Mi", "2Gi"), ("1Gi", "1073741824"), ("1.5", "1500m"), (4, "4"), ("1k", "1000"),
])
def test_a_request_equal_to_its_limit_in_other_units_renders(chart, request_, limit):
    for values in ({"resources": {"requests": {"cpu": request_, "memory": request_},
                                  "limits": {"cpu": limit, "memory": limit}}},
                   {"engineBuild": {"resources": {"requests": {"cpu": limit, "memory": limit},
                                                  "limits": {"cpu": request_, "memory": request_}}}}):
        assert one(render(chart, with_minimal(**values)), "StatefulSet")


def test_a_read_only_root_filesystem_keeps_the_drain_and_leaving_files_writable(chart):
    """prepos.supervise exits 2 at start where it cannot write in the folder of the drain file or of the leaving
    file, which the chart puts in /tmp: over a read-only root filesystem, the Triton container gets an emptyDir
    there."""
    from pathlib import PurePosixPath

    values = with_minimal(securityContext={"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False})
    objects = render(chart, values)
    statefulset = one(objects, "StatefulSet")
    c = container(statefulset, "triton")
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    env = env_of(c)
    for variable in ("PREPOS_SCHEDULER_DRAIN_FILE", "PREPOS_LEAVING_FILE"):
        mount = mounts[str(PurePosixPath(env[variable]).parent)]
        assert not mount.get("readOnly") and volumes[mount["name"]]["emptyDir"] == {}, variable
    # the caches under ~ (OpenAI Triton's compiled scan kernel, the CPU kernels) go under /tmp too, and the engine
    # build (a checkpoint's caches) gets /tmp as well
    assert env["TRITON_CACHE_DIR"].startswith("/tmp/") and env["XDG_CACHE_HOME"].startswith("/tmp/")
    build = next(c for c in statefulset["spec"]["template"]["spec"]["initContainers"] if c["name"] == "engine-build")
    assert "/tmp" in {m["mountPath"] for m in build["volumeMounts"]} and env_of(build)["XDG_CACHE_HOME"] == "/tmp/cache"
    validate_all(objects)
    # a writable root keeps its pod template as it was (no roll of running replicas)
    plain = container(one(render(chart, MINIMAL), "StatefulSet"), "triton")
    assert "/tmp" not in {m["mountPath"] for m in plain["volumeMounts"]}


def test_the_exit_timeout_comment_counts_the_supervisors_stop_grace(chart):
    """values.yaml said the exit timeout must be below the grace period less the preStop sleep; the templates also
    count the supervisor's stop grace (110 s is refused with the defaults, 130 s and 15 s)."""
    from prepos.supervise import STOP_GRACE_S

    comment = comment_above(CHART_DIR / "values.yaml", "  exitTimeoutSeconds: 100")
    assert f"It plus the supervisor's {STOP_GRACE_S:g} s stop grace" in comment
    assert "must be below terminationGracePeriodSeconds minus preStopSleepSeconds" in comment
    limit = 130 - 15 - int(STOP_GRACE_S)
    assert one(render(chart, with_minimal(triton={"exitTimeoutSeconds": limit - 1})), "StatefulSet")
    with pytest.raises(helm.HelmRenderError):
        render(chart, with_minimal(triton={"exitTimeoutSeconds": limit}))


def test_a_new_chart_version_alone_leaves_the_pod_templates_as_they_are(chart, tmp_path):
    """With the chart's version among the pod labels, every chart release rolled every replica (a drain and a model
    load each) and the router (every stream ended)."""
    import shutil
    bumped_dir = tmp_path / "prepos"
    shutil.copytree(CHART_DIR, bumped_dir)
    chart_yaml = yaml.safe_load((bumped_dir / "Chart.yaml").read_text())
    chart_yaml["version"] = chart_yaml["version"] + "-bumped"
    (bumped_dir / "Chart.yaml").write_text(yaml.safe_dump(chart_yaml))
    with helm.Chart.load(bumped_dir) as bumped:
        before, after = render(chart, MINIMAL), render(bumped, MINIMAL)
    for kind in ("StatefulSet", "Deployment"):
        old, new = one(before, kind), one(after, kind)
        assert old["metadata"]["labels"]["helm.sh/chart"] != new["metadata"]["labels"]["helm.sh/chart"]
        assert old["spec"]["template"] == new["spec"]["template"], kind
        labels = new["spec"]["template"]["metadata"]["labels"]
        assert new["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_router_rolls_when_its_configuration_changes_and_only_then(chart):
    def checksum(values):
        return one(render(chart, values), "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    base = checksum(MINIMAL)
    assert checksum(with_minimal(replicaCount=3)) == base  # within the listed replica names
    assert checksum(with_minimal(router={"connectTimeoutSeconds": 7})) != base
    assert checksum(with_minimal(router={"replicaSlots": 17})) != base


def test_pods_get_no_service_link_variables(chart):
    """Kubernetes gives a pod <SERVICE>_SERVICE_HOST and the like for each Service of its namespace unless told not
    to: a release named prepos-engine gave PREPOS_ENGINE_SERVICE_HOST, which prepos refuses as an unknown engine
    setting, so the model never loaded."""
    for owner in pod_owners(render(chart, MINIMAL)):
        assert owner["spec"]["template"]["spec"]["enableServiceLinks"] is False, owner["metadata"]["name"]


def test_engine_build_init_container_writes_the_engine_triton_reads(chart):
    statefulset = one(render(chart, with_minimal(engineBuild={"args": ["--source", "/opt/prepos/engines/ckpt"]})), "StatefulSet")
    build = container(statefulset, "engine-build")
    command = build["command"] + build["args"]
    assert command[command.index("-m") + 1] == "prepos_build"
    engine_dir = command[command.index("--output") + 1]
    assert engine_dir == env_of(container(statefulset, "triton"))["PREPOS_ENGINE_DIR"]
    assert command[-2:] == ["--source", "/opt/prepos/engines/ckpt"]
    mounts = {m["name"]: m["mountPath"] for m in build["volumeMounts"]}
    assert engine_dir.startswith(mounts["engines"] + "/")
    assert {m["name"]: m["mountPath"] for m in container(statefulset, "triton")["volumeMounts"]}["engines"] == mounts["engines"]

    statefulset = one(render(chart, with_minimal(engineBuild={"enabled": False})), "StatefulSet")
    assert [c["name"] for c in statefulset["spec"]["template"]["spec"]["initContainers"]] == ["engine-check"]


@pytest.mark.parametrize("has_engine", [True, False])
def test_without_the_build_an_init_container_stops_a_pod_whose_engine_is_missing(chart, tmp_path, has_engine):
    """engineBuild off: the check runs (here under the local sh, as the pod would) against the engine directory
    Triton reads, through the same volume mount, and fails naming it when the engine is not there."""
    import subprocess
    values = with_minimal(engineBuild={"enabled": False}, storage={"mountPath": "/srv/engines"},
                          prepos={"engineDir": "/srv/engines/mine"})
    statefulset = one(render(chart, values), "StatefulSet")
    check = container(statefulset, "engine-check")
    assert env_of(check)["PREPOS_ENGINE_DIR"] == env_of(container(statefulset, "triton"))["PREPOS_ENGINE_DIR"]
    assert {m["name"]: m["mountPath"] for m in check["volumeMounts"]} == {"engines": "/srv/engines"}
    engine_dir = tmp_path / "mine"
    engine_dir.mkdir()
    if has_engine:
        (engine_dir / "prepos_engine.json").write_text("{}")
    completed = subprocess.run(check["command"], env={"PATH": "/usr/bin:/bin", "PREPOS_ENGINE_DIR": str(engine_dir)},
                               capture_output=True, text=True, timeout=30)
    if has_engine:
        assert (completed.returncode, completed.stderr) == (0, "")
    else:
        assert completed.returncode == 1
        assert f"no engine at {engine_dir} " in completed.stderr and "engineBuild.enabled is false" in completed.stderr


def test_engine_storage_sources(chart):
    def engines_source(values):
        statefulset = one(render(chart, values), "StatefulSet")
        volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
        claims = {t["metadata"]["name"]: t["spec"] for t in statefulset["spec"].get("volumeClaimTemplates", [])}
        return volumes.get("engines"), claims.get("engines")

    volume, claim = engines_source(with_minimal(storage={"volumeClaimTemplate": {"storageClass": "fast", "size": "50Gi"}}))
    assert volume is None
    assert claim["storageClassName"] == "fast" and claim["resources"]["requests"]["storage"] == "50Gi"

    volume, claim = engines_source(with_minimal(storage={"existingClaim": "shared-engines"}))
    assert claim is None and volume["persistentVolumeClaim"]["claimName"] == "shared-engines"

    volume, claim = engines_source(with_minimal(storage={"volumeClaimTemplate": {"enabled": False}}))
    assert claim is None and volume["emptyDir"] == {}


def test_journal_volume_by_default_per_replica_or_shared(chart):
    statefulset = one(render(chart, with_minimal(journal={"mountPath": "/journal", "size": "5Gi"})), "StatefulSet")
    c = container(statefulset, "triton")
    assert env_of(c)["PREPOS_JOURNAL_DIR"] == "/journal"
    assert {"name": "journal", "mountPath": "/journal"} in c["volumeMounts"]
    claims = {t["metadata"]["name"]: t["spec"] for t in statefulset["spec"]["volumeClaimTemplates"]}
    assert claims["journal"]["resources"]["requests"]["storage"] == "5Gi"
    assert claims["journal"]["accessModes"] == ["ReadWriteOnce"]

    shared = one(render(chart, with_minimal(journal={"existingClaim": "prepos-journal"})), "StatefulSet")
    volumes = {v["name"]: v for v in shared["spec"]["template"]["spec"]["volumes"]}
    assert volumes["journal"]["persistentVolumeClaim"]["claimName"] == "prepos-journal"
    assert "journal" not in {t["metadata"]["name"] for t in shared["spec"].get("volumeClaimTemplates", [])}

    statefulset = one(render(chart, with_minimal(journal={"enabled": False})), "StatefulSet")
    assert "PREPOS_JOURNAL_DIR" not in env_of(container(statefulset, "triton"))
    assert "journal" not in {t["metadata"]["name"] for t in statefulset["spec"].get("volumeClaimTemplates", [])}


def test_termination_drains_streams(chart):
    statefulset = one(render(chart, MINIMAL), "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    c = container(statefulset, "triton")
    assert pod["terminationGracePeriodSeconds"] == 130
    shell, flag, script = c["lifecycle"]["preStop"]["exec"]["command"]
    leaving, sleep = script.split("; ")  # not &&: the sleep even where the file cannot be written
    assert (shell, flag) == ("sh", "-c")
    assert leaving == f'touch "${{PREPOS_LEAVING_FILE:-{env_of(c)["PREPOS_LEAVING_FILE"]}}}"'
    sleep_s = int(sleep.removeprefix("sleep "))
    assert 0 < sleep_s <= 30
    exit_timeout = int(next(a for a in c["args"] if a.startswith("--exit-timeout-secs=")).split("=")[1])
    from prepos.supervise import STOP_GRACE_S

    assert exit_timeout + STOP_GRACE_S + sleep_s < pod["terminationGracePeriodSeconds"]


def test_the_router_checks_the_replicas_health_port_which_fails_once_the_replica_is_leaving(chart):
    """Triton's own readiness holds while a replica drains: the router polls the supervisor's health port, which
    fails from the preStop hook on, and the hook sleeps through the two failed checks that take the replica out of
    the ring before SIGTERM begins the drain."""
    from prepos.replica_health import HEALTH_PORT_ENV, LEAVING_FILE_ENV, READY_PATH

    objects = render(chart, MINIMAL)
    statefulset = one(objects, "StatefulSet")
    c = container(statefulset, "triton")
    env = env_of(c)
    health_port = port_named(c, "health")
    assert env[HEALTH_PORT_ENV] == str(health_port) and env[LEAVING_FILE_ENV].startswith("/")
    assert health_port not in {port_named(c, name) for name in ("http", "grpc", "metrics")}
    # prepos.supervise serves it: the image's entrypoint (tests/helm/test_dockerfile.py), or the chart's command
    assert c.get("command", ["python3", "-m", "prepos.supervise"])[:3] == ["python3", "-m", "prepos.supervise"]
    cluster = triton_cluster(envoy_config(objects))
    (check,) = cluster["health_checks"]
    assert check["http_health_check"]["path"] == READY_PATH and check["unhealthy_threshold"] == 2
    for endpoint in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]:
        assert endpoint["endpoint"]["health_check_config"] == {"port_value": health_port}
    script = c["lifecycle"]["preStop"]["exec"]["command"][2]
    assert script.startswith(f'touch "${{{LEAVING_FILE_ENV}:-{env[LEAVING_FILE_ENV]}}}"; ')  # the env's, if changed
    sleep_s = int(script.rsplit(" ", 1)[1])
    interval_s, timeout_s = (int(check[key].removesuffix("s")) for key in ("interval", "timeout"))
    assert sleep_s >= check["unhealthy_threshold"] * interval_s + timeout_s
    # Envoy checks every 60 s while a router has sent no traffic, unless told otherwise: a replica leaving then
    # would stay in the ring past the preStop sleep.
    assert check["no_traffic_interval"] == check["interval"]


def test_the_routers_durations_stay_whole_seconds_for_large_values(chart):
    """Helm reads numbers as floats: 1000000 printed as 1e+06s, which Envoy refuses as a duration."""
    values = {**MINIMAL, "router": {"connectionIdleTimeoutSeconds": 10_000_000, "dnsRefreshSeconds": 3_000_000,
                                    "connectTimeoutSeconds": 2_000_000,
                                    "healthCheck": {"enabled": True, "intervalSeconds": 1_000_000,
                                                    "timeoutSeconds": 1_000_000},
                                    "terminationGracePeriodSeconds": 4_000_000},
              "preStopSleepSeconds": 3_000_000, "terminationGracePeriodSeconds": 4_000_000}
    config = envoy_config(render(chart, values))
    def durations(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key.endswith(("timeout", "interval", "rate")) and isinstance(value, str):
                    yield value
                yield from durations(value)
        elif isinstance(node, list):
            for item in node:
                yield from durations(item)

    found = list(durations(config))
    assert len(found) >= 8 and all(re.fullmatch(r"\d+s", d) for d in found), found
    cluster = triton_cluster(config)
    assert (cluster["dns_refresh_rate"], cluster["connect_timeout"]) == ("3000000s", "2000000s")
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert options["common_http_protocol_options"]["idle_timeout"] == "10000000s"
    (check,) = cluster["health_checks"]
    assert (check["interval"], check["timeout"], check["no_traffic_interval"]) == ("1000000s",) * 3


def test_every_container_has_resource_requests(chart, production_values):
    for values in (MINIMAL, production_values, VALIDATED_VALUES["cpu-only-no-build"]):
        for owner in pod_owners(render(chart, values)):
            spec = owner["spec"]["template"]["spec"]
            for c in spec["containers"] + spec.get("initContainers", []):
                requests = c.get("resources", {}).get("requests", {})
                assert {"cpu", "memory"} <= requests.keys(), f"{owner['metadata']['name']}/{c['name']}"


# --- replicas, autoscaling, disruption budget -----------------------------------------------


def test_replicas_come_from_values(chart):
    objects = render(chart, with_minimal(replicaCount=5))
    assert one(objects, "StatefulSet")["spec"]["replicas"] == 5
    assert find(objects, "HorizontalPodAutoscaler") == []


def test_autoscaler_bounds_and_metric_come_from_values(chart):
    values = with_minimal(autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 7,
                                       "metricName": "prepos_open_sessions", "targetAverageValue": "100"})
    objects = render(chart, values)
    statefulset = one(objects, "StatefulSet")
    hpa = one(objects, "HorizontalPodAutoscaler")
    # The autoscaler owns the count; rendered, so that an upgrade turning autoscaling on does not drop it to
    # Kubernetes' default of 1. Offline, `lookup` finds no StatefulSet: the autoscaler's least.
    assert statefulset["spec"]["replicas"] == 2
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 7)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": statefulset["metadata"]["name"]}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "prepos_open_sessions"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "100"}


def test_disruption_budgets_cover_the_triton_replicas_and_the_router_each(chart):
    objects = render(chart, MINIMAL)
    for kind, name in (("StatefulSet", "prepos-triton"), ("Deployment", "prepos-router")):
        pdb = one(objects, "PodDisruptionBudget", name)
        pod_labels = one(objects, kind)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        others = [o for o in pod_owners(objects) if o["kind"] != kind]
        assert not any(pdb["spec"]["selector"]["matchLabels"].items() <= o["spec"]["template"]["metadata"]["labels"].items()
                       for o in others)
    assert not find(render(chart, with_minimal(router={"podDisruptionBudget": {"enabled": False}})),
                    "PodDisruptionBudget", "prepos-router")


@pytest.mark.parametrize("release", ["prepos", "llm-prod"])
def test_anti_affinity_presets_select_this_releases_own_pods(chart, release):
    """Written by hand in a values file, the selector named the release prepos: under any other release name the
    one-replica-per-node rule matched no pod and did nothing."""
    objects = [doc for path, text in sorted(chart.render(
        values=with_minimal(podAntiAffinity="hard"), name=release, namespace=NAMESPACE, is_install=True).items())
        if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    statefulset, deployment = one(objects, "StatefulSet"), one(objects, "Deployment")
    (hard,) = statefulset["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert hard["topologyKey"] == "kubernetes.io/hostname"
    assert hard["labelSelector"]["matchLabels"] == statefulset["spec"]["selector"]["matchLabels"]
    assert hard["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == release
    (soft,) = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]  # the router's default
    assert soft["podAffinityTerm"]["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    # affinity written out keeps the preset beside it (layered over the production values, a nodeAffinity of one's
    # own dropped their one-replica-per-node rule), unless it has a podAntiAffinity of its own; no preset, no rule
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}}
    both = one(render(chart, with_minimal(podAntiAffinity="hard", affinity=own)), "StatefulSet")["spec"]["template"][
        "spec"]["affinity"]
    preset = one(render(chart, with_minimal(podAntiAffinity="hard")), "StatefulSet")["spec"]["template"]["spec"][
        "affinity"]["podAntiAffinity"]
    assert both == {"nodeAffinity": own["nodeAffinity"], "podAntiAffinity": preset}
    mine = {**own, "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    assert one(render(chart, with_minimal(podAntiAffinity="hard", affinity=mine)), "StatefulSet")["spec"]["template"][
        "spec"]["affinity"] == mine
    assert "affinity" not in one(render(chart, MINIMAL), "StatefulSet")["spec"]["template"]["spec"]


def test_production_values_spread_the_replicas_of_a_release_of_any_name(chart, production_values):
    texts = chart.render(values=production_values, name="llm-prod", namespace=NAMESPACE, is_install=True)
    objects = [doc for path, text in sorted(texts.items()) if path.endswith(".yaml")
               for doc in yaml.safe_load_all(text) if doc]
    statefulset = one(objects, "StatefulSet")
    (rule,) = statefulset["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert rule["labelSelector"]["matchLabels"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()


def test_a_disruption_budget_lets_at_least_one_pod_go(chart):
    """maxUnavailable 0 (refused above) blocks node drains for good; the smallest share, 1%, rounds up to a pod."""
    objects = render(chart, with_minimal(podDisruptionBudget={"maxUnavailable": "1%"}))
    assert one(objects, "PodDisruptionBudget", "prepos-triton")["spec"]["maxUnavailable"] == "1%"
    assert not find(render(chart, with_minimal(podDisruptionBudget={"enabled": False, "maxUnavailable": 0})),
                    "PodDisruptionBudget", "prepos-triton")


def test_production_replica_count_is_said_to_be_ignored_under_the_autoscaler(chart, production_values):
    """values-production.yaml called replicaCount 3 the "starting size": with the autoscaler on the chart renders
    autoscaling.minReplicas whatever it is."""
    assert production_values["autoscaling"]["enabled"]
    comment = comment_above(PRODUCTION_VALUES, "replicaCount: 3")
    assert comment.startswith("Ignored while autoscaling.enabled") and "autoscaling.minReplicas" in comment
    for count in (1, 3, 9):
        statefulset = one(render(chart, {**production_values, "replicaCount": count}), "StatefulSet")
        assert statefulset["spec"]["replicas"] == production_values["autoscaling"]["minReplicas"]


def test_production_values_say_which_sessions_their_per_replica_journals_lose(chart, production_values):
    """values-production.yaml keeps one journal volume per replica under an autoscaler of 3 to 12 replicas: the
    NOTES warn that a removed replica's sessions go with it, where the README's "Nothing is lost" needs a shared
    journal; the file now says so where it chooses the journal."""
    assert not production_values["journal"].get("existingClaim") and production_values["autoscaling"]["enabled"]
    notes = render_files(chart, production_values)["prepos/templates/NOTES.txt"]
    assert "a replica removed for good takes its sessions with it" in notes
    comment = comment_above(PRODUCTION_VALUES, "journal:")
    for phrase in ("lost", "scale-down", "rolling update", "journal.existingClaim", "ReadWriteMany"):
        assert phrase in comment, phrase


def test_a_replica_stays_ready_a_while_before_the_rolling_update_takes_the_next(chart):
    assert one(render(chart, MINIMAL), "StatefulSet")["spec"]["minReadySeconds"] == 15


# --- services and metrics -------------------------------------------------------------------


def test_headless_service_exposes_the_triton_ports(chart):
    objects = render(chart, MINIMAL)
    statefulset = one(objects, "StatefulSet")
    headless = one(objects, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    c = container(statefulset, "triton")
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in headless["spec"]["ports"]}
    assert ports == {name: (port_named(c, name), name) for name in ("grpc", "http", "metrics")}


def test_service_monitor_scrapes_the_metrics_service(chart, production_values):
    objects = render(chart, production_values)
    monitor = one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selector = monitor["spec"]["selector"]["matchLabels"]
    selected = [s for s in find(objects, "Service") if selector.items() <= s["metadata"]["labels"].items()]
    assert len(selected) == 1, "the ServiceMonitor must select exactly the metrics Service"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "15s"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (metrics_port,) = selected[0]["spec"]["ports"]
    assert metrics_port["targetPort"] == "metrics" and "--allow-metrics=true" in triton(objects)["args"]


@pytest.mark.parametrize(("interval", "timeout", "refused"), [
    ("15s", "10s", False), ("15s", "15s", False), ("1m", "59s999ms", False), ("1m", "1m1ms", True),
    ("30s", "1m", True), ("1h", "59m", False), ("1d", "1h30m", False), ("1w", "8d", True), ("10s", "10001ms", True),
    ("1y", "52w", False), ("0", "1s", True), (None, "10s", False), ("15s", None, False),  # null: Prometheus's
], ids=lambda v: str(v))
def test_a_scrape_timeout_past_its_interval_is_refused(chart, interval, timeout, refused):
    """Prometheus refuses a scrape timeout greater than the scrape interval; the chart says so at render."""
    values = with_minimal(metrics={"serviceMonitor": {"enabled": True, "interval": interval, "scrapeTimeout": timeout}})
    if not refused:
        (monitor,) = find(render(chart, values), "ServiceMonitor")
        assert monitor["spec"]["endpoints"][0]["scrapeTimeout"] == timeout
        return
    with pytest.raises(helm.HelmRenderError) as raised:
        render(chart, values)
    assert f"metrics.serviceMonitor.scrapeTimeout ({timeout}) must not exceed metrics.serviceMonitor.interval ({interval})" in str(raised.value)


def test_a_registry_port_in_the_repository_is_no_tag(chart):
    """A tag in image.repository rendered reg/prepos:0.1.0:0.1.0 (refused above); a port is no tag."""
    values = with_minimal(image={"repository": "reg.example.com:5000/ml/prepos", "tag": "0.2.0"})
    assert triton(render(chart, values))["image"] == "reg.example.com:5000/ml/prepos:0.2.0"
    assert triton(render(chart, with_minimal(image={"repository": "localhost:5000/prepos"})))["image"] == (
        "localhost:5000/prepos:0.1.0")


def test_service_monitor_off_by_default(chart):
    assert find(render(chart, MINIMAL), "ServiceMonitor") == []


# --- session-affine router ------------------------------------------------------------------


def ring_endpoints(config: dict[str, Any]) -> list[dict[str, Any]]:
    (locality,) = triton_cluster(config)["load_assignment"]["endpoints"]
    return locality["lb_endpoints"]


def test_router_hashes_the_session_header_onto_each_replicas_stable_name(chart):
    objects = render(chart, with_minimal(replicaCount=3, router={"replicaSlots": 3}))
    config = envoy_config(objects)
    hcm = connection_manager(config)
    (virtual_host,) = hcm["route_config"]["virtual_hosts"]
    (route,) = virtual_host["routes"]
    assert route["route"]["hash_policy"] == [{"header": {"header_name": SESSION_HEADER}, "terminal": True}]

    cluster = triton_cluster(config)
    assert route["route"]["cluster"] == cluster["name"]
    assert cluster["type"] == "STRICT_DNS"
    assert cluster["lb_policy"] == "RING_HASH"
    # Most names may have no healthy replica behind them: never route to unhealthy hosts (Envoy's panic mode).
    assert cluster["common_lb_config"]["healthy_panic_threshold"] == {"value": 0}
    statefulset = one(objects, "StatefulSet")
    headless = one(objects, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    grpc_port = {p["name"]: p["port"] for p in headless["spec"]["ports"]}["grpc"]
    # A pod's DNS name under its StatefulSet's headless Service: <pod>.<service>.<namespace>.svc.<domain>, the pod
    # being <statefulset>-<ordinal>. The ring places each replica by that name, which outlives the pod's IP.
    pod_names = [f"{statefulset['metadata']['name']}-{ordinal}.{headless['metadata']['name']}.{NAMESPACE}"
                 ".svc.cluster.local" for ordinal in range(3)]
    endpoints = ring_endpoints(config)
    assert [e["endpoint"]["address"]["socket_address"]["address"] for e in endpoints] == pod_names
    assert {e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints} == {grpc_port}
    assert [e["metadata"]["filter_metadata"]["envoy.lb"]["hash_key"] for e in endpoints] == [
        f"{name}:{grpc_port}" for name in pod_names]


@pytest.mark.parametrize(("values", "num_names"), [
    ({}, 16),  # router.replicaSlots: scaling within them leaves the router's config alone
    ({"replicaCount": 20}, 20),
    ({"replicaCount": 2, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 24}}, 24),
    ({"replicaCount": 2, "router": {"replicaSlots": 4}}, 4),
])
def test_the_ring_lists_every_replica_there_may_be(chart, values, num_names):
    keys = [e["metadata"]["filter_metadata"]["envoy.lb"]["hash_key"]
            for e in ring_endpoints(envoy_config(render(chart, with_minimal(**values))))]
    assert len(keys) == len(set(keys)) == num_names
    assert keys[-1].startswith(f"{RELEASE}-triton-{num_names - 1}.")


@pytest.mark.parametrize("release", ["prepos", "llm"])
def test_the_replica_slots_comment_names_the_replicas_as_the_router_lists_them(chart, release):
    """values.yaml showed <release>-triton-0, but a release whose name lacks "prepos" lists
    <release>-prepos-triton-0."""
    files = chart.render(values=MINIMAL, name=release, namespace=NAMESPACE, is_install=True)
    (config_map,) = [doc for doc in yaml.safe_load_all(files["prepos/templates/router-configmap.yaml"]) if doc]
    address = ring_endpoints(yaml.safe_load(config_map["data"]["envoy.yaml"]))[0]["endpoint"]["address"]
    first = address["socket_address"]["address"].split(".")[0]
    assert first.replace(release, "<release>", 1) in comment_above(CHART_DIR / "values.yaml", "  replicaSlots: 16")


LONG_CLUSTER_DOMAIN = "k8s.prod.eu-west-1.internal.example.com"


def test_a_router_config_past_a_configmaps_1_mib_fails_the_render(chart):
    """With a 53-character release, a 63-character namespace and a long clusterDomain, 1024 replica names gave a
    ConfigMap of 1,055,758 bytes (envoy.yaml and its key), which Kubernetes refuses (1 MiB of data, keys included)."""
    def render_long(num_replicas):
        values = with_minimal(replicaCount=num_replicas, clusterDomain=LONG_CLUSTER_DOMAIN)
        return chart.render(values=values, name="r" * 53, namespace="n" * 63, is_install=True)

    (config_map,) = [doc for doc in yaml.safe_load_all(render_long(1000)["prepos/templates/router-configmap.yaml"])
                     if doc]
    size = sum(len(key) + len(value.encode()) for key, value in config_map["data"].items())
    assert 1_000_000 < size <= 1024 * 1024
    with pytest.raises(helm.HelmRenderError) as raised:
        render_long(1024)
    assert ("the router's ConfigMap (its key envoy.yaml and the config) would be 1055758 bytes, past the 1 MiB "
            "(1048576 bytes) Kubernetes allows a ConfigMap: it lists 1024 replica names") in str(raised.value)
    # the README's bound: 1024 names fit with the longest release and namespace under a 30-character clusterDomain
    values = with_minimal(replicaCount=1024, clusterDomain="c" * 25 + ".test")
    assert chart.render(values=values, name="r" * 53, namespace="n" * 63, is_install=True)


def test_images_pinned_by_tag_or_digest(chart):
    digest = "sha256:" + "ab" * 32
    assert container(one(render(chart, MINIMAL), "StatefulSet"), "triton")["image"] == (
        "registry.example.com/ml/prepos:0.1.0")
    pinned = one(render(chart, with_minimal(image={"digest": digest, "tag": "0.2.0"})), "StatefulSet")
    for name in ("triton", "engine-build"):
        assert container(pinned, name)["image"] == f"registry.example.com/ml/prepos@{digest}"


@pytest.mark.parametrize("release", ["prepos.v2", "Prepos", "1prepos"])
def test_a_release_name_kubernetes_refuses_as_a_service_name_fails_the_render(chart, release):
    """Helm takes release names with dots; the Services named after them would be refused at install."""
    with pytest.raises(helm.HelmRenderError) as raised:
        chart.render(values=MINIMAL, name=release, namespace=NAMESPACE, is_install=True)
    assert "must be lowercase letters, digits and '-', starting with a letter" in str(raised.value)


def test_storage_class_dash_means_no_dynamic_provisioning(chart):
    values = with_minimal(storage={"volumeClaimTemplate": {"storageClass": "-"}}, journal={"storageClass": "fast"})
    claims = {c["metadata"]["name"]: c["spec"] for c in one(render(chart, values), "StatefulSet")["spec"]["volumeClaimTemplates"]}
    assert claims["engines"]["storageClassName"] == ""
    assert claims["journal"]["storageClassName"] == "fast"
    plain = one(render(chart, MINIMAL), "StatefulSet")["spec"]["volumeClaimTemplates"]
    assert all("storageClassName" not in c["spec"] for c in plain)  # the cluster's default class


def test_maglev_takes_a_prime_table_size(chart):
    for size in (65537, 131071, 5000011):
        values = with_minimal(router={"lbPolicy": "MAGLEV", "maglev": {"tableSize": size}})
        assert triton_cluster(envoy_config(render(chart, values)))["maglev_lb_config"]["table_size"] == size


def test_envoy_runs_as_many_workers_as_the_router_is_given_cpus(chart):
    """Without --concurrency Envoy starts one worker per hardware thread of the node, whatever its CPU limit."""
    for values, workers in ((MINIMAL, "2"), (with_minimal(router={"concurrency": 4}), "4")):
        args = container(one(render(chart, values), "Deployment"), "envoy")["args"]
        assert args[args.index("--concurrency") + 1] == workers


def test_router_speaks_http2_both_ways(chart):
    config = envoy_config(render(chart, MINIMAL))
    assert connection_manager(config)["codec_type"] == "HTTP2"
    options = triton_cluster(config)["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert options["@type"] == "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    assert "http2_protocol_options" in options["explicit_http_config"]


def test_router_pings_idle_client_connections_unless_told_not_to(chart):
    options = connection_manager(envoy_config(render(chart, MINIMAL)))["http2_protocol_options"]
    assert options["connection_keepalive"]["interval"] == "60s"
    off = connection_manager(envoy_config(render(chart, with_minimal(router={"clientKeepaliveSeconds": 0}))))
    assert "connection_keepalive" not in off["http2_protocol_options"]


def test_security_contexts_reach_every_pod_and_container(chart):
    restricted = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                  "seccompProfile": {"type": "RuntimeDefault"}}
    values = with_minimal(podSecurityContext={"fsGroup": 1000}, securityContext=restricted,
                          router={"podSecurityContext": {"runAsNonRoot": True}, "securityContext": {"runAsUser": 101}})
    objects = render(chart, values)
    statefulset, deployment = one(objects, "StatefulSet"), one(objects, "Deployment")
    assert statefulset["spec"]["template"]["spec"]["securityContext"] == {"fsGroup": 1000}
    for name in ("triton", "engine-build"):
        assert container(statefulset, name)["securityContext"] == restricted
    unbuilt = one(render(chart, {**values, "engineBuild": {"enabled": False}}), "StatefulSet")
    assert container(unbuilt, "engine-check")["securityContext"] == restricted
    assert deployment["spec"]["template"]["spec"]["securityContext"] == {"runAsNonRoot": True}
    assert container(deployment, "envoy")["securityContext"] == {"runAsUser": 101}
    plain = render(chart, MINIMAL)
    assert "securityContext" not in container(one(plain, "StatefulSet"), "triton")


def test_the_router_pulls_with_the_charts_pull_secrets(chart):
    objects = render(chart, with_minimal(imagePullSecrets=[{"name": "regcred"}]))
    for owner in (one(objects, "Deployment"), one(objects, "StatefulSet")):
        assert owner["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]


def test_router_keeps_long_streams_open(chart):
    config = envoy_config(render(chart, with_minimal(router={"streamIdleTimeoutSeconds": 900})))
    hcm = connection_manager(config)
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["timeout"] == "0s"
    assert hcm["stream_idle_timeout"] == "900s"


def test_ring_size_bounds_reach_the_config(chart):
    # Envoy's ring itself cannot be reproduced here; this checks only that the configured bounds
    # (which set how many virtual nodes spread sessions over replicas) reach the cluster config.
    values = with_minimal(router={"ringHash": {"minimumRingSize": 4096, "maximumRingSize": 65536}})
    ring = triton_cluster(envoy_config(render(chart, values)))["ring_hash_lb_config"]
    assert ring["minimum_ring_size"] == 4096
    assert ring["maximum_ring_size"] == 65536
    defaults = triton_cluster(envoy_config(render(chart, MINIMAL)))["ring_hash_lb_config"]
    assert 1024 <= defaults["minimum_ring_size"] <= defaults["maximum_ring_size"] <= 8388608


def test_maglev_policy(chart):
    cluster = triton_cluster(envoy_config(render(chart, with_minimal(router={"lbPolicy": "MAGLEV"}))))
    assert cluster["lb_policy"] == "MAGLEV"
    assert cluster["maglev_lb_config"]["table_size"] == 65537
    assert "ring_hash_lb_config" not in cluster


def test_router_deployment_and_service(chart):
    objects = render(chart, with_minimal(router={"replicas": 3, "service": {"type": "LoadBalancer"}}))
    deployment = one(objects, "Deployment")
    envoy = container(deployment, "envoy")
    assert deployment["spec"]["replicas"] == 3
    assert envoy["image"].startswith("envoyproxy/envoy:v1.3")
    config_path = envoy["args"][envoy["args"].index("--config-path") + 1]
    mounts = {m["name"]: m["mountPath"] for m in envoy["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    config_map = one(objects, "ConfigMap")
    assert config_path == f"{mounts['config']}/envoy.yaml"
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert port_named(envoy, "grpc") == grpc_listener(envoy_config(objects))["address"]["socket_address"]["port_value"]

    service = one(objects, "Service", RELEASE)
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(8001, "grpc")]


def test_the_router_admin_is_on_loopback_and_the_probes_use_a_listener_of_their_own(chart):
    """Envoy's admin interface can stop Envoy (/quitquitquit) or fail its health: reachable from every pod, it was
    open to the whole cluster."""
    objects = render(chart, MINIMAL)
    config = envoy_config(objects)
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    (health,) = [listener for listener in config["static_resources"]["listeners"] if listener["name"] == "health"]
    (chain,) = health["filter_chains"]
    (route,) = chain["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    envoy = container(one(objects, "Deployment"), "envoy")
    assert envoy["readinessProbe"]["httpGet"] == {"path": route["match"]["path"], "port": "health"}
    assert route["direct_response"]["status"] == 200
    assert envoy["livenessProbe"]["tcpSocket"]["port"] == "health"
    assert port_named(envoy, "health") == health["address"]["socket_address"]["port_value"]
    assert port_named(envoy, "health") != config["admin"]["address"]["socket_address"]["port_value"]


# --- TLS and access token -------------------------------------------------------------------


def test_tls_wiring_only_when_enabled(chart):
    objects = render(chart, MINIMAL)
    assert "transport_socket" not in grpc_listener(envoy_config(objects))["filter_chains"][0]
    assert "tls" not in {v["name"] for v in one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]}

    objects = render(chart, with_minimal(router={"tls": {"enabled": True, "secretName": "grpc-cert"}}))
    socket = grpc_listener(envoy_config(objects))["filter_chains"][0]["transport_socket"]
    context = socket["typed_config"]
    assert context["@type"] == "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
    assert context["common_tls_context"]["alpn_protocols"] == ["h2"]
    (certificate,) = context["common_tls_context"]["tls_certificates"]
    deployment = one(objects, "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container(deployment, "envoy")["volumeMounts"]}
    assert volumes["tls"]["secret"]["secretName"] == "grpc-cert"
    assert certificate["certificate_chain"]["filename"] == f"{mounts['tls']}/tls.crt"
    assert certificate["private_key"]["filename"] == f"{mounts['tls']}/tls.key"


def test_auth_wiring_only_when_enabled(chart):
    c = triton(render(chart, MINIMAL))
    assert not any("restricted" in arg for arg in c["args"])
    assert not any("secretKeyRef" in str(value) for value in env_of(c).values())

    values = with_minimal(auth={"enabled": True, "existingSecret": "prepos-token", "secretKey": "value"})
    objects = render(chart, values)
    c = triton(objects)
    restricted = [arg for arg in c["args"] if "restricted" in arg]
    (token_env,) = [name for name, value in env_of(c).items() if isinstance(value, dict) and "secretKeyRef" in value]
    assert env_of(c)[token_env]["secretKeyRef"] == {"name": "prepos-token", "key": "value"}
    # Triton 2.51's flags: --grpc-restricted-protocol and --http-restricted-api, "<groups>:<header>=<value>";
    # Kubernetes expands $(VAR) in args from the container's environment
    groups = "inference,model-repository,model-config,shared-memory,statistics,trace,logging"
    expected = f"={groups}:prepos-access-token=$({token_env})"
    assert restricted == [f"--grpc-restricted-protocol{expected}", f"--http-restricted-api{expected}"]
    assert "health" not in groups and "metadata" not in groups  # probes and the router's health checks stay open


def test_auth_groups_are_the_launchers_by_default(chart):
    """The chart and `prepos serve --access-token-file` restrict the same protocol groups under the same header."""
    from prepos.access_token import ACCESS_TOKEN_HEADER, RESTRICTED_PROTOCOLS

    defaults = yaml.safe_load((Path(__file__).resolve().parents[2] / "helm" / "prepos" / "values.yaml").read_text())
    assert tuple(defaults["auth"]["protocols"]) == RESTRICTED_PROTOCOLS
    assert defaults["auth"]["header"] == ACCESS_TOKEN_HEADER


def test_production_values_restrict_every_group_the_launcher_does(chart, production_values):
    from prepos.access_token import RESTRICTED_PROTOCOLS

    (c,) = [c for c in one(render(chart, production_values), "StatefulSet")["spec"]["template"]["spec"]["containers"]
            if any("restricted" in arg for arg in c.get("args", []))]
    for arg in c["args"]:
        if "restricted" in arg:
            assert arg.split("=", 1)[1].split(":", 1)[0].split(",") == list(RESTRICTED_PROTOCOLS)


def test_readme_gpu_node_pool_example_renders_and_validates(chart):
    """The values example in README "Deploy on Kubernetes" stays a working one."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Deploy on Kubernetes", 1)[1]
    example = section.split("```yaml", 1)[1].split("```", 1)[0]
    values = yaml.safe_load(example)
    objects = render(chart, values)
    pod_spec = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == values["nodeSelector"]
    assert triton(objects)["resources"]["limits"]["nvidia.com/gpu"] in (1, "1")
    for obj in objects:
        if obj["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_an_autoscaler_on_another_exporters_metric_needs_no_prepos_metrics(chart):
    # only prepos's own metrics (prepos_*) go away with metrics.enabled false; a GPU exporter's stay
    values = with_minimal(autoscaling={"enabled": True, "metricName": "DCGM_FI_DEV_GPU_UTIL",
                                       "targetAverageValue": "80"}, metrics={"enabled": False})
    hpa = one(render(chart, values), "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "DCGM_FI_DEV_GPU_UTIL"
