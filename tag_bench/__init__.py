"""tag's benchmark harness, apart from the library: nothing under ``tag`` imports it.

- ``tag_bench.testbed``: hosts in network namespaces on one Linux machine, with shaped links and CPU quotas
  (``testbed_hosts``: each host's CPU options; ``signal_teardown``: a stopped process takes its testbeds down);
- ``tag_bench.mwms``: the tf.distribute anchor (MultiWorkerMirroredStrategy) and the models both sides train.

The benchmarks and tools in ``scripts/`` import it; ``pip install -e .`` installs it beside ``tag``.

Example::

    from tag_bench.mwms import tf1_graph
    from tag_bench.testbed import Testbed
"""
