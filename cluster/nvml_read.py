"""Live reads behind `topology.collect_node_facts`: NVML fabric info and NVLink states per GPU, and
two CUDA driver attributes through libcuda (ctypes, no extra dependency).

Runs only on a node with an NVIDIA driver; the CPU test machine exercises the "no driver" branch of
the caller. Every NVML call that a driver generation may lack degrades to a note on the GPU.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from raydecode.cluster.topology import FabricInfo, GpuFacts, format_cluster_uuid

# CUdevice_attribute values (cuda.h, CUDA >= 12.1)
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128
CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 132

_STATE_NAMES = {0: "NOT_SUPPORTED", 1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}
_SUMMARY_NAMES = {0: "UNKNOWN", 1: "HEALTHY", 2: "UNHEALTHY", 3: "LIMITED_CAPACITY"}


@dataclass
class CudaDriver:
    """libcuda handle for attribute reads; `error` says why it is unusable (then lib is None)."""
    lib: Any = None
    error: str | None = None

    @classmethod
    def open(cls) -> "CudaDriver":
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            return cls(error=f"libcuda.so.1 not loadable: {e}")
        rc = lib.cuInit(0)
        if rc != 0:
            return cls(error=f"cuInit failed with CUresult {rc}")
        return cls(lib=lib)

    def attributes(self, pci_bus_id: str) -> tuple[dict[str, int], str | None]:
        """{attribute: value} of the CUDA device at this PCI bus id (NVML's id, so the mapping is
        independent of CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER), or ({}, reason)."""
        if self.lib is None:
            return {}, self.error
        dev = ctypes.c_int()
        rc = self.lib.cuDeviceGetByPCIBusId(ctypes.byref(dev), pci_bus_id.encode())
        if rc != 0:
            return {}, f"cuDeviceGetByPCIBusId({pci_bus_id}) failed with CUresult {rc} " \
                       "(GPU hidden by CUDA_VISIBLE_DEVICES?)"
        out = {}
        for name, attr in (("multicast", CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED),
                           ("fabric_handle", CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)):
            v = ctypes.c_int(0)
            rc = self.lib.cuDeviceGetAttribute(ctypes.byref(v), attr, dev)
            # CUDA_ERROR_INVALID_VALUE (1) from an older driver that lacks the attribute = 0
            out[name] = v.value if rc == 0 else 0
        return out, None


def nvml_return_name(pynvml, code: int) -> str:
    """NVML return code -> "SUCCESS" or the NVML_ERROR_* constant name."""
    if code == 0:
        return "SUCCESS"
    for k in dir(pynvml):
        if k.startswith("NVML_ERROR_") and getattr(pynvml, k) == code:
            return k
    return f"NVML_RETURN_{code}"


def _health_from_mask(pynvml, mask: int) -> str:
    """healthMask (fabric info v2) -> summary, for drivers without `healthSummary` (v3)."""
    def field(shift: str, width: str) -> int:
        return (mask >> getattr(pynvml, shift)) & getattr(pynvml, width)

    route = field("NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY",
                  "NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_ROUTE_UNHEALTHY")
    config = field("NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION",
                   "NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_INCORRECT_CONFIGURATION")
    degraded = field("NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW",
                     "NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW")
    if route == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_TRUE or config > \
            pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE:
        return "UNHEALTHY"
    if degraded == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE:
        return "LIMITED_CAPACITY"
    if route == degraded == config == 0:   # every field NOT_SUPPORTED
        return "UNKNOWN"
    return "HEALTHY"


def read_fabric(pynvml, handle) -> tuple[FabricInfo, list[str]]:
    """Newest fabric-info struct the driver accepts: v3 (health summary) -> v2 (health mask) ->
    legacy (no health). A driver without fabric support reports state NOT_SUPPORTED."""
    notes: list[str] = []
    attempts = []
    if hasattr(pynvml, "c_nvmlGpuFabricInfo_v3_t"):
        attempts.append(("v3", pynvml.c_nvmlGpuFabricInfo_v3_t, pynvml.nvmlDeviceGetGpuFabricInfoV))
    if hasattr(pynvml, "c_nvmlGpuFabricInfo_v2_t"):
        attempts.append(("v2", pynvml.c_nvmlGpuFabricInfo_v2_t, pynvml.nvmlDeviceGetGpuFabricInfoV))
    attempts.append(("v1", pynvml.c_nvmlGpuFabricInfo_t, pynvml.nvmlDeviceGetGpuFabricInfo))
    for ver, struct, fn in attempts:
        info = struct()
        try:
            fn(handle, ctypes.byref(info))
        except pynvml.NVMLError_NotSupported:
            return FabricInfo(state="NOT_SUPPORTED", status="SUCCESS", health="UNKNOWN"), \
                ["NVML: GPU fabric info not supported on this GPU/driver"]
        except (pynvml.NVMLError_ArgumentVersionMismatch, pynvml.NVMLError_FunctionNotFound) as e:
            notes.append(f"fabric info {ver} unavailable ({e})")
            continue
        state = _STATE_NAMES.get(int(info.state), f"STATE_{int(info.state)}")
        if ver == "v3":
            health = _SUMMARY_NAMES.get(int(info.healthSummary), "UNKNOWN")
        elif ver == "v2":
            health = _health_from_mask(pynvml, int(info.healthMask))
        else:
            health = "UNKNOWN"
        if state not in ("COMPLETED", "IN_PROGRESS", "NOT_STARTED"):
            state = "NOT_SUPPORTED"
        return FabricInfo(cluster_uuid=format_cluster_uuid(bytes(info.clusterUuid)[:16]),
                          clique_id=int(info.cliqueId), state=state,
                          status=nvml_return_name(pynvml, int(info.status)), health=health), notes
    return FabricInfo(), notes + ["no NVML fabric-info call succeeded"]


def read_nvlinks(pynvml, handle) -> tuple[int, int, list[str]]:
    """(links up, links present). Link count from the NVLINK_LINK_COUNT field when the driver has
    it, else links are probed until NVML says a link index does not exist."""
    notes: list[str] = []
    total = None
    try:
        fv = pynvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])[0]
        if int(fv.nvmlReturn) == 0:
            total = int(fv.value.uiVal)
    except pynvml.NVMLError as e:
        notes.append(f"NVLink link-count field unavailable ({e})")
    up = present = 0
    for link in range(total if total is not None else pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            active = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            if total is None:
                break
            active = 0          # the field says the link exists: count it as down
        except pynvml.NVMLError as e:
            notes.append(f"nvlink {link}: {e}")
            active = 0
        present += 1
        up += int(active == pynvml.NVML_FEATURE_ENABLED)
    return up, present if total is None else total, notes


def gpu_facts(pynvml, index: int, cuda: CudaDriver) -> GpuFacts:
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = pynvml.nvmlDeviceGetName(h)
    uid = pynvml.nvmlDeviceGetUUID(h)
    name, uid = (x.decode() if isinstance(x, bytes) else x for x in (name, uid))
    fabric, notes = read_fabric(pynvml, h)
    up, total, link_notes = read_nvlinks(pynvml, h)
    notes += link_notes
    bus = pynvml.nvmlDeviceGetPciInfo(h).busId
    bus = bus.decode() if isinstance(bus, bytes) else bus
    attrs, why = cuda.attributes(bus)
    if why:
        notes.append(f"CUDA attributes not read: {why}")
    return GpuFacts(index=index, uuid=uid, name=name, fabric=fabric,
                    multicast_supported=bool(attrs.get("multicast", 0)),
                    fabric_handle_supported=bool(attrs.get("fabric_handle", 0)),
                    nvlinks_up=up, nvlinks_total=total, notes=tuple(notes))
