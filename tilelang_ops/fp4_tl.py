"""FP4 encode/decode building blocks for TileLang kernels, bit-exact with deepinfer/formats/fp4.py.

These are trace-time helpers: called inside a @T.prim_func they build TIR expressions. Powers of two
are made by writing exponent bits (T.reinterpret), so no exp2/log2 rounding can creep in.
"""
import tilelang.language as T


def absf(x):
    """|x| without fabs (the C target has no lowering rule for it)."""
    return T.max(x, -x)


def pow2(e):
    """2^e as fp32 for integer e in [-126, 127] (normal range), exact."""
    return T.reinterpret(T.shift_left(T.Cast("int32", e) + 127, 23), "float32")


def pow2_e8m0(byte):
    """E8M0 byte (biased exponent, 0..254) -> 2^(byte-127); byte 0 is the fp32 subnormal 2^-127."""
    b = T.Cast("int32", byte)
    return T.if_then_else(b == 0, pow2(b - 126) * T.float32(0.5),  # 2^-127, exact (b not folded: no const reinterpret on C)
                          T.reinterpret(T.shift_left(b, 23), "float32"))


def float_exponent(x):
    """floor(log2(x)) for a normal positive fp32 x, read from its exponent bits (subnormals give -127)."""
    return T.bitwise_and(T.shift_right(T.reinterpret(x, "int32"), 23), 255) - 127


def e4m3_decode(byte):
    """E4M3 (fn) bit pattern, sign bit clear -> fp32 value (exact)."""
    b = T.Cast("int32", byte)
    e, m = T.shift_right(b, 3), T.bitwise_and(b, 7)
    return T.if_then_else(e == 0, T.Cast("float32", m) * T.float32(2.0 ** -9),
                          T.Cast("float32", m + 8) * pow2(e - 10))


def group_scale(byte, fmt: str, tensor_scale):
    """A scale byte -> the fp32 multiplier of its group: E4M3 times the tensor scale (nvfp4), E8M0 (mxfp4)."""
    return e4m3_decode(byte) * tensor_scale if fmt == "nvfp4" else pow2_e8m0(byte)


def e4m3_round(s):
    """Non-negative fp32 s -> (E4M3 value, E4M3 byte): round to nearest even, saturate at 448.

    The quantum is 2^(e-3) with e = max(floor(log2 s), -6) (subnormals below 2^-6); s / quantum is exact
    (a power of two), nearbyint rounds half to even like torch's float8_e4m3fn cast.
    """
    sc = T.min(s, T.float32(448.0))
    e = T.max(float_exponent(sc), -6)
    m = T.Cast("int32", T.nearbyint(sc * pow2(3 - e)))      # in [0, 16]
    up = m == 16                                            # rounded up into the next binade
    e2, m2 = T.if_then_else(up, e + 1, e), T.if_then_else(up, 8, m)
    byte = T.if_then_else(m2 < 8, m2, T.shift_left(e2 + 7, 3) + (m2 - 8))
    return T.Cast("float32", m2) * pow2(e2 - 3), byte


def e2m1_code(v):
    """fp32 scaled value -> int32 nibble: RNE on the E2M1 grid (ties to the even code), saturating at 6."""
    a = absf(v)
    c = (T.Cast("int32", a > 0.25) + T.Cast("int32", a >= 0.75) + T.Cast("int32", a > 1.25)
         + T.Cast("int32", a >= 1.75) + T.Cast("int32", a > 2.5) + T.Cast("int32", a >= 3.5)
         + T.Cast("int32", a > 5.0))
    return T.if_then_else(T.And(v < 0, c > 0), c + 8, c)


def e2m1_value(nib):
    """int32 nibble -> fp32 grid value (sign bit 3), via a short select chain (no table in device memory)."""
    c = T.bitwise_and(nib, 7)
    mag = T.if_then_else(c < 4, T.Cast("float32", c) * 0.5,
                         T.if_then_else(c == 4, T.float32(2.0), T.if_then_else(
                             c == 5, T.float32(3.0), T.if_then_else(c == 6, T.float32(4.0), T.float32(6.0)))))
    return T.if_then_else(T.bitwise_and(nib, 8) != 0, -mag, mag)
