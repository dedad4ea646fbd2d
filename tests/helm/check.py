"""Renders, lints and validates the Helm chart (run by scripts/check-helm).

For each scenario (a values file under tests/helm/): render the chart with
Helm's own engine (helm-python-sdk), lint it strictly, validate every
rendered Kubernetes object with `kubernetes-validate --strict` and the
prometheus-operator objects against tests/helm/crd-schemas/, then check a
few properties the schemas cannot see. Values that must be refused are
checked to fail rendering, and every value must be documented in
values.yaml and the chart's README. Prints one line per check and a
summary; exits 1 if anything failed.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import helm_python as helm
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = Path(os.environ.get("SLUICE_HELM_CHART", ROOT / "helm" / "sluice"))
HERE = Path(__file__).resolve().parent
KUBE_VERSIONS = os.environ.get("SLUICE_HELM_KUBE_VERSIONS", "1.31.0,1.37.0").split(",")
NAMESPACE = "sluice"

SCENARIOS = {
    "default": None,
    "ha": "values-ha.yaml",
    "sidecar": "values-sidecar.yaml",
    "tls": "values-tls.yaml",
    "monitoring": "values-monitoring.yaml",
    "s3": "values-s3.yaml",
    "cache": "values-cache.yaml",
    "mount": "values-mount.yaml",
}

# Mount settings checked on top of the default scenario (the DaemonSet only).
MOUNT_VARIANTS = {
    "mount without order files": {"stage": {"mount": {"enabled": True}}},
    "mount with order files beside it": {"stage": {"mount": {
        "enabled": True, "hostPath": "/mnt/sluice/view", "orders": {"hostPath": "/srv/sluice-orders"}}}},
}

# Cache settings checked on top of the default scenario.
CACHE_VARIANTS = {
    "cache memory written as 0": {"stage": {"cache": {"memory": "0"}}},
    "cache memory 0MiB beside a disk tier": {"stage": {"cache": {
        "memory": "0MiB", "disk": {"hostPath": "/mnt/nvme/sluice", "size": "100GiB"}}}},
}

# The stage's configuration file (stage.config), in both workloads.
STAGE_CONFIG = {
    "trainers": [
        {"uids": [1000], "jobs": ["team-a-*"], "labels": {"team": ["a"]}, "require": ["team"]},
        {"gids": [2000]},
    ],
    "cache": {"weights": {"imagenet": 3}},
}

# Admin-auth settings checked on top of the default scenario.
AUTH_VARIANTS = {
    "auth off": {"auth": {"enabled": False}},
    "auth from an existing Secret": {"auth": {"existingSecret": "ops-tokens", "secretKey": "file"}},
}

# Values the chart must refuse, with a piece of the message it must give.
MUST_FAIL = {
    "bad store type (values.schema.json)": ({"store": {"type": "mysql"}}, "value must be one of 'sqlite', 'postgres'"),
    # The stage refuses these at start (exit 64): a crash-looping DaemonSet.
    "node cache as large as the budget": ({"stage": {"memoryBudget": "1GiB", "cache": {"memory": "1GiB"}}},
                                          "leaves the prefetch buffers less than 16MiB"),
    "node cache leaving 8MiB": ({"stage": {"memoryBudget": "1GiB", "cache": {"memory": "1016MiB"}}},
                                "leaves the prefetch buffers less than 16MiB"),
    # The kernel would kill the stage once its buffers fill (the stage only warns).
    "memory limit below the budget": ({"stage": {"memoryBudget": "2GiB"}},
                                      "leaves the stage less than 64MiB above stage.memoryBudget"),
    "memory limit 32MiB above the budget": (
        {"stage": {"memoryBudget": "1GiB", "resources": {"limits": {"memory": "1056Mi"}}}},
        "stage.resources.limits.memory (1056Mi) leaves the stage less than 64MiB"),
    "memory limit in decimal units": (
        {"stage": {"memoryBudget": "1GiB", "resources": {"limits": {"memory": "1.1G"}}}},
        "stage.resources.limits.memory (1.1G)"),
    "postgres without a secret": ({"store": {"type": "postgres"}}, "store.postgres.existingSecret"),
    "tls without a secret": ({"tls": {"enabled": True, "stageSecret": "s"}}, "tls.controllerSecret"),
    # The controller's server certificate is no client certificate: no default.
    "tls without a stage secret": ({"tls": {"enabled": True, "controllerSecret": "c"}}, "tls.stageSecret"),
    "tls for stages without a controller": (
        {"controller": {"enabled": False}, "tls": {"enabled": True, "controllerSecret": "c", "stageSecret": "s"}},
        "tls.enabled secures the stages' session with a controller, and these stages have none"),
    "bound stage ids without tls": ({"tls": {"bindStageIds": True}}, "tls.bindStageIds needs tls.enabled"),
    "dataset without a path": ({"stage": {"datasets": [{"name": "x"}]}}, "needs hostPath, volume or s3"),
    "policy file name": ({"policies": {"files": {"pools.txt": "x: 1"}}}, "must end in .yaml"),
    "misspelled value (values.schema.json)": ({"store": {"typ": "postgres"}}, "additional properties 'typ' not allowed"),
    "port out of range (values.schema.json)": ({"controller": {"grpcPort": 70000}}, "/controller/grpcPort"),
    # Helm's schema engine cannot carry a message of its own: the error
    # names the value that is missing.
    "disk tier without a size (values.schema.json)": (
        {"stage": {"cache": {"disk": {"hostPath": "/mnt/nvme/sluice"}}}}, "at '/stage/cache/disk/size': minLength"),
    "disk tier without a directory (values.schema.json)": (
        {"stage": {"cache": {"disk": {"size": "100GiB"}}}}, "at '/stage/cache/disk/hostPath': minLength"),
    "disk tier in a relative directory (values.schema.json)": (
        {"stage": {"cache": {"disk": {"hostPath": "nvme/sluice", "size": "100GiB"}}}},
        "at '/stage/cache/disk/hostPath': 'nvme/sluice' does not match pattern"),
    # The DaemonSet's stage gets the mount directory's parent at the same path.
    "mount in a top-level directory (values.schema.json)": (
        {"stage": {"mount": {"enabled": True, "hostPath": "/sluice"}}},
        "at '/stage/mount/hostPath': '/sluice' does not match pattern"),
    "mount without a directory in DaemonSet mode": (
        {"stage": {"mount": {"enabled": True, "hostPath": ""}}}, "DaemonSet mode needs an absolute directory"),
    "mount whose parent hides the image": (
        {"stage": {"mount": {"enabled": True, "hostPath": "/usr/local/sluice"}}},
        "the stage gets /usr/local at the same path"),
    "mount whose parent holds the socket's directory": (
        {"stage": {"mount": {"enabled": True, "hostPath": "/run/sluice-mnt"}}},
        "the stage gets /run at the same path"),
    "order files inside the mount": (
        {"stage": {"mount": {"enabled": True, "orders": {"hostPath": "/var/lib/sluice/mnt/orders"}}}},
        "must be neither stage.mount.hostPath, inside it"),
    # What sluice-stage refuses at start (exit 64), refused before that.
    "rate limit without a unit of time (values.schema.json)": (
        {"stage": {"rateLimit": 209715200}}, "at '/stage/rateLimit'"),
    "rate limit without /s (values.schema.json)": (
        {"stage": {"rateLimit": "200MiB"}}, "at '/stage/rateLimit': '200MiB' does not match pattern"),
    "rate limit of zero (values.schema.json)": (
        {"stage": {"rateLimit": "0MiB/s"}}, "at '/stage/rateLimit': '0MiB/s' does not match pattern"),
    "ops limit in exponent notation (values.schema.json)": (
        {"stage": {"opsLimit": "2e6"}}, "at '/stage/opsLimit': '2e6' does not match pattern"),
    "ops limit of zero (values.schema.json)": ({"stage": {"opsLimit": 0}}, "at '/stage/opsLimit'"),
    "fixed readers with tuner bounds": (
        {"stage": {"readers": {"fixed": 4, "min": 2, "max": 8}}},
        "stage.readers.fixed (4) turns the reader tuner off"),
    "reader bounds the wrong way round": (
        {"stage": {"readers": {"min": 16, "max": 8}}}, "stage.readers.min (16) is above stage.readers.max (8)"),
    "too many readers (values.schema.json)": ({"stage": {"readers": {"max": 2000}}}, "at '/stage/readers/max'"),
    "no data set (values.schema.json)": ({"stage": {"datasets": []}}, "at '/stage/datasets'"),
    "a data set given twice": (
        {"stage": {"datasets": [{"name": "a", "hostPath": "/a"}, {"name": "a", "hostPath": "/b"}]}},
        '"a" is given twice'),
    "a data set name too long for its volume's (values.schema.json)": (
        {"stage": {"datasets": [{"name": "d" * 56, "hostPath": "/d"}]}}, "at '/stage/datasets/0/name'"),
    "negative memory budget (values.schema.json)": (
        {"stage": {"memoryBudget": "-1GiB"}}, "at '/stage/memoryBudget': '-1GiB' does not match pattern"),
    "memory budget of zero (values.schema.json)": (
        {"stage": {"memoryBudget": "0"}}, "at '/stage/memoryBudget': '0' does not match pattern"),
    "memory budget in words (values.schema.json)": (
        {"stage": {"memoryBudget": "lots"}}, "at '/stage/memoryBudget': 'lots' does not match pattern"),
    "an S3 endpoint with no scheme (values.schema.json)": (
        {"stage": {"s3": {"endpoint": "minio.storage:9000"}}}, "at '/stage/s3/endpoint'"),
    "a log level misspelt (values.schema.json)": (
        {"stage": {"logLevel": "warning"}}, "at '/stage/logLevel': 'warning' does not match pattern"),
    "a controller log level misspelt (values.schema.json)": (
        {"controller": {"logLevel": "info,tonic=verbose"}}, "at '/controller/logLevel'"),
    "cache memory that is no size (values.schema.json)": (
        {"stage": {"cache": {"memory": "abc"}}}, "at '/stage/cache/memory': 'abc' does not match pattern"),
    "negative disk tier (values.schema.json)": (
        {"stage": {"cache": {"disk": {"hostPath": "/var/cache/x", "size": "-5GiB"}}}},
        "at '/stage/cache/disk/size': '-5GiB' does not match pattern"),
    "buffer bounds the wrong way round": (
        {"stage": {"buffer": {"min": "512MiB", "max": "64MiB", "initial": "64MiB"}}},
        "must keep min <= max <= stage.memoryBudget"),
    "buffer larger than the budget": (
        {"stage": {"memoryBudget": "1GiB", "buffer": {"max": "2GiB"}}}, "must keep min <= max <= stage.memoryBudget"),
    "buffer smaller than its default initial size": (
        {"stage": {"buffer": {"max": "128MiB"}}}, "stage.buffer.initial (unset) is outside"),
    "S3 deadline in words (values.schema.json)": (
        {"stage": {"s3": {"deadline": "soon"}}}, "at '/stage/s3/deadline': 'soon' does not match pattern"),
    "TCP listener on the metrics port": (
        {"stage": {"tcp": {"enabled": True, "port": 7190}}}, "stage.tcp.port and stage.metricsPort are both 7190"),
    # What sluice-controller refuses at start (exit 64): only `ms` and `s`.
    "tick in minutes (values.schema.json)": (
        {"controller": {"tick": "1m"}}, "at '/controller/tick': '1m' does not match pattern"),
    "stage timeout in minutes and seconds (values.schema.json)": (
        {"controller": {"stageTimeout": "2m30s"}}, "at '/controller/stageTimeout': '2m30s' does not match pattern"),
    "tick of zero": ({"controller": {"tick": "0ms"}}, 'controller.tick "0ms" is zero'),
    "tick over a minute": ({"controller": {"tick": "90s", "stageTimeout": "300s"}}, "at least once a minute"),
    "stage timeout under 2s": ({"controller": {"stageTimeout": "1500ms"}}, "give at least 2s"),
    "tick not shorter than the stage timeout": (
        {"controller": {"tick": "5s", "stageTimeout": "5s"}}, "must be shorter than controller.stageTimeout"),
}

# TLS settings checked on top of the default scenario (with the example Job,
# so both the DaemonSet's stage and the sidecar are seen): whoever the stage
# runs as must read its certificate files.
TLS_BASE = {"enabled": True, "controllerSecret": "sluice-controller-tls", "stageSecret": "sluice-stage-tls"}
TLS_VARIANTS = {
    "tls, stage as another user": {"stage": {"podSecurityContext": {"runAsUser": 1000, "runAsGroup": 1000}}},
    "tls, stage pod with fsGroup": {"stage": {"podSecurityContext": {"fsGroup": 65532}}},
    "tls, stage as root": {"stage": {"podSecurityContext": {"runAsUser": 0, "runAsNonRoot": False}}},
    "tls with the mount": {"stage": {"mount": {"enabled": True}}},
}

# Where the chart mounts the disk tier's host directory in the stage.
CACHE_DIR = "/var/cache/sluice"
# The stage container's name in the DaemonSet and in the sidecar example.
STAGE_NAMES = ("stage", "sluice-stage")
# Sidecar mode: the emptyDir the stage and the trainer share, and the
# directory on it where the stage mounts the data sets.
SIDECAR_MOUNT_VOLUME, SIDECAR_MOUNT_DIR = "/mnt/sluice", "/mnt/sluice/data"

CRD_SCHEMAS = {
    "ServiceMonitor": HERE / "crd-schemas" / "servicemonitor.json",
    "PrometheusRule": HERE / "crd-schemas" / "prometheusrule.json",
}

results: list[tuple[str, bool, str]] = []


def record(name: str, ok: bool, detail: str = "") -> None:
    results.append((name, ok, detail))
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail and not ok else ''}")


def load_values(file: str | None) -> dict | None:
    if file is None:
        return None
    return helm.values_from_yaml((HERE / file).read_text())


def render(values: dict | None) -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values, name="sluice", namespace=NAMESPACE, is_install=True)


def objects(manifests: dict[str, str]) -> list[tuple[str, dict]]:
    out = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt") or not text.strip():
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.append((path, doc))
    return out


def lint(scenario: str, values: dict | None) -> None:
    report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE,
                       kube_version="v" + KUBE_VERSIONS[0])
    # Severity 1 is INFO (e.g. "icon is recommended"); warnings and errors fail.
    bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    bad_text = [f"{m['path']}: {m['error']}" for m in bad] + list(report.get("errors") or [])
    record(f"{scenario}: helm lint --strict", not bad_text, "; ".join(bad_text))


def kube_validate(scenario: str, objs: list[tuple[str, dict]], tmp: Path) -> None:
    files = []
    for i, (path, obj) in enumerate(objs):
        if obj.get("kind") in CRD_SCHEMAS:
            continue
        f = tmp / f"{scenario}-{i:02d}-{obj['kind'].lower()}.yaml"
        f.write_text(yaml.safe_dump(obj))
        files.append(str(f))
    cmd = [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "--quiet"]
    for v in KUBE_VERSIONS:
        cmd += ["-k", v]
    proc = subprocess.run(cmd + files, capture_output=True, text=True)
    out = (proc.stdout + proc.stderr).strip()
    # A WARN means no schema was found for a kind: that would pass silently.
    problems = [l for l in out.splitlines() if l.split(" ", 1)[0] in ("ERROR", "WARN", "FATAL")]
    ok = proc.returncode == 0 and not problems
    record(f"{scenario}: kubernetes-validate --strict ({len(files)} objects, "
           f"k8s {', '.join(KUBE_VERSIONS)})", ok, "\n    ".join(problems or [out]))


def crd_validate(scenario: str, objs: list[tuple[str, dict]]) -> None:
    for path, obj in objs:
        schema_file = CRD_SCHEMAS.get(obj.get("kind"))
        if schema_file is None:
            continue
        schema = json.loads(schema_file.read_text())
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}"
                  for e in jsonschema.Draft202012Validator(schema).iter_errors(obj)]
        record(f"{scenario}: {obj['kind']}/{obj['metadata']['name']} schema", not errors,
               "; ".join(errors))


def sluicectl() -> str | None:
    """The sluicectl binary, if one is built (this script never builds it)."""
    bin_dir = os.environ.get("SLUICE_BIN_DIR")
    for c in ([Path(bin_dir) / "sluicectl"] if bin_dir else []) + [
            ROOT / "target" / "debug" / "sluicectl", ROOT / "target" / "release" / "sluicectl"]:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def policies_validate(scenario: str, objs: list[tuple[str, dict]], tmp: Path) -> None:
    """The policy files the chart ships to the controller pass `sluicectl validate`."""
    for _, obj in objs:
        if obj["kind"] != "ConfigMap" or not obj["metadata"]["name"].endswith("-policies"):
            continue
        tool = sluicectl()
        if tool is None:
            print(f"skip {scenario}: policies (no sluicectl built; set SLUICE_BIN_DIR)")
            return
        d = tmp / f"{scenario}-policies"
        d.mkdir()
        for name, text in obj["data"].items():
            (d / name).write_text(text)
        proc = subprocess.run([tool, "validate", "-f", str(d)], capture_output=True, text=True)
        record(f"{scenario}: sluicectl validate of the policies ConfigMap", proc.returncode == 0,
               (proc.stdout + proc.stderr).strip())


def pod_specs(objs):
    for _, obj in objs:
        spec = obj.get("spec", {})
        if obj["kind"] in ("Deployment", "DaemonSet", "Job"):
            yield obj, spec["template"]["spec"]


def properties(scenario: str, objs: list[tuple[str, dict]], values: dict | None) -> None:
    """What schemas cannot see: hardening, probes, cross-references."""
    problems = []
    kinds = {}
    for _, obj in objs:
        kinds.setdefault(obj["kind"], []).append(obj)
    mount_on = bool(mount_values(values).get("enabled"))
    for obj, pod in pod_specs(objs):
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        volumes = {v["name"] for v in pod.get("volumes", [])}
        pod_sc = pod.get("securityContext", {})
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c.get("securityContext", {})
            if not sc.get("readOnlyRootFilesystem"):
                problems.append(f"{where} {c['name']}: root file system is writable")
            # The stage with the mount is privileged (mount_wiring checks
            # exactly how); nothing else may be.
            mounting_stage = mount_on and c["name"] in STAGE_NAMES and sc.get("privileged")
            if sc.get("allowPrivilegeEscalation") is not False and not mounting_stage:
                problems.append(f"{where} {c['name']}: privilege escalation allowed")
            # What the API server and the kubelet refuse, which the schemas
            # cannot see.
            if sc.get("privileged") and sc.get("allowPrivilegeEscalation") is False:
                problems.append(f"{where} {c['name']}: privileged with allowPrivilegeEscalation false (refused)")
            if not sc.get("privileged") and any(m.get("mountPropagation") == "Bidirectional"
                                                for m in c.get("volumeMounts", [])):
                problems.append(f"{where} {c['name']}: Bidirectional propagation in an unprivileged container (refused)")
            if (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
                    and sc.get("runAsUser", pod_sc.get("runAsUser")) == 0):
                problems.append(f"{where} {c['name']}: runAsNonRoot with user 0 (the kubelet refuses to start it)")
            if "limits" not in c.get("resources", {}):
                problems.append(f"{where} {c['name']}: no resource limits")
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    problems.append(f"{where} {c['name']}: mounts unknown volume {m['name']}")
            is_daemon = c["name"] in ("controller", "stage", "sluice-stage")
            if is_daemon and not (c.get("livenessProbe") and c.get("readinessProbe")):
                problems.append(f"{where} {c['name']}: missing probes")
    deployments = [d for d in kinds.get("Deployment", [])]
    store = ((values or {}).get("store") or {}).get("type", "sqlite")
    want = ((values or {}).get("controller") or {}).get("replicas", 1) if store == "postgres" else 1
    for d in deployments:
        if d["spec"]["replicas"] != want:
            problems.append(f"controller replicas {d['spec']['replicas']}, want {want}")
    services = {s["metadata"]["name"]: s for s in kinds.get("Service", [])}
    for sm in kinds.get("ServiceMonitor", []):
        sel = sm["spec"]["selector"]["matchLabels"]
        ports = {p["name"] for s in services.values()
                 if sel.items() <= s["metadata"]["labels"].items() for p in s["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            if ep["port"] not in ports:
                problems.append(f"ServiceMonitor {sm['metadata']['name']}: no Service port {ep['port']}")
    record(f"{scenario}: hardening, probes and references", not problems, "; ".join(problems))


def auth_wiring(scenario: str, objs: list[tuple[str, dict]], values: dict | None) -> None:
    """The controller gets its admin tokens: `--token-file` names a file in
    a mounted Secret that the release holds (or the operator's own), whose
    lines the controller accepts; with auth off it runs `--insecure-admin`."""
    auth = (values or {}).get("auth") or {}
    enabled, key = auth.get("enabled", True), auth.get("secretKey", "tokens")
    secrets = {o["metadata"]["name"]: o for _, o in objs if o["kind"] == "Secret"}
    for obj, pod in pod_specs(objs):
        if obj["kind"] != "Deployment":
            continue
        problems = []
        c = next(c for c in pod["containers"] if c["name"] == "controller")
        args = c.get("args", [])
        token_args = [a for a in args if a.startswith("--token-file=")]
        if not enabled:
            if token_args or "--insecure-admin" not in args:
                problems.append(f"auth off: args {args} lack --insecure-admin or still name a token file")
            record(f"{scenario}: admin auth wiring", not problems, "; ".join(problems))
            continue
        if "--insecure-admin" in args or token_args != [f"--token-file=/etc/sluice/auth/{key}"]:
            problems.append(f"args {args}: want exactly --token-file=/etc/sluice/auth/{key}")
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        if mounts.get("auth", {}).get("mountPath") != "/etc/sluice/auth" or "subPath" in mounts.get("auth", {}):
            problems.append("the auth Secret is not mounted whole at /etc/sluice/auth")
        volume = next((v for v in pod.get("volumes", []) if v["name"] == "auth"), {})
        name = volume.get("secret", {}).get("secretName")
        if auth.get("existingSecret"):
            if name != auth["existingSecret"] or name in secrets:
                problems.append(f"auth volume uses {name!r}, want the existing {auth['existingSecret']!r} (not rendered)")
        elif name not in secrets:
            problems.append(f"auth volume names Secret {name!r}, which the chart does not render")
        else:
            import base64
            text = base64.b64decode(secrets[name]["data"].get(key, "")).decode()
            lines = [ln.split() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
            roles = sorted(ln[0] for ln in lines if len(ln) == 2 and len(ln[1]) >= 32)
            if roles != ["admin", "read"] or len(lines) != 2:
                problems.append(f"the token file holds {len(lines)} lines with roles {roles}, want one admin and one read token")
        record(f"{scenario}: admin auth wiring", not problems, "; ".join(problems))


def cache_wiring(scenario: str, objs: list[tuple[str, dict]], values: dict | None) -> None:
    """The node cache's flags follow the values; with a disk tier the
    DaemonSet's stage gets `--cache-dir` on a writable hostPath volume
    (DirectoryOrCreate) and a root init container that, run here on a
    directory, hands it to the stage container's user (root with the
    mount) and group. Sidecars never get
    a disk tier (pods on one node would share its directory)."""
    stage = (values or {}).get("stage") or {}
    cache = stage.get("cache") or {}
    disk = cache.get("disk") or {}
    has_disk = bool(disk.get("hostPath") and disk.get("size"))
    # A size of 0 is no memory tier (the stage refuses a cache policy
    # with no cache: `memory: "0"` crash-looped every stage).
    memory = cache.get("memory")
    if memory and re.fullmatch(r"[0.]+ *[A-Za-z]*", str(memory)):
        cache = {**cache, "memory": ""}
    problems = []
    for obj, pod in pod_specs(objs):
        if obj["kind"] == "Deployment":
            continue
        where = obj["kind"]
        c = next(c for c in pod.get("initContainers", []) + pod["containers"]
                 if c["name"] in ("stage", "sluice-stage"))
        args = c.get("args", [])
        cache_args = [a for a in args if a.startswith("--cache-")]
        want = []
        if cache.get("memory"):
            want.append(f"--cache-memory={cache['memory']}")
        disk_here = has_disk and obj["kind"] == "DaemonSet"
        if cache.get("memory") or disk_here:
            want.append(f"--cache-policy={cache.get('policy', 'stable')}")
        if disk_here:
            want += [f"--cache-dir={CACHE_DIR}", f"--cache-disk={disk['size']}"]
        if cache_args != want:
            problems.append(f"{where}: cache flags {cache_args}, want {want}")
        mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == CACHE_DIR]
        if not disk_here:
            if mounts:
                problems.append(f"{where}: mounts {CACHE_DIR} without a disk tier")
            continue
        if len(mounts) != 1 or mounts[0].get("readOnly"):
            problems.append(f"{where}: want one writable mount at {CACHE_DIR}, have {mounts}")
            continue
        volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
        if volume.get("hostPath") != {"path": disk["hostPath"], "type": "DirectoryOrCreate"}:
            problems.append(f"{where}: cache volume {volume}, want hostPath {disk['hostPath']} DirectoryOrCreate")
        fixers = [i for i in pod.get("initContainers", [])
                  if any(m["name"] == volume["name"] for m in i.get("volumeMounts", []))]
        if not disk.get("fixPermissions", True):
            if fixers:
                problems.append(f"{where}: init containers {[i['name'] for i in fixers]} with fixPermissions off")
            continue
        if len(fixers) != 1 or fixers[0].get("securityContext", {}).get("runAsUser") != 0:
            problems.append(f"{where}: want one init container running as root on the cache volume, have {fixers}")
            continue
        # The stage container's user (root with the mount) and group.
        sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
        group = {**pod.get("securityContext", {}), **fixers[0].get("securityContext", {})}.get("runAsGroup", 0)
        problems += run_cache_fixer(where, fixers[0], sc.get("runAsUser", 0), sc.get("runAsGroup", 0), group)
    record(f"{scenario}: node cache wiring", not problems, "; ".join(problems))


def tls_wiring(scenario: str, objs: list[tuple[str, dict]], values: dict | None) -> None:
    """With tls.enabled the controller gets the --tls-* flags, and
    --bind-stage-ids exactly when tls.bindStageIds."""
    tls = (values or {}).get("tls", {})
    if not tls.get("enabled"):
        return
    args = [a for obj, pod in pod_specs(objs) if obj["kind"] == "Deployment"
            for c in pod["containers"] if c["name"] == "controller" for a in c.get("args", [])]
    problems = [f"controller lacks {flag}" for flag in ("--tls-cert", "--tls-key", "--tls-ca")
                if not any(a.startswith(flag) for a in args)]
    if ("--bind-stage-ids" in args) != bool(tls.get("bindStageIds")):
        problems.append(f"--bind-stage-ids in the controller's args: {'--bind-stage-ids' in args}, "
                        f"tls.bindStageIds: {tls.get('bindStageIds')}")
    record(f"{scenario}: tls wiring", not problems, "; ".join(problems))


def tls_files_readable(scenario: str, objs: list[tuple[str, dict]]) -> None:
    """Every container that mounts the `tls` Secret can read its files, as
    the kubelet lays them out: user root, group the pod's fsGroup (which it
    also adds to every container's groups, and to the files' mode as 0440)
    or root, mode `defaultMode`; the containers drop every capability, so
    root reads as the owner. No file is writable, and the bit for others is
    set only where the container's user is neither owner nor group."""
    problems = []
    seen = 0
    for obj, pod in pod_specs(objs):
        volume = next((v for v in pod.get("volumes", []) if v["name"] == "tls"), None)
        if volume is None:
            continue
        psc = pod.get("securityContext", {})
        fs_group = psc.get("fsGroup")
        mode = volume["secret"].get("defaultMode", 0o644) | (0o440 if fs_group is not None else 0)
        file_group = fs_group if fs_group is not None else 0
        for c in pod.get("initContainers", []) + pod["containers"]:
            if not any(m["name"] == "tls" for m in c.get("volumeMounts", [])):
                continue
            seen += 1
            sc = c.get("securityContext", {})
            # The images' user (docker/*.Dockerfile) unless one is set.
            uid = sc.get("runAsUser", psc.get("runAsUser", 65532))
            gid = sc.get("runAsGroup", psc.get("runAsGroup", 65532))
            groups = {gid, *psc.get("supplementalGroups", [])} | ({fs_group} if fs_group is not None else set())
            if uid == 0:
                bits, other_needed = mode & 0o400, False
            elif file_group in groups:
                bits, other_needed = mode & 0o040, False
            else:
                bits, other_needed = mode & 0o004, True
            where = f"{obj['kind']}/{obj['metadata']['name']} {c['name']}"
            if not bits:
                problems.append(f"{where}: user {uid}, groups {sorted(groups)} cannot read files "
                                f"0:{file_group} mode {mode:04o}")
            if mode & 0o222:
                problems.append(f"{where}: the certificate files are writable (mode {mode:04o})")
            if mode & 0o004 and not other_needed:
                problems.append(f"{where}: mode {mode:04o} lets others read the key, which user {uid} "
                                f"(groups {sorted(groups)}) does not need")
    record(f"{scenario}: tls files readable by the containers ({seen} mounts)", seen > 0 and not problems,
           "; ".join(problems) or "no container mounts the tls Secret")


