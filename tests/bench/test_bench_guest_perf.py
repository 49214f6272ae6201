"""bench/bench_guest_perf.py reads the figures the tools print (their output formats, as the tools print them)."""

from __future__ import annotations

from bench.bench_guest_perf import ib_average_gbits, nccl_busbw, vllm_output_tokens

NCCL = """#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
     8388608       2097152     float     sum      -1    120.1   69.85  122.24      0    119.8   70.02  122.54      0
  8589934592    2147483648     float     sum      -1    56012  153.36  268.38      0    55990  153.42  268.48      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 187.521
#
"""
IB = """---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      5000             392.11             391.87             0.747438
---------------------------------------------------------------------------------------
"""
VLLM = "Throughput: 12.34 requests/s, 15796.12 total tokens/s, 3159.22 output tokens/s\n"


def test_each_tools_figure_is_read_and_absence_is_none():
    assert nccl_busbw(NCCL) == 187.521
    assert ib_average_gbits(IB) == 391.87
    assert vllm_output_tokens(VLLM) == 3159.22
    assert nccl_busbw("") is None and ib_average_gbits("error") is None and vllm_output_tokens("OOM") is None
