"""``scripts/bench_kernels.py``: what flash-linear-attention, the anchor of the kernel tables, is handed."""

from __future__ import annotations

import torch
from conftest import load_script


def test_fla_gets_the_tensors_themselves_with_one_query_head_per_kv_head():
    """At G = 1 fla's inputs are k, v, g and β as they are: a copy (``repeat_interleave(x, 1)`` makes one) would
    be timed as fla's. At G = 3 each KV head is repeated to its three query heads, in order."""
    repeat_kv = load_script("bench_kernels").repeat_kv
    x = torch.randn(2, 5, 2, 4)
    assert repeat_kv(1)(x) is x
    assert torch.equal(repeat_kv(3)(x), x[:, :, [0, 0, 0, 1, 1, 1]])
    g = torch.randn(2, 5, 2)  # a decay per head: [B, T, H]
    assert torch.equal(repeat_kv(3)(g), g[:, :, [0, 0, 0, 1, 1, 1]])


def test_the_table_shows_fla_graph_time_beside_ours():
    """A row timed from CUDA graphs shows ours and fla's graph forwards side by side, each under its header;
    a row without graphs shows neither column."""
    markdown = load_script("bench_kernels").markdown
    row = {"shape": "std", "B": 2, "T": 8192, "q_heads": 16, "kv_heads": 16, "ours_fwd_ms": 0.5, "fla_fwd_ms": 0.7,
           "ours_fwd_graph_ms": 0.4, "fla_fwd_graph_ms": 0.6, "speedup_fwd_vs_fla": 1.4}
    head, rule, line = markdown([row]).splitlines()
    cells = dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in line.split("|")]))
    assert (cells["ours fwd (graph)"], cells["fla fwd (graph)"], cells["fla fwd"]) == ("0.40", "0.60", "0.70")
    assert rule.count("---") == head.count("|") - 1
    plain = {k: v for k, v in row.items() if "graph" not in k}
    assert "graph" not in markdown([plain]).splitlines()[0]


def test_the_linear_switches_set_their_paths_for_a_run(monkeypatch):
    """``--linear-one-pass``, ``--linear-dv-in-dq`` and ``--linear-fused-segment`` set the switches the kernels
    read (an A/B of the linear paths in one tree); without them the modules keep their own defaults."""
    import argparse

    from linearize.ops.triton import linear_bwd, linear_fused

    bench = load_script("bench_kernels")
    for module, name in ((linear_fused, "ONE_PASS"), (linear_fused, "SEGMENT"), (linear_bwd, "DV_IN_DQ")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    switches = lambda: (linear_fused.ONE_PASS, linear_fused.SEGMENT, linear_bwd.DV_IN_DQ)  # noqa: E731
    defaults = switches()
    p = argparse.ArgumentParser()
    bench.add_operator_options(p)
    bench.apply_operator_options(p.parse_args([]))
    assert switches() == defaults
    bench.apply_operator_options(p.parse_args(["--linear-one-pass", "--linear-dv-in-dq", "--linear-fused-segment", "0"]))
    assert switches() == (True, 0, True)
    bench.apply_operator_options(p.parse_args(["--no-linear-one-pass"]))
    assert not linear_fused.ONE_PASS
