"""The Triton kernels' logic on the CPU (Triton's interpreter, in a subprocess so the
TRITON_INTERPRET switch does not leak into other tests)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).with_name("interpret_checks.py")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


# --- the W8A16 v2/v3 dequant PTX, run through a small emulator of the instructions it uses ---------------

def _bf16_bits_to_f64(bits):
    import numpy as np
    import torch
    bits = np.atleast_1d(np.asarray(bits, dtype=np.int64)) & 0xFFFF
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16).double().numpy()


def _f64_to_bf16_bits(v):
    """Round to nearest even, as mul.rn.bf16x2 does (the products here are exact in fp32, so the fp32 step
    does not round)."""
    import numpy as np
    import torch
    return torch.from_numpy(np.asarray(v)).float().bfloat16().view(torch.int16).numpy().astype(np.int64) & 0xFFFF


def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode): result byte i = byte sel[i] & 7 of {b, a}, or its sign replicated when
    sel[i] & 8."""
    import numpy as np
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = np.where(byte & 0x80, 0xFF, 0)
        out |= byte << (8 * i)
    return out


def run_ptx(asm, regs):
    """Execute the dequant helpers' PTX subset on int64 numpy arrays holding 32-bit (or 16-bit) values."""
    import re
    import numpy as np

    def val(tok):
        tok = tok.strip()
        return np.int64(int(tok, 0)) if re.match(r"^(0x[0-9a-fA-F]+|\d+)$", tok) else regs[tok]

    body = "\n".join(ln for ln in asm.splitlines() if ln.strip() not in ("{", "}"))     # the block braces
    for stmt in body.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        m = re.match(r"^\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)$", rest)          # mov.b32 {a, b}, t
        if op == "mov.b32" and m:
            t = val(m.group(3))
            regs[m.group(1)], regs[m.group(2)] = t & 0xFFFF, (t >> 16) & 0xFFFF
            continue
        m = re.match(r"^(\S+)\s*,\s*\{\s*(\S+)\s*,\s*(\S+)\s*\}$", rest)          # mov.b32 t, {a, b}
        if op == "mov.b32" and m:
            regs[m.group(1)] = (val(m.group(2)) & 0xFFFF) | ((val(m.group(3)) & 0xFFFF) << 16)
            continue
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], args[1:]
        if op == "mov.b32":
            r = val(srcs[0]) & 0xFFFFFFFF
        elif op == "cvt.u32.u16":
            r = val(srcs[0]) & 0xFFFF
        elif op == "prmt.b32":
            r = _prmt(val(srcs[0]) & 0xFFFFFFFF, np.broadcast_to(val(srcs[1]), np.shape(val(srcs[0]))).copy(),
                      int(srcs[2], 0))
        elif op == "shl.b32":
            r = (val(srcs[0]) << int(srcs[1], 0)) & 0xFFFFFFFF
        elif op == "and.b32":
            r = val(srcs[0]) & val(srcs[1])
        elif op == "mul.lo.u32":
            r = (val(srcs[0]) * val(srcs[1])) & 0xFFFFFFFF
        elif op == "mul.rn.bf16x2":
            a, b = val(srcs[0]), val(srcs[1])
            lo = _f64_to_bf16_bits(_bf16_bits_to_f64(a) * _bf16_bits_to_f64(b))
            hi = _f64_to_bf16_bits(_bf16_bits_to_f64(a >> 16) * _bf16_bits_to_f64(b >> 16))
            r = lo | (hi << 16)
        else:
            raise AssertionError(f"instruction {op} not emulated")
        regs[d] = np.asarray(r, dtype=np.int64)
    return regs


def _expected_bf16_bits(byte, scale):
    """bf16 bits of e4m3(byte) * scale, the plain torch way."""
    import numpy as np
    import torch
    w = torch.from_numpy(byte.astype(np.uint8)).view(torch.float8_e4m3fn).float()
    return (w * scale).bfloat16().view(torch.int16).numpy().astype(np.int64) & 0xFFFF


