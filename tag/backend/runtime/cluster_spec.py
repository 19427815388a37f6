"""The cluster as TensorFlow sees it: job ``worker`` addresses, ``TF_CONFIG``, session configs.

Every host of a topology runs one ``tf.distribute.Server`` in the job ``worker``; task T's ops carry
``/job:worker/task:T/device:TYPE:I``. Without a topology the cluster and this process's task come
from the ``TF_CONFIG`` environment variable (``{"cluster": {...}, "task": {"type": ..., "index": ...}}``).
``cluster_dict`` and ``tf_config_task`` are plain data (no TensorFlow import), so command-line
errors stay fast; ``cluster_spec_from`` and ``session_config`` load TensorFlow on first use.

Example::

    import tag
    from tag.backend.runtime.cluster_spec import cluster_dict, session_config

    topo = tag.load_topology("topologies/localhost.pbtxt")
    print(cluster_dict(topo))                     # {"worker": ["127.0.0.1:2222", ...]}
    cfg = session_config(intra_op_threads=2)      # collective leader = task 0 of job worker
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from tag.errors import TagError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import tensorflow as tf

    from tag.cluster.topology import Topology

JOB = "worker"
COLLECTIVE_LEADER = "/job:worker/replica:0/task:0"


class ClusterError(TagError):
    """The cluster cannot be formed or started (no cluster given, port in use, a worker failed)."""


def import_tf() -> Any:
    """Import TensorFlow on first use (keeps ``tag-worker`` bad-input errors fast)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from tag.cuda_noise import init_devices
    init_devices()      # before any session or server: no cuInit error line on a machine without a GPU driver
    return tf


def _tf_config() -> dict:
    """``TF_CONFIG`` parsed; ClusterError when it is unset, not JSON or has no cluster."""
    raw = os.environ.get("TF_CONFIG", "").strip()
    if not raw:
        raise ClusterError("no cluster: give a topology file (--topo) or set TF_CONFIG")
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ClusterError(f"TF_CONFIG is not valid JSON: {err}") from None
    cluster = cfg.get("cluster") if isinstance(cfg, dict) else None
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterError('TF_CONFIG has no "cluster" entry '
                           '(expected {"cluster": {"worker": ["host:port", ...]}, ...})')
    return cfg


def cluster_dict(topology: "Topology | None" = None) -> dict[str, list[str]]:
    """``{"worker": ["addr:port", ...]}`` from the topology, or from ``TF_CONFIG`` when it is None.

    Plain data (no TensorFlow), so callers can build ``TF_CONFIG`` strings from it.
    """
    if topology is not None:
        if not topology.hosts:
            raise ClusterError(f"topology {topology.name!r} has no hosts")
        return {k: list(v) for k, v in topology.cluster_spec().items()}
    cluster = _tf_config()["cluster"]
    return {str(job): [str(a) for a in addrs] for job, addrs in cluster.items()}


def host_has_gpu(topology: "Topology", host_name: str) -> bool:
    """Does the topology give host HOST_NAME any GPU? (CPU-only hosts hide GPUs from TensorFlow.)"""
    return any(d.host == host_name and d.tf_device_type == "GPU" for d in topology.devices)


def tf_config_task() -> tuple[dict[str, list[str]], str, int]:
    """(cluster dict, job, task index) of this process from ``TF_CONFIG``; ClusterError when incomplete."""
    cluster = cluster_dict(None)
    task = _tf_config().get("task") or {}
    job, index = task.get("type"), task.get("index")
    if job is None or index is None:
        raise ClusterError('TF_CONFIG has no "task": {"type": ..., "index": ...} for this process')
    if job not in cluster:
        raise ClusterError(f"TF_CONFIG task type {job!r} is not a job of its cluster ({', '.join(cluster)})")
    try:
        index = int(index)
    except (TypeError, ValueError):
        raise ClusterError(f"TF_CONFIG task index {index!r} is not an integer") from None
    if not 0 <= index < len(cluster[job]):
        raise ClusterError(f"TF_CONFIG task index {index} out of range: job {job!r} has {len(cluster[job])} tasks")
    return cluster, str(job), index


def cluster_spec_from(topology: "Topology | None" = None) -> "tf.train.ClusterSpec":
    """The ``tf.train.ClusterSpec`` of the topology's hosts (job ``worker``, in task order).

    Without a topology the cluster comes from ``TF_CONFIG`` through
    ``tf.distribute.cluster_resolver.TFConfigClusterResolver``; neither given -> ``ClusterError``.
    """
    tf = import_tf()
    if topology is not None:
        return tf.train.ClusterSpec(cluster_dict(topology))
    cluster_dict(None)  # validates TF_CONFIG with a clear message first
    spec = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
    if not spec.jobs:
        raise ClusterError("TF_CONFIG names no jobs in its cluster")
    return spec


def session_config(*, intra_op_threads: int = 0, inter_op_threads: int = 0,
                   soft_placement: bool = False) -> "tf.compat.v1.ConfigProto":
    """ConfigProto for tag's servers and client sessions.

    Sets the collective group leader (task 0 of job ``worker``), which TF's collective ops need in
    client-session (TF1) mode. Sessions share resources by name (``isolate_session_state`` off: one host's
    program reaches the queues and variables of another's), so each run keeps its resources in a container of
    its own (``tag.backend.runtime.containers``): a plan and then its baseline never share variables.
    Thread counts of 0 let TensorFlow choose; servers sharing one machine should get fewer.
    """
    tf = import_tf()
    cfg = tf.compat.v1.ConfigProto()
    cfg.experimental.collective_group_leader = COLLECTIVE_LEADER
    cfg.allow_soft_placement = bool(soft_placement)
    cfg.intra_op_parallelism_threads = int(intra_op_threads)
    cfg.inter_op_parallelism_threads = int(inter_op_threads)
    return cfg
