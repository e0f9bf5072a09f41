"""The int8-weight GEMM in Triton: ``x @ (w_int8 * scale[:, None]).T`` without ever
materialising the dequantized weight.

Decode multiplies a few rows by every weight matrix, so it is bound by reading the
weights: int8 reads half of bf16's bytes. Each program computes a ``BLOCK_M x BLOCK_N``
tile of the output: it walks ``K`` in ``BLOCK_K`` steps, loads the int8 weight tile,
converts it to the activations' dtype in registers and accumulates ``tl.dot`` in fp32;
the per-channel scale multiplies the finished tile once (it is constant along ``K``).
Small-``N`` tiles are among the candidates so a decode step still spreads over every SM;
the autotuner keys on the row count's power of two, so decode and prefill tune apart.
"""

from __future__ import annotations

import torch

from llmctl_torch.triton_common import UPCAST_LOADS, tl, triton, tuning_configs


def _row_bucket(rows: int) -> int:
    """The autotuner's key for the row count: decode (1..16) and prefill sizes apart."""
    return min(triton.next_power_of_2(max(rows, 16)), 256)


@triton.autotune(
    configs=tuning_configs(
        gpu=[
            ({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256}, 4, 4),
            ({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256}, 4, 4),
            ({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}, 4, 4),
            ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 3),
            ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, 8, 3),
        ],
        interpreted={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32},
    ),
    key=["ROW_BUCKET", "N", "K"],
)
@triton.jit
def _int8_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    ROW_BUCKET: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0)
        if UPCAST:
            x = x.to(tl.float32)
        # int8 -> the activations' dtype is exact (|w| <= 127 fits every float mantissa).
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
    scale = tl.load(scale_ptr + cols, mask=col_mask, other=0.0)
    acc = acc * scale[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x: [..., K]`` (float16, bfloat16 or float32) times ``qweight: int8 [N, K]`` with
    ``scale: float32 [N]`` per output channel → ``[..., N]`` in ``x``'s dtype."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.stride(1) != 1:
        raise ValueError(
            f"qweight must be a 2-d int8 [N, K] tensor with contiguous rows, got "
            f"{qweight.dtype} {tuple(qweight.shape)}"
        )
    num_out, num_in = qweight.shape
    if x.shape[-1] != num_in or scale.shape != (num_out,):
        raise ValueError(
            f"x [..., {num_in}] and scale [{num_out}] must match qweight "
            f"{tuple(qweight.shape)}, got {tuple(x.shape)} and {tuple(scale.shape)}"
        )
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, not {x.dtype}")
    if not (x.device == qweight.device == scale.device):
        raise ValueError("x, qweight and scale must be on the same device")
    rows = x.reshape(-1, num_in)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], num_out), dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(*x.shape[:-1], num_out)

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(rows.shape[0], meta["BLOCK_M"]), triton.cdiv(num_out, meta["BLOCK_N"]))

    _int8_linear_kernel[grid](
        rows,
        qweight,
        scale.float(),
        out,
        rows.shape[0],
        num_out,
        num_in,
        rows.stride(0),
        qweight.stride(0),
        out.stride(0),
        ROW_BUCKET=_row_bucket(rows.shape[0]),
        UPCAST=UPCAST_LOADS,
    )
    return out.view(*x.shape[:-1], num_out)