def stage_config_wiring() -> None:
    """`stage.config` becomes the stage's `--config` file: a ConfigMap of
    its keys, mounted read-only in the DaemonSet's and a sidecar's stage
    container, and a DaemonSet pod annotation that changes with it (the
    stage reads the file at start only). Without it nothing of the kind
    is rendered."""
    values = {"stage": {"config": STAGE_CONFIG}, "sidecar": {"exampleJob": {"enabled": True}}}
    objs = objects(render(values))
    problems = []
    maps = [o for _, o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-stage-config")]
    if len(maps) != 1 or yaml.safe_load(maps[0]["data"]["stage.yaml"]) != STAGE_CONFIG:
        problems.append(f"want one ConfigMap whose stage.yaml holds the config, have {maps}")
    name = maps[0]["metadata"]["name"] if maps else None
    stages = 0
    for obj, pod in pod_specs(objs):
        for c in pod.get("initContainers", []) + pod["containers"]:
            if c["name"] not in STAGE_NAMES:
                continue
            stages += 1
            where = f"{obj['kind']} {c['name']}"
            mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
            mount = mounts.get("stage-config", {})
            if "--config=" + posixpath.join(mount.get("mountPath", "?"), "stage.yaml") not in c.get("args", []):
                problems.append(f"{where}: no --config naming the mounted file (args {c.get('args')})")
            if not mount.get("readOnly"):
                problems.append(f"{where}: the config volume is not mounted read-only: {mount}")
            volume = next((v for v in pod.get("volumes", []) if v["name"] == "stage-config"), {})
            if (volume.get("configMap") or {}).get("name") != name:
                problems.append(f"{where}: volume {volume}, want the ConfigMap {name}")
        if obj["kind"] == "DaemonSet":
            annotations = obj["spec"]["template"]["metadata"].get("annotations") or {}
            if "checksum/stage-config" not in annotations:
                problems.append(f"DaemonSet: no checksum/stage-config annotation ({annotations})")
    if stages < 2:
        problems.append(f"want the DaemonSet's and the sidecar's stage containers, found {stages}")
    for _, o in objects(render({"sidecar": {"exampleJob": {"enabled": True}}})):
        if "stage-config" in json.dumps(o) or "--config=" in json.dumps(o):
            problems.append(f"{o['kind']} {o['metadata']['name']}: a config file rendered with no stage.config")
    record("stage.config renders the stage's --config file", not problems, "; ".join(problems))


def limits_rendering() -> None:
    """Numbers in a values file reach the stage as digits: Helm holds them
    as floats, which `{{ . }}` prints as 2e+06 (refused by the stage)."""
    values = helm.values_from_yaml("stage:\n  opsLimit: 2000000\n  rateLimit: 200MiB/s\n"
                                   "sidecar:\n  exampleJob:\n    enabled: true\n")
    problems = []
    for obj, pod in pod_specs(objects(render(values))):
        for c in pod.get("initContainers", []) + pod["containers"]:
            if c["name"] not in STAGE_NAMES:
                continue
            got = [a for a in c.get("args", []) if a.startswith(("--ops-limit", "--rate-limit"))]
            if got != ["--rate-limit=200MiB/s", "--ops-limit=2000000"]:
                problems.append(f"{obj['kind']}: {got}, want --rate-limit=200MiB/s --ops-limit=2000000")
    record("limits from a values file render as the stage takes them", not problems, "; ".join(problems))


def memory_limits_accepted() -> None:
    """Memory limits at least 64MiB above the budget render, in any unit;
    a quantity the chart does not read (exponent notation) is left to the
    stage's own warning rather than refused."""
    cases = {"1.5Gi": "1GiB", "1088Mi": "1GiB", "2G": "1GiB", "1200000000": "1GiB", "1e12": "1GiB", "200Mi": "128MiB"}
    problems = []
    for limit, budget in cases.items():
        try:
            render({"stage": {"memoryBudget": budget, "resources": {"limits": {"memory": limit}}}})
        except helm.HelmError as e:
            problems.append(f"limit {limit} with budget {budget}: {e}")
    record("memory limits at least 64MiB above the budget render", not problems, "; ".join(problems))


def standalone_alerts() -> None:
    """SluiceStageDisconnected only where the stages are given a controller:
    a standalone stage reports sluice_stage_controller_connected 0 for good.
    The dashboards' count of disconnected stages cannot be left out, so its
    description says so."""
    rule_on = {"metrics": {"prometheusRule": {"enabled": True}}}
    cases = {
        "the chart's controller": ({}, True),
        "no controller (standalone)": ({"controller": {"enabled": False}}, False),
        "a controller of their own": ({"controller": {"enabled": False}, "stage": {
            "extraArgs": ["--controller=http://sluice-controller.ml.svc:7070"]}}, True),
    }
    problems = []
    for name, (values, want) in cases.items():
        alerts = [r.get("alert") for _, o in objects(render({**rule_on, **values})) if o["kind"] == "PrometheusRule"
                  for g in o["spec"]["groups"] for r in g["rules"]]
        if ("SluiceStageDisconnected" in alerts) != want:
            problems.append(f"stages with {name}: SluiceStageDisconnected {'missing' if want else 'rendered'}")
    for f in sorted((CHART / "dashboards").glob("*.json")):
        def panels(o):
            for p in o.get("panels", []):
                yield p
                yield from panels(p)
        for p in panels(json.loads(f.read_text())):
            exprs = [t.get("expr", "") for t in p.get("targets", [])]
            if any("sluice_stage_controller_connected == 0" in e for e in exprs) \
                    and "standalone" not in p.get("description", ""):
                problems.append(f"{f.name}: panel {p.get('title')!r} counts disconnected stages "
                                f"without saying standalone stages count as such")
    record("SluiceStageDisconnected only for stages with a controller", not problems, "; ".join(problems))


def names_and_admin_port() -> None:
    """Release names Helm accepts (dots, 53 characters) and a long
    fullnameOverride give names Kubernetes takes (DNS labels: a Service's
    must be one, a Job's goes into its pods' labels), none rendered twice.
    Without tokens the controller's HTTP port, where the REST API takes
    changes, admits only adminFrom even when metricsFrom is empty."""
    label = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
    subdomain = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
    problems = []
    cases = {"team.prod": {}, "a" * 53: {}, "sluice": {"fullnameOverride": "f" * 62}}
    with helm.Chart.load(str(CHART)) as chart:
        for release, extra in cases.items():
            values = {"sidecar": {"exampleJob": {"enabled": True}}, "networkPolicy": {"enabled": True}, **extra}
            seen = set()
            for _, o in objects(chart.render(values, name=release, namespace=NAMESPACE, is_install=True)):
                key = (o["kind"], o["metadata"]["name"])
                if key in seen:
                    problems.append(f"release {release[:20]}: {key[0]} {key[1]} rendered twice")
                seen.add(key)
                if o["kind"] in ("Service", "Job") and not label.fullmatch(key[1]):
                    problems.append(f"release {release[:20]}: {key[0]} name {key[1]!r} is not a DNS label")
                if not (len(key[1]) <= 253 and subdomain.fullmatch(key[1])):
                    problems.append(f"release {release[:20]}: {key[0]} name {key[1]!r} is not a DNS subdomain")
    closed = {"auth": {"enabled": False}, "networkPolicy": {
        "enabled": True, "adminFrom": [{"namespaceSelector": {"matchLabels": {"team": "ops"}}}]}}
    for _, o in objects(render(closed)):
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-controller"):
            for rule in o["spec"]["ingress"]:
                if any(p["port"] == "http" for p in rule["ports"]) and not rule.get("from"):
                    problems.append("auth off: the controller's HTTP port (the REST API) admits any source")
    record("names of any release, and the admin port without tokens", not problems, "; ".join(problems))


def documented_names() -> None:
    """What the operator's guide and the chart's README tell operators to
    type, for the documented install (`helm install sluice helm/sluice -n
    sluice`), names objects the chart renders: `port-forward svc/NAME`, `get
    secret NAME`; the cert-manager example issues the controller's
    certificate (`server auth`) for the host stages dial and the stages' one
    (`client auth`) into the Secrets its `tls:` values name."""
    docs = [ROOT / "docs" / "operations.md", CHART / "README.md"]
    objs = objects(render({"tls": TLS_BASE}))
    names = {(o["kind"], o["metadata"]["name"]) for _, o in objs}
    url = next(a for o, pod in pod_specs(objs) if o["kind"] == "DaemonSet"
               for c in pod["containers"] for a in c.get("args", []) if a.startswith("--controller="))
    host = re.match(r"--controller=https://([^:/]+)", url).group(1)
    problems = []
    for doc in docs:
        text = doc.read_text()
        where = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
        for m in re.finditer(r"port-forward svc/([\w.-]+)", text):
            if ("Service", m.group(1)) not in names:
                problems.append(f"{where}: port-forward svc/{m.group(1)}: no such Service")
        for m in re.finditer(r"get secret ([\w.-]+)", text):
            if ("Secret", m.group(1)) not in names:
                problems.append(f"{where}: get secret {m.group(1)}: no such Secret")
        tls_values, certs = {}, {}
        for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
            try:
                docs_in_block = list(yaml.safe_load_all(block))
            except yaml.YAMLError:
                continue
            for d in docs_in_block:
                if isinstance(d, dict) and isinstance(d.get("tls"), dict):
                    tls_values = d["tls"]
                if isinstance(d, dict) and d.get("kind") == "Certificate":
                    certs[d["spec"]["secretName"]] = d["spec"]
        if not certs:
            continue
        ctl = certs.get(tls_values.get("controllerSecret"), {})
        stage = certs.get(tls_values.get("stageSecret"), {})
        if host not in ctl.get("dnsNames", []) or "server auth" not in ctl.get("usages", []):
            problems.append(f"{where}: the controller's certificate ({ctl}) lacks dnsNames {host} or `server auth`")
        if "client auth" not in stage.get("usages", []):
            problems.append(f"{where}: the stages' certificate ({stage}) lacks `client auth`")
    record("docs: resource names and certificates of the documented install", not problems, "; ".join(problems))


def mount_values(values: dict | None) -> dict:
    """stage.mount of `values` over the chart's defaults."""
    default = yaml.safe_load((CHART / "values.yaml").read_text())["stage"]["mount"]
    given = ((values or {}).get("stage") or {}).get("mount") or {}
    return {**default, **given, "orders": {**default["orders"], **(given.get("orders") or {})}}


def mount_wiring(scenario: str, objs: list[tuple[str, dict]], values: dict | None) -> None:
    """With `stage.mount.enabled` the stage gets `--mount` (and
    `--mount-job`, `--mount-orders` as set), the mount directory's parent
    with Bidirectional propagation (DaemonSet: a hostPath at the same path,
    created if missing; sidecar: the emptyDir shared with the trainer, which
    mounts it HostToContainer and finds the mount in SLUICE_MOUNT_DIR),
    /dev/fuse as a CharDevice hostPath, and a privileged root security
    context; an init container, run here on a directory, creates the mount
    directory (and the order files' one, for the stage's group). No other
    container is privileged, and the init containers stay as they were.
    With the mount off none of it appears and the stage stays unprivileged."""
    m = mount_values(values)
    on = bool(m["enabled"])
    problems = []
    for obj, pod in pod_specs(objs):
        if obj["kind"] == "Deployment":
            continue
        where = obj["kind"]
        containers = pod.get("initContainers", []) + pod["containers"]
        c = next(c for c in containers if c["name"] in STAGE_NAMES)
        for o in containers:
            if o is c:
                continue
            osc = o.get("securityContext", {})
            if osc.get("privileged") or osc.get("allowPrivilegeEscalation") is not False \
                    or osc.get("capabilities", {}).get("drop") != ["ALL"] \
                    or any(x.get("mountPropagation") == "Bidirectional" for x in o.get("volumeMounts", [])):
                problems.append(f"{where} {o['name']}: only the stage may be privileged or propagate mounts, have {osc}")
        args = [a for a in c.get("args", []) if a.startswith("--mount")]
        sc = c.get("securityContext", {})
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = c.get("volumeMounts", [])
        fuse = [x for x in mounts if x["mountPath"] == "/dev/fuse"]
        bidir = [x for x in mounts if x.get("mountPropagation") == "Bidirectional"]
        if not on:
            if args or fuse or bidir or {"mount", "mount-orders", "fuse"} & set(volumes):
                problems.append(f"{where}: mount off, yet args {args}, mounts {fuse + bidir}")
            if sc.get("privileged") or "runAsUser" in sc or "runAsNonRoot" in sc \
                    or sc.get("capabilities", {}).get("drop") != ["ALL"]:
                problems.append(f"{where}: mount off, yet the stage runs with {sc}")
            continue
        job = [f"--mount-job={m['job']}"] if m["job"] else []
        if obj["kind"] == "DaemonSet":
            mount_dir = posixpath.normpath(m["hostPath"])
            parent = posixpath.dirname(mount_dir)
            orders = posixpath.normpath(m["orders"]["hostPath"]) if m["orders"]["hostPath"] else ""
            want_args = [f"--mount={mount_dir}"] + job + ([f"--mount-orders={orders}"] if orders else [])
            want_volume = {"hostPath": {"path": parent, "type": "DirectoryOrCreate"}}
        else:
            mount_dir, parent, orders = SIDECAR_MOUNT_DIR, SIDECAR_MOUNT_VOLUME, ""
            want_args = [f"--mount={mount_dir}"] + job
            want_volume = {"emptyDir": {"sizeLimit": "1Mi"}}
        if args != want_args:
            problems.append(f"{where}: mount flags {args}, want {want_args}")
        if len(bidir) != 1 or bidir[0]["mountPath"] != parent or bidir[0].get("readOnly"):
            problems.append(f"{where}: want one writable Bidirectional mount at {parent}, have {bidir}")
            continue
        volume = {k: v for k, v in volumes[bidir[0]["name"]].items() if k != "name"}
        if volume != want_volume:
            problems.append(f"{where}: the mount's volume is {volume}, want {want_volume}")
        separate = bool(orders) and not orders.startswith(parent + "/")
        orders_mounts = [x for x in mounts if orders and x["mountPath"] == orders]
        if separate != bool(orders_mounts) or any(x.get("mountPropagation") or x.get("readOnly")
                                                    for x in orders_mounts):
            problems.append(f"{where}: order files {orders!r} mounted as {orders_mounts}")
        for x in orders_mounts:
            v = volumes[x["name"]]
            if v.get("hostPath") != {"path": orders, "type": "DirectoryOrCreate"}:
                problems.append(f"{where}: the order files' volume is {v}")
        if len(fuse) != 1 or volumes[fuse[0]["name"]].get("hostPath") != {"path": "/dev/fuse", "type": "CharDevice"}:
            problems.append(f"{where}: want /dev/fuse from a CharDevice hostPath, have {fuse}")
        want_sc = {"privileged": True, "runAsUser": 0, "runAsNonRoot": False, "readOnlyRootFilesystem": True}
        if {k: sc.get(k) for k in want_sc} != want_sc or sc.get("allowPrivilegeEscalation") is False \
                or "capabilities" in sc:
            problems.append(f"{where}: the stage runs with {sc}, want {want_sc} (escalation not refused, no capabilities)")
        if not pod.get("securityContext", {}).get("runAsNonRoot"):
            problems.append(f"{where}: the pod's runAsNonRoot is gone; override the stage container only")
        if obj["kind"] == "Job":
            trainer = next(t for t in pod["containers"] if t["name"] == "trainer")
            seen = [x for x in trainer.get("volumeMounts", []) if x["name"] == bidir[0]["name"]]
            if [(x["mountPath"], x.get("mountPropagation")) for x in seen] != [(parent, "HostToContainer")]:
                problems.append(f"{where}: the trainer mounts the shared volume as {seen}, want {parent} HostToContainer")
            env = {e["name"]: e.get("value") for e in trainer.get("env", [])}
            if env.get("SLUICE_MOUNT_DIR") != mount_dir:
                problems.append(f"{where}: the trainer's SLUICE_MOUNT_DIR is {env.get('SLUICE_MOUNT_DIR')!r}, want {mount_dir}")
        inits = pod.get("initContainers", [])
        before = inits[: inits.index(c)] if c in inits else inits
        makers = [i for i in before if any(x["name"] == bidir[0]["name"] for x in i.get("volumeMounts", []))]
        if len(makers) != 1:
            problems.append(f"{where}: want one init container before the stage creating {mount_dir}, have {makers}")
            continue
        pod_sc = pod.get("securityContext", {})
        problems += run_mount_maker(where, makers[0], parent, mount_dir, orders if separate else "",
                                    orders, (pod_sc.get("runAsUser", 0), pod_sc.get("runAsGroup", 0)))
    record(f"{scenario}: mount wiring", not problems, "; ".join(problems))


def run_mount_maker(where: str, init: dict, parent: str, mount_dir: str, orders_volume: str,
                    orders: str, owner: tuple[int, int]) -> list[str]:
    """Runs the init container's script twice (the second time everything
    exists) on directories standing for the mount's parent and the order
    files' directory (as root, like the container; skipped otherwise): the
    mount directory must exist, the order files' one be owned by `owner`
    with mode 2770."""
    cmd = init.get("command", [])
    if cmd[:2] != ["/bin/sh", "-c"] or len(cmd) != 3 or not isinstance(cmd[2], str):
        return [f"{where}: init container {init['name']} command {cmd}, want /bin/sh -c SCRIPT"]
    if os.geteuid() != 0:
        print(f"skip {where}: running the mount directory's init script (needs root)")
        return []
    out = []
    with tempfile.TemporaryDirectory(prefix="sluice-mount-") as d:
        script = cmd[2]
        if orders_volume:
            os.mkdir(f"{d}/orders")
            script = script.replace(orders_volume, f"{d}/orders")
        script = script.replace(parent + "/", f"{d}/parent/")
        os.mkdir(f"{d}/parent")
        for attempt in (1, 2):
            proc = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True)
            if proc.returncode != 0:
                out.append(f"{where}: init script failed (run {attempt}): {(proc.stdout + proc.stderr).strip()}")
        made = f"{d}/parent/{posixpath.relpath(mount_dir, parent)}"
        if not os.path.isdir(made):
            out.append(f"{where}: the init script did not create {mount_dir}")
        if orders:
            o = f"{d}/orders" if orders_volume else f"{d}/parent/{posixpath.relpath(orders, parent)}"
            st = os.stat(o) if os.path.isdir(o) else None
            if st is None or (st.st_uid, st.st_gid) != owner or st.st_mode & 0o7777 != 0o2770:
                out.append(f"{where}: after the init script the order files' directory is "
                           f"{st and (st.st_uid, st.st_gid, oct(st.st_mode & 0o7777))}, want {owner} 2770")
    return out