@pytest.mark.parametrize("scale_exp", [-40, -9, 0, 7, 20])
def test_w8a16_dequant_ptx_every_byte(scale_exp):
    """The pair (pack=1) and byte (pack=4) dequant PTX of triton_gemm, emulated instruction by instruction,
    give bf16(e4m3 * 2^e) bit for bit for every finite e4m3 byte (subnormals, +-0 included) and every byte
    position. e4m3 NaN bytes (0x7f, 0xff; never in a checkpoint) decode to +-480 here instead of NaN."""
    import numpy as np
    import torch
    from deepinfer.kernels import triton_gemm as tg
    s_bits = int(torch.tensor(2.0 ** scale_exp).bfloat16().view(torch.int16)) & 0xFFFF
    finite = lambda b: (b & 0x7F) != 0x7F  # noqa: E731
    # pair form: every int16
    v = np.arange(65536, dtype=np.int64)
    r = run_ptx(tg._PAIR_ASM.value, {"$2": v, "$3": np.full_like(v, s_bits)})
    for out, byte in (("$0", v & 0xFF), ("$1", v >> 8)):
        ok = finite(byte)
        assert np.array_equal(r[out][ok], _expected_bf16_bits(byte, 2.0 ** scale_exp)[ok]), out
    # the row-scaled kernel's pair form (no scale): every int16
    r = run_ptx(tg._PAIR_ASM_NOSCALE.value, {"$2": v})
    for out, byte in (("$0", v & 0xFF), ("$1", v >> 8)):
        ok = finite(byte)
        assert np.array_equal(r[out][ok], _expected_bf16_bits(byte, 1.0)[ok]), ("noscale", out)
    # byte form: every byte value in each of the four positions, scales per byte pair
    b = np.arange(256, dtype=np.int64)
    word = b | (((b + 37) % 256) << 8) | (((b + 101) % 256) << 16) | (((b + 199) % 256) << 24)
    s_pair = np.full_like(b, s_bits | (s_bits << 16))
    r = run_ptx(tg._BYTES_ASM.value, {"$2": word, "$3": s_pair, "$4": s_pair})
    for i, (out, half) in enumerate((("$0", 0), ("$0", 16), ("$1", 0), ("$1", 16))):
        byte = (word >> (8 * i)) & 0xFF
        got = (r[out] >> half) & 0xFFFF
        ok = finite(byte)
        assert np.array_equal(got[ok], _expected_bf16_bits(byte, 2.0 ** scale_exp)[ok]), (out, half)


@pytest.mark.parametrize("scale_byte", [1, 2, 20, 100, 117, 127, 128])
def test_w4a16_dequant_ptx_every_int16(scale_byte):
    """The MXFP4 decode PTX (triton_gemm._FP4_ASM), emulated instruction by instruction, gives
    bf16(dequant_fp4_ref) bit for bit for every int16 of fp4_kernel_layout (four nibbles: +-0, the
    subnormal 0.5, every e2m1 value in every position) at block scales 2^(k - 127) from the smallest byte
    the kernel sees (fp4_kernel_weight maps byte 0 away) up to FP4_MAX_SCALE_BYTE. Outputs $0..$3 are
    k = 2c, 2c+1, 2c+8, 2c+9: byte 0's low and byte 1's low nibble, then the two high nibbles."""
    import numpy as np
    import torch
    from deepinfer.kernels import triton_gemm as tg
    from deepinfer.kernels.reference import dequant_fp4_ref

    v = np.arange(65536, dtype=np.int64)
    mult = ((scale_byte + 126) << 7) * 0x10001            # what _fp4_scale hands the asm
    assert mult == scale_byte * 0x800080 + 0x3F003F00
    r = run_ptx(tg._FP4_ASM.value, {"$4": v, "$5": np.full_like(v, mult)})
    nib = [v & 15, (v >> 8) & 15, (v >> 4) & 15, (v >> 12) & 15]      # k = 2c, 2c+1, 2c+8, 2c+9
    rows = np.zeros((65536, 16), dtype=np.uint8)
    rows[:, 0] = nib[0] | (nib[1] << 4)
    rows[:, 1] = nib[2] | (nib[3] << 4)
    ref = dequant_fp4_ref(torch.from_numpy(rows), torch.full((65536, 1), scale_byte, dtype=torch.uint8))[:, :4]
    assert torch.equal(ref.bfloat16().float(), ref)                  # exact in bf16
    want = ref.bfloat16().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    for j in range(4):
        assert np.array_equal(r[f"${j}"] & 0xFFFF, want[:, j]), (j, scale_byte)


def test_fp4_kernel_weight_is_the_release_weight():
    """fp4_kernel_layout only moves nibbles (fp4_release_layout undoes it), and fp4_kernel_weight's zero-block
    mapping (scale byte 0 -> nibbles +0, byte 1) keeps every dequantized weight: the reference's byte 0 is 0."""
    import torch
    from deepinfer.kernels import triton_gemm as tg
    from deepinfer.kernels.reference import dequant_fp4_ref
    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (3, 7, 80), generator=gen).to(torch.uint8)
    scale = torch.randint(2, 129, (3, 7, 5), generator=gen).to(torch.uint8)
    scale[0, :, 1] = 0
    scale[2, 3, 4] = 0
    assert torch.equal(tg.fp4_release_layout(tg.fp4_kernel_layout(packed)), packed)
    pk, sk = tg.fp4_kernel_weight(packed, scale)
    assert tg.fp4_scales_ok(scale) and int(sk.min()) >= 1 and not (sk == 0).any()
    assert not tg.fp4_scales_ok(torch.tensor([5, 129], dtype=torch.uint8))
    assert not tg.fp4_scales_ok(torch.tensor([5, 1], dtype=torch.uint8))
    for g in range(3):
        assert torch.equal(dequant_fp4_ref(tg.fp4_release_layout(pk[g]), sk[g]), dequant_fp4_ref(packed[g], scale[g]))
    # a k16 slice: stored byte j holds k[j] (low nibble) and k[j + 8] (high)
    row = torch.arange(16, dtype=torch.uint8)
    rel = (row[0::2] | (row[1::2] << 4))[None]
    assert tg.fp4_kernel_layout(rel)[0].tolist() == [j | ((j + 8) << 4) for j in range(8)]
