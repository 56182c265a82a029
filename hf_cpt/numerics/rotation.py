"""Fixed orthogonal rotations of a layer's input features (docs/method.md, "Rotation").

Rotating the input features by an orthogonal ``R`` (``x -> x R``, ``W -> W R``, so ``x R (W R)^T = x W^T``) spreads a
pretrained transformer's outlier channels over every channel before quantizing (QuaRot, SpinQuant). ``R = diag(s)
(H_1 ⊗ H_2 ⊗ ...) / sqrt(d)``: random signs and small Hadamard factors (powers of two up to `MAX_FACTOR`; a Paley
factor of order ``q + 1`` for an odd part such as 384 = 12 x 32; else a dense random orthogonal factor), applied
factor by factor, a deterministic function of ``(d, seed)`` built on the CPU (packed checkpoints also store the
tensors). Knows nothing of layers.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass

import torch

from ..utils import cached_outside_compile
from . import native
from .derived import derived

MAX_FACTOR = 32  # largest power-of-two Hadamard factor stored (the rotation's definition)
MAX_MERGED_BLOCK = 256  # trailing factors merged into one block of at most this size when applied (speed only)
# How a power-of-two (Sylvester) part of these sizes is applied instead of merged: block sizes, innermost first,
# when the rotated axis is the last one ("last": the first block is a plain matrix product) or not ("inner": every
# block is a batched product, e.g. a Conv1D weight's first axis). The same matrix whatever the split (H_a ⊗ H_b =
# H_ab for Sylvester's construction); measured faster on CPU than one merged block (docs/benchmarks.md). Speed only.
SYLVESTER_SPLITS = {"last": {128: (16, 8), 256: (16, 16)}, "inner": {64: (8, 8), 128: (16, 8), 256: (16, 16)}}
MAX_PALEY_ORDER = 64  # larger Paley factors cost more than a dense factor for the odd part
MAX_DENSE_FACTOR = 256  # largest odd part handled by a dense orthogonal factor
DEFAULT_SEED = 0


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, math.isqrt(n) + 1))


def paley_hadamard(order: int) -> torch.Tensor:
    """Hadamard matrix of ``order = q + 1`` (``q`` prime, ``q = 3 mod 4``) by Paley's first construction."""
    q = order - 1
    if not (_is_prime(q) and q % 4 == 3):
        raise ValueError(f"Paley's construction needs order - 1 to be a prime = 3 mod 4, got order {order}.")
    residues = {(i * i) % q for i in range(1, q)}
    chi = [0] + [1 if i in residues else -1 for i in range(1, q)]
    jacobsthal = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float64)
    skew = torch.zeros(order, order, dtype=torch.float64)
    skew[0, 1:] = 1.0
    skew[1:, 0] = -1.0
    skew[1:, 1:] = jacobsthal
    return skew + torch.eye(order, dtype=torch.float64)


def sylvester_hadamard(order: int) -> torch.Tensor:
    """Hadamard matrix of a power-of-two order (Sylvester's construction)."""
    if order < 1 or order & (order - 1):
        raise ValueError(f"Sylvester's construction needs a power of two, got {order}.")
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < order:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return matrix


def _paley_order_for(odd: int, power: int) -> int | None:
    """The smallest Paley order ``odd * 2^j`` (``j <= power``), or None."""
    for j in range(power + 1):
        order = odd << j
        if order > MAX_PALEY_ORDER:
            return None
        if _is_prime(order - 1) and (order - 1) % 4 == 3:
            return order
    return None


