"""Skinny matrix products on the CPU (engine/kernels/skinny.cpp through ctypes).

`SkinnyMatrix(w)` packs a [K, N] float32 matrix into the kernel's column panels once;
`sm.matmul(x, bias, residual)` computes `x @ w (+ bias) (+ residual)` for x [M, K] with few rows
(decode and verify passes). `SkinnyMatrix(w, bf16=True)` keeps the panels in bf16: half the bytes
streamed per product, each weight widened back to float32 exactly in the kernel, so the result is
the float32 product over `w` rounded to bf16 (`w.bfloat16()`), with the same row independence.
`SkinnyMatrix(w, dot=True)` computes in bf16 arithmetic: x and w rounded to bf16, pairs of products
summed into float32 by AVX512_BF16's dot product (2x float32's arithmetic a core does: a drafter's
products, engine.spec.drafter_products, and the target's, engine.products), in a fixed order, so
rows stay independent too.
Each output row is accumulated on its own in a fixed order, so a
row's result does not depend on M nor on the host's tuned loop parameters (engine/kernels/params.py);
the panel width those fix is read once, when the library loads, and never changes after.
"""

from __future__ import annotations

import torch

from engine.kernels.library import library

# The kernel serves every decode and verify pass: a row's result then never depends on how many
# rows share the pass, so a verify pass reproduces sequential decoding bit for bit. A verify pass
# is batch x (1 + draft) rows (128 x 17 = 2176), so the bound is far above decode sizes; beyond it
# only long prefills go to torch. Where the kernel is slower than torch's GEMM on a host even
# tuned, the engine drops it for every row count at once (engine/kernels/tune.py, guard).
MAX_ROWS = 4096


def bf16_dot(choice: str) -> bool:
    """Whether products chosen as `choice` (float32 | bf16 | auto) run in bf16 arithmetic: auto where
    the kernels build and were compiled with AVX512_BF16, so the dot products run natively (emulated
    ones are slower than float32's)."""
    if choice != "auto":
        return choice == "bf16"
    from engine.kernels.library import available

    return available()[0] and bool(library().skinny_bf16dot_native())


class SkinnyMatrix:
    """A [K, N] float32 matrix packed for few-row products (a copy: the caller keeps its own), in
    float32 or, with `bf16`, rounded to bf16 (to nearest even, as `w.bfloat16()`); with `dot`,
    rounded to bf16 and multiplied in bf16 arithmetic (see the module's docstring)."""

    def __init__(self, w: torch.Tensor, bf16: bool = False, dot: bool = False) -> None:  # w [K, N]
        if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
            raise ValueError(f"SkinnyMatrix takes a 2-D float32 CPU matrix, got {tuple(w.shape)} {w.dtype} on {w.device}")
        lib = library()
        self.K, self.N = w.shape
        tn = lib.skinny_tile_n()
        if dot:  # panels of k pairs [P, ceil(K / 2), TN, 2]
            dtype, pack, self.gemm, rows = torch.bfloat16, lib.skinny_pack_bf16dot, lib.skinny_gemm_bf16dot, 2 * (-(-self.K // 2))
        elif bf16:
            dtype, pack, self.gemm, rows = torch.bfloat16, lib.skinny_pack_bf16, lib.skinny_gemm_bf16, self.K
        else:
            dtype, pack, self.gemm, rows = torch.float32, lib.skinny_pack, lib.skinny_gemm, self.K
        w = w.detach().to(dtype).contiguous()
        self.panels = torch.empty(-(-self.N // tn) * rows * tn, dtype=dtype)  # [P, K, TN] (bf16: their bits)
        pack(w.data_ptr(), self.N, self.panels.data_ptr(), self.K, self.N)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] = x @ w (+ bias [N]) (+ residual [M, N])."""
        M = x.shape[0]
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty(M, self.N, dtype=torch.float32)
        if residual is not None and not residual.is_contiguous():
            residual = residual.contiguous()
        self.gemm(
            x.data_ptr(), self.K, self.panels.data_ptr(), bias.data_ptr() if bias is not None else None,
            residual.data_ptr() if residual is not None else None, self.N, y.data_ptr(), self.N, M, self.K, self.N,
            torch.get_num_threads(),
        )
        return y
