"""Backend: carry a strategy out on TensorFlow.  [TensorFlow]

- ``tag.backend.rewrite``: the rewritten, device-annotated GraphDef (replicas with batch slices,
  collectives, parameter servers, partitions, sufficient-factor gathers);
- ``tag.backend.runtime``: TF servers per host, sessions, step timing;
- ``tag.backend.testbed``: hosts in network namespaces with shaped links, for real multi-host runs.
"""
