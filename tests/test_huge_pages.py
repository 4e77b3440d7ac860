"""The packed weights' buffer on transparent huge pages (`dvi.decode.huge_pages`, `RowsKernel.pack_all`)."""

from __future__ import annotations

import sys

import pytest
import torch

from dvi.decode import huge_pages, rows_kernel

THP = sys.platform.startswith("linux") and huge_pages.thp_mode() in ("madvise", "always")


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.fixture
def restore_switch():
    yield
    huge_pages.enable(True)


@pytest.mark.skipif(not THP, reason="no transparent huge pages for advised ranges here")
def test_a_buffer_starts_on_a_huge_page_boundary_and_is_advised(restore_switch):
    buf = huge_pages.buffer(5 * huge_pages.HUGE_PAGE + 12345)
    assert buf.dtype == torch.uint8 and buf.numel() == 5 * huge_pages.HUGE_PAGE + 12345
    assert buf.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in vm_flags(buf.data_ptr()) and "hg" in vm_flags(buf.data_ptr() + buf.numel() - 1)
    buf.fill_(7)  # every page writable
    assert int(buf[-1]) == 7


def advice_recorder(monkeypatch) -> list[tuple[int, int, int]]:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda addr, n, advice: calls.append((addr, n, advice)) or 0)
    return calls


def test_switched_off_or_small_buffers_are_not_advised(restore_switch, monkeypatch, tmp_path):
    calls = advice_recorder(monkeypatch)
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "_THP_ENABLED", f)
    huge_pages.enable(False)
    assert not huge_pages.enabled() and huge_pages.buffer(4 * huge_pages.HUGE_PAGE).numel() == 4 * huge_pages.HUGE_PAGE
    huge_pages.enable(True)
    assert huge_pages.buffer(4096).numel() == 4096 and huge_pages.buffer(0).numel() == 0
    assert calls == []
    f.write_text("always madvise [never]\n")
    assert huge_pages.buffer(3 * huge_pages.HUGE_PAGE).numel() == 3 * huge_pages.HUGE_PAGE
    assert calls == []
    f.write_text("[always] madvise never\n")
    buf = huge_pages.buffer(3 * huge_pages.HUGE_PAGE + 1)
    assert calls == [(buf.data_ptr(), 4 * huge_pages.HUGE_PAGE, 14)] and buf.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_thp_mode_reads_the_bracketed_word(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "_THP_ENABLED", f)
    assert huge_pages.thp_mode() == "madvise"
    f.write_text("[never]\n")
    assert huge_pages.thp_mode() == "never"
    monkeypatch.setattr(huge_pages, "_THP_ENABLED", tmp_path / "absent")
    assert huge_pages.thp_mode() == ""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_all_holds_what_pack_holds_in_one_buffer(dtype):
    kernel = rows_kernel.load(dtype)
    if kernel is None:
        pytest.skip(f"no rows kernel for {dtype} on this CPU: {rows_kernel.unavailable_reason(dtype)}")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).to(dtype) for n, k in ((96, 64), (200, 128), (33, 64), (1024, 512))]
    packed = kernel.pack_all(weights)
    alone = [kernel.pack(w) for w in weights]
    storage = packed[0].data.untyped_storage().data_ptr()
    for p, q, w in zip(packed, alone, weights, strict=True):
        assert p.data.untyped_storage().data_ptr() == storage  # one buffer
        assert p.data.is_contiguous() and p.data.data_ptr() % 64 == 0
        assert (p.out_features, p.in_features) == (w.shape[0], w.shape[1])
        assert torch.equal(p.data, q.data)
        x = torch.randn(5, w.shape[1], generator=g).to(dtype)
        assert torch.equal(kernel.rows(x, p), kernel.rows(x, q))


def test_the_benchmark_pools_rounds_and_holds_huge_pages_to_4k():
    from benchmarks import huge_pages as bench

    kernel = {"huge": {1: [0.010, 0.012], 8: [0.020, 0.019]}, "4k": {1: [0.011, 0.013], 8: [0.019, 0.022]}}
    engine = {("off", "huge"): {8: [(100, 1.0), (100, 2.0)]}, ("off", "4k"): {8: [(100, 0.5), (100, 2.5)]}}
    kernel_rows, rows = bench.figures(kernel, engine, ["off"], [8])
    assert [r["rows"] for r in kernel_rows] == [1, 8]
    assert kernel_rows[0]["x_4k"] == pytest.approx(1.1) and kernel_rows[1]["x_4k"] == pytest.approx(1.0)
    assert rows[0]["x_4k"] == pytest.approx(1.0) and rows[0]["x_4k_rounds"] == pytest.approx([0.5, 1.25])
    assert bench.parse_args(["--arms", "off,hybrid", "--concurrency", "4"]).levels == [4]
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "eagle"])


def test_the_benchmark_times_the_kernel_on_both_kinds_of_page_and_restores_the_switch():
    from types import SimpleNamespace

    from tiny_models import tiny_llama

    from benchmarks import huge_pages as bench

    if rows_kernel.load(torch.float32) is None:
        pytest.skip(f"no fp32 rows kernel here: {rows_kernel.unavailable_reason(torch.float32)}")
    args = bench.parse_args(["--dtype", "fp32", "--rounds", "2", "--reps", "1"])
    times = bench.measure_kernel(args, SimpleNamespace(target=tiny_llama(0)))
    assert set(times) == set(bench.PAGES)
    assert all(len(times[p][r]) == 2 and min(times[p][r]) > 0 for p in bench.PAGES for r in bench.KERNEL_ROWS)
    assert huge_pages.enabled()
