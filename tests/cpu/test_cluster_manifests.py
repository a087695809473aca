"""KubeRay manifests: build the kustomize overlays (the subset of kustomize they use), then validate
every object (RayService / ComputeDomain against their vendored CRD schemas in tests/data/schemas,
see SOURCES.md; core kinds against the `kubernetes` client's models) with unknown fields rejected
as `kubectl apply --validate=strict` would, and check the cross-references between objects."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
SCHEMAS = REPO / "tests" / "data" / "schemas"
CRDS = {("ray.io/v1", "RayService"): "kuberay-v1.7.0-rayservice-v1.json",
        ("ray.io/v1", "RayCluster"): "kuberay-v1.7.0-raycluster-v1.json",
        ("resource.nvidia.com/v1beta1", "ComputeDomain"):
            "dra-driver-gpu-v0.4.0-computedomain-v1beta1.json"}
CORE = {("v1", "Namespace"): "V1Namespace", ("v1", "ServiceAccount"): "V1ServiceAccount",
        ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
        ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy"}
TRAYS_PER_RACK = 18


# ------------------------------------------------------------------ kustomize (the subset used)

def _json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 replace/add/remove on a copy."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~")
                          for p in op["path"].lstrip("/").split("/")]
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        key = int(last) if isinstance(node, list) else last
        if op["op"] == "replace":
            assert key in node if isinstance(node, dict) else key < len(node), op["path"]
            node[key] = op["value"]
        elif op["op"] == "add":
            node.insert(key, op["value"]) if isinstance(node, list) else \
                node.__setitem__(key, op["value"])
        elif op["op"] == "remove":
            del node[key]
        else:
            raise AssertionError(f"JSON-patch op {op['op']!r} not modelled here")
    return doc


def kustomize_build(d: Path) -> list[dict]:
    k = yaml.safe_load((d / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "resources", "patches"}
    assert not unknown, f"{d}: kustomization fields {unknown} are not modelled by this test"
    objs: list[dict] = []
    for r in k.get("resources", []):
        p = (d / r).resolve()
        objs += kustomize_build(p) if p.is_dir() else \
            [o for o in yaml.safe_load_all(p.read_text()) if o]
    for patch in k.get("patches", []):
        t = patch["target"]
        ops = yaml.safe_load((d / patch["path"]).read_text()) if "path" in patch else \
            yaml.safe_load(patch["patch"])
        hits = [i for i, o in enumerate(objs) if o["kind"] == t["kind"]
                and o["metadata"]["name"] == t["name"]
                and o["apiVersion"] == f"{t['group']}/{t['version']}"]
        assert len(hits) == 1, f"{d}: patch target {t} matches {len(hits)} objects"
        objs[hits[0]] = _json_patch(objs[hits[0]], ops)
    return objs


# ------------------------------------------------------------------ validators

def _strict_unknown_fields(obj, schema, path="") -> list[str]:
    """Fields the schema does not declare (the API server would reject them under strict field
    validation instead of pruning them)."""
    errs = []
    if isinstance(obj, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
            for k, v in obj.items():
                if k in props:
                    errs += _strict_unknown_fields(v, props[k], f"{path}.{k}")
                elif not extra:
                    errs.append(f"{path}.{k}: unknown field")
        elif isinstance(extra, dict):
            for k, v in obj.items():
                errs += _strict_unknown_fields(v, extra, f"{path}.{k}")
    elif isinstance(obj, list) and "items" in schema:
        for i, v in enumerate(obj):
            errs += _strict_unknown_fields(v, schema["items"], f"{path}[{i}]")
    return errs


def _model_errors(data, type_name: str, path: str) -> list[str]:
    """Check a dict against a kubernetes client model type ('V1PodSpec', 'List[V1Volume]',
    'Dict[str, str]', 'str', ...): unknown keys and wrong scalar types."""
    import kubernetes.client as kc
    m = re.fullmatch(r"[Ll]ist\[(.+)\]", type_name)
    if m:
        if not isinstance(data, list):
            return [f"{path}: expected a list"]
        return [e for i, v in enumerate(data) for e in _model_errors(v, m.group(1), f"{path}[{i}]")]
    m = re.fullmatch(r"[Dd]ict[\[(](.+), (.+)[\])]", type_name)
    if m:
        if not isinstance(data, dict):
            return [f"{path}: expected a map"]
        return [e for k, v in data.items() for e in _model_errors(v, m.group(2), f"{path}.{k}")]
    scalar = {"str": str, "int": int, "bool": bool, "float": (int, float)}
    if type_name in scalar:
        ok = isinstance(data, scalar[type_name]) and not (type_name == "int" and
                                                          isinstance(data, bool))
        return [] if ok else [f"{path}: expected {type_name}, got {data!r}"]
    if type_name in ("object", "datetime"):
        return []
    cls = getattr(kc, type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected an object ({type_name})"]
    by_json = {j: py for py, j in cls.attribute_map.items()}
    errs = []
    for k, v in data.items():
        if k not in by_json:
            errs.append(f"{path}.{k}: unknown field of {type_name}")
        else:
            errs += _model_errors(v, cls.openapi_types[by_json[k]], f"{path}.{k}")
    return errs


def validate(obj: dict) -> list[str]:
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRDS:
        doc = json.loads((SCHEMAS / CRDS[key]).read_text())
        schema = doc["openAPIV3Schema"]
        errs = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]
        errs += _strict_unknown_fields(obj, schema)
        errs += _model_errors(obj.get("metadata", {}), "V1ObjectMeta", ".metadata")
        return errs
    if key in CORE:
        from kubernetes.client import ApiClient
        errs = _model_errors({k: v for k, v in obj.items()}, CORE[key], "")
        try:   # required fields (the model constructors check them)
            ApiClient()._ApiClient__deserialize(obj, CORE[key])
        except ValueError as e:
            errs.append(str(e))
        return errs
    return [f"no schema for {key}: vendor one under tests/data/schemas"]


# ------------------------------------------------------------------ tests

@pytest.fixture(scope="module", params=["base", "overlays/tp8", "overlays/tp16"])
def build(request):
    return request.param, kustomize_build(MANIFESTS / request.param)


def _one(objs, kind):
    hits = [o for o in objs if o["kind"] == kind]
    assert len(hits) == 1, kind
    return hits[0]


def test_every_object_validates_against_its_schema(build):
    name, objs = build
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ComputeDomain", "Namespace",
                     "NetworkPolicy", "RayService", "ServiceAccount"]
    for o in objs:
        assert validate(o) == [], f"{name}: {o['kind']} {o['metadata']['name']}"


def test_worker_pod_template_is_a_valid_pod_spec(build):
    _, objs = build
    rs = _one(objs, "RayService")["spec"]["rayClusterConfig"]
    for i, grp in enumerate(rs["workerGroupSpecs"]):
        assert _model_errors(grp["template"], "V1PodTemplateSpec", f"worker[{i}]") == []
    assert _model_errors(rs["headGroupSpec"]["template"], "V1PodTemplateSpec", "head") == []


def test_serve_config_and_tp_match_the_worker_groups(build):
    from ray.serve.schema import ServeDeploySchema

    from raydecode.cluster.placement import PlacementOptions

    name, objs = build
    spec = _one(objs, "RayService")["spec"]
    serve = ServeDeploySchema.model_validate(yaml.safe_load(spec["serveConfigV2"]))
    (app,) = serve.applications
    assert app.import_path == "raydecode.actors.serve:build_app"
    cfg = app.args["config"]
    tp = cfg["tensor_parallel_size"]
    assert tp == {"overlays/tp8": 8}.get(name, 16)
    assert tp % cfg["decode_context_parallel_size"] == 0
    PlacementOptions(**cfg["placement"])               # the embedded block is accepted as is
    for grp in spec["rayClusterConfig"]["workerGroupSpecs"]:
        gpus = int(grp["template"]["spec"]["containers"][0]["resources"]["limits"]
                   ["nvidia.com/gpu"])
        assert gpus * grp["numOfHosts"] == tp           # one replica = one TP group
        assert grp["replicas"] * grp["numOfHosts"] <= TRAYS_PER_RACK
        assert grp["minReplicas"] == grp["replicas"] == grp["maxReplicas"]
        assert "labels" not in grp["rayStartParams"]    # KubeRay rejects it: labels-file instead


def test_clique_affinity_imex_claim_and_label_init_container(build):
    _, objs = build
    rs = _one(objs, "RayService")
    cd = _one(objs, "ComputeDomain")
    sa = _one(objs, "ServiceAccount")
    role, binding = _one(objs, "ClusterRole"), _one(objs, "ClusterRoleBinding")
    for grp in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        pod = grp["template"]
        spec = pod["spec"]
        (term,) = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "nvidia.com/gpu.clique"
        assert term["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        claims = {c["name"]: c for c in spec["resourceClaims"]}
        assert claims["imex-channel"]["resourceClaimTemplateName"] == \
            cd["spec"]["channel"]["resourceClaimTemplate"]["name"]
        ray_c = spec["containers"][0]
        assert [c["name"] for c in ray_c["resources"]["claims"]] == ["imex-channel"]
        # the init container writes the file that `ray start --labels-file` reads
        (init,) = spec["initContainers"]
        assert "raydecode node-labels --source k8s --format yaml" in " ".join(init["args"])
        labels_file = grp["rayStartParams"]["labels-file"]
        mounts = {m["name"]: m["mountPath"] for m in ray_c["volumeMounts"]}
        init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        shared = [n for n in init_mounts if labels_file.startswith(init_mounts[n] + "/")]
        assert shared and mounts[shared[0]] == init_mounts[shared[0]]
        assert labels_file in " ".join(init["args"])
        assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} \
            in init["env"]
        # RBAC: the pod's service account may read nodes
        assert spec["serviceAccountName"] == sa["metadata"]["name"]
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]} in role["rules"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": sa["metadata"]["name"],
            "namespace": sa["metadata"]["namespace"]} in binding["subjects"]


def test_workers_kernel_cache_is_pod_private(build):
    """Every worker's RAYDECODE_KERNEL_CACHE is a mounted node-local directory of its own pod
    (kernels/aot.py: the first rank compiles, the others load; flock needs local disk), never a
    hostPath: ranks load compiled code from it, so no other pod may be able to write it."""
    _, objs = build
    for grp in _one(objs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        spec = grp["template"]["spec"]
        ray_c = spec["containers"][0]
        env = {e["name"]: e.get("value") for e in ray_c["env"]}
        path = env["RAYDECODE_KERNEL_CACHE"]
        (mount,) = [m for m in ray_c["volumeMounts"] if m["mountPath"] == path]
        assert not mount.get("readOnly")
        (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert "emptyDir" in vol and "medium" not in vol["emptyDir"], vol
    assert not [v for o in objs for v in _pod_specs(o) for v in v.get("volumes", [])
                if "hostPath" in v]


# ------------------------------------------------------------------ control surfaces

def _pod_specs(obj: dict) -> list[dict]:
    if obj["kind"] != "RayService":
        return []
    rc = obj["spec"]["rayClusterConfig"]
    return [rc["headGroupSpec"]["template"]["spec"]] + \
        [g["template"]["spec"] for g in rc["workerGroupSpecs"]]


def _templates(objs) -> list[dict]:
    rc = _one(objs, "RayService")["spec"]["rayClusterConfig"]
    return [rc["headGroupSpec"]["template"]] + [g["template"] for g in rc["workerGroupSpecs"]]


def test_ray_starts_with_token_auth_from_a_secret(build):
    """CVE-2023-48022: every Ray container (head, workers) has RAY_AUTH_MODE=token and its
    token from the Secret that authOptions names (the operator's dashboard client reads it)."""
    _, objs = build
    rc = _one(objs, "RayService")["spec"]["rayClusterConfig"]
    assert rc["authOptions"]["mode"] == "token"
    secret = rc["authOptions"]["secretName"]
    for spec in _pod_specs(_one(objs, "RayService")):
        ray_c = spec["containers"][0]
        env = {e["name"]: e for e in ray_c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", ray_c["name"]
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret, "key": "auth_token"}, ray_c["name"]
        assert "value" not in env["RAY_AUTH_TOKEN"]            # never a literal token


def test_head_declares_no_ray_client_port(build):
    _, objs = build
    head = _one(objs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {6379, 8265, 8000}


def test_every_container_is_non_root_without_privileges(build):
    _, objs = build
    for spec in _pod_specs(_one(objs, "RayService")):
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True and pod_sc.get("runAsUser", 0) != 0
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, c["name"]
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
            assert not sc.get("privileged") and "add" not in sc.get("capabilities", {})
            assert sc.get("runAsUser", pod_sc["runAsUser"]) != 0
        for c in spec.get("initContainers", []) + \
                [c for c in spec["containers"] if c["name"] == "ray-head"]:
            assert c["securityContext"].get("readOnlyRootFilesystem") is True, c["name"]


def test_init_containers_have_resource_limits(build):
    _, objs = build
    for spec in _pod_specs(_one(objs, "RayService")):
        for c in spec.get("initContainers", []):
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]


SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def test_node_reader_token_reaches_the_init_container_only(build):
    _, objs = build
    for grp in _one(objs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        spec = grp["template"]["spec"]
        assert spec["serviceAccountName"] == "raydecode-node-reader"
        assert spec["automountServiceAccountToken"] is False
        (init,) = spec["initContainers"]
        (mount,) = [m for m in init["volumeMounts"] if m["mountPath"] == SA_PATH]
        (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert any("serviceAccountToken" in s for s in vol["projected"]["sources"])
        for c in spec["containers"]:
            assert all(m["name"] != mount["name"] and not m["mountPath"].startswith(SA_PATH)
                       for m in c.get("volumeMounts", [])), c["name"]
    head = _one(objs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["template"]["spec"]["automountServiceAccountToken"] is False


def test_network_policy_admits_only_serve_from_outside(build):
    """Every ingress rule is one of: from the replica's own pods (Ray's internal ports), the
    Serve port 8000 from anywhere, the dashboard 8265 from the operator's namespace only."""
    _, objs = build
    np = _one(objs, "NetworkPolicy")
    rs = _one(objs, "RayService")
    assert np["metadata"]["namespace"] == rs["metadata"]["namespace"]
    sel = np["spec"]["podSelector"]["matchLabels"]
    for tpl in _templates(objs):                      # the policy covers every Ray pod
        assert sel.items() <= tpl["metadata"]["labels"].items()
    assert np["spec"]["policyTypes"] == ["Ingress"]
    kinds = set()
    for rule in np["spec"]["ingress"]:
        ports = [(p.get("protocol", "TCP"), p["port"]) for p in rule.get("ports", [])]
        src = rule.get("from")
        if src == [{"podSelector": {"matchLabels": sel}}] and not ports:
            kinds.add("own pods")
        elif src is None and ports == [("TCP", 8000)]:
            kinds.add("serve")
        elif src and all(set(s) == {"namespaceSelector"} for s in src) and \
                ports == [("TCP", 8265)]:
            kinds.add("operator")
        else:
            raise AssertionError(f"ingress rule admits more than the Serve port: {rule}")
    assert kinds == {"own pods", "serve", "operator"}


def test_validators_catch_typos_and_wrong_types():
    objs = kustomize_build(MANIFESTS / "base")
    rs = copy.deepcopy(_one(objs, "RayService"))
    grp = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    grp["numOfHost"] = grp.pop("numOfHosts")                       # typo
    grp["template"]["spec"]["containers"][0]["resources"]["claims"][0]["nam"] = "x"
    errs = validate(rs)
    assert any("numOfHost: unknown field" in e for e in errs)
    assert any(".nam: unknown field" in e for e in errs)
    rs2 = copy.deepcopy(_one(objs, "RayService"))
    rs2["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "four"
    assert any("is not of type 'integer'" in e for e in validate(rs2))
    cd = copy.deepcopy(_one(objs, "ComputeDomain"))
    cd["spec"]["channel"]["allocationMode"] = "Many"
    assert any("is not one of ['All', 'Single']" in e for e in validate(cd))
    role = copy.deepcopy(_one(objs, "ClusterRole"))
    role["rules"][0]["verb"] = role["rules"][0].pop("verbs")
    assert any("verb: unknown field" in e for e in validate(role))
