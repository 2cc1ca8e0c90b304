"""benchmarks.clocks: the SM clock read while the host waits for the timed runs, and where it is shown."""

from benchmarks import ceilings, clocks, tables
from tests.bench.helpers import kernels_result


class EventDoneAfter:
    """An event whose work ends after `polls` queries of done."""

    def __init__(self, polls):
        self.polls, self.synced = polls, False

    @property
    def done(self):
        self.polls -= 1
        return self.polls < 0

    def synchronize(self):
        self.synced = True


def test_the_clock_is_read_until_the_last_run_ends():
    reads = iter([1980, 1755, 1590, 1755, 1800])
    event = EventDoneAfter(5)
    stats = clocks.wait_reading_clock(event, read=lambda: next(reads))
    assert stats == {"median_mhz": 1755.0, "min_mhz": 1590, "max_mhz": 1980, "samples": 5} and event.synced


def test_no_clock_without_nvml_and_none_from_a_failed_read():
    event = EventDoneAfter(3)
    assert clocks.wait_reading_clock(event, read=None) is None and event.synced
    assert clocks.wait_reading_clock(EventDoneAfter(2), read=lambda: None) is None  # every read failed
    assert clocks.wait_reading_clock(EventDoneAfter(0), read=lambda: 1500) is None  # done before any read


def test_rows_show_the_clock_only_where_it_was_read():
    result = kernels_result(shapes=((8, 1024),))
    rows = [r for r in result["rows"] if r["status"] != "unsupported"]
    plain = "\n".join(tables.render_rows_table(result, rows))
    assert "SM MHz" not in plain
    ok = [r for r in rows if r["status"] == "ok"]
    ok[0]["timing"]["sm_clock"] = {"median_mhz": 1755.0, "min_mhz": 1590, "max_mhz": 1980, "samples": 40}
    lines = tables.render_rows_table(result, rows)
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert header[4:6] == ["% of ceiling", "SM MHz"]
    cells = {tuple(c.strip() for c in line.split("|")[1:-1])[0]: [c.strip() for c in line.split("|")[1:-1]]
             for line in lines[2:]}
    assert cells[tables._label(ok[0])][5] == "1,755" and cells[tables._label(ok[1])][5] == "-"
    assert all(len(c) == len(header) for c in cells.values())  # wrong rows keep the column count


def test_the_ceilings_say_the_clock_they_ran_at():
    c = {"bf16_tflops": 790.8, "bf16_what": "torch.matmul bfloat16 8192^3",
         "bf16_timing": {"median_ms": 1.4, "sm_clock": {"median_mhz": 1612.0, "min_mhz": 1590, "max_mhz": 1755,
                                                         "samples": 90}},
         "fp16_tflops": 761.3, "fp16_what": "torch.matmul float16 8192^3", "fp16_timing": {"median_ms": 1.4}}
    text = ceilings.measured(c)
    assert "bf16 tensor 790.8 TFLOP/s at a 1,612 MHz SM clock (median) (torch.matmul bfloat16 8192^3)" in text
    assert "fp16 tensor 761.3 TFLOP/s (torch.matmul float16 8192^3)" in text
