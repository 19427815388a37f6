"""Run training graphs on TensorFlow's distributed runtime: clusters, worker servers, timed steps.

A cluster comes from a topology (each host's address, port and task index) or, without one, from
the ``TF_CONFIG`` environment variable. Every host runs one ``tf.distribute.Server`` in the job
``worker`` (``tag-worker``); a client session connected to task 0 runs the (rewritten) training graph,
whose ops carry ``/job:worker/task:T/device:TYPE:I`` device strings.

One module per concern:

- ``cluster_spec``: cluster dicts, ``TF_CONFIG``, ``ClusterSpec`` and session configs;
- ``ports``: free ports, loopback addresses, listening/bindable probes;
- ``server``: one host's TF server (what ``tag-worker`` runs);
- ``local_cluster``: ``LocalCluster``, the supervisor of one worker process per host;
- ``live``: objects stopped at interpreter exit (clusters here, testbeds in ``tag_bench.testbed``);
- ``collective_keys``: fresh collective keys per graph;
- ``inputs``: random and synthetic input batches;
- ``steps``: ``run_steps`` and ``RunResult``;
- ``guard``: deadlines and a watchdog around every blocking call, progress events (``RunControl``);
- ``health``: are remote hosts answering (before a run, and as its watchdog);
- ``checkpoint``: TensorFlow checkpoints under the original variable names, saved every K steps and
  restored to resume (``.npz`` only as an explicit export);
- ``input_pipeline``: a ``tf.data`` pipeline on every worker host that reads the training data there;
- ``training``: ``train_graph``, the training loop behind ``tag.train`` (data sets, evaluation, curves);
- ``measure``: rewrite and time strategies on a topology's cluster, one start for several measurements
  (``open_cluster``; ``tag-deploy --run``), a one-device plan with no server (``run_on``);
- ``one_device``: a plan placed on one device run as a process of its own on its host, as a user runs it.

Example::

    import tag
    from tag.backend.runtime import LocalCluster, run_steps

    topo = tag.load_topology("topologies/localhost.pbtxt")
    with LocalCluster(topo) as cluster:          # one tag-worker process per host, stopped on exit
        result = run_steps(graph_def, cluster.target, steps=20, warmup=3)
    print(result.mean_step_time_s, result.losses[-1])

From a shell, one host's server: ``tag-worker --topo cluster.pbtxt --host gpu-node-2`` (or
``python -m tag.cli.worker ...``); with ``TF_CONFIG`` set and no ``--topo``, the cluster and this
task come from ``TF_CONFIG``.

Note: TensorFlow's gRPC server listens on every interface of its network namespace at the port the
cluster names for its task; the address in the topology is where the others reach it.
TensorFlow itself loads on first use, not on import.
"""
from tag.backend.runtime.checkpoint import Checkpointer, read_checkpoint_meta
from tag.backend.runtime.cluster_spec import (
                                              COLLECTIVE_LEADER,
                                              JOB,
                                              ClusterError,
                                              cluster_dict,
                                              cluster_spec_from,
                                              host_has_gpu,
                                              session_config,
                                              tf_config_task,
)
from tag.backend.runtime.collective_keys import fresh_collective_keys
from tag.backend.runtime.guard import RunControl, RunEvent, guarded
from tag.backend.runtime.health import HostProbe, wait_for_hosts
from tag.backend.runtime.inputs import random_input
from tag.backend.runtime.live import LiveRegistry
from tag.backend.runtime.local_cluster import LocalCluster
from tag.backend.runtime.measure import Cluster, measure_strategies, open_cluster
from tag.backend.runtime.ports import free_ports, is_loopback, port_bindable, port_listening
from tag.backend.runtime.server import READY_WORD, serve
from tag.backend.runtime.steps import RunResult, run_steps

__all__ = ["COLLECTIVE_LEADER", "JOB", "READY_WORD", "Checkpointer", "Cluster", "ClusterError", "HostProbe",
           "LiveRegistry", "LocalCluster", "RunControl", "RunEvent", "RunResult", "guarded", "read_checkpoint_meta",
           "wait_for_hosts", "cluster_dict", "cluster_spec_from", "free_ports", "fresh_collective_keys",
           "host_has_gpu", "is_loopback", "measure_strategies", "open_cluster", "port_bindable", "port_listening",
           "random_input", "run_steps", "serve", "session_config", "tf_config_task"]