def factor_sizes(features: int) -> list[tuple[str, int]]:
    """How a rotation of ``features`` is factored: ``[(kind, size), ...]`` with kind in paley/sylvester/dense."""
    if features < 1:
        raise ValueError(f"a rotation needs at least one feature, got {features}.")
    power = (features & -features).bit_length() - 1
    odd = features >> power
    factors: list[tuple[str, int]] = []
    if odd > 1:
        paley = _paley_order_for(odd, power)
        if paley is not None:
            factors.append(("paley", paley))
            power -= (paley // odd).bit_length() - 1
        elif odd <= MAX_DENSE_FACTOR:
            factors.append(("dense", odd))
        else:
            raise ValueError(
                f"cannot rotate {features} features: the odd part {odd} has no Hadamard matrix here and exceeds "
                f"{MAX_DENSE_FACTOR} for a dense factor."
            )
    max_power = MAX_FACTOR.bit_length() - 1
    while power > 0:
        step = min(power, max_power)
        factors.append(("sylvester", 1 << step))
        power -= step
    return factors


def can_rotate(features: int) -> bool:
    try:
        factor_sizes(features)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Rotation:
    """An orthogonal ``d x d`` rotation kept as random signs and small orthonormal factors."""

    features: int
    signs: torch.Tensor  # (d,) of ±1
    factors: tuple[torch.Tensor, ...]  # orthonormal matrices whose Kronecker product (times signs) is R
    kinds: tuple[str, ...]  # "sylvester", "paley" (±1 entries) or "dense" (real multiplies), one per factor

    @property
    def operations_per_value(self) -> tuple[int, int]:
        """(additions, multiplications) per rotated value, as a dedicated kernel does them.

        A Sylvester factor of size n is a fast Walsh-Hadamard transform (log2 n additions per value), a
        Paley factor a ±1 product (n additions), a dense factor n multiply-accumulates.
        """
        adds = mults = 0
        for factor, kind in zip(self.factors, self.kinds):
            n = factor.shape[0]
            if kind == "sylvester":
                adds += n.bit_length() - 1
            elif kind == "paley":
                adds += n
            else:
                mults += n
        return adds, mults

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Rotation:
        """This rotation on ``device`` in ``dtype``: itself where it is already, else one copy per (device, dtype),
        kept beside it (`derived`; bf16 activations under autocast ask at every product)."""
        device = torch.device(device)
        if self.signs.device == device and self.signs.dtype == dtype:
            return self
        return derived(self.signs, ("rotation", device, dtype), lambda: Rotation(
            self.features, self.signs.to(device=device, dtype=dtype, copy=True),
            tuple(f.to(device=device, dtype=dtype, copy=True) for f in self.factors), self.kinds))

    def apply(self, x: torch.Tensor, dim: int = -1, transpose: bool = False, in_place: bool = False) -> torch.Tensor:
        """``x R`` along ``dim`` (``x R^T`` with ``transpose=True``); differentiable in ``x`` (the rotation is
        fixed: its backward is ``grad R^T`` and keeps nothing but the rotation). ``in_place``: the C kernel, where it
        serves, writes the result over ``x`` (no gradient; the caller's to drop); the result is what is returned."""
        self._check_features(x, dim)
        if torch.is_grad_enabled() and x.requires_grad:
            if in_place:
                raise ValueError("a rotation in place takes no gradient: pass x.detach()")
            return _Rotate.apply(x, dim, transpose, self.signs, self.kinds, *self.factors)
        return _rotate(x, dim, transpose, self.signs, self.factors, self.kinds, in_place)

    def stand_in(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """What stands for ``x R`` in the graph of a product that reads only codes made from ``x R`` elsewhere
        (`hf_cpt.numerics.rotated_codes`): its shape and dtype with no values (one NaN element, zero strides, so a
        read by mistake shows), and `apply`'s backward."""
        self._check_features(x, dim)
        if torch.is_grad_enabled() and x.requires_grad:
            return _RotationStandIn.apply(x, dim, False, self.signs, self.kinds, *self.factors)
        return _values_never_formed(x)

    def _check_features(self, x: torch.Tensor, dim: int) -> None:
        if x.shape[dim] != self.features:
            raise ValueError(f"rotation of {self.features} features applied to a tensor of shape {tuple(x.shape)}")

    def matrix(self) -> torch.Tensor:
        """The dense ``d x d`` matrix (for tests and inspection)."""
        eye = torch.eye(self.features, dtype=self.signs.dtype, device=self.signs.device)
        return self.apply(eye)


@cached_outside_compile(maxsize=16)
def _sylvester_block(size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return (sylvester_hadamard(size) / math.sqrt(size)).to(device=device, dtype=dtype)


def _axis_steps(
    factors: tuple[torch.Tensor, ...], kinds: tuple[str, ...], transpose: bool, last_axis: bool = True
) -> list[torch.Tensor]:
    """The matrices `_rotate` contracts one axis at a time, innermost first: the trailing factors merged into one
    block of at most `MAX_MERGED_BLOCK`, or a Sylvester part split anew as `SYLVESTER_SPLITS` says for a rotation
    along the last axis (``last_axis``) or another. Computed once per rotation and layout (`derived`): a product
    made contiguous or a merged block is a kernel launch per call on a GPU."""
    def kept() -> list[torch.Tensor]:  # nothing kept beside factors[0] may refer to it (it would never be freed)
        steps = _build_axis_steps(factors, kinds, transpose, last_axis)
        return [step.clone() if step._base is not None or any(step is f for f in factors) else step for step in steps]

    # The factors of one rotation live and die together, so their ids name them while factors[0] lives.
    key = ("axis_steps", tuple(map(id, factors[1:])), kinds, transpose, last_axis)
    return derived(factors[0], key, kept)


def _build_axis_steps(
    factors: tuple[torch.Tensor, ...], kinds: tuple[str, ...], transpose: bool, last_axis: bool
) -> list[torch.Tensor]:
    leading = len(factors) - kinds.count("sylvester")  # factor_sizes puts the odd-order factor first
    power = 1
    for factor in factors[leading:]:  # (a loop, not math.prod over a generator, which torch.compile cannot trace)
        power *= factor.shape[0]
    split = SYLVESTER_SPLITS["last" if last_axis else "inner"].get(power)
    remaining = [(f.t() if transpose else f).contiguous() for f in (factors[:leading] if split else factors)]
    if split is not None:
        # Sylvester blocks are symmetric: the same whether transposed or not.
        device, dtype = factors[0].device, factors[0].dtype
        return [_sylvester_block(size, device, dtype) for size in split] + remaining[::-1]
    block = remaining.pop()
    while remaining and block.shape[0] * remaining[-1].shape[0] <= MAX_MERGED_BLOCK:
        block = torch.kron(remaining.pop(), block)
    return [*remaining, block][::-1]


def _rotate(
    x: torch.Tensor, dim: int, transpose: bool, signs: torch.Tensor, factors: tuple[torch.Tensor, ...],
    kinds: tuple[str, ...], in_place: bool = False,
) -> torch.Tensor:
    """``x diag(s) (F_1 ⊗ F_2 ⊗ ...)`` along ``dim`` (its transpose with ``transpose=True``).

    Each step (`_axis_steps`) contracts one axis of a view of ``x`` as ``(lead, size, trailing)`` by a (batched)
    matrix product, along any ``dim``, so no step copies the tensor to move an axis (docs/method.md, "Rotation").
    Over the last axis of a float32 CPU tensor, or a matrix's first, the C kernel runs (`_rotate_native`).
    """
    dim = dim % x.dim()
    trailing = math.prod(x.shape[dim + 1:])
    if trailing == 1 or dim == 0:
        rotated = _rotate_native(x, transpose, signs, factors, kinds, in_place, -1 if trailing == 1 else 0)
        if rotated is not None:
            return rotated
    signs = signs.view(-1, *([1] * (x.dim() - dim - 1)))
    steps = _axis_steps(factors, kinds, transpose, last_axis=trailing == 1)
    y = x if transpose else x * signs
    for factor in steps:
        size = factor.shape[0]
        if trailing == 1:  # the last axis: one plain matrix product
            y = torch.mm(y.reshape(-1, size), factor)
        else:  # F^T @ y over this axis, every other axis batched
            y = torch.matmul(factor.t(), y.reshape(-1, size, trailing))
        trailing *= size
    y = y.reshape(x.shape)
    return y * signs if transpose else y


NATIVE_MIN_NUMEL = 1 << 15  # below this many values the factor-by-factor products are as fast as the C kernel


@functools.cache
def _native_library():
    signature = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2, ctypes.c_int)  # both kernels'
    return native.bind("rotation_kernels", {"hf_cpt_rotate": signature, "hf_cpt_rotate_columns": signature})


def _rotate_native(
    x: torch.Tensor, transpose: bool, signs: torch.Tensor, factors: tuple[torch.Tensor, ...], kinds: tuple[str, ...],
    in_place: bool = False, dim: int = -1,
) -> torch.Tensor | None:
    """`_rotate` over the last axis, or a matrix's first (``dim=0``: a Conv1D's weight), by the C kernel (rows, or
    blocks of columns), or None where it does not serve (`native_layout`). ``in_place``: over ``x``."""
    if (layout := native_layout(x, signs, factors, kinds, dim)) is None or _native_library() is None:
        return None
    lead, lead_size, power = layout
    out = x if in_place else torch.empty_like(x)
    kernel = _native_library().hf_cpt_rotate_columns if dim == 0 else _native_library().hf_cpt_rotate
    threads = kernel(x.data_ptr(), out.data_ptr(), signs.contiguous().data_ptr(), None if lead is None else
                     lead.data_ptr(), lead_size, power, x.numel() // signs.numel(), int(transpose), native.threads())
    return None if threads < 0 else out  # out of memory for a scratch row


def native_layout(x, signs, factors, kinds, dim: int = -1) -> tuple[torch.Tensor | None, int, int] | None:
    """(the leading factor, contiguous, or None; its order n; the Sylvester part's order P) where the C kernels rotate
    ``x`` over ``dim`` (-1, or 0 of a matrix; large, contiguous, float32, CPU, untraced; P a multiple of 16)."""
    served_axis = dim == -1 or (dim == 0 and x.dim() == 2)
    if (not served_axis or not native.takes(x, NATIVE_MIN_NUMEL) or x.dtype != torch.float32
            or x.shape[dim] != signs.numel() or any(t.dtype != torch.float32 or t.device.type != "cpu"
                                                    for t in (signs, *factors))):
        return None
    lead = None if kinds[0] == "sylvester" else factors[0].contiguous()
    power = signs.numel() // (lead_size := 1 if lead is None else lead.shape[0])
    return None if power % 16 else (lead, lead_size, power)


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: itself, or one copy kept beside it (`derived`)."""
    return t if t.dtype == dtype else derived(t, ("dtype", dtype), lambda: t.to(dtype, copy=True))


class _Rotate(torch.autograd.Function):
    """A fixed rotation with a backward that keeps only the rotation (autograd's own would keep an expanded
    copy of each factor per batched product)."""

    @staticmethod
    def forward(ctx, x, dim, transpose, signs, kinds, *factors):
        _Rotate.keep(ctx, dim, transpose, signs, kinds, factors)
        return _rotate(x, dim, transpose, signs, factors, kinds)

    @staticmethod
    def keep(ctx, dim, transpose, signs, kinds, factors) -> None:
        """What the backward reads: the rotation and its axis, nothing of ``x``."""
        ctx.dim, ctx.transpose, ctx.signs, ctx.kinds, ctx.factors = dim, transpose, signs, kinds, factors

    @staticmethod
    def backward(ctx, grad, in_place: bool = False):
        # The gradient's dtype rules (bf16 when the forward ran under autocast; autograd casts it to x's).
        signs, factors = _in_dtype(ctx.signs, grad.dtype), tuple(_in_dtype(f, grad.dtype) for f in ctx.factors)
        rotated = _rotate(grad, ctx.dim, not ctx.transpose, signs, factors, ctx.kinds, in_place=in_place)
        return (rotated, None, None, None, None, *(None for _ in ctx.factors))


def _values_never_formed(x: torch.Tensor) -> torch.Tensor:
    """``x``'s shape, dtype and device over one NaN element, filled before the zero strides are set."""
    return torch.full((1,), math.nan, dtype=x.dtype, device=x.device).as_strided(x.shape, (0,) * x.dim())


class _RotationStandIn(_Rotate):
    """`_Rotate` forming no values (`Rotation.stand_in`); its gradient, its products' fresh sum, rotated in place."""

    @staticmethod
    def forward(ctx, x, dim, transpose, signs, kinds, *factors):
        _Rotate.keep(ctx, dim, transpose, signs, kinds, factors)
        return _values_never_formed(x)

    @staticmethod
    def backward(ctx, grad):
        return _Rotate.backward(ctx, grad, in_place=not grad.requires_grad)


def _orthonormal(kind: str, size: int, generator: torch.Generator) -> torch.Tensor:
    if kind == "paley":
        return paley_hadamard(size) / math.sqrt(size)
    if kind == "sylvester":
        return sylvester_hadamard(size) / math.sqrt(size)
    q, r = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r)).unsqueeze(0)).contiguous()