def run_cache_fixer(where: str, init: dict, uid: int, gid: int, group: int) -> list[str]:
    """Runs the init container's script on a directory a stage of another
    user left (0750, as the script set it then), as the container runs it:
    root in the pod's `group`, with only the capabilities it adds (needs
    root and setpriv; skipped otherwise). All must end up the stage's, the
    directory with mode 0750."""
    cmd = init.get("command", [])
    if cmd[:2] != ["/bin/sh", "-c"] or len(cmd) != 3 or CACHE_DIR not in cmd[2]:
        return [f"{where}: init container {init['name']} command {cmd}, want /bin/sh -c on {CACHE_DIR}"]
    if os.geteuid() != 0:
        print(f"skip {where}: running the cache directory's init script (needs root)")
        return []
    security = init.get("securityContext", {}).get("capabilities", {})
    if "ALL" not in security.get("drop", []):
        return [f"{where}: init container {init['name']} keeps capabilities it does not list (drop ALL)"]
    if not shutil.which("setpriv"):
        print(f"skip {where}: running the cache directory's init script (needs setpriv)")
        return []
    bounding = "-all" + "".join(f",+{c.lower()}" for c in security.get("add", []))
    with tempfile.TemporaryDirectory(prefix="sluice-cache-") as base:
        os.chmod(base, 0o711)
        d = os.path.join(base, "cache")
        sub = Path(d) / "ab"
        sub.mkdir(parents=True)
        (sub / "sample").write_bytes(b"x")
        for path in (d, sub, sub / "sample"):
            os.chown(path, 4242, 4242)
        os.chmod(d, 0o750)
        proc = subprocess.run(["setpriv", "--reuid=0", f"--regid={group}", "--clear-groups",
                               f"--bounding-set={bounding}", "--inh-caps=-all",
                               "/bin/sh", "-c", cmd[2].replace(CACHE_DIR, d)], capture_output=True, text=True)
        if proc.returncode != 0:
            return [f"{where}: init script failed: {(proc.stdout + proc.stderr).strip()}"]
        owners = {str(p): (os.stat(p).st_uid, os.stat(p).st_gid) for p in (d, sub, sub / "sample")}
        wrong = {p: o for p, o in owners.items() if o != (uid, gid)}
        mode = os.stat(d).st_mode & 0o7777
        out = [f"{where}: after the init script {p} is owned by {o}, want {(uid, gid)}" for p, o in wrong.items()]
        if mode != 0o750:
            out.append(f"{where}: after the init script the directory has mode {mode:o}, want 750")
        return out


