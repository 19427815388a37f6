"""tag's benchmark harness, apart from the library: nothing under ``tag`` imports it.

- ``tag_bench.testbed``: hosts in network namespaces on one Linux machine, with shaped links and CPU quotas
  (``testbed_hosts``: each host's CPU options; ``signal_teardown``: a stopped process takes its testbeds down);
- ``tag_bench.mwms``: the tf.distribute anchor (MultiWorkerMirroredStrategy), the models both sides train and
  the launcher of its workers on a testbed;
- ``tag_bench.cases``: the testbed configurations and their calibration (``testbed_recipe.json``), the
  interleaved measurement, the runtime levels, bench_e2e's cases;
- ``tag_bench.fidelity``: bench_fidelity's models and figures (errors by class, ranking, regret, targets);
- ``tag_bench.published``: the published-throughput data, its GPU systems and the predictions of its rows;
- ``tag_bench.exactness``: checks that a rewritten step trains as the original does (also used by the tests);
- ``tag_bench.machine``, ``tag_bench.stats``, ``tag_bench.records``: the load average and CPU model, geomeans,
  and every benchmark JSON's ``provenance`` (commit, command, load average, date, machine).

The benchmarks and tools in ``scripts/`` import it; ``pip install -e .`` installs it beside ``tag``.

Example::

    from tag_bench.mwms import tf1_graph
    from tag_bench.records import Run, write_json
    from tag_bench.testbed import Testbed
"""
