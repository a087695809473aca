"""Kubernetes node labels (GPU feature discovery's `nvidia.com/gpu.clique` and
`nvidia.com/gpu.product`) through the `kubernetes` client: in-cluster service account first,
then the local kubeconfig.

Reading a label never raises and never hangs: outside Kubernetes, without RBAC, or on a timeout the
answer is (None, note) and the caller carries on with NVML facts alone.
"""
from __future__ import annotations

REQUEST_TIMEOUT_S = 5.0


def _core_api():
    """CoreV1Api or (None, why)."""
    try:
        from kubernetes import client, config
    except ImportError:
        return None, "kubernetes client not installed"
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except Exception as e:  # noqa: BLE001 - any kubeconfig problem means "not in k8s"
            return None, f"not in a Kubernetes pod and no usable kubeconfig ({type(e).__name__})"
    return client.CoreV1Api(), None


def node_labels(node: str) -> tuple[dict[str, str] | None, str | None]:
    """All labels of Kubernetes node `node`, or (None, why not)."""
    api, why = _core_api()
    if api is None:
        return None, f"Kubernetes node labels not read: {why}"
    try:
        obj = api.read_node(node, _request_timeout=REQUEST_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - ApiException, connection errors, timeouts
        status = getattr(e, "status", None)
        detail = f"HTTP {status}" if status else type(e).__name__
        hint = " (needs RBAC: get on nodes)" if status == 403 else ""
        return None, f"Kubernetes node {node!r} not read: {detail}{hint}"
    return dict(obj.metadata.labels or {}), None


def node_label(node: str, key: str) -> tuple[str | None, str | None]:
    """One label's value (None when absent) and a note when the labels could not be read."""
    labels, why = node_labels(node)
    if labels is None:
        return None, why
    return labels.get(key), None