def documented_values() -> None:
    """Every value has a `# --` comment (on itself or a parent) in values.yaml
    and a row in the chart's README."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented, stack, pending = set(), [], False
    for line in lines:
        s = line.strip()
        if s.startswith("# -- "):
            pending = True
            continue
        if s.startswith("#") or not s:
            continue
        m = re.match(r"^( *)([A-Za-z0-9_]+):", line)
        if not m or s.startswith("- "):
            pending = False
            continue
        stack = stack[: len(m.group(1)) // 2] + [m.group(2)]
        if pending:
            documented.add(".".join(stack))
        pending = False
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def leaves(v, path):
        if isinstance(v, dict) and v:
            for k, sub in v.items():
                yield from leaves(sub, path + [k])
        else:
            yield ".".join(path)

    undocumented = [p for p in leaves(values, [])
                    if not any(p == d or p.startswith(d + ".") for d in documented)]
    record("values.yaml: every value has a comment", not undocumented,
           ", ".join(undocumented))
    readme = (CHART / "README.md").read_text()
    missing = sorted(d for d in documented if f"| `{d}` |" not in readme)
    record("README.md: every value in the table", not missing, ", ".join(missing))


def main() -> int:
    print(f"helm {helm.helm_sdk_version()} (helm-python-sdk {helm.__version__}), chart {CHART}")
    with tempfile.TemporaryDirectory(prefix="sluice-helm-") as tmp:
        for scenario, file in SCENARIOS.items():
            values = load_values(file)
            try:
                manifests = render(values)
            except helm.HelmError as e:
                record(f"{scenario}: render", False, str(e))
                continue
            objs = objects(manifests)
            record(f"{scenario}: render ({len(objs)} objects)", bool(objs), "nothing rendered")
            lint(scenario, values)
            kube_validate(scenario, objs, Path(tmp))
            crd_validate(scenario, objs)
            policies_validate(scenario, objs, Path(tmp))
            properties(scenario, objs, values)
            auth_wiring(scenario, objs, values)
            cache_wiring(scenario, objs, values)
            mount_wiring(scenario, objs, values)
            tls_wiring(scenario, objs, values)
            if ((values or {}).get("tls") or {}).get("enabled"):
                tls_files_readable(scenario, objs)
    for scenario, values in AUTH_VARIANTS.items():
        auth_wiring(scenario, objects(render(values)), values)
    for scenario, values in CACHE_VARIANTS.items():
        cache_wiring(scenario, objects(render(values)), values)
    for scenario, values in MOUNT_VARIANTS.items():
        objs = objects(render(values))
        properties(scenario, objs, values)
        mount_wiring(scenario, objs, values)
    for scenario, values in TLS_VARIANTS.items():
        values = {**values, "tls": TLS_BASE, "sidecar": {"exampleJob": {"enabled": True}}}
        objs = objects(render(values))
        properties(scenario, objs, values)
        tls_files_readable(scenario, objs)
    stage_config_wiring()
    limits_rendering()
    memory_limits_accepted()
    standalone_alerts()
    names_and_admin_port()
    documented_names()
    documented_values()
    for name, (values, message) in MUST_FAIL.items():
        try:
            render(values)
            record(f"refused: {name}", False, "rendered without an error")
        except helm.HelmError as e:
            record(f"refused: {name}", message in str(e), f"unexpected error: {e}")
    failed = sum(1 for _, ok, _ in results if not ok)
    print(f"helm checks: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