@functools.lru_cache(maxsize=64)
def _float64_rotation(features: int, seed: int) -> Rotation:
    # A pure function of (features, seed); callers get copies (`get_rotation`), never these tensors. Built under
    # an explicit CPU device context, which overrides the meta-device context transformers loads models in.
    with torch.device("cpu"):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + features)
        signs = torch.randint(0, 2, (features,), generator=generator, dtype=torch.int64).to(torch.float64) * 2 - 1
        kinds = factor_sizes(features)
        factors = tuple(_orthonormal(kind, size, generator) for kind, size in kinds)
    return Rotation(features, signs, factors, tuple(kind for kind, _ in kinds))


def get_rotation(
    features: int, seed: int = DEFAULT_SEED, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Rotation:
    """The rotation of ``features`` input features for ``seed`` (deterministic), as new tensors on ``device``."""
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("a rotation needs real tensors: build it on the device the weights will live on, not 'meta'")
    source = _float64_rotation(features, seed)
    return Rotation(features, source.signs.to(device=device, dtype=dtype, copy=True),
        tuple(f.to(device=device, dtype=dtype, copy=True) for f in source.factors), source.kinds)


def rotation_shapes(features: int) -> list[tuple[int, ...]]:
    """Shapes of a rotation's tensors, signs first, then one square factor each (no tensor is built)."""
    return [(features,)] + [(size, size) for _, size in factor_sizes(features)]
