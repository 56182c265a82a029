"""Products of quantized operands computed on their integer codes (docs/method.md §2, "Integer products").

With codes centred on their middle code (int8), ``A B = s_a s_b (a' b') + s_a (a' 1) z_b + z_a (1 b') s_b + K z_a z_b``:
one integer product (exact int32 sums) and rank-one terms, applied in one native pass: an int8 GEMM where the CPU has
int8 dot products, else the float32 GEMM of the centred codes where a bound proves its sums exact, or float64.
"""

from __future__ import annotations

import torch

from ..utils import cached_outside_compile
from .code_kernels import centred_codes_native, code_product_native
from .derived import derived

MAX_REDUCED_SIZE = (2**31 - 1) // 128**2  # the largest K whose sum of int8 code products fits in int32


def _centred(codes: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
    """``codes - middle`` as int8: the uint8 difference wraps modulo 256, and codes in ``[0, 2 middle)`` land in
    ``[-middle, middle)``, which int8 holds exactly (no branch on the data: a compiled graph traces it)."""
    return (codes - middle).view(torch.int8)


# Columns of ones that `_code_sums` multiplies by (an int8 product needs a few, not one).
SUM_COLUMNS = 8


@cached_outside_compile(maxsize=32)
def _ones(reduced: int, device: torch.device) -> torch.Tensor:
    """``[reduced, SUM_COLUMNS]`` int8 ones: made once per size and device in eager code (every product of a step
    needs one), a constant of the graph in compiled code."""
    with torch.inference_mode(False):  # a normal tensor even when first asked for under inference mode
        return torch.ones(reduced, SUM_COLUMNS, dtype=torch.int8, device=device)


def _code_sums(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row sums of ``a`` ``[M, 1]`` and column sums of ``b`` ``[1, N]`` (int8), in int32: as int8 products with
    a block of ones, exact like every int32 sum here. (``sum(dtype=torch.int32)`` first copies the operand to int32,
    a tensor four times the codes' size, and reads it back.)"""
    ones = _ones(a.shape[1], a.device)
    return torch._int_mm(a, ones)[:, :1], torch._int_mm(ones.t(), b)[:1]


# Every partial sum of a product of int8 codes whose row and column norms multiply to at most 2^24 is an integer that
# float32 holds exactly: the bound on the product of their squares, compared in integers.
EXACT_FLOAT_SQUARES = 2**48


def _float_gemm_on_codes(a_codes: torch.Tensor, b_codes: torch.Tensor, middle_code: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the row sums of ``a`` ``[M, 1]``, the column sums of ``b`` ``[1, N]``, the products ``a @ b`` ``[M, N]``) of
    the centred codes, exact, on a CPU without int8 dot products: in a float32 GEMM of the centred codes (the GEMM the
    float product runs), exact because every partial sum it forms, in whatever order, is an integer at most 2^24 in
    magnitude: each is bounded by ``|a_i| |b_j|`` (Cauchy-Schwarz), whose squares `EXACT_FLOAT_SQUARES` bounds; above
    it, or where float32 GEMMs may round to bfloat16 (``torch.set_float32_matmul_precision("medium")``), in float64
    (docs/method.md §2, "Integer products")."""
    with torch.autocast("cpu", enabled=False):  # a float32 GEMM, never autocast's bfloat16 one
        a_values, a_sums, a_squares = _centred_values(a_codes, middle_code, False)
        b_values, b_sums, b_squares = _centred_values(b_codes, middle_code, True)
        a_sums, b_sums = a_sums.view(-1, 1), b_sums.view(1, -1)
        largest = [int(t.max()) if t.numel() else 0 for t in (a_squares, b_squares)]
        if largest[0] * largest[1] <= EXACT_FLOAT_SQUARES and _full_float32_gemm():
            return a_sums, b_sums, torch.mm(a_values, b_values)
        return a_sums, b_sums, torch.mm(a_values.double(), b_values.double()).to(torch.int32)


def _centred_values(codes: torch.Tensor, middle_code: torch.Tensor, per_column: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``codes - middle`` as float32, the int32 sums and sums of squares along the reduced dimension: of each row of
    ``[M, K]`` codes, of each column of ``[K, N]`` ones), in one native pass where it serves (a weight's transposed
    view as the Linear passes it, read as its rows)."""
    transposed = per_column and codes.t().is_contiguous()
    native = centred_codes_native(codes.t() if transposed else codes, int(middle_code), per_column and not transposed)
    if native is not None:
        values, sums, squares = native
        return (values.t() if transposed else values), sums, squares
    centred = _centred(codes, middle_code).to(torch.int32)
    dim = 0 if per_column else 1
    return centred.float(), centred.sum(dim, dtype=torch.int32), centred.square().sum(dim, dtype=torch.int32)


def _full_float32_gemm() -> bool:
    """Whether CPU float32 GEMMs multiply in full float32 (torch's "highest" precision, oneDNN's IEEE mode)."""
    onednn = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "none")
    return torch.get_float32_matmul_precision() == "highest" and onednn in ("none", "ieee")


def _middle_code(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    middle = torch.exp2(bits.float() - 1)
    return middle, middle.to(torch.uint8)


def code_matmul(
    a_codes: torch.Tensor, a_scale: torch.Tensor, a_min: torch.Tensor,
    b_codes: torch.Tensor, b_scale: torch.Tensor, b_min: torch.Tensor,
    bits: torch.Tensor, bias: torch.Tensor | None = None, int8: bool = True, native: bool = True,
) -> torch.Tensor:
    """``(a_codes * a_scale + a_min) @ (b_codes * b_scale + b_min) + bias`` in float32, for codes of ``bits`` <= 8.

    ``a_codes``: uint8 ``[M, K]``, its scale and minimum ``[M, 1]`` or one value; ``b_codes``: uint8 ``[K, N]``
    (a transposed view is fine), its scale and minimum ``[1, N]`` or one value; ``bias``: ``[N]``. ``K`` is at most
    `MAX_REDUCED_SIZE`. ``int8``: the integer product as an int8 GEMM (the caller's backend knows whether that is
    fast; a compiled graph always takes it), else as the float32 GEMM of the centred codes, exact where a bound proves
    it (a CPU without int8 dot products); ``native``: the scaling in one C pass where it serves.
    """
    reduced = a_codes.shape[1]
    if reduced > MAX_REDUCED_SIZE:
        raise ValueError(f"code_matmul sums at most {MAX_REDUCED_SIZE} code products exactly in int32, got {reduced}")
    # the middle code, 2^(b-1), as a float and as a code: once per value of the bits (`derived`)
    middle, middle_code = derived(bits, "middle_code", lambda: _middle_code(bits))
    a_scale, b_scale = a_scale.float(), b_scale.float()
    a_zero = a_min.float() + middle * a_scale  # the value of the middle code
    b_zero = b_min.float() + middle * b_scale
    if int8 or a_codes.device.type != "cpu" or torch.compiler.is_compiling():
        a, b = _centred(a_codes, middle_code), _centred(b_codes, middle_code)
        a_sums, b_sums = _code_sums(a, b)
        products = torch._int_mm(a, b)
    else:
        a_sums, b_sums, products = _float_gemm_on_codes(a_codes, b_codes, middle_code)
    row_sum, column_term = a_scale * a_sums, b_scale * b_sums + reduced * b_zero
    fast = (code_product_native(products, a_scale, row_sum, a_zero, b_scale, b_zero, column_term, bias) if native
            else None)
    if fast is not None:
        return fast
    out = products.view(torch.float32)  # int32 -> float32 in the product's own memory: no second full-size tensor
    if products.dtype != torch.float32:
        out.copy_(products)
    out.mul_(a_scale).mul_(b_scale)
    # the rank-one terms and the bias in one pass: [s_a (a' 1), z_a, 1] @ [z_b; s_b (1 b') + K z_b; bias]
    rows, columns = out.shape
    left = torch.stack([row_sum.expand(rows, 1).reshape(rows), a_zero.expand(rows, 1).reshape(rows),
                        torch.ones(rows, dtype=out.dtype, device=out.device)], 1)
    right = torch.stack([b_zero.expand(1, columns).reshape(columns), column_term.expand(1, columns).reshape(columns),
                         torch.zeros(columns, dtype=out.dtype, device=out.device) if bias is None else bias.float()],
                        0)
    return out.addmm_(left, right)
