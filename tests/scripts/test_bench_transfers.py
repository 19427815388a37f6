"""scripts/bench_transfers.py without a testbed: its kernel chains on one in-process device."""
from helpers import load_script


def test_kernel_chains_run_on_one_device():
    bench_transfers = load_script("bench_transfers")
    from tag.backend.runtime import run_steps
    for kind in ("conv", "conv_filter_grad", "matmul"):
        r = run_steps(bench_transfers.kernel_chain_graph(kind, "/device:CPU:0"), "", train_op="step", loss=None,
                      steps=2, warmup=1)
        assert len(r.step_times) == 2, kind
    assert set(bench_transfers.CONTENTION_KERNELS) == {"conv", "conv_filter_grad", "matmul", "elementwise"}
