"""Per-GPU NVLink-fabric facts of one node: the data model, its JSON form, and live collection.

Collection and judgement are separate: `collect_node_facts()` reads NVML, the CUDA driver and the
Kubernetes node label; `verify.py` and `labels.py` judge `NodeFacts` only, so tests feed recorded
JSON (the output of `raydecode topology --json`).

JSON shape (field names are a contract, extras may be added):
    {"node": str, "k8s_clique": str|null, "notes": [str],
     "gpus": [{"index": int, "uuid": str, "name": str,
               "fabric": {"cluster_uuid": str, "clique_id": int, "state": FabricState,
                          "status": "SUCCESS"|str, "health": FabricHealth},
               "multicast_supported": bool, "fabric_handle_supported": bool,
               "nvlinks_up": int, "nvlinks_total": int, "notes": [str]}]}

NVLink domain identity = (cluster_uuid, clique_id), written `<cluster_uuid>.<clique_id>`: the
same string NVIDIA's GPU feature discovery puts in the node label `nvidia.com/gpu.clique`. An
all-zero cluster UUID means the GPU is NVLink-capable but not attached to a multi-node fabric.
"""
from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import asdict, dataclass
from typing import Any

FABRIC_STATES = ("COMPLETED", "IN_PROGRESS", "NOT_STARTED", "NOT_SUPPORTED")
FABRIC_HEALTH = ("HEALTHY", "UNHEALTHY", "LIMITED_CAPACITY", "UNKNOWN")
ZERO_UUID = str(uuid.UUID(int=0))
K8S_CLIQUE_LABEL = "nvidia.com/gpu.clique"


class FactsError(ValueError):
    """Topology facts (a JSON file or dict) that do not have the documented shape."""


@dataclass(frozen=True)
class FabricInfo:
    """NVML GPU fabric info: domain identity, registration state/status, health summary."""

    cluster_uuid: str = ZERO_UUID
    clique_id: int = 0
    state: str = "NOT_SUPPORTED"
    status: str = "SUCCESS"
    health: str = "UNKNOWN"

    @property
    def domain(self) -> str:
        """`<cluster_uuid>.<clique_id>`: the NVLink-domain id (also the k8s clique label value)."""
        return f"{self.cluster_uuid}.{self.clique_id}"

    @property
    def attached(self) -> bool:
        return self.state == "COMPLETED" and self.cluster_uuid != ZERO_UUID


@dataclass(frozen=True)
class GpuFacts:
    """One GPU's fabric facts (the module docstring has the JSON shape)."""

    index: int
    uuid: str
    name: str
    fabric: FabricInfo
    multicast_supported: bool
    fabric_handle_supported: bool
    nvlinks_up: int
    nvlinks_total: int
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeFacts:
    """One node's GPUs plus its Kubernetes clique label, if it runs under Kubernetes."""

    node: str
    gpus: tuple[GpuFacts, ...]
    k8s_clique: str | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpus"] = [dict(g, notes=list(g["notes"])) for g in d["gpus"]]
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "facts") -> "NodeFacts":
        """Parse the JSON form; raises FactsError naming the offending field."""
        if not isinstance(d, dict):
            raise FactsError(f"{where}: expected an object with 'node' and 'gpus', got "
                             f"{type(d).__name__}")
        node = _req(d, "node", str, where)
        gpus_raw = _req(d, "gpus", list, where)
        gpus = tuple(_gpu_from_dict(g, f"{where}: gpus[{i}]") for i, g in enumerate(gpus_raw))
        seen = [g.index for g in gpus]
        if len(set(seen)) != len(seen):
            raise FactsError(f"{where}: duplicate GPU indices {seen}")
        clique = d.get("k8s_clique")
        if clique is not None and not isinstance(clique, str):
            raise FactsError(f"{where}: k8s_clique must be a string or null, got {clique!r}")
        return cls(node=node, gpus=gpus, k8s_clique=clique, notes=tuple(d.get("notes", ())))


def _req(d: dict, key: str, typ: type | tuple, where: str) -> Any:
    if key not in d:
        raise FactsError(f"{where}: missing field '{key}'")
    v = d[key]
    # bool is an int subclass; never accept it where an int is meant
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        name = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise FactsError(f"{where}: field '{key}' must be {name}, got {v!r}")
    return v


