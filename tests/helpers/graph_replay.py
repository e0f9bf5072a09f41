"""A stand-in for CUDA graph capture on machines without a GPU."""

from __future__ import annotations


def replay_eagerly(fn, pool):
    """Record ``fn`` the way ``llmctl.engine.cuda_graphs.record_cuda_graph`` does, minus the
    graph: replaying reruns ``fn`` on the same fixed buffers and writes into the same
    output tensor, so the staging and padding around the graphs run as on a GPU."""
    output = fn()
    return (lambda: output.copy_(fn())), output
