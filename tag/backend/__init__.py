"""Backend: carry a strategy out on TensorFlow.  [TensorFlow]

- ``tag.backend.rewrite``: the rewritten, device-annotated GraphDef (replicas with batch slices,
  collectives, parameter servers, partitions, sufficient-factor gathers);
- ``tag.backend.runtime``: TF servers per host, sessions, step timing.

The benchmark testbed (hosts in network namespaces with shaped links) is not part of the library: ``tag_bench.testbed``.
"""
