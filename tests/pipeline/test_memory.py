"""Per-step peak memory (megabase.pipeline.memory.step_peak_gib): each training step's row holds its
own peak, not the largest of the run so far."""

import numpy as np
import pytest
import torch

from megabase.pipeline.memory import proc_status, reset_peak_rss, step_peak_gib


@pytest.mark.skipif(proc_status("VmHWM") is None or not reset_peak_rss(),
                    reason="needs Linux's /proc/self/clear_refs")
def test_a_small_step_after_a_large_one_reads_its_own_peak():
    cpu = torch.device("cpu")
    step_peak_gib(cpu)
    big = np.ones(512 * 2**20 // 8)  # a step's 0.5 GiB of activations, touched, then freed
    del big
    large = step_peak_gib(cpu)
    small = step_peak_gib(cpu)
    assert large - small > 0.4, (large, small)
    assert small > 0.01  # the process itself is still counted
