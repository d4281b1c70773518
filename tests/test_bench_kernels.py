"""benchmarks/bench_kernels.py's report against issue #4's floors (its timings need CUDA)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import bench_kernels
finally:
    sys.path.pop(0)


def test_each_cell_gets_the_issues_floor() -> None:
    target = bench_kernels.target
    assert [target("w4a16", s, 1) for s in ("8B qkv", "8B down", "70B gate_up")] == [None, 3.0, 3.5]
    assert [target("w4a16", "8B o", m) for m in (4, 16, 64, 256, 1024, 4096)] == [None, 2.5, 1.5, None, 0.9, 0.9]
    assert [target("w4a8", "8B down", m) for m in (1, 4, 16, 256, 1024, 4096)] == [1.98, None, 1.87, 0.76, 1.1, 1.1]
    assert [target("w4a8", "8B qkv", m) for m in (1, 1024)] == [None, 1.1]


def test_the_report_says_met_tie_or_missed() -> None:
    row = dict(scheme="w4a16", shape="8B down", t_cublas_us=30.0, t_kernel_us=10.0, kernel_GBps=3000.0,
               kernel_TFLOPs=1.0, config="c")
    rows = [dict(row, M=1, speedup=s) for s in (3.0, 2.95, 2.5)] + [dict(row, M=4, speedup=1.0)]
    text = bench_kernels.markdown(dict(date="d", device="dev", command="c", commit="x", torch="t", triton="t"), rows)
    assert [line.split(" | ")[6] for line in text.splitlines() if line.startswith("| w4a16")] == [
        "3.00 met", "3.00 tie", "3.00 missed", ""]
    assert "1 met, 1 tie, 1 missed" in text
