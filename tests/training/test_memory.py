"""The CPU counter against allocations of known size, and the prediction against it."""

import torch

from workbook.training.memory import measure, state_tensors, storage_bytes

CPU = torch.device("cpu")


def test_cpu_counter_sees_known_allocations_and_frees():
    keep = torch.zeros(1000)  # 4,000 bytes alive before the phase
    with measure(CPU, [keep]) as m:
        a = torch.empty(1000)  # +4,000
        b = torch.empty(2000)  # +8,000 -> peak 12,000 above the start
        del a  # -4,000
        c = torch.empty(500)  # +2,000
    r = m.reading
    assert r.counter == "cpu-profiler" and r.peak_reserved_bytes is None
    assert r.baseline_bytes == 4000
    assert r.peak_allocated_bytes == 4000 + 12000
    assert r.allocated_bytes == 4000 + 10000
    assert r.rss_peak_bytes is None or r.rss_peak_bytes > r.peak_allocated_bytes
    del b, c


def test_cpu_counter_on_a_linear_backward_matches_the_arithmetic():
    lin = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(64, 256)
    with measure(CPU) as m:
        y = lin(x)  # 64 x 256 floats
        y.sum().backward()  # weight gradient 256 x 256 floats, plus small temporaries
    grad_and_out = (64 * 256 + 256 * 256) * 4
    assert grad_and_out <= m.reading.allocated_bytes <= grad_and_out + 64 * 256 * 4 + 64


def test_counter_reading_survives_an_exception():
    try:
        with measure(CPU) as m:
            torch.empty(100)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert m.reading is not None and m.reading.peak_allocated_bytes >= 400


def test_storage_bytes_counts_shared_storage_once():
    t = torch.zeros(100)
    assert storage_bytes([t, t[:10], t.view(10, 10)]) == 400
    model = torch.nn.Linear(4, 2)
    assert storage_bytes(state_tensors(model)) == (8 + 2) * 4


def test_cublas_workspaces_are_nothing_off_cuda():
    """On a GPU the prediction adds the cuBLAS workspaces it measures (an H200 held 64 MiB:
    benchmarks/gpu_check.py); on the CPU nothing is added and no column appears."""
    import torch

    from workbook.training.fake_phases import with_workspaces
    from workbook.training.memory import cublas_workspace_bytes

    assert cublas_workspace_bytes(torch.device("cpu")) == 0
    rows = [{"phase": "backward", "predicted_peak_bytes": 10}]
    assert with_workspaces(rows, torch.device("cpu")) == rows
