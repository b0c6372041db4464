"""The cluster manifests in infra/ parse, and name what a deployment needs: the image, the
entrypoint, the store and the device-class resources the farm routes units by."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from workers.backends import offered_resources

INFRA = Path(__file__).resolve().parents[1] / "infra"


def _docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((INFRA / "kuberay" / name).read_text()))


def _ray_resources(group: dict) -> dict[str, float]:
    return json.loads(json.loads(group["rayStartParams"]["resources"]))  # KubeRay's quoted JSON string


def test_raycluster_worker_groups_declare_the_farms_device_classes(monkeypatch):
    from workers.backends import cpu_isa

    monkeypatch.setattr(cpu_isa, "host_vec_isas", lambda: {"avx2", "avx512"})  # the group's c7i nodes, not this host
    (cluster,) = _docs("raycluster.yaml")
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    cpu, gpu = _ray_resources(groups["cpu-avx512"]), _ray_resources(groups["gpu-h100"])
    assert set(cpu) == set(offered_resources(1))  # every CPU class an AVX-512 node can build
    assert {"farm_cuda", "farm_cuda_sm90"} <= set(gpu) and groups["gpu-h100"]["rayStartParams"]["num-gpus"] == "1"
    images = {c["image"] for g in groups.values() for c in g["template"]["spec"]["containers"]}
    assert images == {"ghcr.io/pt2-farm/farm:cpu", "ghcr.io/pt2-farm/farm:cuda"}
    for g in groups.values():  # credentials come from a Secret, never inline
        (container,) = g["template"]["spec"]["containers"]
        assert container["envFrom"] == [{"secretRef": {"name": "farm-s3"}}]
        assert not any(re.search("SECRET|KEY|TOKEN", e["name"]) for e in container.get("env", []))


def test_nightly_rayjob_runs_the_suite_against_s3_and_a_cronjob_starts_it():
    (job,) = _docs("rayjob-nightly.yaml")
    assert job["kind"] == "RayJob" and job["spec"]["clusterSelector"] == {"ray.io/cluster": "farm"}
    entry = job["spec"]["entrypoint"].split()
    assert entry[:3] == ["farm", "zoo", "run"] and entry[entry.index("--store") + 1].startswith("s3://")
    assert entry[entry.index("--suite") + 1] == "nightly"
    assert job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["image"] == "ghcr.io/pt2-farm/farm:cpu"
    cron, *rbac = _docs("cronjob-nightly.yaml")
    assert cron["kind"] == "CronJob" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert len(cron["spec"]["schedule"].split()) == 5
    (starter,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert starter["command"][:3] == ["kubectl", "create", "-f"] and starter["command"][3].endswith("rayjob-nightly.yaml")
    (role,) = [d for d in rbac if d["kind"] == "Role"]
    assert role["rules"] == [{"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["create"]}]


def test_worker_images_install_the_pinned_torch_first_and_the_project():
    for name, extra in (("Dockerfile", ".[hf,executorch]"), ("Dockerfile.cuda", ".[gpu,hf]")):
        text = (INFRA / "image" / name).read_text()
        torch_at, project_at = text.index("torch==2.13.0"), text.index(f'"{extra}"')
        assert torch_at < project_at, name  # an unpinned torch would pull the wrong build
        assert "USER farm" in text and "TORCHINDUCTOR_CACHE_DIR=/var/cache/farm/" in text
        assert "FARM_NODE_CACHE=/var/cache/farm/" in text, name  # a restarted pod keeps its headers and host checks


def test_a_nightly_gc_rayjob_collects_the_s3_store_and_a_cronjob_starts_it():
    (job,) = _docs("rayjob-gc.yaml")
    assert job["kind"] == "RayJob" and job["spec"]["clusterSelector"] == {"ray.io/cluster": "farm"}
    entry = job["spec"]["entrypoint"].split()
    assert entry[:2] == ["farm", "gc"] and entry[entry.index("--store") + 1].startswith("s3://")
    assert float(entry[entry.index("--unused-days") + 1]) >= 1 and "--metrics" in entry
    assert job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "farm-s3"}}]
    (cron,) = _docs("cronjob-gc.yaml")
    assert cron["kind"] == "CronJob" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    (starter,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert starter["command"][:3] == ["kubectl", "create", "-f"] and starter["command"][3].endswith("rayjob-gc.yaml")
    nightly_hour = int(_docs("cronjob-nightly.yaml")[0]["spec"]["schedule"].split()[1])
    assert int(cron["spec"]["schedule"].split()[1]) > nightly_hour  # after the nightly run


def test_the_bucket_lifecycle_rules_abort_incomplete_uploads_and_expire_only_by_last_use():
    rules = {name: json.loads((INFRA / "s3" / name).read_text())["Rules"]
             for name in ("lifecycle.json", "lifecycle-without-collector.json")}
    for name, listed in rules.items():
        assert any(r.get("AbortIncompleteMultipartUpload", {}).get("DaysAfterInitiation") == 1 for r in listed), name
    expire = {r["Filter"]["Prefix"]: r["Expiration"]["Days"] for r in rules["lifecycle-without-collector.json"]
              if "Expiration" in r}
    assert expire["zoo/blobs/"] > expire["zoo/units/"]  # a unit's manifest goes before its blobs
    assert not [r for r in rules["lifecycle.json"] if r["Filter"]["Prefix"].endswith(("units/", "blobs/"))]


def test_a_job_starts_the_farm_service_on_the_cluster_with_the_nightlys_store():
    (job,) = _docs("job-serve.yaml")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["farm", "serve"] and command[command.index("--address") + 1] == "farm-head-svc:6379"
    (cluster,) = _docs("raycluster.yaml")
    assert cluster["metadata"]["name"] + "-head-svc" == command[command.index("--address") + 1].split(":")[0]
    nightly = _docs("rayjob-nightly.yaml")[0]["spec"]["entrypoint"].split()
    assert command[command.index("--store") + 1] == nightly[nightly.index("--store") + 1]  # one store, one service
    assert container["image"] == "ghcr.io/pt2-farm/farm:cpu"
    assert {"name": "farm-s3"} in [e["secretRef"] for e in container["envFrom"]]
    assert not any(re.search("SECRET|KEY|TOKEN", e["name"]) for e in container.get("env", []))
