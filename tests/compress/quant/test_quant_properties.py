"""Property tests (hypothesis) of the int8 format's quantizer: codes in range, RTN error <= half a step."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pocketdiff.compress.quant.int8_format import dequantize, qmax, quantize_codes, rtn_scale


@st.composite
def weights(draw):
    out = draw(st.integers(1, 6))
    cin = draw(st.sampled_from([1, 2, 4, 8]))
    k = draw(st.sampled_from([1, 3]))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.floats(1e-4, 1e3))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cin, k, k, generator=g) * scale
    if draw(st.booleans()):
        w[0] = 0.0  # an all-zero output channel must not divide by zero
    return w


@settings(max_examples=60, deadline=None)
@given(w=weights(), bits=st.sampled_from([4, 8]), grouped=st.booleans())
def test_rtn_codes_in_range_and_error_at_most_half_a_step(w, bits, grouped):
    group = w[0].numel() // 2 if grouped and w[0].numel() % 2 == 0 else None
    scale = rtn_scale(w, bits, group)
    codes = quantize_codes(w, scale, bits, group)
    assert codes.dtype == torch.int8
    assert int(codes.abs().max()) <= qmax(bits)
    err = (dequantize(codes, scale, group) - w).abs()
    step = dequantize(torch.ones_like(codes), scale, group)  # the scale broadcast to every weight
    assert bool((err <= step * 0.5 + 1e-6 * step + 1e-12).all())
