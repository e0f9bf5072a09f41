"""A plain K-quant quantizer (Q4_K, Q5_K, Q6_K) for test files, since gguf-py has none.

Not llama.cpp's (no search for the best scales: each sub-block's range is its min and
max), but it writes valid blocks in ggml's byte layout, so a tiny checkpoint stored as
K-quants keeps its weights' scale and shape instead of random blocks. Whatever it writes
is read back by ``gguf.quants.dequantize``, the tests' reference; it only has to be valid.
"""

from __future__ import annotations

import numpy as np

SUPER = 256  # weights per super-block


def _fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _q4_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block as ggml's 12 bytes (get_scale_min_k4)."""
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return out


def _q4_k_q5_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K / Q5_K: w = d sc q - dmin m per 32 weights, q < 2^bits."""
    top = 2**bits - 1
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)  # the min is subtracted: dmin m >= 0
    scale = (sub.max(-1) - low) / top
    d = scale.max(-1) / 63
    dmin = (-low).max(-1) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16)
    dmin16 = dmin16.astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d16 > 0, d16, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / np.where(dmin16 > 0, dmin16, 1)[:, None]), 0, 63).astype(np.uint8)
    step = (d16[:, None] * sc)[..., None]
    offset = (dmin16[:, None] * m)[..., None]
    q = np.clip(np.round((sub + offset) / np.where(step > 0, step, 1)), 0, top).astype(np.uint8)
    q = q.reshape(-1, SUPER)
    e = np.arange(SUPER)
    qs = np.zeros((q.shape[0], 128), np.uint8)
    # Weight e: nibble (e / 32) % 2 of qs[32 (e / 64) + e % 32].
    np.bitwise_or.at(
        qs,
        (slice(None), 32 * (e // 64) + e % 32),
        ((q & 15) << (4 * ((e // 32) % 2))).astype(np.uint8),
    )
    parts = [_fp16(d), _fp16(dmin), _q4_k_scales(sc, m)]
    if bits == 5:  # the 5th bit of weight e: bit e / 32 of qh[e % 32]
        qh = np.zeros((q.shape[0], 32), np.uint8)
        np.bitwise_or.at(qh, (slice(None), e % 32), ((q >> 4) << (e // 32)).astype(np.uint8))
        parts.append(qh)
    return np.concatenate([*parts, qs], axis=-1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: w = d sc (q - 32) per 16 weights, int8 sc, q < 64."""
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = scale.max(-1) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d16 > 0, d16, 1)[:, None]), -128, 127).astype(np.int8)
    step = (d16[:, None] * sc)[..., None]
    q = np.clip(np.round(sub / np.where(step != 0, step, 1)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, SUPER)
    e = np.arange(SUPER)
    h, r = e // 128, e % 128
    ql = np.zeros((q.shape[0], 128), np.uint8)
    qh = np.zeros((q.shape[0], 64), np.uint8)
    np.bitwise_or.at(
        ql, (slice(None), 64 * h + r % 64), ((q & 15) << (4 * (r // 64))).astype(np.uint8)
    )
    np.bitwise_or.at(
        qh, (slice(None), 32 * h + r % 32), ((q >> 4) << (2 * (r // 32))).astype(np.uint8)
    )
    return np.concatenate([ql, qh, sc.view(np.uint8), _fp16(d)], axis=-1)


def quantize_k(array: np.ndarray, tensor_type: str) -> np.ndarray:
    """``array`` [rows, K] (K a multiple of 256) as ``tensor_type`` blocks: uint8 [rows,
    row bytes], as ``gguf.quants.quantize`` returns the other types."""
    rows = array.shape[0]
    blocks = array.astype(np.float32).reshape(-1, SUPER)
    if tensor_type == "Q6_K":
        raw = _q6_k(blocks)
    else:
        raw = _q4_k_q5_k(blocks, {"Q4_K": 4, "Q5_K": 5}[tensor_type])
    return raw.reshape(rows, -1)