def _gpu_from_dict(g: Any, where: str) -> GpuFacts:
    if not isinstance(g, dict):
        raise FactsError(f"{where}: expected an object, got {type(g).__name__}")
    f = _req(g, "fabric", dict, where)
    fw = f"{where}.fabric"
    fabric = FabricInfo(cluster_uuid=_req(f, "cluster_uuid", str, fw),
                        clique_id=_req(f, "clique_id", int, fw),
                        state=_req(f, "state", str, fw), status=_req(f, "status", str, fw),
                        health=_req(f, "health", str, fw))
    if fabric.state not in FABRIC_STATES:
        raise FactsError(f"{fw}: state {fabric.state!r} is not one of {FABRIC_STATES}")
    if fabric.health not in FABRIC_HEALTH:
        raise FactsError(f"{fw}: health {fabric.health!r} is not one of {FABRIC_HEALTH}")
    up, total = _req(g, "nvlinks_up", int, where), _req(g, "nvlinks_total", int, where)
    if not 0 <= up <= total:
        raise FactsError(f"{where}: need 0 <= nvlinks_up ({up}) <= nvlinks_total ({total})")
    return GpuFacts(index=_req(g, "index", int, where), uuid=_req(g, "uuid", str, where),
                    name=_req(g, "name", str, where), fabric=fabric,
                    multicast_supported=_req(g, "multicast_supported", bool, where),
                    fabric_handle_supported=_req(g, "fabric_handle_supported", bool, where),
                    nvlinks_up=up, nvlinks_total=total, notes=tuple(g.get("notes", ())))


def accelerator_type(gpu_name: str) -> str | None:
    """Ray's `ray.io/accelerator-type` value for an NVML GPU name: the model token after the vendor
    ("NVIDIA GB300" -> "GB300", "NVIDIA H100 80GB HBM3" -> "H100", "NVIDIA RTX PRO 6000 ..." ->
    "RTX-PRO-6000"). Agrees with what `ray start` sets by itself, so `--labels` never fights it."""
    words = gpu_name.split()
    prefix: list[str] = []
    for w in words[1:]:                       # the first word is the vendor
        m = re.match(r"[A-Z0-9]*\d[A-Z0-9]*", w)  # the first word with a digit is the model
        if m:
            token = "-".join(prefix + [m.group(0)])
            if len(token) > 1:
                return token
            break
        if not re.fullmatch(r"[A-Z]+", w):    # mixed case ("GeForce"): no model token
            break
        prefix.append(w)
    cleaned = re.sub(r"^NVIDIA\s+", "", gpu_name).strip()
    return cleaned.replace(" ", "-") or None


# ---------------------------------------------------------------- live collection (NVML, CUDA, k8s)

def collect_node_facts(node: str | None = None, *, k8s: bool = True) -> NodeFacts:
    """Read this node's facts. Never raises for a missing driver / library / cluster: each gap
    becomes a note, and a node without NVIDIA GPUs yields an empty GPU list."""
    node = node or os.environ.get("NODE_NAME") or socket.gethostname()
    notes: list[str] = []
    gpus: tuple[GpuFacts, ...] = ()
    try:
        import pynvml
    except ImportError:
        notes.append("nvidia-ml-py (pynvml) is not installed: no GPU facts")
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            notes.append(f"NVML unavailable ({e}): no NVIDIA driver here, so no GPUs listed")
        else:
            try:
                from raydecode.cluster import nvml_read
                cuda = nvml_read.CudaDriver.open()
                if cuda.error:
                    notes.append(f"CUDA driver attributes unavailable ({cuda.error}); "
                                 "multicast/fabric-handle support reported as false")
                gpus = tuple(nvml_read.gpu_facts(pynvml, i, cuda)
                             for i in range(pynvml.nvmlDeviceGetCount()))
            finally:
                pynvml.nvmlShutdown()
    clique = None
    if k8s:
        from raydecode.cluster import kube
        clique, note = kube.node_label(node, K8S_CLIQUE_LABEL)
        if note:
            notes.append(note)
    return NodeFacts(node=node, gpus=gpus, k8s_clique=clique, notes=tuple(notes))


def format_cluster_uuid(raw: bytes) -> str:
    return str(uuid.UUID(bytes=bytes(raw)))

