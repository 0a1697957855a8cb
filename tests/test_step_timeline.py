"""bench/step_timeline.py's classification of a profiler trace (a synthetic one: the function is
pure), so a wrong sum or a misread launch shows here and not first on the GPU."""

from __future__ import annotations

import pytest

from bench.step_timeline import summarize


def _trace():
    rt = lambda name, corr: {"cat": "cuda_runtime", "name": name, "args": {"correlation": corr}}  # noqa: E731
    k = lambda name, ts, dur, corr, cat="kernel": {"cat": cat, "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                                   "args": {"correlation": corr}}
    return {"traceEvents": [
        rt("cudaLaunchKernel", 1), rt("cudaMemcpyAsync", 2), rt("cudaGraphLaunch", 3), rt("cudaGraphLaunch", 4),
        k("fill", 0.0, 4.0, 1),                         # eager, 0 .. 4
        k("Memcpy HtoD", 10.0, 2.0, 2, "gpu_memcpy"),   # idle 6 before it
        k("layer_a", 12.0, 50.0, 3),                    # graph, back to back
        k("layer_b", 62.0, 30.0, 3),
        k("head", 100.0, 20.0, 4),                      # idle 8 before it
        {"cat": "cpu_op", "name": "aten::add", "ts": 1.0, "dur": 1.0},
    ]}


def test_classifies_by_launching_call_and_finds_gaps():
    rep = summarize(_trace(), steps=2, wall_s=2e-4)
    assert rep["classified"]
    assert rep["busy_ms_per_step"] == pytest.approx({"eager_kernel": 2e-3, "memcpy": 1e-3, "graph": 50e-3})
    assert rep["activities_per_step"] == {"eager_kernel": 0.5, "memcpy": 0.5, "graph": 1.5}
    assert rep["idle_ms_per_step"] == pytest.approx(7e-3)         # (6 + 8) us over 2 steps
    assert rep["idle_gaps_over_5us_per_step"] == 1.0
    assert rep["largest_gaps_us"][0] == (8.0, "layer_b", "head")
    assert rep["gpu_span_ms_per_step"] == pytest.approx(60e-3)
    assert rep["wall_ms_per_step"] == pytest.approx(0.1)
    names = [n for n, _, _ in rep["outside_graph_by_name"]]
    assert names == ["eager_kernel: fill", "memcpy: Memcpy HtoD"]
    # the graph's kernels by name, most time first: (name, launches per step, ms per step)
    assert rep["graph_kernels_by_name"] == [("layer_a", 0.5, pytest.approx(25e-3)),
                                            ("layer_b", 0.5, pytest.approx(15e-3)),
                                            ("head", 0.5, pytest.approx(10e-3))]
    # the span each graph kernel adds: head's 20 us with the 8 us idle before it counted
    assert rep["graph_kernels_by_added_span"] == [("layer_a", 0.5, pytest.approx(25e-3)),
                                                  ("layer_b", 0.5, pytest.approx(15e-3)),
                                                  ("head", 0.5, pytest.approx(14e-3))]


def test_overlapping_activities_are_not_gaps():
    t = {"traceEvents": [{"cat": "kernel", "name": "a", "ts": 0.0, "dur": 10.0, "args": {}},
                         {"cat": "kernel", "name": "b", "ts": 2.0, "dur": 3.0, "args": {}},
                         {"cat": "kernel", "name": "c", "ts": 9.0, "dur": 1.0, "args": {}}]}
    rep = summarize(t, steps=1, wall_s=1e-5)
    assert rep["idle_ms_per_step"] == 0.0 and not rep["classified"]


def test_added_span_counts_overlapping_kernels_once():
    """Under PDL a kernel starts before the one it waits for has ended: each adds only its end past the
    earlier ones', so the additions sum to the span."""
    g = lambda name, ts, dur: {"cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                               "args": {"correlation": 1}}
    t = {"traceEvents": [{"cat": "cuda_runtime", "name": "cudaGraphLaunch", "args": {"correlation": 1}},
                         g("a", 0.0, 10.0), g("b", 2.0, 12.0), g("c", 3.0, 5.0), g("d", 20.0, 2.0)]}
    rep = summarize(t, steps=1, wall_s=1e-5)
    added = {n: ms * 1e3 for n, _, ms in rep["graph_kernels_by_added_span"]}
    assert added == pytest.approx({"a": 10.0, "b": 4.0, "c": 0.0, "d": 8.0})
    assert sum(added.values()) == pytest.approx(rep["gpu_span_ms_per_step"] * 1e3)


def test_last_replay_sequence_in_launch_order():
    """The last replay's kernels, in order, with their start from the replay's first kernel and the span each adds."""
    rep = summarize(_trace(), steps=2, wall_s=2e-4)
    assert rep["last_replay_sequence"] == [("head", 0.0, 20.0, 28.0)]   # replay 4 started last; 8 us idle before it
    t = _trace()
    t["traceEvents"] = [e for e in t["traceEvents"] if e.get("name") != "head"]
    assert summarize(t, steps=1, wall_s=1e-4)["last_replay_sequence"] == [("layer_a", 0.0, 50.0, 50.0),
                                                                          ("layer_b", 50.0, 30.0, 30.0)]
