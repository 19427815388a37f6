"""scripts/refit_levels.py: the calibration ratios read back from a bench_fidelity log (no TensorFlow run)."""
from helpers import load_script

logged_ratios = load_script("refit_levels").logged_ratios

LOG = """=== run 1 of 1 ===
runtime levels (batches 48 and 12; applied: one scale):
  CPUq100 (alone) conv x0.8 + 1 us/op (fit within 3%); measured/predicted 1.16/1.38/0.84/0.81/0.84/1.23; residuals
  CPUq25 (under load) conv x0.9 + 2 us/op (fit within 5%); measured/predicted 1.01/1.40/0.83/0.76/0.98/1.12; residuals
A  mlp  single  uniform  predicted 1 ms
runtime levels (batches 48 and 12; applied: one scale):
  CPUq100 (alone) conv x0.7 (fit within 9%); measured/predicted 1.00/1.10/0.90/0.80/0.70/0.60; residuals
"""


def test_ratios_per_run_configuration_type_and_condition():
    runs = logged_ratios(LOG)
    assert len(runs) == 1 and len(runs[0]) == 2
    first, second = runs[0]
    assert first[("CPUq100", "alone")] == [1.16, 1.38, 0.84, 0.81, 0.84, 1.23]
    assert first[("CPUq25", "under load")][1] == 1.40
    assert set(second) == {("CPUq100", "alone")} and second[("CPUq100", "alone")][-1] == 0.60
