"""deploy/k8s/lws-deepseek.yaml, the LeaderWorkerSet of docs/deploy.md, checked without a cluster.

Its shape against the LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1, written below from the API's Go types in
kubernetes-sigs/lws: api/leaderworkerset/v1/leaderworkerset_types.go, with the core/v1 pod fields the manifest
uses), and every pod's command through moeserve's argument parser with the LWS variables as that pod gets them:
the leader is node 0 and serves HTTP, each worker a further node rank, and the GPUs of the group are the ranks.
Where kubectl reaches a cluster that has the LeaderWorkerSet CRD, `kubectl apply --dry-run=client` as well.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess

import jsonschema
import pytest
import yaml

from tests.serve_commands import ROOT, check_serve

MANIFEST = ROOT / "deploy/k8s/lws-deepseek.yaml"
# The variables LWS sets in every container; the leader's address stands in for the DNS name LWS gives it.
LEADER_ADDRESS = "moeserve-deepseek-v3-0.moeserve-deepseek-v3.default"
LWS_VARIABLE = re.compile(r"\$\((\w+)\)")

_STRINGS = {"type": "array", "items": {"type": "string"}}
_CONTAINER = {
    "type": "object",
    "required": ["name", "image"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string"}, "image": {"type": "string"}, "command": _STRINGS, "args": _STRINGS,
        "workingDir": {"type": "string"}, "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "envFrom": {"type": "array"}, "securityContext": {"type": "object"},
        "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"],
                                             "properties": {"containerPort": {"type": "integer"}}}},
        "resources": {"type": "object", "additionalProperties": False, "properties": {
            "limits": {"type": "object", "additionalProperties": {"type": ["string", "integer"]}},
            "requests": {"type": "object", "additionalProperties": {"type": ["string", "integer"]}}}},
        "readinessProbe": {"type": "object"}, "livenessProbe": {"type": "object"}, "startupProbe": {"type": "object"},
        "volumeMounts": {"type": "array", "items": {"type": "object", "required": ["name", "mountPath"]}},
    },
}
_POD_TEMPLATE = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "metadata": {"type": "object", "properties": {"labels": {"type": "object"}, "annotations": {"type": "object"}}},
        "spec": {"type": "object", "required": ["containers"], "properties": {
            "containers": {"type": "array", "minItems": 1, "items": _CONTAINER},
            "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}}}},
    },
}
LWS_SCHEMA = {  # LeaderWorkerSetSpec and LeaderWorkerTemplate: every field of the v1 API, none other
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {"type": "object", "properties": {"type": {"enum": ["RollingUpdate"]}}},
                "networkConfig": {"type": "object", "properties": {
                    "subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "required": ["workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart",
                                                   "None"]},
                        "leaderTemplate": _POD_TEMPLATE,
                        "workerTemplate": _POD_TEMPLATE,
                        "subGroupPolicy": {"type": "object", "properties": {
                            "subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]},
                            "subGroupSize": {"type": "integer", "minimum": 1}}},
                        "volumeClaimTemplates": {"type": "array"},
                        "persistentVolumeClaimRetentionPolicy": {"type": "object"},
                    },
                },
            },
        },
    },
}
SERVICE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "v1"}, "kind": {"const": "Service"},
        "spec": {"type": "object", "required": ["selector", "ports"], "properties": {
            "ports": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["port"]}}}},
    },
}


def _documents() -> tuple[dict, dict]:
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["LeaderWorkerSet", "Service"], kinds
    return next(d for d in docs if d["kind"] == "LeaderWorkerSet"), next(d for d in docs if d["kind"] == "Service")


def pods(lws: dict) -> list[tuple[int, dict]]:
    """(LWS_WORKER_INDEX, pod spec) of every pod of one group: the leader 0 (its own template, or the workers'),
    then the workers 1 .. size - 1."""
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template.get("size", 1)
    leader = template.get("leaderTemplate", template["workerTemplate"])
    return [(0, leader["spec"])] + [(i, template["workerTemplate"]["spec"]) for i in range(1, size)]


def pod_argv(command: list[str], size: int, index: int) -> list[str]:
    """A container's command as the pod runs it: Kubernetes expands $(VAR) from the variables LWS set."""
    env = {"LWS_LEADER_ADDRESS": LEADER_ADDRESS, "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)}

    def expand(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is no variable LeaderWorkerSet sets"
        return env[m.group(1)]

    return [LWS_VARIABLE.sub(expand, word) for word in command]


def check_manifest(lws: dict, service: dict) -> None:
    """Raise (jsonschema.ValidationError, ValueError, AssertionError) where the manifest is wrong."""
    jsonschema.validate(lws, LWS_SCHEMA)
    jsonschema.validate(service, SERVICE_SCHEMA)
    size = lws["spec"]["leaderWorkerTemplate"].get("size", 1)
    commands = []
    for index, pod in pods(lws):
        volumes = {v["name"] for v in pod.get("volumes", [])}
        (container,) = pod["containers"]  # one container: moeserve
        assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes, "a mount names no volume"
        argv = pod_argv(container["command"] + container.get("args", []), size, index)
        assert argv[:2] == ["moeserve", "serve"], argv[:2]
        args = check_serve(argv[2:])
        assert (args.nnodes, args.node_rank) == (size, index), (args.nnodes, args.node_rank)
        assert args.dist_init_addr.rpartition(":")[0] == LEADER_ADDRESS
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus * args.nnodes == args.tp_size, f"{gpus} GPUs a pod x {args.nnodes} pods != --tp-size"
        commands.append(container["command"] + container.get("args", []))
        if index == 0:  # node 0 serves HTTP: the probe, the port and the Service must meet it there
            assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": args.port}
            assert args.port in [p["containerPort"] for p in container["ports"]]
            assert args.host == "0.0.0.0", "the leader must listen beyond its own loopback"
            labels = {**lws["spec"]["leaderWorkerTemplate"].get("leaderTemplate", {}).get("metadata", {}).get(
                "labels", {}), "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}
            assert service["spec"]["selector"].items() <= labels.items(), "the Service does not select the leader"
            assert [p.get("targetPort", p["port"]) for p in service["spec"]["ports"]] == [args.port]
    assert all(c == commands[0] for c in commands), "every node runs the same command"


def test_manifest_is_a_leaderworkerset_whose_pods_run_moeserves_multinode_server():
    lws, service = _documents()
    check_manifest(lws, service)
    args = check_serve(pod_argv(pods(lws)[0][1]["containers"][0]["command"], 2, 0)[2:])
    assert args.tp_size == 16 and args.enable_dp_attention and args.moe_a2a_backend == "all2all"


@pytest.mark.parametrize("breakage", ["typo in the API", "flag moeserve lacks", "ranks over GPUs", "group size"])
def test_a_broken_manifest_is_caught(breakage):
    lws, service = _documents()
    lws = copy.deepcopy(lws)
    template = lws["spec"]["leaderWorkerTemplate"]
    command = template["leaderTemplate"]["spec"]["containers"][0]["command"]
    if breakage == "typo in the API":
        template["groupSize"] = template.pop("size")
    elif breakage == "flag moeserve lacks":
        command.append("--enable-deepep-moe-typo")
    elif breakage == "ranks over GPUs":
        command[command.index("--tp-size=16")] = "--tp-size=32"  # valid for moeserve, 16 ranks a pod
    else:  # three pods, but the command's --tp-size is for two nodes of 8 GPUs
        template["size"] = 3
    with pytest.raises((jsonschema.ValidationError, ValueError, AssertionError)):
        check_manifest(lws, service)


def test_kubectl_dry_run_where_a_cluster_has_leaderworkerset():
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed; the schema check above stands in for it")
    crd = subprocess.run(["kubectl", "get", "crd", "leaderworkersets.leaderworkerset.x-k8s.io",
                          "--request-timeout=5s"], capture_output=True, text=True, timeout=30)
    if crd.returncode != 0:
        pytest.skip(f"kubectl reaches no cluster with the LeaderWorkerSet CRD: {crd.stderr.strip()[:200]}")
    out = subprocess.run(["kubectl", "apply", "--dry-run=client", "-f", str(MANIFEST)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
