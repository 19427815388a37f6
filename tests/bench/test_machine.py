"""tag_bench.machine: the steal-time reading printed beside each benchmark row, the load average and CPU model."""
from __future__ import annotations

import os
import re

from tag_bench.machine import cpu_times, load_averages, load_text, machine_text, steal_fraction, steal_text


def _stat(tmp_path, name: str, cpu_line: str) -> str:
    path = tmp_path / name
    path.write_text(cpu_line + "\ncpu0 1 2 3 4 5 6 7 8 0 0\nintr 123\n")
    return str(path)


def test_cpu_times_reads_steal_and_total_without_guest_time(tmp_path):
    # user nice system idle iowait irq softirq steal guest guest_nice
    path = _stat(tmp_path, "stat", "cpu  100 0 50 800 10 0 5 35 20 0")
    assert cpu_times(path) == (35, 1000)


def test_steal_fraction_between_two_readings(tmp_path):
    before = cpu_times(_stat(tmp_path, "a", "cpu  100 0 50 800 10 0 5 35 0 0"))
    after = cpu_times(_stat(tmp_path, "b", "cpu  200 0 100 1500 10 0 5 185 0 0"))
    assert steal_fraction(before, after) == 150 / 1000
    assert steal_text(steal_fraction(before, after)) == "  steal 15%"


def test_missing_or_malformed_readings_give_none(tmp_path):
    assert cpu_times(str(tmp_path / "absent")) is None
    assert cpu_times(_stat(tmp_path, "short", "cpu  1 2 3")) is None
    reading = (5, 100)
    assert steal_fraction(None, reading) is None and steal_fraction(reading, reading) is None
    assert steal_text(None) == ""


def test_load_average_texts_and_row_values():
    assert re.fullmatch(r"\d+\.\d \d+\.\d \d+\.\d", load_text())
    assert re.fullmatch(r"\d+\.\d\d \d+\.\d\d \d+\.\d\d", load_text(2))
    values = load_averages()
    assert len(values) == 3 and all(v >= 0 and round(v, 2) == v for v in values)


def test_machine_names_the_cpu_model_and_cores(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Example CPU @ 2.0GHz\n" * 2)
    assert machine_text(str(info)) == f"Example CPU @ 2.0GHz, {os.cpu_count()} cores"
    assert machine_text(str(tmp_path / "absent")).endswith(f", {os.cpu_count()} cores")
