"""The share of CPU time the hypervisor stole during a benchmark (bench/steal.py): read from
/proc/stat's counters, recorded beside the machine and shown on the results page."""

from __future__ import annotations

from tandem.bench.results_page import machine_line
from tandem.bench.spec import machine_info
from tandem.bench.steal import StealMeter, cpu_ticks, steal_notice


def test_cpu_ticks_reads_steal_and_the_total_from_the_cpu_line(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 50 800 10 1 4 30 0 0\ncpu0 50 2 25 400 5 0 2 15 0 0\n")
    assert cpu_ticks(stat) == (30, 1000)
    stat.write_text("cpu  100 5 50 800\n")  # a kernel without the steal field
    assert cpu_ticks(stat) is None
    assert cpu_ticks(tmp_path / "missing") is None


def test_the_meter_reports_the_share_stolen_since_it_started():
    readings = iter([(30, 1000), (130, 1400), (130, 1400)])
    meter = StealMeter(lambda: next(readings))
    assert meter.share() == 0.25  # 100 of 400 ticks
    assert meter.share() == 0.25
    assert StealMeter(lambda: None).share() is None
    same = iter([(0, 10), (0, 10)])
    assert StealMeter(lambda: next(same)).share() is None  # no tick has passed


def test_a_run_that_lost_cpu_time_says_so_and_its_page_shows_it():
    assert steal_notice(None) is None and steal_notice(0.01) is None
    assert "25%" in steal_notice(0.25)
    info = machine_info(StealMeter(iter([(0, 100), (12, 200)]).__next__))
    assert info["steal"] == 0.12
    assert "12.0% of the CPU time stolen" in machine_line("x.json", info)
    assert "stolen" not in machine_line("x.json", machine_info())
