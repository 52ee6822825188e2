"""Host-side helpers of ``slimformer.kernels.dispatch``."""

import triton

from slimformer.kernels import dispatch


def test_host_integer_helpers_equal_tritons():
    """``dispatch.cdiv`` / ``next_power_of_2`` are Triton's formulas without the
    ``constexpr_function`` wrapper that Triton 3.6 puts around them (µs per host call)."""
    for n in [*range(0, 1100), 4095, 4096, 4097, 2**20 - 1, 2**31 + 5]:
        assert dispatch.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 7, 16, 128):
            assert dispatch.cdiv(n, d) == triton.cdiv(n, d), (n, d)
