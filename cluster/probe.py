"""OPT-IN multicast probe (`raydecode verify-domain --probe-multicast`): really allocates what the
fast path will need on this node's chosen GPUs, because device attributes can claim multicast and
fabric-handle support while the IMEX domain is broken (DESIGN §6).

Steps, each reported with its CUresult name:
  1. per GPU: cuMemCreate with CU_MEM_HANDLE_TYPE_FABRIC, cuMemExportToShareableHandle (FABRIC) —
     fails when no IMEX channel is usable;
  2. cuMulticastCreate over the node's chosen GPUs, cuMulticastAddDevice each, cuMulticastBindMem
     each GPU's fabric allocation; then unbind and release everything.
Covers the GPUs of this node only (a cross-node check needs every node's process to import the
multicast handle). Never called by tests, benchmarks or serving: only by that CLI flag.
"""
from __future__ import annotations

import ctypes
import math
import os
import socket
from dataclasses import dataclass, field

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_HANDLE_TYPE_FABRIC = 8
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_MULTICAST_GRANULARITY_RECOMMENDED = 1
_u64 = ctypes.c_ulonglong


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):   # 32 bytes
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class CUmulticastObjectProp(ctypes.Structure):  # 32 bytes
    _fields_ = [("numDevices", ctypes.c_uint), ("size", ctypes.c_size_t),
                ("handleTypes", _u64), ("flags", _u64)]


@dataclass
class ProbeReport:
    node: str
    devices: list[str]
    steps: list[tuple[str, bool, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(ok for _, ok, _ in self.steps)

    def text(self) -> str:
        head = f"multicast probe on {self.node} ({', '.join(self.devices) or 'no GPUs'}): " + \
            ("OK" if self.ok else "FAILED")
        return "\n".join([head] + [f"  [{'ok' if ok else 'FAIL'}] {what}: {detail}"
                                   for what, ok, detail in self.steps])


class _Cuda:
    def __init__(self, report: ProbeReport):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.report = report
        L = self.lib
        L.cuMemCreate.argtypes = [ctypes.POINTER(_u64), ctypes.c_size_t,
                                  ctypes.POINTER(CUmemAllocationProp), _u64]
        L.cuMemRelease.argtypes = [_u64]
        L.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, _u64, ctypes.c_int, _u64]
        L.cuMulticastCreate.argtypes = [ctypes.POINTER(_u64), ctypes.POINTER(CUmulticastObjectProp)]
        L.cuMulticastAddDevice.argtypes = [_u64, ctypes.c_int]
        L.cuMulticastBindMem.argtypes = [_u64, ctypes.c_size_t, _u64, ctypes.c_size_t,
                                         ctypes.c_size_t, _u64]
        L.cuMulticastUnbind.argtypes = [_u64, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t]

    def name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(s))
        return s.value.decode() if s.value else f"CUresult {rc}"

    def call(self, what: str, fn: str, *args) -> bool:
        rc = getattr(self.lib, fn)(*args)
        self.report.steps.append((what, rc == 0, "CUDA_SUCCESS" if rc == 0 else self.name(rc)))
        return rc == 0


def probe_multicast(pci_bus_ids: list[str], node: str = "") -> ProbeReport:
    """Fabric allocation + export per GPU, then one multicast object bound on all of them."""
    report = ProbeReport(node or socket.gethostname(), list(pci_bus_ids))
    cu = _Cuda(report)
    if not cu.call("cuInit", "cuInit", 0):
        return report
    devs, ctxs = [], []
    for bus in pci_bus_ids:
        d, ctx = ctypes.c_int(), ctypes.c_void_p()
        if not cu.call(f"device {bus}", "cuDeviceGetByPCIBusId", ctypes.byref(d), bus.encode()):
            return report
        cu.call(f"primary context {bus}", "cuDevicePrimaryCtxRetain", ctypes.byref(ctx), d)
        devs.append(d.value)
        ctxs.append(ctx)
    mems: list[tuple[int, int]] = []   # (device, handle)
    mc = _u64(0)
    try:
        gran = ctypes.c_size_t()
        mprop = CUmulticastObjectProp(numDevices=len(devs), size=0,
                                      handleTypes=CU_MEM_HANDLE_TYPE_FABRIC, flags=0)
        size = 2 << 20
        if cu.call("multicast granularity", "cuMulticastGetGranularity", ctypes.byref(gran),
                   ctypes.byref(mprop), CU_MULTICAST_GRANULARITY_RECOMMENDED):
            size = math.lcm(size, gran.value)
        for d, ctx in zip(devs, ctxs):
            cu.lib.cuCtxSetCurrent(ctx)
            prop = CUmemAllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                                       requestedHandleTypes=CU_MEM_HANDLE_TYPE_FABRIC,
                                       location=CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, d))
            if cu.call(f"gpu {d} allocation granularity", "cuMemGetAllocationGranularity",
                       ctypes.byref(gran), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM):
                size = math.lcm(size, gran.value)
            h = _u64(0)
            if not cu.call(f"gpu {d} fabric allocation ({size} B)", "cuMemCreate",
                           ctypes.byref(h), size, ctypes.byref(prop), 0):
                return report
            mems.append((d, h.value))
            fabric_handle = (ctypes.c_ubyte * 64)()
            cu.call(f"gpu {d} fabric handle export (IMEX)", "cuMemExportToShareableHandle",
                    ctypes.byref(fabric_handle), h.value, CU_MEM_HANDLE_TYPE_FABRIC, 0)
        mprop.size = size
        if not cu.call(f"multicast object over {len(devs)} GPU(s)", "cuMulticastCreate",
                       ctypes.byref(mc), ctypes.byref(mprop)):
            return report
        for d in devs:
            if not cu.call(f"multicast add gpu {d}", "cuMulticastAddDevice", mc.value, d):
                return report
        for d, h in mems:
            if cu.call(f"multicast bind gpu {d}", "cuMulticastBindMem", mc.value, 0, h, 0,
                       size, 0):
                cu.lib.cuMulticastUnbind(mc.value, d, 0, size)
        return report
    finally:
        if mc.value:
            cu.lib.cuMemRelease(mc.value)
        for _, h in mems:
            cu.lib.cuMemRelease(h)
        for d in devs:
            cu.lib.cuDevicePrimaryCtxRelease(d)


def probe_chosen_on_this_node(verdict, nodes) -> ProbeReport:
    """Probe the verdict's chosen GPUs that live on this node (matched by UUID through NVML)."""
    import pynvml

    here = os.environ.get("NODE_NAME") or socket.gethostname()
    uuids = [g.uuid for g in verdict.chosen if g.node == here]
    if not uuids:
        r = ProbeReport(here, [])
        r.steps.append(("select GPUs", False, f"none of the chosen GPUs is on this node ({here}); "
                        "run the probe on each node of the group"))
        return r
    pynvml.nvmlInit()
    try:
        buses = []
        for u in uuids:
            bus = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByUUID(u)).busId
            buses.append(bus.decode() if isinstance(bus, bytes) else bus)
    finally:
        pynvml.nvmlShutdown()
    return probe_multicast(buses, here)
