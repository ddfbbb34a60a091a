"""A kernel matrix K(x1, x2) that you can multiply by without ever storing it.

``LazyKernel(kernel, x1, x2) @ X`` gives what the dense matrix ``K @ X`` gives, but computes K a block of rows at a
time inside a ``jax.lax.fori_loop``:

    for each block I of rows of x1:
        out[I] = K(x1[I], x2) @ X          # one [block, N] piece of K at a time

so memory is one block plus the output, not the [M, N] matrix. ``X @ K`` runs the same loop over blocks of columns.
With ``checkpoint=True`` blocks are recomputed in the backward pass instead of stored.

Reading map. The core comes first and runs alone: 1. kernels; 2. the plan (``block_plan``: how a block is made,
sized, multiplied and contracted, once per kernel structure, D, dtype and ``SETTINGS``; each optional layer refines
it through ``_LAYERS``, the core's seam, using only the core's ``_LAYER_API``); 3. the engine (``_blockwise_matmul``,
the loop above); 4. the operator (``LazyKernel``); 5. the check (``python lazy_kernel.py``). Optional layers follow,
each one span between ``# --- begin optional layer`` and ``# --- end optional layer`` lines (delete one, and those
that stand on it, and the rest runs): sums and solves (``KernelSum``, ``LazyKernel.solve``), kernel programs (a
kernel's jaxpr walked, which the next two stand on), the pair program (``PairProgramForm``: the vmap form's numbers,
faster), measured blocks (``MeasuredBlocks``: the budget bounds XLA's measured peak) and the fused TPU product
(``FusedProduct``).

The file depends on ``jax`` alone: copy it into your project if you like.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import glob
import hashlib
import math
import numbers
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CrossCovarianceKernel",
    "LazyKernel",
    "Measurement",
    "PairKernel",
    "Plan",
    "RBF",
    "block_evaluation",
    "block_plan",
    "kernel_block",
]


# -- 1. Kernels ------------------------------------------------------------


@runtime_checkable
class PairKernel(Protocol):
    """``kernel(x: [D], y: [D]) -> scalar``: a function, a ``functools.partial`` or a pytree (whose array leaves
    are hyperparameters that gradients reach)."""

    def __call__(self, x: jax.Array, y: jax.Array) -> jax.Array: ...


@runtime_checkable
class CrossCovarianceKernel(PairKernel, Protocol):
    """A pair kernel that fills blocks, ``[m, D], [n, D] -> [m, n]``: used unless it is exactly the vmap form of
    the pair call (GPJax's is), which a faster form may replace."""

    def cross_covariance(self, x1: jax.Array, x2: jax.Array) -> jax.Array: ...


@jax.tree_util.register_pytree_node_class
class RBF:
    """``variance * exp(-|x - y|^2 / (2 lengthscale^2))``, a lengthscale per feature or one; each difference is
    taken before it is scaled, so equal points give exactly ``variance``."""

    def __init__(self, lengthscale=1.0, variance=1.0):
        self.lengthscale = jnp.asarray(lengthscale)
        self.variance = jnp.asarray(variance)

    def __call__(self, x, y):
        r = (x - y) / self.lengthscale
        return self.variance * jnp.exp(-0.5 * jnp.sum(r * r))

    def __repr__(self):
        return f"RBF(lengthscale={self.lengthscale}, variance={self.variance})"

    def tree_flatten(self):
        return (self.lengthscale, self.variance), None

    @classmethod
    def tree_unflatten(cls, _, children):
        kernel = object.__new__(cls)
        kernel.lengthscale, kernel.variance = children
        return kernel


def kernel_block(kernel: PairKernel, xa: jax.Array, xb: jax.Array, *, transposed: bool = False) -> jax.Array:
    """The block ``K[i, j] = kernel(xa[i], xb[j])`` (with ``transposed``, ``kernel(xb[j], xa[i])``), made as
    ``block_plan`` says: the vmap form (the reference), the kernel's ``cross_covariance`` or a layer's form."""
    return block_plan(kernel, xa.shape[1], jnp.result_type(xa, xb)).block.make(kernel, xa, xb, transposed)


def _vmap_block(kernel, xa, xb, transposed=False):
    """The block by vmapping the pair call: GPJax's form, the reference."""
    pair = (lambda x, y: kernel(y, x)) if transposed else kernel
    return jax.vmap(jax.vmap(pair, in_axes=(None, 0)), in_axes=(0, None))(xa, xb)


def _probe_blocks(dim, dtype):
    """Abstract [2, D] and [3, D] blocks: small, and of different sizes so that rows and columns differ."""
    return jax.ShapeDtypeStruct((2, dim), dtype), jax.ShapeDtypeStruct((3, dim), dtype)


def _check_kernel(kernel, dim, dtype):
    """The dtype ``kernel`` returns, checking its shapes without evaluating it."""
    point = jax.ShapeDtypeStruct((dim,), dtype)
    expected = "a kernel is called on one pair of points, kernel(x: [D], y: [D]) -> scalar; "
    block_function = (  # GPJax's kernel.cross_covariance, say
        "; a function of blocks ([m, D], [n, D] -> [m, n]) is not one: pass the kernel object itself (LazyKernel "
        "uses its cross_covariance), or a function of one pair"
    )
    try:
        out = jax.eval_shape(lambda x, y: kernel(x, y), point, point)
    except Exception as error:  # the kernel's own error, with a note of how LazyKernel called it (Python 3.11 on)
        if hasattr(error, "add_note"):
            error.add_note(f"{expected}kernel({dim}-vector, {dim}-vector) raised it{block_function}")
        raise
    if not hasattr(out, "shape") or out.shape != ():
        shape = getattr(out, "shape", type(out).__name__)
        raise TypeError(f"{expected}kernel({dim}-vector, {dim}-vector) returned {shape}{block_function}")
    if hasattr(kernel, "cross_covariance"):
        block = jax.eval_shape(kernel.cross_covariance, *_probe_blocks(dim, dtype))
        if getattr(block, "shape", None) != (2, 3):
            raise TypeError(
                "cross_covariance(x1: [m, D], x2: [n, D]) must return [m, n]; "
                f"on [2, {dim}] and [3, {dim}] it returned {getattr(block, 'shape', block)}"
            )
    return jnp.dtype(out.dtype)


# -- 2. The plan -----------------------------------------------------------
#
# The core plans the vmap form (or the kernel's cross_covariance) and the contraction; each optional layer may
# refine it (_LAYERS) with a frozen value of its own holding every decision that does not depend on the data.
# Rules that do (a GEMM's error bound, the fused form's digits) run on the data, among the forms the plan names.


class BlockForm(Protocol):
    """How a plan makes blocks (``Plan.block``): the core's VmapForm, CrossCovarianceForm, or a layer's."""

    name: str
    fastest_bytes: tuple[int, int | None] | None  # the fastest block's bytes, product and gradient; None: default

    def make(self, kernel, xa, xb, transposed) -> jax.Array: ...  # [len(xa), len(xb)]

    def describe(self, kernel, dim, dtype) -> str: ...


class BlockSizing(Protocol):
    """How a layer sizes blocks (``Plan.sizing``): ``LazyKernel.__matmul__`` runs its product, ``measure()`` its
    measurement."""

    name: str

    def product(self, op, rhs, dtype) -> jax.Array: ...  # op @ rhs at the layer's blocks

    def measure(self, op, width, wrt=(), cached_only=False) -> Measurement | None: ...


class BlockProduct(Protocol):
    """How a layer multiplies a block of rows by the operand (``Plan.product``): ``_product`` hands it the
    engine's ``rows_times``, which it may replace."""

    name: str

    def rows_times(self, op, x1, x2, rhs, rows_times) -> Callable[[jax.Array], jax.Array]: ...


@dataclasses.dataclass(frozen=True)
class VmapForm:
    """A block by vmapping the pair call over it: GPJax's form, and the reference."""

    name = "vmap"
    fastest_bytes = None  # the fastest block's bytes, product and gradient; None: the sizing layer's default
    make = staticmethod(_vmap_block)

    def describe(self, kernel, dim, dtype):
        return self.name


@dataclasses.dataclass(frozen=True)
class CrossCovarianceForm(VmapForm):
    """A block by the kernel's own ``cross_covariance``, which fills blocks of K only: a block of K.T is one of K
    transposed, and ``X @ K`` takes blocks of K's columns as they come (_columns_product)."""

    name = "cross_covariance"

    def make(self, kernel, xa, xb, transposed):
        return kernel.cross_covariance(xb, xa).T if transposed else kernel.cross_covariance(xa, xb)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The switches and constants plans follow, one frozen value: ``SETTINGS``. Change them by replacing it,
    ``lazy_kernel.SETTINGS = lazy_kernel.SETTINGS.replace(backend="tpu")``; each optional layer extends it with
    fields of its own."""

    backend: str | None = None  # the backend blocks are planned for; None: JAX's default
    contraction_chunk: int = 2048  # a TPU's matrix unit sums this many float32 terms within 2 eps (_chunked_contract)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


SETTINGS = Settings()


@dataclasses.dataclass(frozen=True)
class Plan:
    """How blocks of one kernel on points of D features are made, sized, multiplied and contracted on a backend."""

    backend: str  # what it was planned for
    block: BlockForm  # how a block is made
    contraction_chunk: int | None  # columns of K per matrix-unit product in K @ X, or None: all at once
    contraction_precision: jax.lax.Precision | None  # None: JAX's default, which the user has set
    sizing: BlockSizing | None = None  # None: blocks of batch_size_row rows (the seed's)
    product: BlockProduct | None = None  # None: a block's rows times the operand is the block contracted
    notes: tuple[str, ...] = ()  # why the layers did not take a faster form

    def noted(self, note):
        return dataclasses.replace(self, notes=(*self.notes, note))

    @property
    def forms(self):
        return " + ".join(part.name for part in (self.block, self.sizing, self.product) if part is not None)


_LAYERS = []  # refine(plan, kernel, dim, dtype) -> plan, one for each optional layer in the file: the core's seam
# What a layer may use of the core besides its public names: the layers' API.
_LAYER_API = frozenset(
    "_LAYERS _Operator _traced _settings _product _contract _vmap_block _probe_blocks _zeros_varying_like "
    "_is_array".split()
)
_PLANS = {}  # (kernel structure, D, dtype, backend, settings) -> Plan


def block_plan(kernel: PairKernel, dim: int, dtype=jnp.float32) -> Plan:
    """How blocks of ``kernel`` on points of ``dim`` features and ``dtype`` are made here (traced, not run): the
    only reader of ``jax.default_backend()`` (or ``SETTINGS.backend``). Cached by the kernel's structure, D, dtype
    and settings."""
    backend, dtype = SETTINGS.backend or jax.default_backend(), jnp.dtype(dtype)
    structure = _structure(kernel, dim, dtype)
    key = (structure, dim, dtype, backend, _settings())
    if structure is not None and key in _PLANS:
        return _PLANS[key]
    chunked = backend != "cpu" and hasattr(jax.lax, "optimization_barrier")  # JAX 0.4.31 on
    own = CrossCovarianceForm() if hasattr(kernel, "cross_covariance") else VmapForm()
    plan = Plan(backend, own, SETTINGS.contraction_chunk if chunked else None, _contraction_precision())
    for refine in _LAYERS:
        plan = refine(plan, kernel, dim, dtype)
    if structure is not None:
        _PLANS[key] = plan
    return plan


def block_evaluation(kernel: PairKernel, dim: int, dtype=jnp.float32) -> str:
    """How ``kernel_block`` computes blocks of ``kernel`` on ``dim`` features here, in a word: ``"vmap"``,
    ``"cross_covariance"`` or a layer's form (``"pair program"``, naming any equations it vmaps on pairs)."""
    return block_plan(kernel, dim, dtype).block.describe(kernel, dim, dtype)


def _structure(kernel, dim, dtype):
    """What a plan of ``kernel`` depends on: its pytree and its leaves' types where they are all arrays, else its
    program (and its cross_covariance's) on abstract points, with its constants; None where NumPy cannot hold one (a
    tracer, a PRNG key)."""
    leaves, treedef = jax.tree_util.tree_flatten(kernel)
    if all(map(_is_array, leaves)):
        structure = (treedef, tuple((jnp.shape(a), jnp.result_type(a), getattr(a, "weak_type", False)) for a in leaves))
        try:
            hash(structure)
            return structure
        except TypeError:  # static pytree data that cannot be hashed (a slice, say)
            pass
    point = jax.ShapeDtypeStruct((dim,), dtype)
    programs = [jax.make_jaxpr(lambda x, y: kernel(x, y))(point, point)]
    if hasattr(kernel, "cross_covariance"):
        programs.append(jax.make_jaxpr(kernel.cross_covariance)(*_probe_blocks(dim, dtype)))
    try:  # None (planned on each call) for a traced value, whose identity may matter, and for a PRNG key
        consts = [np.asarray(c) for p in programs for c in p.consts]
    except TypeError:
        return None
    if any(c.dtype == object for c in consts):  # a PRNG key, as JAX 0.4 gives it to NumPy
        return None
    values = tuple((c.dtype, c.shape, hashlib.blake2b(c.tobytes()).digest()) for c in consts)
    return (*map(str, programs), values)  # the programs' text omits their constants' values


def _settings():
    """What a plan depends on besides the kernel: ``SETTINGS``, JAX's settings and the layers present."""
    return SETTINGS, jax.config.jax_default_matmul_precision, jax.config.jax_enable_x64, *_LAYERS


def _contraction_precision():
    """A block times the operand at the precision the user set (``jax_default_matmul_precision``), else HIGHEST:
    JAX's own default lets an accelerator round it to bf16 (TF32 on a GPU)."""
    return None if jax.config.jax_default_matmul_precision is not None else jax.lax.Precision.HIGHEST


# -- 3. The engine ---------------------------------------------------------


def _blockwise_matmul(rows_times, points, rhs_width, dtype, block, policy, inputs, axis=0):
    """``out[I] = rows_times(points[I])``, K's rows at the points times the operand [len(I), rhs_width] (with
    ``axis`` 1 transposed, as out is), for blocks I of ``block`` points; ``policy``: what reverse mode saves of a
    block, as ``jax.checkpoint``'s (None: nothing, it recomputes the block); ``inputs``: the arrays it depends on."""
    n = points.shape[0]
    rows_times = jax.checkpoint(rows_times, prevent_cse=False, policy=policy)

    def body(i, out):
        start = jnp.minimum(i * block, n - block)  # the last block overlaps the one before it
        rows = jax.lax.dynamic_slice_in_dim(points, start, block)
        return jax.lax.dynamic_update_slice_in_dim(out, rows_times(rows), start, axis=axis)

    # Every block has one size, so that no remainder block runs beside the loop (XLA would keep both alive): the
    # rows the last block shares with the one before are computed twice, with the same values.
    out = _zeros_varying_like((n, rhs_width)[:: 1 - 2 * axis], dtype, inputs)
    return jax.lax.fori_loop(0, -(-n // block), body, out) if n else out


def _contract(a, b, plan, width):
    """``a @ b`` at the plan's precision, a block of K and an operand of ``width`` columns: [rows, n] @ [n, width],
    or [width, n] @ [n, rows] (a block of K's columns, in X @ K); in chunks of n where the plan says."""
    if (chunk := plan.contraction_chunk) and a.shape[1] > chunk and width > 1:  # K @ v is float32
        return _chunked_contract(a, b, chunk, plan.contraction_precision)
    if a.shape[0] == 1 < b.shape[1]:  # XLA:CPU's dot sums [1, n] @ [n, k] term by term; its reduce, in parts
        return jnp.sum(a.T * b, axis=0, keepdims=True)
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), plan.contraction_precision)


def _chunked_contract(a, b, chunk, precision):
    """``a @ b`` as one product per ``chunk`` of n (zero-padded), added on the vector unit: a TPU v5e's matrix
    unit rounds a long float32 sum toward zero. The barriers keep the chunks from folding back into one product,
    and the block whole (fused into it, XLA:TPU held many blocks at once under ``grad``)."""
    (rows, n), cols = a.shape, b.shape[1]
    pad = -n % chunk
    a, b = jax.lax.optimization_barrier(
        (jnp.pad(a, ((0, 0), (0, pad))), jnp.pad(b, ((0, pad), (0, 0)))) if pad else (a, b)
    )
    chunks = (n + pad) // chunk
    within_chunks = (((2,), (1,)), ((1,), (0,)))  # contract within a chunk, batch over chunks
    partial = jax.lax.dot_general(
        a.reshape(rows, chunks, chunk), b.reshape(chunks, chunk, cols), within_chunks, precision
    )
    return jnp.sum(jax.lax.optimization_barrier(partial), 0)


def _is_array(leaf):
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _zeros_varying_like(shape, dtype, tree):
    """Zeros that, inside ``jax.shard_map``, vary over the mesh axes of every array in ``tree``, as the loop's
    blocks do (a ``fori_loop`` carry has its body's type): ``lax.full_like`` keeps its template's axes, and a sum
    varies over all of its terms'."""
    zero = jnp.zeros((), dtype)
    for leaf in filter(_is_array, jax.tree_util.tree_leaves(tree)):
        zero = zero + jax.lax.full_like(leaf, 0, dtype, shape=())
    return jnp.broadcast_to(zero, shape)


def _product(op, rhs, dtype, block, refined=True):
    """``op @ rhs``, rhs [N, width], by the engine at ``block`` rows per block, each row block's product made as
    the plan says (the sizing layers' way in: the product at a block of their choosing); with ``refined`` False,
    the block contracted even where the plan names a product (a sizing layer's choice)."""
    kernel, x1, cols, transposed, plan = op.kernel, jnp.asarray(op.x1), jnp.asarray(op.x2), op.transposed, op.plan
    width = rhs.shape[1]
    if isinstance(plan.block, CrossCovarianceForm) and transposed:  # its blocks are K's: X @ K by K's columns
        return _columns_product(op, rhs.T, dtype, block)

    def rows_times(rows):
        return _contract(plan.block.make(kernel, rows, cols, transposed).astype(dtype), rhs, plan, width)

    if plan.product is not None and refined:
        rows_times = plan.product.rows_times(op, x1, cols, rhs, rows_times)
    return _blockwise_matmul(rows_times, x1, width, dtype, block, _reverse_mode_policy(op), (op, rhs))


def _columns_product(op, lhs, dtype, block):
    """``K.T @ lhs.T`` for K = ``kernel.cross_covariance(x2, x1)``: ``lhs @ K`` by blocks of K's columns as the
    kernel gives them, ``lhs`` [width, len(x2)] times each at columns of the result (XLA:CPU transposed blocks)."""
    cols, width = jnp.asarray(op.x2), lhs.shape[0]

    def columns_times(points):
        return _contract(lhs, op.kernel.cross_covariance(cols, points).astype(dtype), op.plan, width)

    policy = _reverse_mode_policy(op)
    return _blockwise_matmul(columns_times, jnp.asarray(op.x1), width, dtype, block, policy, (op, lhs), axis=1).T


# -- 4. The operator -------------------------------------------------------


class Measurement(NamedTuple):
    """The block for one program (a product, or one gradient of it) and XLA's temporaries there."""

    rows: int  # rows of K per block
    peak_mb: float  # XLA's temporaries at that block, in MiB
    limit_mb: float  # max_memory_mb + twice the data (x1, x2, kernel arrays, operand, result); nan if given


class _Operator:
    """What multiplies like a matrix and is never stored whole: LazyKernel, and a layer's operators."""

    __array_ufunc__ = None  # NumPy arrays on the left defer to __rmatmul__

    def __array__(self, *_, **__):
        raise TypeError(
            f"{type(self).__name__}{self.shape} is not converted to an array, which would make the whole matrix: "
            "multiply by it, or call .to_dense() where the matrix is small enough to hold"
        )


@jax.tree_util.register_pytree_node_class
class LazyKernel(_Operator):
    """The kernel matrix ``K[i, j] = kernel(x1[i], x2[j])``, [M, N], never stored whole: ``K @ X`` and ``X @ K``
    (NumPy's matmul rules), ``.T``, ``.to_dense()``, ``.diagonal()``; a pytree of x1, x2 and the kernel's arrays.
    ``max_memory_mb`` bounds the blocks' memory, or ``batch_size`` fixes their rows; ``checkpoint=True``
    recomputes blocks in the backward pass rather than storing them."""

    def __init__(self, kernel, x1, x2, /, *, max_memory_mb=2**10, batch_size=None, checkpoint=False):
        if not callable(kernel):
            raise TypeError(f"kernel must be callable as kernel(x, y); got {type(kernel).__name__}")
        for name, x in (("x1", x1), ("x2", x2)):
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"{name} must be an array of shape [points, features]; got {type(x).__name__}")
            if len(x.shape) != 2:
                raise ValueError(f"{name} must be 2-D, [points, features]; got shape {tuple(x.shape)}")
        if x1.shape[1] != x2.shape[1]:
            raise ValueError(
                f"x1 and x2 must have the same number of features; got x1 {tuple(x1.shape)}, x2 {tuple(x2.shape)}"
            )
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1
        ):
            raise ValueError(f"batch_size must be a positive integer or None; got {batch_size!r}")
        if getattr(max_memory_mb, "shape", None) == () and jnp.issubdtype(max_memory_mb.dtype, jnp.number):
            try:
                max_memory_mb = float(max_memory_mb)  # a NumPy or JAX scalar
            except jax.errors.ConcretizationTypeError:
                raise TypeError("max_memory_mb sizes blocks as products trace: a number, not a traced one") from None
        real = isinstance(max_memory_mb, numbers.Real) and not isinstance(max_memory_mb, bool)
        if not real or not math.isfinite(max_memory_mb) or max_memory_mb < 0:
            raise ValueError(f"max_memory_mb must be a finite number >= 0; got {max_memory_mb!r}")
        if not isinstance(checkpoint, bool):
            raise TypeError(f"checkpoint must be True or False; got {checkpoint!r}")
        self.kernel, self.x1, self.x2 = kernel, x1, x2
        self.max_memory_mb, self.batch_size, self.checkpoint = max_memory_mb, batch_size, checkpoint
        self.dtype = _check_kernel(kernel, x1.shape[1], jnp.result_type(x1, x2))
        self.transposed = False  # True: K[i, j] = kernel(x2[j], x1[i]), as in the transpose of an operator
        # Which kernel leaves are arrays is fixed here: JAX also flattens pytrees of placeholders.
        self._array_leaves = tuple(map(_is_array, jax.tree_util.tree_leaves(kernel)))

    # -- CAGPJax's batch-size arithmetic ---------------------------------------

    @property
    def shape(self):
        return (self.x1.shape[0], self.x2.shape[0])

    @property
    def max_elements(self) -> int:
        """Most elements of K held at once: the budget in elements of ``dtype``."""
        return int(self.max_memory_mb * 2**20) // self.dtype.itemsize

    @property
    def batch_size_row(self) -> int:
        """Most rows of K per block in ``K @ X``: ``batch_size``, else the budget's."""
        return self.batch_size or max(1, self.max_elements // max(self.shape[1], 1))

    @property
    def batch_size_col(self) -> int:
        """Most columns of K per block in ``X @ K``."""
        return self.batch_size or max(1, self.max_elements // max(self.shape[0], 1))

    # -- products ------------------------------------------------------------

    def __matmul__(self, other):
        x = self._operand(other, "right")
        if _traced(self, x):
            return _matmul(self, x)  # compiled with the program around it
        return _compiled_matmul(self, x, _settings())

    def __rmatmul__(self, other):
        x = self._operand(other, "left")
        if x.ndim == 1:
            return self.T @ x
        return jnp.swapaxes(self.T @ jnp.swapaxes(x, -1, -2), -1, -2)  # X @ K = (K^T @ X^T)^T

    def _operand(self, other, side):
        """``other`` as a JAX array, with its size along K's ``side`` axis checked."""
        if isinstance(other, _Operator):
            raise TypeError("the product of two LazyKernels is not supported; multiply by arrays")
        x = jnp.asarray(other)
        if x.ndim == 0:
            raise ValueError(f"matmul: a LazyKernel of shape {self.shape} cannot multiply a 0-d operand")
        m, n = self.shape
        rows = x.shape[0 if x.ndim == 1 else -2]
        if side == "right" and rows != n:
            raise ValueError(
                f"matmul: LazyKernel of shape {self.shape} @ operand of shape {x.shape}: "
                f"K has {n} columns, the operand {rows} rows"
            )
        if side == "left" and x.shape[-1] != m:
            raise ValueError(
                f"matmul: operand of shape {x.shape} @ LazyKernel of shape {self.shape}: "
                f"the operand has {x.shape[-1]} columns, K {m} rows"
            )
        return x

    @property
    def plan(self) -> Plan:
        """The plan its blocks follow: ``block_plan(kernel, D, dtype)``."""
        return block_plan(self.kernel, self.x1.shape[1], jnp.result_type(self.x1, self.x2))

    @property
    def block_rows(self) -> int:
        """Rows of K per block in ``K @ v`` (at most ``batch_size_row``); a gradient's: ``measure(wrt=...)``."""
        sizing = self.plan.sizing
        if self.batch_size is None and sizing is not None:
            return sizing.measure(self, 1).rows
        return max(1, min(self.batch_size_row, self.shape[0]))

    @property
    def block_cols(self) -> int:
        """Columns of K per block in ``v @ K`` (at most ``batch_size_col``)."""
        return self.T.block_rows

    def measure(self, width: int = 1, wrt: tuple[str, ...] = ()) -> Measurement:
        """The block for ``K @ X`` (X [N, width]) and XLA's temporaries there (``peak_mb <= limit_mb`` unless a
        warning said one row does not fit; with ``batch_size`` given, that block and ``limit_mb`` nan). ``wrt``:
        instead its reverse-mode gradient in some of "kernel" (its arrays and the tracers it closes over), "x1",
        "x2", "operand", at its own block, or without ``checkpoint`` what it stores at the product's block (over
        the limit). For ``X @ K``, ``K.T.measure(width, wrt)``."""
        if not set(wrt) <= {"kernel", "x1", "x2", "operand"}:
            raise ValueError(f'wrt names some of "kernel", "x1", "x2", "operand"; got {wrt!r}')
        if self.plan.sizing is None:
            raise NotImplementedError("measure() needs the layer of measured blocks, off or cut from this file")
        return self.plan.sizing.measure(self, width, wrt)

    # -- views ----------------------------------------------------------------

    @property
    def T(self) -> LazyKernel:
        """The transpose, ``K.T[i, j] = K[j, i]``, also lazy."""
        flipped = object.__new__(LazyKernel)
        flipped.__dict__.update(self.__dict__)
        flipped.x1, flipped.x2 = self.x2, self.x1
        flipped.transposed = not self.transposed
        return flipped

    def to_dense(self) -> jax.Array:
        """The whole [M, N] matrix (it is materialised: for small problems and checks)."""
        x1, x2 = jnp.asarray(self.x1), jnp.asarray(self.x2)
        return kernel_block(self.kernel, x1, x2, transposed=self.transposed).astype(self.dtype)

    def diagonal(self) -> jax.Array:
        """``K[i, i]`` for ``i < min(M, N)``, from ``min(M, N)`` pair evaluations."""
        k = min(self.shape)
        x1, x2 = jnp.asarray(self.x1)[:k], jnp.asarray(self.x2)[:k]
        return jax.vmap(self.kernel)(*((x2, x1) if self.transposed else (x1, x2))).astype(self.dtype)

    def __repr__(self):
        plan = self.plan
        known = plan.sizing and plan.sizing.measure(self, 1, cached_only=True)
        measured = f", block_rows={known.rows}, peak_mb={known.peak_mb:.3g}" if known else ""
        return (
            f"LazyKernel({self.kernel!r}, shape={self.shape}, dtype={self.dtype}, "
            f"max_memory_mb={self.max_memory_mb}, batch_size={self.batch_size}, checkpoint={self.checkpoint}, "
            f"batch_size_row={self.batch_size_row}, batch_size_col={self.batch_size_col}{measured}, "
            f"form={plan.forms!r}" + (f", notes={plan.notes!r}" if plan.notes else "") + ")"
        )

    # -- pytree --------------------------------------------------------------

    def tree_flatten(self):
        leaves, treedef = jax.tree_util.tree_flatten(self.kernel)
        is_array = self._array_leaves
        arrays = [leaf for leaf, a in zip(leaves, is_array, strict=True) if a]
        static = tuple(leaf for leaf, a in zip(leaves, is_array, strict=True) if not a)
        settings = (self.max_memory_mb, self.batch_size, self.checkpoint, self.dtype, self.transposed, is_array)
        return (arrays, self.x1, self.x2), (treedef, static, settings)

    @classmethod
    def tree_unflatten(cls, aux, children):
        treedef, static, settings = aux
        arrays, x1, x2 = children
        op = object.__new__(cls)
        op.max_memory_mb, op.batch_size, op.checkpoint, op.dtype, op.transposed, op._array_leaves = settings
        arrays, static = iter(arrays), iter(static)
        op.kernel = treedef.unflatten([next(arrays) if a else next(static) for a in op._array_leaves])
        op.x1, op.x2 = x1, x2
        return op


def _matmul(op, x):
    """``op @ x``, x [N], [N, k] or [..., N, k]."""
    if x.ndim == 1:
        return _matmul(op, x[:, None])[:, 0]
    m, n = op.shape
    dtype = jnp.result_type(op.dtype, x.dtype)
    batch, k = x.shape[:-2], x.shape[-1]
    rhs = jnp.moveaxis(x, -2, 0).reshape(n, math.prod(batch) * k).astype(dtype)  # every batch in one pass
    sizing = op.plan.sizing
    if op.batch_size is None and sizing is not None:
        out = sizing.product(op, rhs, dtype)  # the sizing layer's, at its blocks, gradients' included
    else:
        out = _product(op, rhs, dtype, op.block_rows)
    return jnp.moveaxis(out.reshape(m, *batch, k), 0, -2)


def _traced(*trees):
    """Whether an array in ``trees`` is a tracer: the call is inside ``jit``, ``grad`` or ``vmap``."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(trees))


@functools.partial(jax.jit, static_argnums=2)
def _compiled_matmul(op, x, settings):
    """``_matmul`` outside ``jit``: compiled once per structure (the kernel's pytree, shapes, dtypes) and
    ``settings``, not on every call."""
    return _matmul(op, x)


def _reverse_mode_policy(op):
    """What reverse mode saves of ``op``'s blocks: nothing with ``checkpoint`` (None); else every value, as
    without ``jax.checkpoint``, warning that it does. JAX asks the policy only in reverse mode (grad, vjp,
    linearize): forward mode stores nothing and warns nothing."""
    if op.checkpoint:
        return None
    m, n = op.shape
    warned = []

    def save_every_value(*_, **__):
        if warned:
            return True
        warned.append(True)
        warnings.warn(
            f"LazyKernel{op.shape} with checkpoint=False is differentiated in reverse mode (grad, vjp, linearize): "
            f"that stores every block, at least the whole matrix ({m * n * op.dtype.itemsize / 2**20:.4g} MiB), "
            "whatever max_memory_mb says. Pass checkpoint=True to keep gradients within the budget.",
            stacklevel=2,
        )
        return True

    return save_every_value


# -- 5. python lazy_kernel.py: check this machine against a dense NumPy oracle --
#
# Points N(5, 1) at lengthscale sqrt(D) keep d^2 near 2 at every D, and the operands mostly positive, so that K's
# relative error shows whole in a product. Each result is compared with NumPy float64 on ``--check`` rows (columns
# for ``w @ K``) relative to its scale (|K| |v|), within 16 eps plus 4x the vmap form's error (the kernel on each
# pair on this device, summed elementwise), which must be within ((D + 8) z / 2 + EXP_ULPS) eps of each K (the
# feature sum's roundings and 9 more, through exp; and exp's own). Every device runs the whole check on its own.
# All programs of all D are traced and compiled at once, a thread each, beside NumPy's oracle: XLA compiles
# (blocks are measured by compiling, in the traces) without Python's lock.

EXP_ULPS = {"float32": 256, "float64": 2048}  # exp's error allowed: a TPU v5e's errs up to 116 ulp, past 256 in float64
SANITY_CONTRACT_EPS = 16  # the operator's contract: 16 eps of the scale plus 4x the vmap form's error
CHECK_DIMS = (3, 16, 128)  # a form of each kind the plan picks: features written out or a loop; the fused form
# (TPU) or the float64 GEMM (CPU); int8 digits (TPU) or the GEMM
CHECK_POINTS = {"cpu": 8191, "float32": 65536, "float64": 4096}  # N: on a CPU a prime, so that the last block
# overlaps the one before; off it 32 contraction chunks, a sum a TPU's matrix unit errs on in one product
FLOAT64_ACCELERATOR_BATCH = 512  # float64 off the CPU: emulated, its blocks' measurements compile for minutes
INSTALL = {"tpu": 'pip install -e ".[tpu]"', "gpu": 'pip install -e ".[cuda12]" (or ".[cuda13]")'}
_TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")  # Google's, as JAX lists


def _accelerator_here():
    """An accelerator this machine shows, whether or not JAX can use it: "tpu" (a Google TPU chip on PCI, as JAX
    looks for one), "gpu" (an NVIDIA GPU's device file), else None."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        with open(vendor) as f, open(os.path.join(os.path.dirname(vendor), "device")) as g:
            if f.read().strip() == "0x1ae0" and g.read().strip() in _TPU_PCI_DEVICES:
                return "tpu"
    return "gpu" if any(map(os.path.exists, ("/dev/nvidia0", "/dev/nvidiactl"))) else None


def _wrong_platform(asked):
    """Why this check cannot run on the platform ``asked`` (None: JAX's default), or None where it can."""
    default, seen = jax.default_backend(), _accelerator_here()
    if asked is None and default == "cpu" and seen:
        install = f"install JAX for it ({INSTALL[seen]}), or check the CPU with --platform cpu"
        return f"this machine has a {seen.upper()}, but JAX runs on the CPU: {install}"
    if asked in (None, default):
        return None
    try:
        jax.devices(asked)
    except RuntimeError:
        install = f": install JAX for it ({INSTALL[asked]})" if asked in INSTALL else ""
        return f"JAX finds no {asked} here (it runs on {default}){install}"
    return f"JAX runs on {default} by default here; check {asked} with JAX_PLATFORMS={asked}"


def _rbf_numpy(x1, x2, lengthscale, variance):
    """Dense RBF rows in NumPy float64, independent of everything above, a feature at a time; and z."""
    z = np.zeros((len(x1), len(x2)))
    for d in range(x1.shape[1]):
        z += ((x1[:, d, None] - x2[None, :, d]) / lengthscale) ** 2
    return variance * np.exp(-0.5 * z), z


def _on_every_device(f, devices):
    """``f`` jitted to run whole on each device, every input replicated, its outputs stacked [devices, ...]."""
    stacked = lambda *args: jax.tree_util.tree_map(lambda out: out[None], f(*args))  # noqa: E731
    if len(devices) == 1:
        return jax.jit(stacked)
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # JAX 0.4: its home was jax.experimental, and its replication check refuses the loop
        from jax.experimental.shard_map import shard_map

        shard_map = functools.partial(shard_map, check_rep=False)
    mesh, specs = jax.sharding.Mesh(np.array(devices), ("devices",)), jax.sharding.PartitionSpec
    return jax.jit(shard_map(stacked, mesh=mesh, in_specs=specs(), out_specs=specs("devices")))


def _vmap_form(kernel, rows, x1, x2, v, w, operand):
    """The reference on this device: for each checked row, K's row by vmapping the pair call, its products with v
    and ``operand``, w @ K's entry in that column, and its row of the gradient of w.(K @ v) in x1 (``_check``'s
    cases, in order). Sums elementwise, a row at a time: no matrix unit, no [rows, N, D] array."""
    row_of = lambda a: jax.vmap(kernel, (None, 0))(a, x2)  # noqa: E731

    def row(i):
        k, column = row_of(x1[i]), jax.vmap(kernel, (0, None))(x1, x2[i])
        gradient = w[i] * jax.grad(lambda a: jnp.sum(row_of(a) * v))(x1[i])
        return k, jnp.sum(k * v), jnp.sum(k[:, None] * operand, 0), jnp.sum(w * column), gradient

    return jax.lax.map(row, rows)


def _relative_errors(got, want, scale):
    """Each device's worst error relative to the scale: ``got`` [devices, ...] against ``want`` [...]."""
    return np.max(np.abs(np.asarray(got, np.float64) - want) / scale, axis=tuple(range(1, np.ndim(got))))


def _check(dim, devices, args):
    """The check at ``dim`` features on every device: its work (NumPy's oracle, each program's compile), to be
    done at once with every D's, and its verdict on the results (it runs the programs, prints a line per case and
    returns what failed)."""
    dtype, n, eps = args.dtype, args.n, float(np.finfo(args.dtype).eps)
    lengthscale, variance = (float(np.asarray(a, dtype)) for a in (np.sqrt(dim), 1.3))  # as JAX has them
    rng = np.random.default_rng(dim)
    x1, x2 = (np.asarray(rng.normal(size=(n, dim)) + 5.0, dtype) for _ in range(2))
    v, w = (np.asarray(rng.uniform(-0.25, 1, size=n), dtype) for _ in range(2))
    wide = np.asarray(rng.uniform(-0.25, 1, size=(n, args.width)), dtype)
    rows = np.unique(np.r_[0, n - 1, rng.choice(n, size=min(args.check, n), replace=False)])  # and the end blocks
    kernel = RBF(jnp.asarray(lengthscale, dtype), jnp.asarray(variance, dtype))
    lazy = functools.partial(LazyKernel, kernel, max_memory_mb=args.max_memory_mb, batch_size=args.batch_size)
    loss = lambda x1, x2, v, w: jnp.vdot(w, lazy(x1, x2, checkpoint=args.checkpoint) @ v)  # noqa: E731
    cases = {  # name: its value at the rows checked, a function of (x1, x2, v, w, wide)
        "K @ v": lambda x1, x2, v, w, wide: (lazy(x1, x2) @ v)[rows],
        f"K @ X ({args.width} columns)": lambda x1, x2, v, w, wide: (lazy(x1, x2) @ wide)[rows],
        "w @ K": lambda x1, x2, v, w, wide: (w @ lazy(x1, x2))[rows],
        "grad_x1 w.(K @ v)": lambda x1, x2, v, w, wide: jax.grad(loss)(x1, x2, v, w)[rows],
    }
    host, arrays = (x1, x2, v, w, wide), list(map(jnp.asarray, (x1, x2, v, w, wide)))

    def oracle():  # NumPy float64's K[rows, :] and z there; each case at the rows checked, and its scale
        x1, x2, v, w, wide = (np.asarray(a, np.float64) for a in host)
        k_rows, z = _rbf_numpy(x1[rows], x2, lengthscale, variance)
        k_cols = _rbf_numpy(x1, x2[rows], lengthscale, variance)[0]  # K[:, rows]
        weighted, at = k_rows * v, x1[rows]  # the terms of the gradient's sums
        gradient = w[rows, None] * (weighted @ x2 - at * weighted.sum(1, keepdims=True)) / lengthscale**2
        terms = np.stack([np.abs(weighted * (x2[:, d] - at[:, d, None])).sum(1) for d in range(dim)], 1)
        gradient_scale = np.abs(w[rows, None]) * terms / lengthscale**2
        scaled = lambda k, a: (k @ a, k @ np.abs(a))  # noqa: E731
        return k_rows, z, [scaled(k_rows, v), scaled(k_rows, wide), scaled(k_cols.T, w), (gradient, gradient_scale)]

    def compile_program(f):  # in a thread of its own, whose default device is the check's
        with jax.default_device(devices[0]):
            return _on_every_device(f, devices).lower(*arrays).compile()

    def verdict(oracle, vmap_form, *compiled):
        (k_rows, z, truths), failures = oracle, []
        named = [f"device {d.id} ({d.device_kind})" for d in devices]

        def judged(what, ratios, allowed):  # each device's error as a share of what is allowed: ok, or failures
            failures.extend(
                f"D = {dim}: {what} ({r:.3g}x {allowed}) on {named[i]}" for i, r in enumerate(ratios) if r > 1
            )
            return f"{np.max(ratios):.2f} of {allowed} " + ("ok" if np.max(ratios) <= 1 else "FAIL")

        op = lazy(*arrays[:2])  # its blocks, measured in the programs' traces
        shown = f"RBF(lengthscale sqrt(D), variance 1.3), points N(5, 1); form: {op.plan.forms}"
        print(f"\nD = {dim}: K {n} x {n}, {dtype}, {shown}")
        print(f"blocks used: {op.block_rows} rows of {n} in K @ v, {op.block_cols} columns in w @ K")
        k_vmap, *vmap_results = (np.asarray(a, np.float64) for a in vmap_form(*arrays))
        allowed = ((dim + 8) * z / 2 + EXP_ULPS[dtype]) * eps
        wrong = np.max(np.abs(k_vmap - k_rows) / (k_rows * allowed), axis=(1, 2))
        print(f"{'kernel values, vmap form':>26}: {judged('the kernel values', wrong, 'what float arithmetic allows')}")
        for name, f, vmapped, (want, scale) in zip(cases, compiled, vmap_results, truths, strict=True):
            times = []
            while not times or (times[0] < 0.1 and len(times) < 6):  # one run; a fast one, the median of 5 more
                start = time.perf_counter()
                result = jax.block_until_ready(f(*arrays))
                times.append(time.perf_counter() - start)
            seconds = float(np.median(times[1:] or times))
            errors, vmap_errors = (_relative_errors(a, want, scale) for a in (result, vmapped))
            i = np.argmax(contract := errors / (SANITY_CONTRACT_EPS * eps + 4 * vmap_errors))
            timing = f"{seconds * 1e3:9.2f} ms, {n * n / seconds:8.3g} pairs/s"
            print(f"{name:>26}: {timing}, error {errors[i]:.2e} (vmap form {vmap_errors[i]:.2e}): ", end="")
            print(judged(name, contract, "the contract"))
        return failures

    programs = (functools.partial(_vmap_form, kernel, rows), *cases.values())
    return [oracle, *(functools.partial(compile_program, f) for f in programs)], verdict


def _dims(text):
    """``--dim``'s value: features per point, one number or a comma-separated list."""
    if not all(part.strip().isdigit() and int(part) > 0 for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"features per point, each at least 1, such as 16 or 3,16,128; got {text!r}")
    return tuple(int(part) for part in text.split(","))


def _parse(argv):
    """The flags; N and float64's blocks off the CPU as the platform JAX runs on has them; a budget of a row of K."""
    parser = argparse.ArgumentParser(description="Check LazyKernel on this machine against dense NumPy rows.")
    parser.add_argument("--platform", choices=["cpu", "gpu", "tpu"], help="fail unless JAX runs there")
    parser.add_argument("--n", type=int, help="points in x1 and x2; 8191 on CPU, 65536 off it (float64: 4096)")
    parser.add_argument("--dim", type=_dims, default=CHECK_DIMS, help="features per point, or a list: 3,16,128")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--width", type=int, default=16, help="columns of X in K @ X")
    parser.add_argument("--max-memory-mb", type=float, default=2**10, help="budget for the blocks: a row of K or more")
    parser.add_argument("--batch-size", type=int, help="rows per block; else measured (float64 off the CPU: 512)")
    parser.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=True, help="in the gradient")
    parser.add_argument("--check", type=int, default=64, help="rows and columns compared with NumPy, and the ends")
    args = parser.parse_args(argv)
    for name in ("n", "width", "batch_size", "check"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    on_cpu = jax.default_backend() == "cpu"
    args.n = args.n or CHECK_POINTS["cpu" if on_cpu else args.dtype]
    if args.batch_size is None and args.dtype == "float64" and not on_cpu:
        args.batch_size = FLOAT64_ACCELERATOR_BATCH
    row = 0 if args.batch_size else math.ceil(args.n * np.dtype(args.dtype).itemsize / 2**20 * 1e3) / 1e3  # MB
    if not row <= args.max_memory_mb < math.inf:  # else blocks of one row, over budget, for minutes
        parser.error(f"--max-memory-mb must be a finite number >= {row:g} (a row of K); got {args.max_memory_mb:g}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    wrong = _wrong_platform(args.platform)
    if wrong:
        print(f"FAIL: {wrong}")
        return 1
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    devices = jax.devices()
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    print(f"platform: {devices[0].platform}, {len(devices)} x {kinds}; jax {jax.__version__}")
    blocks = f"budget {args.max_memory_mb:g} MB" if args.batch_size is None else f"blocks of {args.batch_size} rows"
    print(f"each device runs the whole check; {blocks}; D = {', '.join(map(str, args.dim))}", flush=True)
    checks = [_check(dim, devices, args) for dim in args.dim]
    with concurrent.futures.ThreadPoolExecutor(sum(len(work) for work, _ in checks)) as pool:
        done = [(verdict, [pool.submit(task) for task in work]) for work, verdict in checks]
    failures = [f for verdict, work in done for f in verdict(*(task.result() for task in work))]  # all compiled
    contract = f"the contract: {SANITY_CONTRACT_EPS} eps + 4x the vmap form's error; a bf16 product errs about 1e-3"
    print(f"FAIL: {'; '.join(failures)}. {contract}" if failures else "PASS")
    return 1 if failures else 0


# --- begin optional layer: sums and solves ---
#
# c * K, K / c, -K, K1 + K2, K1 - K2 and K.add_diagonal(d) give a KernelSum, lazy like K; A.solve(y) is conjugate
# gradients on its products. LazyKernel takes these methods from KernelSum (at this span's end): cut the span, and
# it multiplies alone, as the seed.


@jax.tree_util.register_pytree_node_class
class KernelSum(_Operator):
    """``sum_i c_i K_i + diag(d)``, what ``c * K``, ``K1 + K2``, ``K1 - K2`` and ``K.add_diagonal(d)`` give, never
    stored whole: ``@`` on both sides (NumPy's matmul rules), ``.T``, ``diagonal()``, ``to_dense()`` and
    LazyKernel's algebra and ``solve``. ``terms``: pairs (c_i, K_i) of a scalar and a LazyKernel, one for each set
    of points; ``added``: d, [M], or None. A pytree."""

    def __init__(self, terms, added):
        self.terms, self.added = tuple(terms), added

    @property
    def shape(self):
        return self.terms[0][1].shape

    @property
    def dtype(self):
        added = () if self.added is None else (self.added,)
        return jnp.result_type(*added, *(c for c, _ in self.terms), *(k.dtype for _, k in self.terms))

    def __matmul__(self, other):
        out = sum(c * (k @ other) for c, k in self.terms)
        if self.added is None:
            return out
        x = jnp.asarray(other)
        return out + (self.added[:, None] if x.ndim > 1 else self.added) * x

    def __rmatmul__(self, other):
        out = sum(c * (other @ k) for c, k in self.terms)
        return out if self.added is None else out + jnp.asarray(other) * self.added

    @property
    def T(self) -> KernelSum:
        return KernelSum([(c, k.T) for c, k in self.terms], self.added)

    def to_dense(self) -> jax.Array:
        """The whole [M, N] matrix (it is materialised: for small problems and checks)."""
        dense = sum(c * k.to_dense() for c, k in self.terms)
        return dense if self.added is None else dense + jnp.diag(self.added)

    def diagonal(self) -> jax.Array:
        diagonal = sum(c * k.diagonal() for c, k in self.terms)
        return diagonal if self.added is None else diagonal + self.added

    def __add__(self, other):
        """``A + B``, both of one shape; kernels on the same points (the same ``x1`` and ``x2`` objects) are added
        into one kernel, one loop of blocks."""
        return _sum(self, other) if isinstance(other, _Operator) else NotImplemented

    def __sub__(self, other):
        return _sum(self, -other) if isinstance(other, _Operator) else NotImplemented

    def __mul__(self, scalar):
        """``c * A``, ``A * c``, ``c`` a Python or JAX scalar, traced or not."""
        return _scaled(self, scalar, jnp.multiply)

    __rmul__ = __mul__

    def __truediv__(self, scalar):
        return _scaled(self, scalar, jnp.divide)

    def __neg__(self):
        return _scaled(self, -1, jnp.multiply)

    def add_diagonal(self, d) -> KernelSum:
        """``A + diag(d)`` for a square A, ``d`` a scalar or [M]: ``K.add_diagonal(noise)`` is K + noise I."""
        (m, n), d = self.shape, jnp.asarray(d)
        if m != n or d.shape not in ((), (m,)):
            raise ValueError(f"add_diagonal: A must be square and d a scalar or [{m}]; got A {self.shape}, d {d.shape}")
        op = _as_sum(self)
        return KernelSum(op.terms, _plus(op.added, jnp.broadcast_to(d, (m,))))

    def solve(self, y, *, rtol=None, max_steps=None, preconditioner=None, return_info=False):
        """``A^-1 y`` for a symmetric positive definite A, y [M] or [M, k] (its columns together), by conjugate
        gradients: each column until its residual, as CG updates it, is within ``rtol |y|`` (default 32 eps of the
        dtype, 3.8e-6 in float32: twice the 16 eps of ``|A| |x|`` a product may err by, the least a residual computed
        with them shows) or ``max_steps`` (default ``10 M``, SciPy's). ``preconditioner``: ``r -> P^-1 r``, P near
        A and symmetric positive definite. Gradients solve the adjoint system (``jax.lax.custom_linear_solve``), not
        through the steps. ``return_info=True``: ``(x, SolveInfo(steps, residual))``."""
        if _traced(self, y, rtol, max_steps):
            return _solve(self, y, rtol, max_steps, preconditioner, return_info)
        return _compiled_solve(self, y, rtol, max_steps, _settings(), preconditioner, return_info)

    def __repr__(self):
        return f"KernelSum(terms={list(self.terms)!r}, added={self.added!r})"

    def tree_flatten(self):
        return (self.terms, self.added), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def _as_sum(op):
    """``op`` as a KernelSum: a LazyKernel K as 1 K."""
    return op if isinstance(op, KernelSum) else KernelSum([(jnp.asarray(1), op)], None)


def _scaled(op, scalar, times):
    """``times(op, scalar)``, ``times`` multiplying or dividing; NotImplemented unless ``scalar`` is a scalar."""
    if isinstance(scalar, _Operator) or jnp.ndim(scalar) != 0:
        return NotImplemented
    op = _as_sum(op)
    added = None if op.added is None else times(op.added, scalar)
    return KernelSum([(times(c, scalar), k) for c, k in op.terms], added)


def _sum(a, b):
    """``a + b``: a term of b on the points of one of a's is added into that one's kernel."""
    if a.shape != b.shape:
        raise ValueError(f"cannot add operators of shapes {a.shape} and {b.shape}")
    a, b = _as_sum(a), _as_sum(b)
    on_points = {(id(k.x1), id(k.x2), k.transposed): (c, k) for c, k in a.terms}
    for c, k in b.terms:
        points = (id(k.x1), id(k.x2), k.transposed)
        on_points[points] = (jnp.asarray(1), _merged(*on_points[points], c, k)) if points in on_points else (c, k)
    return KernelSum(on_points.values(), _plus(a.added, b.added))


def _plus(added, d):
    """Two added diagonals, each [M] or None, added."""
    return d if added is None else added if d is None else added + d


def _weighted_sum(c1, k1, c2, k2, x, y):
    """``c1 k1(x, y) + c2 k2(x, y)``, in a ``Partial`` a pytree kernel of both; no ``cross_covariance``, were one of
    them to have one: its blocks are the pair call's."""
    return c1 * k1(x, y) + c2 * k2(x, y)


def _merged(c1, k1, c2, k2):
    """``c1 K1 + c2 K2``, both on the same points, as one LazyKernel (the least budget and batch size)."""
    if k1.transposed:
        return _merged(c1, k1.T, c2, k2.T).T
    kernel = jax.tree_util.Partial(_weighted_sum, c1, k1.kernel, c2, k2.kernel)
    sizes = [size for size in (k1.batch_size, k2.batch_size) if size is not None]
    settings = dict(max_memory_mb=min(k1.max_memory_mb, k2.max_memory_mb), checkpoint=k1.checkpoint or k2.checkpoint)
    return LazyKernel(kernel, k1.x1, k1.x2, batch_size=min(sizes, default=None), **settings)


class SolveInfo(NamedTuple):
    """How ``A.solve(y, return_info=True)`` ended."""

    steps: jax.Array  # conjugate-gradient steps taken, each one product A @ (y-sized)
    residual: jax.Array  # |y - A x| / |y| per column of y (a scalar for y [M]), by one more product


def _solve(op, y, rtol, max_steps, preconditioner, return_info):
    """``op.solve``: preconditioned conjugate gradients, each column of y with its own step sizes."""
    (m, n), y = op.shape, jnp.asarray(y)
    if m != n or y.ndim not in (1, 2) or y.shape[0] != m:
        raise ValueError(f"solve: A must be square and y [{m}] or [{m}, k]; got A {op.shape}, y {y.shape}")
    y = y.astype(jnp.result_type(op.dtype, y.dtype))
    rtol = 32 * jnp.finfo(y.dtype).eps if rtol is None else rtol
    max_steps = 10 * m if max_steps is None else max_steps
    precondition = preconditioner or (lambda r: r)

    def conjugate_gradients(matvec, b):
        b_norm = jnp.linalg.norm(b, axis=0)
        unfinished = lambda r: jnp.linalg.norm(r, axis=0) > rtol * b_norm  # noqa: E731

        def step(state):
            x, r, p, rz, steps = state
            q, active = matvec(p), unfinished(r)
            alpha = jnp.where(active, rz / jnp.sum(p * q, 0), 0)  # finished columns stay as they are
            x, r = x + alpha * p, r - alpha * q
            z = precondition(r)
            rz_next = jnp.sum(r * z, 0)
            return x, r, z + jnp.where(active, rz_next / rz, 0) * p, rz_next, steps + 1

        z = precondition(b)
        # 0, from b: under jax.shard_map it varies over devices as b does (JAX 0.10's custom_linear_solve refuses a
        # constant 0 there, XLA 0.4 the loop holding one)
        no_steps = jnp.sum(b_norm < 0, dtype=jnp.int32)
        start = (jnp.zeros_like(b), b, z, jnp.sum(b * z, 0), no_steps)
        running = lambda state: (state[-1] < max_steps) & jnp.any(unfinished(state[1]))  # noqa: E731
        x, *_, steps = jax.lax.while_loop(running, step, start)
        return x, steps

    x, steps = jax.lax.custom_linear_solve(lambda v: op @ v, y, conjugate_gradients, symmetric=True, has_aux=True)
    if not return_info:
        return x
    y_norm = jnp.maximum(jnp.linalg.norm(y, axis=0), jnp.finfo(y.dtype).tiny)
    return x, SolveInfo(steps, jnp.linalg.norm(y - op @ x, axis=0) / y_norm)


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _compiled_solve(op, y, rtol, max_steps, settings, preconditioner, return_info):
    """``_solve`` outside ``jit``, compiled once per structure as ``_compiled_matmul``."""
    return _solve(op, y, rtol, max_steps, preconditioner, return_info)


LazyKernel.__add__, LazyKernel.__sub__, LazyKernel.__neg__ = KernelSum.__add__, KernelSum.__sub__, KernelSum.__neg__
LazyKernel.__mul__ = LazyKernel.__rmul__ = KernelSum.__mul__
LazyKernel.__truediv__, LazyKernel.add_diagonal = KernelSum.__truediv__, KernelSum.add_diagonal
LazyKernel.solve = KernelSum.solve
__all__ += ["KernelSum", "SolveInfo"]
# --- end optional layer: sums and solves ---


# --- begin optional layer: kernel programs ---
#
# What the pair program and the fused product both stand on (cut with them): a kernel's program (its jaxpr) walked
# equation by equation, calls inlined (_evaluate); and a function of one scalar run on float64 values (_in_float64),
# with its derivatives (_tail_derivatives).

_JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:2])
_ELEMENTWISE = frozenset(
    "abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp complex conj convert_element_type copy "
    "copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le "
    "lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt "
    "select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan tanh xor".split()
)
_CALLS = ("pjit", "jit", "closed_call")  # inlined by _evaluate, so that their equations meet the rules


def _evaluate(jaxpr, consts, args, equation, literal, const=lambda c: c):
    """Evaluate ``jaxpr`` on ``args``: the loop of JAX's "Writing custom interpreters", each equation's outputs by
    ``equation(eqn, read, inline)`` (``read(var)``: a variable's value, a literal's ``literal(var)``; ``inline(args)``:
    a call's program evaluated on ``args`` so, its constants by ``const``, None for other equations). The one
    walker of kernel programs: each caller brings its ``equation``."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(var):
        return literal(var) if isinstance(var, jax.extend.core.Literal) else env[var]

    def inline(inner, args):
        return _evaluate(inner.jaxpr, list(map(const, inner.consts)), args, equation, literal, const)

    for eqn in jaxpr.eqns:
        called = functools.partial(inline, _called(eqn)) if eqn.primitive.name in _CALLS else None
        env.update(zip(eqn.outvars, equation(eqn, read, called), strict=True))
    return [read(var) for var in jaxpr.outvars]


def _called(eqn):
    """The ClosedJaxpr that a call equation (one of _CALLS) runs."""
    inner = eqn.params.get("jaxpr") or eqn.params["call_jaxpr"]
    return inner if isinstance(inner, jax.extend.core.ClosedJaxpr) else jax.extend.core.ClosedJaxpr(inner, [])


def _bind(eqn, args, params=None):
    params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)  # JAX < 0.5: (subfuns, params)
    out = eqn.primitive.bind(*subfuns, *args, **params)
    return out if eqn.primitive.multiple_results else [out]


def _bind_broadcast(eqn, args):
    """``eqn`` bound to ``args`` broadcast against each other."""
    common = jnp.broadcast_shapes(*(a.shape for a in args))
    return _bind(eqn, [jnp.broadcast_to(a, common) for a in args])


def _float64():
    """A context in which float64 values can be made."""
    return contextlib.nullcontext() if jax.config.jax_enable_x64 else jax.enable_x64(True)


def _float64_in_traces():
    """Whether float64 values can be made in a trace, x64 on or off: from JAX 0.8 (before, x64 switched on inside
    a trace failed to lower)."""
    return hasattr(jax, "enable_x64") and _JAX_VERSION >= (0, 8)


def _in_float64(program):
    """A ClosedJaxpr to one scalar as a function run on float64 values (float32 constants, literals, casts and
    arguments widened), to be called under _float64(); None where the program does not run so. In float32, a Matern
    kernel's polynomial times exp cancels near zero, and its derivatives there were rounding noise."""

    def widened(value):
        value = jax.lax.stop_gradient(jnp.asarray(value))  # a probe: no derivative reaches the kernel through it
        return value.astype(jnp.float64) if value.dtype == jnp.float32 else value

    def equation(eqn, read, inline):
        args = [read(var) for var in eqn.invars]
        if inline:
            return inline(args)
        params = dict(eqn.params)
        if eqn.primitive.name == "convert_element_type" and params["new_dtype"] == jnp.float32:
            params["new_dtype"] = jnp.dtype(jnp.float64)
        return _bind(eqn, args, params)

    def run(*args):
        consts = list(map(widened, program.consts))
        return _evaluate(program.jaxpr, consts, args, equation, lambda var: widened(var.val), widened)[0].reshape(())

    wide = [jax.ShapeDtypeStruct(a.shape, jnp.float64 if a.dtype == jnp.float32 else a.dtype) for a in program.in_avals]
    try:
        with _float64():
            jax.eval_shape(run, *wide)
    except Exception:  # a primitive that takes no float64 (the error differs by primitive): no float64 GEMM
        return None
    return run


def _tail_derivatives(tail, at):
    """``tail`` (a function of d^2) and its first two derivatives at each of the points ``at``."""

    def derivatives(at):
        with_slope = lambda at: jax.jvp(tail, (at,), (jnp.ones_like(at),))  # noqa: E731
        (value, slope), (_, curvature) = jax.jvp(with_slope, (at,), (jnp.ones_like(at),))
        return value, slope, curvature

    return jax.vmap(derivatives)(at)


# --- end optional layer: kernel programs ---


# --- begin optional layer: pair program ---
#
# ``_vmap_block`` is a [b, n, D] computation whose short feature sum XLA on CPU runs several times slower than the
# exponential after it, its gradient tens of times. The pair program runs the kernel's jaxpr (its program on one pair
# of points) once on the whole block, equation by equation (``_run``; ``_RULES`` chooses each rule), holding each
# value of shape S (say [D] or []) as
#
# - an array [B, N, *S], B in {1, b} and N in {1, n}: a value of x alone is [b, 1, *S], of y alone [1, n, *S], of
#   neither [1, 1, *S], so whatever depends on one point is computed once per point, not once per pair;
# - ``_WrittenOut``: a value of both points with at most the form's ``written_out`` features, as one [b, n] array each;
# - ``_ByFeature``: one with more, as a function from a feature index to its [b, n] array, summed as the form's
#   ``feature_sum`` says: in a ``fori_loop`` whose body reverse mode recomputes, or at once on [b, n, D] values.
#
# Every rule applies the vmap form's primitives to the same values, except: sums may add their terms in another
# order; two points scaled alike are subtracted before they are scaled (``_Scaled``); a square of a value of both
# points is ``a ** 2`` (reverse mode through ``a * a`` adds ``ct * a`` twice); and |s (x - y)|^2 (``_squaring``) is
# computed as the form's ``squared_distances`` say (``_sum_of_squares``). An equation no rule takes is vmapped on its
# own (``_by_vmap``).
#
# On a CPU the program runs every kernel it takes, summing over more than a few features in a loop. On an
# accelerator the vector unit's lanes hold those features, mostly empty at small D: there the program writes
# features out at small D (values only: its derivatives compiled slowly and ran slower); past them it runs float32
# kernels of a squared distance, summed at once (values only) and from gemm_features_min by the GEMM, so that the
# fused form stands on it. bench_lazy_kernel.py measured each constant (its docstring says how).


@dataclasses.dataclass(frozen=True)
class Settings(Settings):
    """The settings, with the pair program's."""

    pair_program: bool = True  # False: every block is the vmap form (or the kernel's cross_covariance)
    split_features_max: int = 2  # on CPU, features written out to here, summed in a loop past it (bench --split)
    accelerator_features: range = range(2, 65)  # off the CPU, D whose features are written out (--accelerator-features)
    gemm_features_min: int = 128  # d^2 by the GEMM from here; below, too many pairs it cannot vouch for (--gemm)
    wide_gemm_features_min: int = 8  # on CPU, d^2 by the float64 GEMM from here (--wide)
    sum_chunk: int = 4  # features summed pairwise per step of the loop (_looped_sum; --chunks)
    accelerator_wide_block_bytes: int = 256 * 2**20  # off the CPU, its blocks' fastest bytes, half for gradients


SETTINGS = Settings()


class FeatureSum(enum.Enum):
    """How the pair program sums a value of both points over more features than it writes out."""

    LOOP = "a loop adding one [b, n] array per feature, recomputed in reverse mode"
    AT_ONCE = "at once, on [b, n, D] values (on an accelerator a loop is a pass over memory per feature)"


class Distance(enum.Enum):
    """A way to compute |s (x - y)|^2 for every pair of a block, besides the direct sum over features."""

    GEMM = "|a|^2 + |b|^2 - 2 a.b, where its error bound is within 4x the direct sum's"
    FLOAT64_GEMM = "float32 points by the GEMM in float64, where the kernel takes its error"


@dataclasses.dataclass(frozen=True)
class PairProgramForm:
    """Blocks from the kernel's program run on whole blocks, and everything that shapes that run."""

    name = "pair program"
    values_only: bool  # differentiated as the vmap form (off the CPU at small D), else as it is
    written_out: int  # a value of both points with at most this many features: one [b, n] array each
    feature_sum: FeatureSum  # a value with more
    squared_distances: tuple[Distance, ...]  # each falls back to the next, the last to the direct sum
    gemm_precision: jax.lax.Precision  # of d^2's GEMM: float32 where an accelerator would round to bf16
    sum_chunk: int  # features summed pairwise per step of a loop
    chunked_derivative: bool  # the loop's derivative one feature at a time (JAX 0.10 on)
    fastest_bytes: tuple[int, int | None] | None  # its blocks' fastest bytes, product and gradient (None: default)

    def make(self, kernel, xa, xb, transposed):
        if not (xa.shape[0] and xb.shape[0]):
            return _vmap_block(kernel, xa, xb, transposed)
        if not self.values_only:
            return _pair_program_run(kernel, xa, xb, transposed, self).block
        pair, consts = jax.closure_convert(
            lambda x, y: kernel(x, y), *((xb[0], xa[0]) if transposed else (xa[0], xb[0]))
        )
        return _values_block(pair, transposed, self, xa, xb, *consts)

    def describe(self, kernel, dim, dtype):
        vmapped = sorted(_probe_run(kernel, dim, dtype, self).vmapped)
        return self.name + (f" (by vmap: {', '.join(vmapped)})" if vmapped else "")

    def squared_distance(self, kernel, xa, xb, transposed=False):
        """The kernel on the block ``xa``, ``xb`` as a function of one squared distance d^2 = |s (x - y)|^2 with a
        step s, a scalar or one per feature, as this program reads it: a SquaredDistance, or why it is not one."""
        probe = dataclasses.replace(self, written_out=0, squared_distances=())  # every d^2 seen
        run = _pair_program_run(kernel, xa, xb, transposed, probe)
        if not run.distances:
            return "no sum of squared scaled differences |s (x - y)|^2"
        (point, _), eqn = run.distances[-1]
        tail = run.tail(eqn)
        if tail is None:
            return "the kernel depends on the points otherwise than through d^2"
        step = _dense(point.scaling(jnp.ones((1, 1, 1), point.point.dtype)))
        return SquaredDistance(step.reshape(() if step.size == 1 else -1), len(point.steps), tail)


class SquaredDistance(NamedTuple):
    """A kernel as its program computes it on a block: K = tail(d^2), d^2 = |s (x - y)|^2 (PairProgramForm's
    ``squared_distance``)."""

    step: jax.Array  # s, traced: a scalar, or [D] (a step per feature)
    steps: int  # the scaling steps that make s (each rounds)
    tail: jax.extend.core.ClosedJaxpr  # K as a function of d^2, a scalar, to [1, 1]


def _pair_program_plan(plan, kernel, dim, dtype):
    """The plan's block by the pair program where it takes the kernel: on a CPU at every D, off it where features
    are written out, or past them (float32) for a kernel of a squared distance; else the plan as it was, and why."""
    on_cpu, float32, settings = plan.backend == "cpu", dtype == jnp.float32, SETTINGS
    gemm = dim >= settings.gemm_features_min and (float32 or (on_cpu and dtype == jnp.float64))  # float64: CPU only
    wide = on_cpu and float32 and dim >= settings.wide_gemm_features_min and _float64_in_traces()
    if not settings.pair_program:
        return plan.noted("not the pair program: SETTINGS.pair_program is off")
    past_written_out = not on_cpu and float32 and dim > max(settings.accelerator_features)  # kernels of a d^2 only
    if not (on_cpu or dim in settings.accelerator_features or past_written_out):
        return plan.noted(f"not the pair program: D = {dim} in {jnp.dtype(dtype).name} off the CPU")
    values_only = not (on_cpu or gemm)
    wide_bytes = settings.accelerator_wide_block_bytes
    form = PairProgramForm(
        values_only=values_only,
        written_out=settings.split_features_max if on_cpu else max(settings.accelerator_features),
        feature_sum=FeatureSum.LOOP if on_cpu else FeatureSum.AT_ONCE,
        squared_distances=(Distance.GEMM,) * gemm + (Distance.FLOAT64_GEMM,) * wide,
        gemm_precision=jax.lax.Precision.HIGHEST,
        sum_chunk=settings.sum_chunk,
        chunked_derivative=_JAX_VERSION >= (0, 10),  # 0.4.30's scan transpose rejected it (0.5 to 0.9 untried)
        fastest_bytes=None if on_cpu else (wide_bytes, None if values_only else wide_bytes // 2),
    )
    reason = _pair_program_refuses(kernel, dim, dtype, form, distance_only=past_written_out)
    if reason:
        return plan.noted(f"not the pair program: {reason}")
    if wide and not _tails_widen(kernel, dim, dtype, form):  # the float64 GEMM needs the tail in float64
        form = dataclasses.replace(form, squared_distances=form.squared_distances[:-1])
    return dataclasses.replace(plan, block=form)


def _pair_program_refuses(kernel, dim, dtype, form, distance_only):
    """Why the pair program cannot make blocks of ``kernel`` as ``form`` says, or None: it takes a kernel without
    effects whose ``cross_covariance``, if any, is the vmap form; ``distance_only``, one with a squared distance."""
    point = jax.ShapeDtypeStruct((dim,), dtype)
    if not _vmap_or_no_cross_covariance(kernel, dim, dtype):
        return "a cross_covariance of its own"
    if _pair_program(kernel, point, point).jaxpr.effects:
        return "a kernel with effects"
    direct = dataclasses.replace(form, squared_distances=())  # enough to see whether the program has a d^2
    if distance_only and not _probe_run(kernel, dim, dtype, direct).distances:
        return f"D = {dim} off the CPU, with no squared distance"
    return None


def _tails_widen(kernel, dim, dtype, form):
    """Whether the kernel, as a function of each d^2 it sums, runs on float64 values (``_in_float64``)."""
    run = _probe_run(kernel, dim, dtype, dataclasses.replace(form, squared_distances=()))
    return all(_in_float64(tail) is not None for tail in map(run.tail, (eqn for _, eqn in run.distances)) if tail)


def _probe_run(kernel, dim, dtype, form):
    """The pair program's run on small abstract blocks (traced, not run)."""
    runs, (xa, xb) = [], _probe_blocks(dim, dtype)
    jax.eval_shape(lambda xa, xb: runs.append(_pair_program_run(kernel, xa, xb, False, form)), xa, xb)
    return runs[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _values_block(pair, transposed, form, xa, xb, *consts):
    """The pair program's block, differentiated as the vmap form (jvp, grad, hessian alike): on a TPU, the
    program's own gradient compiled slowly and ran slower than the vmap form's (bench_lazy_kernel.py's docstring)."""
    return _pair_program_run(lambda x, y: pair(x, y, *consts), xa, xb, transposed, form).block


@_values_block.defjvp
def _values_block_jvp(pair, transposed, form, primals, tangents):
    vmapped = lambda xa, xb, *consts: _vmap_block(lambda x, y: pair(x, y, *consts), xa, xb, transposed)  # noqa: E731
    return jax.jvp(vmapped, primals, tangents)


def _pair_program_run(kernel, xa, xb, transposed, form):
    """The kernel's program run on the block: its ``block``, and what the rules did (``vmapped``, ``distances``)."""
    first, second = (xb, xa) if transposed else (xa, xb)
    program = _pair_program(kernel, first[0], second[0])  # traced on them: under shard_map, as they vary
    rows, cols = xa[:, None, :], xb[None, :, :]  # [b, 1, D] and [1, n, D]: values of x alone, of y alone
    inputs = [_Scaled(p, form) if jnp.issubdtype(p.dtype, jnp.floating) else p for p in (rows, cols)]  # real floats
    run = _Run(program, inputs[::-1] if transposed else inputs, form)
    run.block = jnp.broadcast_to(run.value(), (xa.shape[0], xb.shape[0]))
    return run


class _WrittenOut:
    """A value of both points with features: a NumPy object array of shape S holding [b, n] arrays."""

    def __init__(self, parts):
        self.parts = parts


class _ByFeature:
    """A value of both points with more features than the form writes out, shape [D]: ``feature(i)`` computes feature
    ``i`` (traced) as a [b, n] array, ``dense()`` all of them as [b, n, D]. ``difference``: the two _Scaled points,
    where the value is their difference scaled (``steps(x - y)``); ``square_of``: the same, where it is that difference
    squared (see _squaring)."""

    def __init__(self, size, feature, dense, difference=None, square_of=None):
        self.size, self.feature, self.dense = size, feature, dense
        self.difference, self.square_of = difference, square_of


def _pair_program(kernel, x, y):
    """The kernel's program on one pair of points ``x`` and ``y``."""
    return jax.make_jaxpr(lambda x, y: kernel(x, y))(x, y)  # __name__ may not be a str


class _Run:
    """One evaluation of a kernel's program on a block, as the rules see it, made as ``form`` says. ``vmapped``
    collects the equations vmapped on values of both points; ``distances`` the sums |s (x - y)|^2 it found (the
    two _Scaled points, the equation); ``given`` maps equations (by id) to the outputs a tail probe gives them."""

    def __init__(self, program, inputs, form, given=None):
        self.program, self.inputs, self.form, self.given, self.vmapped = program, inputs, form, given or {}, set()
        self.distances = []

    def value(self):
        """The block, [B, N] with B in {1, b} and N in {1, n}."""
        (out,) = _run(self.program.jaxpr, self.program.consts, self.inputs, self)
        return _dense(_evaluated(out))

    def tail(self, eqn):
        """The kernel's value as a function of the output of ``eqn`` alone (a scalar), the program run again with
        that output given: a ClosedJaxpr from a scalar to [1, 1]; None where the value depends on the points
        otherwise too, or is not a float (argmax's has no derivatives)."""
        given = lambda out: {**self.given, id(eqn): [out.reshape(1, 1)]}  # noqa: E731
        program = jax.make_jaxpr(lambda out: _Run(self.program, self.inputs, self.form, given(out)).value())
        program = program(jnp.zeros((), eqn.outvars[0].aval.dtype))
        out = program.out_avals[0]
        return program if out.shape == (1, 1) and jnp.issubdtype(out.dtype, jnp.floating) else None


def _run(jaxpr, consts, args, run):
    """Evaluate ``jaxpr`` on block values as the pair program ``run`` does (see this layer's head)."""
    done = {}  # equation key -> (its arguments, kept alive so that their ids stay theirs; its outputs)

    def equation(eqn, read, inline):
        if id(eqn) in run.given:
            return run.given[id(eqn)]
        args = [read(var) for var in eqn.invars]
        key = _equation_key(eqn, args)
        if key in done:  # computed before (GPJax's softplus of its lengthscale, twice): the same values
            return done[key][1]
        if inline:
            outs = inline(args)
        else:
            rule = _RULES.get(eqn.primitive.name)
            outs = rule(eqn, args, run) if rule else None
        if outs is None:
            args = [_evaluated(a) for a in args]
            if any(_of_both([a]) for a in args):  # an argument of both points: vmapped on pairs
                run.vmapped.add(eqn.primitive.name)
            outs = _by_vmap(eqn, args)
        if key is not None:
            done[key] = (args, outs)
        return outs

    block_value = lambda c: jnp.asarray(c)[None, None]  # noqa: E731
    literal = lambda var: jnp.asarray(var.val, var.aval.dtype)[None, None]  # noqa: E731
    return _evaluate(jaxpr, list(map(block_value, consts)), args, equation, literal, block_value)


def _equation_key(eqn, args):
    """What an equation computes: its primitive, parameters and argument values (by identity); None with
    effects. Equal keys mean equal outputs, so that ``x/s - y/s`` with ``s`` computed twice is seen as two
    points scaled alike (see _Scaled)."""
    if eqn.effects:
        return None
    params = tuple(
        (k, id(v) if isinstance(v, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)) else repr(v))
        for k, v in sorted(eqn.params.items())
    )
    return eqn.primitive, params, tuple(map(id, args))


def _elementwise(eqn, args, form):
    """An elementwise equation: per feature on a value of both points with 1 to the form's ``written_out`` features,
    feature by feature on one with more (_ByFeature), else on the arguments broadcast against each other."""
    shape, written_out = eqn.outvars[0].aval.shape, form.written_out
    if _of_both(args) and shape and 0 < math.prod(shape) <= written_out:
        parts = np.empty(shape, object)
        for index in np.ndindex(shape):
            (parts[index],) = _bind_broadcast(eqn, [_feature(a, index) for a in args])
        return [_WrittenOut(parts)]
    if _of_both(args) and len(shape) == 1 and shape[0] > written_out:
        sources = [_features_of(a) for a in args]
        feature = lambda i: _bind_broadcast(eqn, [f(i) for f in sources])[0]  # noqa: E731
        squaring = _squaring(eqn, args)
        if squaring and eqn.primitive.name == "mul":
            feature = _squared(sources[0])
        square_of = getattr(args[0], "difference", None) if squaring else None
        dense = lambda: _broadcast_elementwise(eqn, [_dense(a) for a in args])[0]  # noqa: E731
        return [_ByFeature(shape[0], feature, dense, _scaled_difference(eqn, args), square_of)]
    return _broadcast_elementwise(eqn, [_dense(a) for a in args])


def _squaring(eqn, args):
    """Whether ``eqn`` squares its argument: ``a * a``, ``square(a)``, ``a ** 2`` or a dot of ``a`` with itself.
    Where that is ``steps(x - y)`` (a _ByFeature's ``difference``), the square is |s (x - y)|^2."""
    name = eqn.primitive.name
    power = name == "integer_pow" and eqn.params["y"] == 2
    return args[0] is args[-1] and (name in ("mul", "square", "dot_general") or power)


def _scaled_difference(eqn, args):
    """For an equation that negates, multiplies or divides a scaled difference of two points (a _ByFeature's
    ``difference``) by a value of neither point: the two points with that step added; else None."""
    tagged = [i for i, a in enumerate(args) if isinstance(a, _ByFeature) and a.difference]
    if len(tagged) != 1 or eqn.outvars[0].aval.dtype != args[tagged[0]].difference[0].point.dtype:
        return None
    step = _scaling_step(eqn, args, tagged[0])
    return None if step is None else tuple(p.then(eqn, *step) for p in args[tagged[0]].difference)


def _broadcast_elementwise(eqn, args):
    """An elementwise equation on block values [B, N, *S] (or [B, N]: scalars) broadcast against each other."""
    shape = eqn.outvars[0].aval.shape
    return _bind_broadcast(eqn, [a.reshape(a.shape[:2] + (1,) * (len(shape) + 2 - a.ndim) + a.shape[2:]) for a in args])


def _feature_sum_rule(eqn, args, run):
    """``reduce_sum`` of a _WrittenOut: a sum of [b, n] arrays; of a _ByFeature: the form's feature sum."""
    (a,) = args
    if isinstance(a, _ByFeature):
        return [_sum_of_squares(eqn, run, a.size, a.square_of, a.feature, a.dense)]
    if not isinstance(a, _WrittenOut):
        return None
    axes = tuple(eqn.params["axes"])
    if len(axes) == a.parts.ndim:
        return [_pairwise(list(a.parts.flat))]
    total = np.sum(a.parts, axis=axes)
    if isinstance(total, np.ndarray):
        return [_WrittenOut(total) if total.ndim else total[()]]
    return [total]


def _feature_dot_rule(eqn, args, run):
    """A dot of two float vectors, one of them a _WrittenOut or _ByFeature: the sum of their products."""
    (contract, batch), out = eqn.params["dimension_numbers"], eqn.outvars[0].aval
    inputs = [var.aval for var in eqn.invars]
    plain = all(a.ndim == 1 and a.dtype == out.dtype for a in inputs) and jnp.issubdtype(out.dtype, jnp.floating)
    features = [isinstance(a, (_WrittenOut, _ByFeature)) for a in args]
    if not (any(features) and plain and contract == ((0,), (0,)) and batch == ((), ())):
        return None
    x, y = map(_evaluated, args)
    if not any(isinstance(a, _WrittenOut) for a in args):
        size = inputs[0].shape[0]
        if _squaring(eqn, [x, y]):
            square = lambda: jax.lax.integer_pow(_dense(x), 2)  # noqa: E731
            return [_sum_of_squares(eqn, run, size, getattr(x, "difference", None), _squared(_features_of(x)), square)]
        product = lambda: _dense(x) * _dense(y)  # noqa: E731
        x, y = _features_of(x), _features_of(y)
        return [_feature_sum(size, lambda i: x(i) * y(i), product, run.form)]
    return [_pairwise([_feature(x, (d,)) * _feature(y, (d,)) for d in range(inputs[0].shape[0])])]


def _elementwise_rule(eqn, args, run):
    """Scaling a point, or subtracting two scaled alike (_scaling_rule); else _elementwise."""
    return _scaling_rule(eqn, args) or _elementwise(eqn, list(map(_evaluated, args)), run.form)


_RULES = {  # primitive name -> rule(eqn, block values, run) -> outputs, or None: vmap the equation
    **dict.fromkeys(_ELEMENTWISE, _elementwise_rule),
    "reduce_sum": _feature_sum_rule,
    "dot_general": _feature_dot_rule,
}


def _of_both(args):
    """Whether block values together depend on both points."""
    if any(isinstance(a, (_WrittenOut, _ByFeature)) for a in args):
        return True
    return any(a.shape[0] > 1 for a in args) and any(a.shape[1] > 1 for a in args)


def _feature(a, index):
    """The [B, N] array of one feature of a block value (a value with no features is its own). An axis of size 1
    broadcasts, as in ``lax.sub(f32[3], f32[1])``: its one feature serves every index."""
    shape = a.parts.shape if isinstance(a, _WrittenOut) else a.shape[2:]
    index = tuple(0 if size == 1 else i for i, size in zip(index[len(index) - len(shape) :], shape, strict=True))
    if isinstance(a, _WrittenOut):
        return a.parts[index]
    return a[(slice(None), slice(None), *index)]


def _features_of(a):
    """A block value of shape [D] or [1], or a scalar, as a function of a feature index (traced): its [B, N]
    array there."""
    if isinstance(a, _ByFeature):
        return a.feature
    a = _dense(a)
    if a.ndim == 2 or a.shape[2] == 1:
        return lambda i: a.reshape(a.shape[:2])
    by_feature = jnp.moveaxis(a, 2, 0)  # [D, B, N]: each feature contiguous
    return lambda i: jax.lax.dynamic_index_in_dim(by_feature, i, keepdims=False)


def _squared(feature):
    """``feature(i) * feature(i)`` as ``feature(i) ** 2``: the same values, and a derivative of one product where
    reverse mode through ``a * a`` adds ``ct * a`` twice."""
    return lambda i: jax.lax.integer_pow(feature(i), 2)


def _feature_sum(size, feature, dense, form):
    """The sum over features of a value of both points, as the form says: of ``feature(i)``, i < size, in a loop,
    or of ``dense()``, its [b, n, D] values, at once."""
    return _looped_sum(size, feature, form) if form.feature_sum is FeatureSum.LOOP else jnp.sum(dense(), 2)


def _sum_of_squares(eqn, run, size, square_of, feature, dense):
    """The sum of ``feature(i)``, i < size (``dense()``: all of them), the output of ``eqn``. Where it is
    |steps(x - y)|^2 (``square_of``, the two _Scaled points), by the form's ``squared_distances``, each falling
    back to the next and the last to the direct sum: the GEMM (_squared_distance), and the float64 GEMM
    (_wide_squared_distance) where the kernel's value is a function of this sum alone. Else _feature_sum."""
    direct = functools.partial(_feature_sum, size, feature, dense, run.form)
    if square_of is None:
        return direct()
    run.distances.append((square_of, eqn))
    fallback = direct
    for distance in reversed(run.form.squared_distances):
        if distance is Distance.GEMM:
            fallback = functools.partial(_squared_distance, *square_of, fallback, run.form.gemm_precision)
        elif not run.given:  # Distance.FLOAT64_GEMM; not while its own tail is probed
            tail = run.tail(eqn)
            tail = None if tail is None else _in_float64(tail)
            if tail is not None:
                fallback = functools.partial(_wide_squared_distance, *square_of, fallback, tail)
    return fallback()


def _rows_and_columns(first, second):
    """The two _Scaled points of a block as (the one of rows [b, 1, D], the one of columns [1, n, D]), and their
    points, [b, D] and [n, D]."""
    rows, cols = (first, second) if first.point.shape[1] == 1 and second.point.shape[0] == 1 else (second, first)
    return rows, cols, rows.point[:, 0], cols.point[0]


def _wide_squared_distance(first, second, fallback, tail):
    """|steps(x - y)|^2 of float32 points for every pair of a block, by the GEMM ``|a|^2 + |b|^2 - 2 a.b`` in
    float64 on the points converted, then centred and scaled, rounded to float32; ``fallback()`` (the direct sum) where
    the kernel, ``tail(d^2)``, cannot take that GEMM's error (under ``vmap``, both run).

    The float64 d^2 errs by at most delta = (D + 3) eps64 (max|a| + max|b|)^2 (the largest norms of the block's rows
    and columns): one bound for every pair. A d^2 within 2 delta of zero is zero (a duplicate point, for all the GEMM
    can tell; its gradient is kept), which leaves its K exactly the vmap form's. The block takes the GEMM where delta
    is at most (16 eps32)^2 and ``_takes_error(tail, delta)``."""
    rows, cols, x, y = _rows_and_columns(first, second)
    with _float64():
        x, y = (jax.lax.convert_element_type(p, jnp.float64) for p in (x, y))
        centre = jax.lax.stop_gradient((jnp.sum(x, 0) + jnp.sum(y, 0)) / (x.shape[0] + y.shape[0]))
        # Each lengthscale converted once for both points: their gradients, which cancel to about (a - b)^2, are
        # then added in float64. Converted apart, each was rounded to float32 first.
        converted = {}
        cast = lambda v: converted.setdefault(id(v), (v, jax.lax.convert_element_type(v, jnp.float64)))[1]  # noqa: E731
        a, b = rows.scaling(x[:, None] - centre, cast)[:, 0], cols.scaling(y[None] - centre, cast)[0]
        norms_a, norms_b = jnp.sum(a * a, 1), jnp.sum(b * b, 1)
        # The gradient stops before the reductions: transposed after this context, they would mix dtypes.
        reach = jnp.sqrt(jnp.max(jax.lax.stop_gradient(norms_a))) + jnp.sqrt(jnp.max(jax.lax.stop_gradient(norms_b)))
        delta = (x.shape[1] + 3) * float(jnp.finfo(jnp.float64).eps) * reach * reach
        eps = float(jnp.finfo(jnp.float32).eps)
        vouched = (delta <= (16 * eps) ** 2) & _takes_error(tail, delta, eps)

    def by_gemm():
        with _float64():
            # lax.dot_general, not jnp.matmul: its transpose in reverse mode stays float64 after this context
            squared = norms_a[:, None] + norms_b[None] - 2 * jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())))
            squared = jax.lax.convert_element_type(squared, jnp.float32)  # first: XLA then fuses it into the GEMM
        zero = squared <= 2 * delta.astype(jnp.float32)
        return jnp.where(zero, squared - jax.lax.stop_gradient(squared), squared)

    return jax.lax.cond(vouched, by_gemm, jax.checkpoint(fallback))


def _takes_error(tail, delta, eps):
    """Whether ``tail`` (the kernel as a function of d^2, in float64) moves by at most 16 eps of itself, and its
    derivative (the gradient's factor) by at most 16 eps of itself, when d^2 errs by ``delta``: judged to first order
    where the tails of stationary kernels are most sensitive, near zero: at 2 delta (the least d^2 not taken as zero)
    and at 4 delta / eps (from there on, delta is within d^2's own float32 rounding, as in the direct sum).

    RBF, Matern 3/2 and 5/2 pass while delta is small; Matern 1/2 (a square root of d^2) never does: its
    derivative moves by half at 2 delta."""
    value, slope, curvature = _tail_derivatives(tail, jnp.stack([2 * delta, 4 * delta / eps]))
    value_moved, slope_moved = jnp.abs(slope) * delta, jnp.abs(curvature) * delta
    return jnp.all((value_moved <= 16 * eps * jnp.abs(value)) & (slope_moved <= 16 * eps * jnp.abs(slope)))


def _squared_distance(first, second, fallback, precision):
    """|steps(x - y)|^2 for every pair of a block, by the GEMM ``|a|^2 + |b|^2 - 2 a.b`` on centred, scaled points
    wherever its error bound is within 4x the direct sum's; ``fallback()`` otherwise (the float64 GEMM, or the direct
    sum). The GEMM's d^2 has an error bound of about eps (|a|^2 + |b|^2 + 2 |a| |b|) <= 2 eps (|a|^2 + |b|^2), the
    direct sum's eps d^2: so the GEMM vouches for a pair where d^2 >= (|a|^2 + |b|^2) / 2. Two pairs in a row that it
    cannot vouch for (a duplicate point and a near one, say) are recomputed directly; a block with a row with more falls
    back, recomputed in reverse mode (under ``vmap``, both run)."""
    rows, cols, x, y = _rows_and_columns(first, second)
    centre = (jnp.sum(x, 0) + jnp.sum(y, 0)) / (x.shape[0] + y.shape[0])
    a, b = rows.scaling(rows.point - centre)[:, 0], cols.scaling(cols.point - centre)[0]
    norms = jnp.sum(a * a, 1)[:, None] + jnp.sum(b * b, 1)[None, :]
    squared = norms - 2 * jnp.matmul(a, b.T, precision=precision)
    unvouched = ~(squared >= norms / 2)  # NaN included

    def repaired():
        column = jax.lax.broadcasted_iota(jnp.int32, squared.shape, 1)
        highest = jnp.max(jnp.where(unvouched, column, 0), axis=1)
        lowest = jnp.min(jnp.where(unvouched, column, highest[:, None]), axis=1)
        result = jnp.maximum(squared, 0)
        for partner in (highest, lowest):  # the columns of each row's unvouched pairs
            direct = rows.scaling(rows.point - y[partner][:, None])  # [b, 1, D]: each row with its partner
            result = jnp.where(column == partner[:, None], jnp.sum(direct * direct, 2), result)
        return result

    return jax.lax.cond(jnp.any(jnp.sum(unvouched, 1) > 2), jax.checkpoint(fallback), repaired)


def _looped_sum(size, feature, form):
    """The sum of ``feature(i)``, i < size, in a loop whose body is rematerialised, so that reverse mode recomputes each
    feature from the points, and stores none. Up to ``sum_chunk`` features are added one at a time; past that, chunks of
    ``sum_chunk`` features (more past 64, so that there are at most 16) are summed pairwise, one chunk per step, and the
    remainder after them: an error bound of at most (16 + log2 chunk) eps of the terms' sum, where added one at a time
    it grows as (size - 1) eps, and a large d^2 (every pair far apart) carries its relative error into K's. Compensating
    the chunks' sum (Kahan's) doubled the loop's time. The derivative (a sum in any order) is taken one feature a time:
    chunks in reverse mode took twice as long."""
    if size <= form.sum_chunk:
        return _one_at_a_time(size, feature)
    if not form.chunked_derivative:
        return _chunks(size, form.sum_chunk, feature)
    indexed, consts = jax.closure_convert(feature, 0)  # custom_jvp differentiates explicit inputs only
    return _chunked_sum(size, form.sum_chunk, indexed, *consts)


def _one_at_a_time(size, feature):
    return jax.lax.fori_loop(1, size, jax.checkpoint(lambda i, total: total + feature(i)), feature(0))


def _chunks(size, sum_chunk, feature):
    """``_looped_sum`` past ``sum_chunk`` features."""
    width = max(sum_chunk, -(-size // 16))  # at most 16 chunks: the error bound above
    chunks, rest = divmod(size, width)

    def chunk(first, count=width):
        return _pairwise([feature(first + i) for i in range(count)])

    add = jax.checkpoint(lambda c, total: total + chunk(c * width))
    total = jax.lax.fori_loop(1, chunks, add, chunk(0))
    return total + chunk(chunks * width, rest) if rest else total


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _chunked_sum(size, sum_chunk, indexed, *consts):
    """``_chunks`` of ``indexed(i, *consts)``, its derivative one feature a time."""
    return _chunks(size, sum_chunk, lambda i: indexed(i, *consts))


@_chunked_sum.defjvp
def _chunked_sum_jvp(size, sum_chunk, indexed, primals, tangents):
    def tangent(i):
        return jax.jvp(lambda *consts: indexed(i, *consts), primals, tangents)[1]

    return _chunked_sum(size, sum_chunk, indexed, *primals), _one_at_a_time(size, tangent)


def _pairwise(terms):
    """The sum of a list of arrays, added in pairs."""
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


def _dense(a):
    """A block value as one array [B, N, *S]."""
    if isinstance(a, _ByFeature):
        return a.dense()
    if not isinstance(a, _WrittenOut):
        return a
    lead = jnp.broadcast_shapes(*(part.shape for part in a.parts.flat))
    parts = [jnp.broadcast_to(part, lead) for part in a.parts.flat]
    return jnp.stack(parts, axis=-1).reshape(lead + a.parts.shape)


def _by_vmap(eqn, args):
    """Any equation, vmapped over the pair axes its arguments have: a value of x alone stays one."""
    args = [_dense(a) for a in args]
    by_row, by_col = [a.shape[0] > 1 for a in args], [a.shape[1] > 1 for a in args]

    def per_row(*row):  # each [N, *S]: the row axis is gone
        row = [a if c else a[0] for a, c in zip(row, by_col, strict=True)]
        f = lambda *a: _bind(eqn, a)  # noqa: E731
        return jax.vmap(f, [0 if c else None for c in by_col])(*row) if any(by_col) else f(*row)

    rows = [a if r else a[0] for a, r in zip(args, by_row, strict=True)]
    outs = jax.vmap(per_row, [0 if r else None for r in by_row])(*rows) if any(by_row) else per_row(*rows)
    missing = [axis for axis, mapped in ((0, any(by_row)), (1, any(by_col))) if not mapped]
    return [jnp.expand_dims(out, missing) for out in outs]


class _Scaled:
    """A point (the kernel's argument, [B, 1, D] or [1, N, D]) held with the steps applied to it so far, each
    multiplying or dividing by a value of neither point, or negating, as equation ``eqn`` did (with ``other`` at
    ``position`` among its arguments).

    Two points scaled by the same steps are subtracted before they are scaled: ``x/s - y/s`` is computed as
    ``(x - y)/s``, so that equal points differ by exactly zero and near ones by their difference rounded once. Scaled
    first, each point's rounding (XLA's float32 division is not even correctly rounded) enters the difference, and a
    near-duplicate's gradient (GPJax's kernels) was off by far more than the vmap form's, which XLA fuses pair by
    pair."""

    def __init__(self, point, form, steps=()):
        self.point, self.form, self.steps = point, form, steps

    def then(self, eqn, other, position):
        return _Scaled(self.point, self.form, (*self.steps, (eqn, other, position)))

    def scaling(self, value, cast=None):
        """The steps, applied to a block value as the kernel's program applies them; ``cast`` converts the values
        of neither point first (to float64 for the wide GEMM)."""
        for eqn, other, position in self.steps:
            if other is not None and cast is not None:
                other = cast(other)
            (value,) = _elementwise(eqn, [value] if other is None else [other, value][:: 2 * position - 1], self.form)
        return value


def _evaluated(a):
    return a.scaling(a.point) if isinstance(a, _Scaled) else a


def _scaling_rule(eqn, args):
    """Outputs for an equation that scales a _Scaled point, or subtracts two scaled alike (their difference,
    then the steps); None for any other (its arguments are then evaluated)."""
    name, out = eqn.primitive.name, eqn.outvars[0].aval
    lazy = [i for i, a in enumerate(args) if isinstance(a, _Scaled)]
    if not lazy:
        return None
    first = args[lazy[0]]
    if out.shape != first.point.shape[2:] or out.dtype != first.point.dtype:
        return None
    step = _scaling_step(eqn, args, lazy[0])
    if step is not None:
        return [first.then(eqn, *step)]
    if name == "sub" and len(lazy) == 2:
        a, b = args
        if a.point is not b.point and _same_steps(a.steps, b.steps):
            (difference,) = _elementwise(eqn, [a.point, b.point], a.form)
            scaled = a.scaling(difference)
            if isinstance(scaled, _ByFeature):
                scaled = _ByFeature(scaled.size, scaled.feature, scaled.dense, (a, b))
            return [scaled]
    return None


def _scaling_step(eqn, args, position):
    """``(other, position)`` for ``_Scaled.then`` where ``eqn`` negates its argument at ``position``, or multiplies
    it by (or, as the numerator, divides it by) a value of neither point; else None."""
    name = eqn.primitive.name
    if name == "neg":
        return None, 0
    if name in ("mul", "div") and (name == "mul" or position == 0):
        other = args[1 - position]
        if not isinstance(other, (_WrittenOut, _ByFeature, _Scaled)) and other.shape[:2] == (1, 1):  # of neither point
            return other, position
    return None


def _same_steps(s, t):
    """Whether two lists of steps are the same equations with the same values of neither point."""
    return len(s) == len(t) and all(
        e.primitive is f.primitive and e.params == f.params and o is u and p == q
        for (e, o, p), (f, u, q) in zip(s, t, strict=True)
    )


def _vmap_or_no_cross_covariance(kernel, dim, dtype):
    """Whether ``kernel`` has no ``cross_covariance``, or one that is exactly the vmap form. Decided on the programs,
    not their printed text: the same equations with the same parameters, wired the same way, and constants of equal
    value."""
    if not hasattr(kernel, "cross_covariance"):
        return True
    a, b = _probe_blocks(dim, dtype)
    own = jax.make_jaxpr(kernel.cross_covariance)(a, b)
    return _same_program(own, jax.make_jaxpr(functools.partial(_vmap_block, kernel))(a, b))


def _same_program(p, q):
    """Two ClosedJaxprs compute the same: equal constants and equal equations."""
    return (
        len(p.consts) == len(q.consts)
        and all(_same_value(c, d) for c, d in zip(p.consts, q.consts, strict=True))
        and _same_jaxpr(p.jaxpr, q.jaxpr)
    )


def _same_jaxpr(p, q):
    lists = [(p.constvars, q.constvars), (p.invars, q.invars), (p.outvars, q.outvars), (p.eqns, q.eqns)]
    if any(len(u) != len(w) for u, w in lists) or p.effects != q.effects:
        return False
    names = dict(zip(p.constvars + p.invars, q.constvars + q.invars, strict=True))  # p's variables -> q's
    for e, f in zip(p.eqns, q.eqns, strict=True):
        if e.primitive is not f.primitive or len(e.invars) != len(f.invars) or len(e.outvars) != len(f.outvars):
            return False
        if not all(_same_atom(u, w, names) for u, w in zip(e.invars, f.invars, strict=True)):
            return False
        if e.params.keys() != f.params.keys() or not all(_same_param(e.params[k], f.params[k]) for k in e.params):
            return False
        names.update(zip(e.outvars, f.outvars, strict=True))
    return all(_same_atom(u, w, names) for u, w in zip(p.outvars, q.outvars, strict=True))


def _same_atom(u, w, names):
    if isinstance(u, jax.extend.core.Literal):
        return isinstance(w, jax.extend.core.Literal) and u.aval == w.aval and _same_value(u.val, w.val)
    return names.get(u) is w


def _same_param(p, q):
    if isinstance(p, jax.extend.core.ClosedJaxpr):
        return isinstance(q, jax.extend.core.ClosedJaxpr) and _same_program(p, q)
    if isinstance(p, jax.extend.core.Jaxpr):
        return isinstance(q, jax.extend.core.Jaxpr) and _same_jaxpr(p, q)
    if isinstance(p, (tuple, list)):
        return type(p) is type(q) and len(p) == len(q) and all(map(_same_param, p, q))
    if _is_array(p) or _is_array(q):
        return _same_value(p, q)
    try:
        return p is q or (type(p) is type(q) and bool(p == q))
    except Exception:  # a parameter without a usable ==: not known to be the same
        return False


def _same_value(c, d):
    if isinstance(c, jax.core.Tracer) or isinstance(d, jax.core.Tracer):
        return c is d
    c, d = np.asarray(c), np.asarray(d)
    return c.dtype == d.dtype and c.shape == d.shape and np.array_equal(c, d)


_LAYERS.append(_pair_program_plan)
# --- end optional layer: pair program ---


# --- begin optional layer: measured blocks ---
#
# One block of K is not the peak: XLA keeps the temporaries the kernel's computation needs (a checkpointed gradient
# holds several blocks), beside arrays the size of the data. So the block comes from XLA's ``temp_size_in_bytes`` for
# the program that runs, compiled on abstract inputs. A gradient is a program of its own, known only when JAX
# differentiates the product: the product is a ``jax.custom_jvp`` whose rule sees which tangents are symbolic zeros,
# measures that gradient, and runs at its block (``_measured_product``). The block is the fastest if its peak fits
# ``max_memory_mb`` plus twice the data; else it shrinks (_fit). Peaks are cached by the program and its plan
# (_peak_key).


@dataclasses.dataclass(frozen=True)
class Settings(Settings):
    """The settings, with the measured blocks'."""

    measured_blocks: bool = True  # False: blocks of batch_size_row, the seed's arithmetic
    cpu_block_bytes: int = 4 * 2**20  # the fastest block on CPU, cache-sized (bench --blocks)
    cpu_min_block: int = 64  # the fewest rows or columns of a block on CPU (--blocks)
    accelerator_block_bytes: int = 64 * 2**20  # the fastest block off the CPU (--accelerator-blocks)


SETTINGS = Settings()
# Probes compile at XLA:CPU's lowest code-generation optimisation, with its older fusion emitters where this XLA
# has both: the same buffers (the tests compare measurements with the programs users compile), sooner.
_PROBE_OPTIONS = {"cpu": {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}}


@dataclasses.dataclass(frozen=True)
class MeasuredBlocks:
    """Blocks sized by XLA's measured peak of the program that runs: at most the fastest, within the budget."""

    name = "measured blocks"
    block_bytes: int  # the fastest block of a product
    gradient_block_bytes: int  # the fastest block of its gradient
    min_block_rows: int  # blocks smaller than this are slower
    probe_options: tuple[tuple[str, object], ...]  # XLA's options for a block's measurement

    def product(self, op, rhs, dtype):
        return _measured_product(op, rhs, dtype)

    def measure(self, op, width, wrt=(), cached_only=False):
        """``LazyKernel.measure``'s answer; with ``cached_only``, nothing compiled: the product's if known, else
        None."""
        differentiated = _differentiated(op, wrt) if wrt else None
        if wrt and not op.checkpoint:  # no block bounds what reverse mode stores: measured at the product's
            product, refined = _measured_block(op, width, op.dtype, given=op.batch_size, with_form=True)
            stored = _measured_block(op, width, op.dtype, product.rows, differentiated=differentiated, refined=refined)
            return stored._replace(limit_mb=product.limit_mb)
        return _measured_block(op, width, op.dtype, op.batch_size, cached_only, differentiated)


def _measured_blocks_plan(plan, kernel, dim, dtype):
    """The plan's blocks sized by measurement, the fastest as its block form asks (else this layer's default)."""
    if not SETTINGS.measured_blocks:
        return plan.noted("blocks of batch_size_row: SETTINGS.measured_blocks is off")
    on_cpu = plan.backend == "cpu"
    default = SETTINGS.cpu_block_bytes if on_cpu else SETTINGS.accelerator_block_bytes
    product, gradient = plan.block.fastest_bytes or (None, None)
    options = tuple(_probe_options(plan.backend).items())
    sizing = MeasuredBlocks(product or default, gradient or default, SETTINGS.cpu_min_block if on_cpu else 1, options)
    return dataclasses.replace(plan, sizing=sizing)


@functools.cache
def _probe_options(backend):
    """The _PROBE_OPTIONS for ``backend`` that this XLA knows (one older than jaxlib 0.5.3 has no
    ``xla_cpu_use_fusion_emitters``)."""
    options = _PROBE_OPTIONS.get(backend, {})
    return {name: value for name, value in options.items() if _known_to_xla(backend, name, value)}


def _known_to_xla(backend, name, value):
    """Whether XLA compiles for ``backend`` with the option ``name`` set to ``value``."""
    try:
        with jax.default_device(jax.local_devices(backend=backend)[0]):
            jax.jit(lambda x: x).lower(0.0).compile({name: value})
    except Exception:  # XlaRuntimeError, by another name in each JAX: "No such compile option"
        return False
    return True


_PEAKS = {}  # (what decides the peak, rows) -> XLA's temporaries in bytes; see _peak_key
_BLOCKS = {}  # (what decides the peak, limit) -> (rows, peak): the block chosen


def _measured_product(op, rhs, dtype):
    """``op @ rhs`` at the block measured for the program that runs: the product, or the gradient taken. custom_jvp
    differentiates only explicit inputs, so the tracers the kernel closes over (a hyperparameter under ``grad``, say)
    are passed in as inputs, and replaced by them in the traced product."""
    width = rhs.shape[1]
    if not (op.checkpoint and jnp.issubdtype(dtype, jnp.inexact)):  # no gradient within the budget
        measured, refined = _measured_block(op, width, dtype, with_form=True)
        return _product(op, rhs, dtype, measured.rows, refined)
    leaves, treedef = jax.tree_util.tree_flatten((op, rhs))
    closed_over = _closed_over(op)

    def at(measured, inputs):
        (block, *_), refined = measured
        rebuilt, operand = treedef.unflatten(inputs[: len(leaves)])
        product = functools.partial(_product, rebuilt, operand, dtype, block, refined)
        if not closed_over:
            return product()
        return _eval_replacing(jax.make_jaxpr(product)(), closed_over, inputs[len(leaves) :])

    @jax.custom_jvp
    def product(*inputs):
        return at(_measured_block(op, width, dtype, with_form=True), inputs)

    def gradient_at_its_block(primals, tangents):
        moved = tuple(not isinstance(t, jax.custom_derivatives.SymbolicZero) for t in tangents)
        measured = _measured_block(op, width, dtype, differentiated=moved, with_form=True)
        moving = _of_moved(functools.partial(at, measured), primals, moved)
        return jax.jvp(moving, _moved(primals, moved), _moved(tangents, moved))

    product.defjvp(gradient_at_its_block, symbolic_zeros=True)
    try:
        return product(*leaves, *closed_over)
    except NotImplementedError:  # JAX 0.4's shard_map(check_rep=True) takes no symbolic zeros: the gradient is unknown
        wrts = (("x1", "operand"), ("x2", "operand"), ("kernel", "x1", "x2", "operand"))
        forms = [_measured_block(op, width, dtype, differentiated=_differentiated(op, w), with_form=True) for w in wrts]
        return _product(op, rhs, dtype, min(m.rows for m, _ in forms), all(refined for _, refined in forms))


def _eval_replacing(closed, tracers, values, *args):
    """``closed`` (a ClosedJaxpr) evaluated on ``args``, each of ``tracers`` among its constants replaced by its
    value in ``values``."""
    replaced = {id(t): value for t, value in zip(tracers, values, strict=True)}
    return jax.core.eval_jaxpr(closed.jaxpr, [replaced.get(id(c), c) for c in closed.consts], *args)[0]


def _of_moved(f, inputs, moved):
    """``f(inputs)`` as a function of the inputs that ``moved`` flags, the others held as they are."""

    def of_moved(*values):
        values = iter(values)
        return f([next(values) if m else x for x, m in zip(inputs, moved, strict=True)])

    return of_moved


def _moved(inputs, moved):
    return [x for x, m in zip(inputs, moved, strict=True) if m]


def _differentiated(op, wrt):
    """The flags of ``_measured_block`` for a gradient with respect to the inputs named as in ``measure``."""
    kernel = "kernel" in wrt
    arrays, closed_over = sum(op._array_leaves), len(_closed_over(op))
    return (kernel,) * arrays + ("x1" in wrt, "x2" in wrt, "operand" in wrt) + (kernel,) * closed_over


def _closed_over(op):
    """The tracers ``op``'s kernel closes over rather than holds as pytree leaves, in a fixed order."""
    return [c for c in _kernel_program(op).consts if isinstance(c, jax.core.Tracer)]


def _kernel_program(op):
    """The jaxpr of one small block of ``op``, its pytree leaves as inputs."""
    leaves, treedef = jax.tree_util.tree_flatten(op)
    probes = _probe_blocks(op.x1.shape[1], jnp.result_type(op.x1, op.x2))
    block = lambda leaves, xa, xb: kernel_block(treedef.unflatten(leaves).kernel, xa, xb, transposed=op.transposed)  # noqa: E731
    return jax.make_jaxpr(block)(leaves, *probes)


def _measured_block(
    op, width, dtype, given=None, cached_only=False, differentiated=None, refined=True, with_form=False
):
    """The block for ``op @ X``, X [N, width] of ``dtype``, and its measured peak; ``with_form``, and whether the plan's
    product runs (``refined``): where its peak does not fit the budget, blocks contracted may. ``differentiated``: None
    for the product; for its gradient, a flag for each input (op's pytree leaves, X, then ``_closed_over(op)``): is the
    gradient taken with respect to it. ``given`` rows are measured as they are, ``refined`` or not. With
    ``cached_only``, nothing is compiled: the answer if it is known, else None."""
    key = (_peak_key(op, width, dtype), differentiated)
    m = op.shape[0]

    def peak(rows, refined=True):
        if (key, rows, refined) not in _PEAKS:
            _PEAKS[key, rows, refined] = _compiled_peak(op, width, dtype, rows, differentiated, refined)
        return _PEAKS[key, rows, refined]

    if given is not None:
        rows = max(1, min(given, m))
        if cached_only and (key, rows, refined) not in _PEAKS:
            return None
        measured = Measurement(rows, peak(rows, refined) / 2**20, math.nan)
        return (measured, refined) if with_form else measured
    data = sum(jnp.size(a) * jnp.result_type(a).itemsize for a in jax.tree_util.tree_leaves(op))
    data += (m + op.shape[1]) * width * jnp.dtype(dtype).itemsize  # the operand and the result
    limit = op.max_memory_mb * 2**20 + 2 * data  # the data and their cotangents: no block size removes them
    if (key, limit) not in _BLOCKS:  # decided once: a warning is said once
        if cached_only:
            return None
        fastest = _fastest_rows(op, differentiated is not None)
        choice = (*_fit(peak, fastest, limit), True)
        if choice[1] > limit and op.plan.product is not None:  # the plan's product over the budget: without it
            unrefined = (*_fit(functools.partial(peak, refined=False), fastest, limit), False)
            choice = min(choice, unrefined, key=lambda fit: fit[1])  # the lower peak
        _BLOCKS[key, limit] = choice
        _check_fit(choice[1], limit, op)
    rows, at_rows, refined = _BLOCKS[key, limit]
    measured = Measurement(rows, at_rows / 2**20, limit / 2**20)
    return (measured, refined) if with_form else measured


def _fastest_rows(op, gradient):
    """The block before the budget is measured: ``batch_size_row``, at most the plan's fastest block. A gradient's is at
    most half the rows: XLA compiles a loop of one iteration as straight-line code, scheduled with the loss around it,
    which the measured program lacks; such a gradient's peak reached 1.33x the measured one."""
    sizing = op.plan.sizing
    fastest = sizing.gradient_block_bytes if gradient else sizing.block_bytes
    rows = min(max(sizing.min_block_rows, fastest // (op.dtype.itemsize * max(op.shape[1], 1))), op.batch_size_row)
    return max(1, min(rows, -(-op.shape[0] // 2) if gradient else op.shape[0]))


def _fit(peak, rows, limit):
    """Rows, at most ``rows``, whose measured ``peak(rows)`` fits ``limit`` (else 1); and that peak. A peak of inf (too
    large to compile) halves the block first. A block that must shrink is aimed 10% under where the fitted line meets
    the limit: XLA's peaks wander around the line, and each miss costs a compile."""
    at_rows = peak(rows)
    while math.isinf(at_rows) and rows > 1:  # too large to compile: halve until a peak is measured
        rows = max(1, rows // 2)
        at_rows = peak(rows)
    if at_rows > limit and rows > 1:
        small = max(1, min(8, rows // 2))
        at_small = peak(small)
        per_row = max((at_rows - at_small) / (rows - small), 1.0)
        fixed = at_small - per_row * small
        while at_rows > limit and rows > 1:  # shrink, measuring again: XLA's choices can jump
            rows = max(1, min(rows - 1, int(0.9 * (limit - fixed) / per_row)))
            at_rows = peak(rows)
            per_row = max(per_row, (at_rows - fixed) / rows)
    return rows, at_rows


def _check_fit(at_rows, limit, op):
    """A MemoryError where XLA finds no room for a block of one row, a warning where its peak is over ``limit``."""
    if math.isinf(at_rows):
        raise MemoryError(
            f"LazyKernel{op.shape}: XLA finds no room on this device for the temporaries of a block of one row "
            f"(checkpoint={op.checkpoint})"
        )
    if at_rows > limit:
        warnings.warn(
            f"LazyKernel{op.shape}: one row of a block needs {at_rows / 2**20:.3g} MiB of temporaries "
            f"(checkpoint={op.checkpoint}): more than max_memory_mb={op.max_memory_mb} plus twice the data "
            f"({limit / 2**20:.3g} MiB in all); using 1 row per block",
            stacklevel=4,  # the caller of block_rows or measure()
        )


def _compiled_peak(op, width, dtype, rows, differentiated, refined=True):
    """XLA's temporaries in bytes for ``op @ X`` at ``rows`` rows per block, or for its gradient (``refined``: by the
    plan's product, as _product's). The gradient is in reverse mode with respect to the inputs ``differentiated`` flags
    (see _measured_block). The programs take abstract inputs: the kernel's arrays, x1, x2, X, and the tracers the kernel
    closes over."""
    leaves, treedef = jax.tree_util.tree_flatten(op.kernel)
    kernel_arrays = [_spec(a) for a in leaves if _is_array(a)]
    points_and_rhs = (_spec(op.x1), _spec(op.x2), jax.ShapeDtypeStruct((op.shape[1], width), dtype))

    def product(kernel, x1, x2, rhs):
        arrays = iter(kernel)
        kernel = treedef.unflatten([next(arrays) if _is_array(a) else a for a in leaves])
        settings = dict(batch_size=rows, checkpoint=op.checkpoint, max_memory_mb=op.max_memory_mb)  # as op runs
        measured = LazyKernel(kernel, x2, x1, **settings).T if op.transposed else LazyKernel(kernel, x1, x2, **settings)
        return _product(measured, rhs, dtype, rows, refined)

    closed = jax.make_jaxpr(product)(kernel_arrays, *points_and_rhs)
    closed_over = _closed_over(op)
    specs = [*kernel_arrays, *points_and_rhs, *map(_spec, closed_over)]
    given = len(specs) - len(closed_over)

    def run(*args):
        return _eval_replacing(closed, closed_over, args[given:], *args[:given])

    program = run
    if differentiated is not None:
        moved = [m and jnp.issubdtype(spec.dtype, jnp.inexact) for m, spec in zip(differentiated, specs, strict=True)]
        if any(moved):
            program = functools.partial(_value_and_pullback, run, moved)
            specs.append(jax.ShapeDtypeStruct((op.shape[0], width), dtype))  # the cotangent
    try:
        compiled = jax.jit(program).lower(*specs).compile(dict(op.plan.sizing.probe_options))
    except Exception as error:  # JaxRuntimeError, XlaRuntimeError in older JAX
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        return math.inf  # XLA found no room for its temporaries on this device: over any budget
    return compiled.memory_analysis().temp_size_in_bytes


def _value_and_pullback(run, moved, *args):
    """``run``'s value and its pullback of a cotangent (the last of ``args``) to the inputs ``moved`` flags. What any
    loss of the product needs. Not ``grad(sum(run))``: a loss that is linear in the product lets XLA drop the forward
    loop, and a nonlinear loss (sin, say) then needed up to 1.9x that program's temporaries."""
    *args, cotangent = args
    value, pullback = jax.vjp(_of_moved(lambda a: run(*a), args, moved), *_moved(args, moved))
    return value, pullback(cotangent)


def _spec(a):
    """An array's abstract value, weak type included: a weakly typed float64 scalar (GPJax's variance, with
    x64 on) times float32 values is float32, a strong one float64."""
    return jax.core.ShapedArray(jnp.shape(a), jnp.result_type(a), weak_type=getattr(a, "weak_type", False))


def _peak_key(op, width, dtype):
    """What decides the peak: the settings, shapes and dtypes, the kernel's program and its plan. A kernel whose pytree
    leaves are all arrays is known by its structure (no trace). Any other (a closure, say, made anew in every trace) by
    its block's program on small blocks, which costs a trace but no compile."""
    leaves, treedef = jax.tree_util.tree_flatten(op.kernel)
    kernel = (treedef, tuple(_spec(a) for a in leaves)) if all(map(_is_array, leaves)) else None
    try:
        hash(kernel)
    except TypeError:  # static pytree data that cannot be hashed (a slice, say)
        kernel = None
    if kernel is None:
        kernel = str(_kernel_program(op))
    shapes = (_spec(op.x1), _spec(op.x2), width, jnp.dtype(dtype))
    return (kernel, shapes, op.transposed, op.checkpoint, op.plan)


_LAYERS.append(_measured_blocks_plan)
# --- end optional layer: measured blocks ---


# --- begin optional layer: fused TPU product ---
#
# Needs the pair program (its form and its reading of a kernel's program: _fusion).
#
# Where a kernel is a function of d^2 = |s (x - y)|^2 with a step s (a lengthscale, or one per feature), a TPU's
# matrix unit computes |x - y|^2 exactly for points on a grid. Each coordinate x_d becomes m_d + r h: m the middle of
# the points' range in each feature, h = R 2^(2 - 8 c) with R >= every |x_d - m_d|, and r an integer of c signed
# 8-bit digits (top first), taken in float64 (the difference exact). The grid moves a coordinate by at most h / 2:
# with c = 4, 2^-31 R (under a 128th of R's ulp); with c = 3, 2^-23 R (an ulp or two), so the rule vouches for
# fewer points, but a block takes 9 digit products, not 16. Only R counts, not how far the points are from the
# origin. Digits are exact in bf16 and in int8, their products exact on the matrix unit, their sums exact below
# 2^24 (bf16 into float32) or 2^31 (int8 into int32). For each level l = i + j of digit pairs,
#
#     T_l = sum_{i+j=l} (a_i - b_i) . (a_j - b_j) = |a|^2_l + |b|^2_l - 2 sum_{i+j=l} a_i . b_j
#
# is exact: one product per level, the level's digit pairs packed side by side (bf16 folds the norms in as six
# more columns where that costs no extra pass of the 128-deep unit; more than 250 digit columns go in chunks
# whose exact sums are added). Carries then bring T_1 .. T_(2c-2) into [0, 256), so |x - y|^2 on the grid is a
# sum of non-negative terms: nothing is left to cancel. One Pallas kernel per block keeps each tile of fused_tiles
# pairs in VMEM: the levels, d^2 (times s^2), the kernel's tail (its program as a function of d^2) and the tile's
# product with the operand, added into the block's result.
#
# The rule (_verdicts), per product and c: the grid moves a difference by at most rho = sqrt(D) |s| h (times
# 1 + 2^-20 for float64's roundings), so d^2 by 2 d rho + rho^2, and the levels' sum, s^2 and |s| h round d^2 by
# (G + 2 n + 3) u (u = eps / 2, G = 2 c - 1 levels, n steps in s), where the direct sum's bound is (D + n + 1) u
# d^2. K moves by |tail'| times that, and lambda bounds |tail' / tail| (taken in float64 at d^2 from 0 to 64).
# The rule vouches where, for every d, this bound is within the contract (16 eps of K plus 4x the direct sum's):
# lambda rho^2 (1 + 1 / kappa) <= 16 eps, with kappa = (4 (D + n + 1) - (G + 2 n + 3)) u. A product takes the
# fewest digits vouched for (RBF: 3 where |s| R <= 4, 4 where |s| R <= 1024). Elsewhere the unfused form runs. The
# columns' digits count in the product's measured peak: where that cannot fit max_memory_mb, blocks are contracted.
# Which kernels, D and chips the form takes is the plan's (_fused_refuses); which digits, the data's.
#
# A step per feature (lengthscales per feature) is taken into the points: the grid is that of s_d x_d, each
# product of two float32 values exact in float64, and the rule's s is 1 (R that of the scaled points); the fused
# backward scales the points' cotangents by s_d^2 after (_fused_cotangents).
#
# Derivatives: the product is a primitive of its own (_fused_primitives). Forward mode, and anything of second
# order, is the unfused form's. Reverse mode of K @ X (up to fused_backward_width_max operand columns) runs a second
# Pallas kernel per block (_fused_backward_kernel; the cotangent of s^2 from the grid's d^2: _fused_cotangents) where
# the rule vouches with lambda bounding |tail'' / tail'| too, up to D = fused_backward_features_max; elsewhere, and
# for wider operands, the unfused form's vjp.

try:  # bound once, as JAX's Pallas TPU kernels bind them
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
except ImportError:
    pl = pltpu = None
_PALLAS_TPU = hasattr(pltpu, "CompilerParams") and hasattr(pltpu, "SMEM")  # JAX 0.4.30's has neither


@dataclasses.dataclass(frozen=True)
class FusedTiles:
    """The Pallas kernels' block sizes and scoped VMEM, as JAX's TPU kernels keep theirs (flash attention's
    ``BlockSizes``)."""

    rows: int = 512  # rows of K per step of the kernels (a multiple of 32)
    cols: int = 1024  # columns of K per step
    vmem_limit_bytes: int = 100 * 2**20  # Mosaic's default 16 MiB is too small; within a v5e's 128 MiB a core


@dataclasses.dataclass(frozen=True)
class Settings(Settings):
    """The settings, with the fused product's."""

    fused_product: bool = True  # False: no block's product is fused on a TPU
    interpret_pallas: bool = False  # True: the fused kernels run interpreted, on any backend (the tests' on a CPU)
    fused_features_min: int = 16  # on a TPU, the fused product from here (bench --fused)
    fused_width_max: int = 512  # operand columns the fused product takes; a wider operand gets the unfused form
    fused_backward_features_max: int = 127  # the fused backward to here; above, the unfused vjp (by the GEMM's d^2)
    fused_backward_width_max: int = 32  # operand columns the fused backward takes; wider, the unfused vjp
    fused_int8_features_min: int = 128  # digits in int8 from here (half bf16's matrix-unit time, more vector work)
    digit_counts: tuple[int, ...] = (3, 4)  # signed 8-bit digits per coordinate: the fewest the rule vouches for
    fused_tiles: FusedTiles = FusedTiles()


SETTINGS = Settings()
_VMEM_BYTES = {"TPU v5 lite": 128 * 2**20, "TPU v6 lite": 128 * 2**20}  # a core's, where get_tpu_info is missing
_BF16_FOLDED = 250  # digit columns per exact bf16 product with the 6 norm columns folded in: 2^16 each, < 2^24
_BF16_PLAIN = 256  # digit columns per exact bf16 product without them
_NORM_COLUMNS = 6
_SENSITIVITY_AT = (0.0, 2.0**-40, 2.0**-20, 2.0**-10, 2.0**-4, 0.25, 1.0, 4.0, 16.0, 64.0)  # d^2 where lambda is taken
_TILE_RESHAPES = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims"})  # of one value: the tile itself


@dataclasses.dataclass(frozen=True)
class FusedProduct:
    """A block's product (and its reverse mode) by the Pallas kernels, where the rule vouches for the
    data; elsewhere the plan's block, contracted."""

    tiles: FusedTiles
    packings: tuple  # (digits, "bf16" or "int8", its _Chunks) for each digit count, fewest first
    backward: bool  # reverse mode fused (D <= fused_backward_features_max), else the unfused form's vjp
    width_max: int  # operand columns it takes
    backward_width_max: int  # operand columns its reverse mode takes
    interpret: bool  # the Pallas kernels interpreted (interpret_pallas), else compiled for the chip

    @property
    def name(self):
        return "fused" if self.backward else "fused (its gradient unfused)"

    def packing(self, digits):
        """The variant and chunks of ``digits`` digits."""
        return next((variant, chunks) for count, variant, chunks in self.packings if count == digits)

    def rows_times(self, op, x1, x2, rhs, rows_times):
        """The engine's ``rows_times`` by the fused form where this layer's rule vouches for the points, else by
        ``rows_times`` (whose derivatives both use); ``rows_times`` itself where the fused form does not take the
        product: an operand wider than ``width_max``."""
        kernel, transposed, plan = op.kernel, op.transposed, op.plan
        n, width, dim = x2.shape[0], rhs.shape[1], x1.shape[1]
        if rhs.dtype != jnp.float32 or not (0 < width <= self.width_max and n and x1.shape[0]):
            return rows_times
        example = (x2[0], x1[0]) if transposed else (x1[0], x2[0])
        pair, consts = jax.closure_convert(lambda x, y: kernel(x, y), *example)
        probe = [jnp.broadcast_to(x[:1], (size, x.shape[1])) for x, size in ((x1, 2), (x2, 3))]  # of both points
        fusion = _fusion(lambda x, y: pair(x, y, *consts), *probe, transposed, plan.block)
        if isinstance(fusion, str):
            return rows_times
        per_feature = jnp.ndim(fusion.step) == 1  # its step in the grid's points
        grid = _grid(x1, x2, fusion.step if per_feature else None)
        verdicts = _verdicts(grid, fusion, dim, self)
        columns = _tile(n, self.tiles.cols, 128)[1]
        points = jax.lax.stop_gradient(_padded(x2, columns))
        packed = []
        for (digits, variant, chunks), verdict in zip(self.packings, verdicts, strict=True):
            cols, col_norms = _packed(_digits(points, verdict.grid, digits), chunks, variant, False)
            packed.append((cols, col_norms.T))
        counts = tuple(digits for digits, _, _ in self.packings)
        kernels = tuple(functools.partial(_fused_product, tail=fusion.tile_tail, form=self, digits=d) for d in counts)
        fallback = lambda rows, cols, rhs, *consts: _contract(  # noqa: E731
            plan.block.make(lambda x, y: pair(x, y, *consts), rows, cols, transposed), rhs, plan, width
        )

        def scalars(*consts):  # s^2 and the tail's constants, as functions of the kernel's (on points of no trace)
            zeros = [jnp.zeros(p.shape, p.dtype) for p in probe]
            zero_fusion = _fusion(lambda x, y: pair(x, y, *consts), *zeros, transposed, plan.block)
            return zero_fusion.step * zero_fusion.step, zero_fusion.tile_consts

        backward, backward_vouched, moves = None, (), ()
        if width <= self.backward_width_max and self.backward:
            back = tuple(functools.partial(_fused_backward, tail=fusion.tile_tail, form=self, digits=d) for d in counts)
            wide = _wide_fallback(op, pair, example, consts, rhs) if self.interpret else None
            backward = _FusedBackward(back, scalars, fallback, wide, counts)
            backward_vouched = tuple(v.vouched for v in _verdicts(grid, fusion, dim, self, derivative=True))
            moves = tuple(
                None if per_feature else _grid_moves(points, v.grid, d) for d, v in zip(counts, verdicts, strict=True)
            )
        given = _FusedOperands(tuple(packed), _fused_operand(rhs, columns), verdicts, points, backward_vouched, moves)
        return lambda rows: _fused_or_fallback((kernels, backward), fallback, given, rows, x2, rhs, *consts)


def _wide_fallback(op, pair, example, consts, rhs):
    """The fallback's vmap form on float64 values (points, operand, and the kernel's constants ``consts`` widened
    once, so that the cotangents of their uses add up in float64): a pytree kernel whose leaves hold the constants
    with its float32 leaves widened, else its program ``pair`` run on float64 values; None where the kernel does not
    run so. Taken where the Pallas kernels are interpreted (off the chip, float64 native); on a TPU float64 is
    emulated, and XLA:TPU keeps in float32 the digits XLA:CPU loses (_wide_cotangents)."""
    kernel, transposed, plan, width = op.kernel, op.transposed, op.plan, rhs.shape[1]
    widen = lambda a: a.astype(jnp.float64) if _is_array(a) and a.dtype == jnp.float32 else a  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(kernel)
    at = [next((i for i, c in enumerate(consts) if c is leaf), None) for leaf in leaves]
    if set(at) - {None} == set(range(len(consts))):  # GPJax's, RBF, a Partial: each constant a leaf
        made = lambda consts: treedef.unflatten(  # noqa: E731
            [widen(leaf) if i is None else consts[i] for leaf, i in zip(leaves, at, strict=True)]
        )
    elif (run := _in_float64(jax.make_jaxpr(pair)(*example, *consts))) is not None:  # a closure: its program
        made = lambda consts: lambda x, y: run(x, y, *consts)  # noqa: E731
    else:
        return None

    def wide(rows, cols, rhs, *consts):
        return _contract(_vmap_block(made([widen(c) for c in consts]), rows, cols, transposed), rhs, plan, width)

    probes = [jax.ShapeDtypeStruct((1, a.shape[-1]), jnp.float64) for a in (*example, rhs)]
    with _float64():
        try:  # its values and its cotangents (a custom_jvp's rule may take no float64)
            jax.eval_shape(lambda *a: jax.vjp(wide, *a)[1](jnp.ones((1, width), jnp.float64)), *probes, *consts)
        except Exception:  # a kernel that takes no float64 values (the error differs by kernel)
            return None
    return wide


def _fused_plan(plan, kernel, dim, dtype):
    """The plan's product fused where this layer takes the kernel, D and chip; else the plan as it was, and why."""
    reason = _fused_refuses(plan, kernel, dim, dtype)
    if reason:
        return plan.noted(f"not fused: {reason}")
    settings = SETTINGS
    packings = tuple((digits, *_fused_chunks(dim, digits, settings)) for digits in settings.digit_counts)
    backward = dim <= settings.fused_backward_features_max
    tiles, interpret = settings.fused_tiles, settings.interpret_pallas
    widths = settings.fused_width_max, settings.fused_backward_width_max
    product = FusedProduct(tiles, packings, backward, *widths, interpret)
    return dataclasses.replace(plan, product=product)


def _fused_refuses(plan, kernel, dim, dtype):
    """Why the fused form does not take this kernel's products, or None: it takes float32 points on a TPU with
    room for its kernels, from ``fused_features_min`` features, blocks the pair program makes, and a kernel of
    |s (x - y)|^2 with a step s (a scalar or one per feature) and a tail the Pallas kernel runs."""
    settings = SETTINGS
    if not settings.fused_product:
        return "SETTINGS.fused_product is off"
    if plan.backend != "tpu":
        return f"planned for {plan.backend}, not a TPU"
    if dtype != jnp.float32 or dim < settings.fused_features_min:
        return f"{dtype} points" if dtype != jnp.float32 else f"D = {dim} < {settings.fused_features_min}"
    if not isinstance(plan.block, PairProgramForm):
        return "blocks not by the pair program"
    if not _PALLAS_TPU or not _float64_in_traces():
        return f"JAX {jax.__version__} has no Pallas TPU or no float64 in traces (JAX 0.8 on)"
    if not settings.interpret_pallas and (vmem := _vmem_bytes()) < settings.fused_tiles.vmem_limit_bytes * 32 // 25:
        return f"the chip's VMEM ({vmem / 2**20:.3g} MiB a core, None: unknown) under what the kernels ask for"
    found = []
    jax.eval_shape(lambda xa, xb: found.append(_fusion(kernel, xa, xb, False, plan.block)), *_probe_blocks(dim, dtype))
    return found[0] if isinstance(found[0], str) else None


def _vmem_bytes():
    """A TPU core's VMEM in bytes (JAX's get_tpu_info, from 0.8.1; else by the chip's name), or 0 where unknown."""
    try:
        return pltpu.get_tpu_info().vmem_capacity_bytes
    except (AttributeError, ValueError, RuntimeError):  # no get_tpu_info in this JAX, or a chip it does not know
        try:
            return _VMEM_BYTES.get(jax.devices("tpu")[0].device_kind, 0)
        except RuntimeError:  # no TPU here: planned for one (SETTINGS.backend) without interpreting
            return 0


class _Fusion(NamedTuple):
    """What the fused form reads of a kernel's program on a block: d^2 = |s (x - y)|^2 and K = tail(d^2)."""

    step: jax.Array  # s, traced: a scalar, or [D] (a step per feature)
    steps: int  # the scaling steps that make s (each rounds)
    tail: object  # the tail, a ClosedJaxpr of d^2
    tile_tail: object  # the tail as the Pallas kernel runs it: a Jaxpr of d^2 alone (_hoisted)
    tile_consts: list  # the constants tile_tail reads, float32 scalars


def _fusion(kernel, xa, xb, transposed, form):
    """The kernel's d^2 and tail, as the pair program ``form`` reads them on a block; or, where the fused form
    cannot run it, why."""
    distance = form.squared_distance(kernel, xa, xb, transposed)
    if isinstance(distance, str):
        return distance
    jaxpr, consts = _hoisted(distance.tail)
    if not _tile_ready(jaxpr) or any(jnp.size(c) != 1 or jnp.result_type(c) != jnp.float32 for c in consts):
        return "a tail of d^2 the Pallas kernel does not run"
    return _Fusion(*distance, jaxpr, [jnp.reshape(c, ()) for c in consts])


def _on_tile(tail, consts, *inputs):
    """The kernel's tail (a Jaxpr from d^2 to a [1, 1] value, _tile_ready) on a tile of d^2, its constants
    scalars: each equation on the whole tile."""

    def equation(eqn, read, inline):
        args = [jnp.asarray(read(var), var.aval.dtype) for var in eqn.invars]
        if inline:
            return [inline(args)[0]]
        if eqn.primitive.name in _TILE_RESHAPES:
            return args[:1]
        return _bind_broadcast(eqn, args)

    return _evaluate(tail, consts, inputs, equation, lambda var: var.val)[0]


def _hoisted(tail):
    """A ClosedJaxpr of d^2 as (a Jaxpr of d^2 alone and its constants): the equations of constants alone
    evaluated here, not on every pair, and those the output does not use dropped."""
    known, kept = dict(zip(tail.jaxpr.constvars, tail.consts, strict=True)), []

    def equation(eqn, read, inline):  # a call is kept whole, or evaluated here
        if all(isinstance(var, jax.extend.core.Literal) or var in known for var in eqn.invars) and not eqn.effects:
            outs = _bind(eqn, [read(var) for var in eqn.invars])
            known.update(zip(eqn.outvars, outs, strict=True))
            return outs
        kept.append(eqn)
        return [None] * len(eqn.outvars)

    _evaluate(tail.jaxpr, tail.consts, [None] * len(tail.jaxpr.invars), equation, lambda var: var.val)
    live = {var for var in tail.jaxpr.outvars if not isinstance(var, jax.extend.core.Literal)}
    for eqn in reversed(kept):
        if any(var in live for var in eqn.outvars):
            live.update(var for var in eqn.invars if not isinstance(var, jax.extend.core.Literal))
    kept = [eqn for eqn in kept if any(var in live for var in eqn.outvars)]
    constvars = [var for var in known if var in live]
    jaxpr = tail.jaxpr.replace(constvars=constvars, eqns=kept)
    return jaxpr, [known[var] for var in constvars]


def _tile_ready(tail):
    """Whether _on_tile runs ``tail``: one input and output; equations elementwise, reshapes of a value of
    one element, or calls of such; no effects."""

    def ready(jaxpr):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if eqn.effects or len(eqn.outvars) != 1:
                return False
            if name in _CALLS and not ready(_called(eqn).jaxpr):
                return False
            if name in _TILE_RESHAPES and math.prod(eqn.outvars[0].aval.shape) != 1:
                return False
            if name not in _ELEMENTWISE | _TILE_RESHAPES | set(_CALLS):
                return False
        return True

    return len(tail.invars) == 1 and len(tail.outvars) == 1 and ready(tail)


class _Chunk(NamedTuple):
    """One exact matrix-unit product: digit columns ``a_i[:, d0:d1] . b_j[:, d0:d1]`` of one level, packed."""

    level: int
    pairs: tuple  # ((i, j, d0, d1), ...)
    width: int  # digit columns
    fold: bool  # the norms folded in as columns
    offset: int  # its first column in the packed operands (a multiple of 128)
    padded: int  # its columns there, a multiple of 128
    plain: int  # its index among the unfolded chunks' norms, or -1


def _fused_chunks(dim, digits, settings):
    """The exact products of a block on ``dim`` features of ``digits`` digits: the variant ("bf16" or "int8")
    and its chunks, by level."""
    variant = "int8" if dim >= settings.fused_int8_features_min else "bf16"
    passes = lambda columns: -(-columns // 128)  # noqa: E731
    pieces = []
    for level in range(2 * digits - 1):
        pairs = [(i, level - i) for i in range(digits) if 0 <= level - i < digits]  # i + j = level
        columns = [(i, j, d) for i, j in pairs for d in range(dim)]
        if variant == "int8":  # exact below 2^31: one product per level up to D = 8191
            sizes, fold = [len(columns)], False
        else:  # fold the norms in where that costs no extra pass
            folded, plain = _in_pieces(len(columns), _BF16_FOLDED), _in_pieces(len(columns), _BF16_PLAIN)
            fold = sum(passes(c + _NORM_COLUMNS) for c in folded) <= sum(passes(c) for c in plain)
            sizes = folded if fold else plain
        start = 0
        for size in sizes:
            runs = []
            for i, j, d in columns[start : start + size]:
                if runs and runs[-1][:2] == (i, j) and runs[-1][3] == d:
                    runs[-1] = (i, j, runs[-1][2], d + 1)
                else:
                    runs.append((i, j, d, d + 1))
            pieces.append((level, tuple(runs), size, fold))
            start += size
    chunks, offset, plain = [], 0, 0
    for level, runs, width, fold in pieces:
        padded = 128 * passes(width + _NORM_COLUMNS * fold)
        chunks.append(_Chunk(level, runs, width, fold, offset, padded, -1 if fold else plain))
        offset, plain = offset + padded, plain + (not fold)
    return variant, tuple(chunks)


def _in_pieces(total, most):
    """``total`` as sizes of at most ``most``, all ``most`` but the last."""
    return [most] * (total // most) + [total % most] * bool(total % most)


def _grid(x1, x2, scale=None):
    """The fused form's grid for the points of x1 and x2 [n, D] (each feature times ``scale``, [D] float32, where given:
    a step per feature, taken into the grid): per feature the middle m of their range, and R >= every |x - m| (float32,
    rounded up from float64, where the difference of two float32 values, or their product, is exact); and ``scale``."""
    x1, x2 = jax.lax.stop_gradient((x1, x2))
    low, high = jnp.minimum(jnp.min(x1, 0), jnp.min(x2, 0)), jnp.maximum(jnp.max(x1, 0), jnp.max(x2, 0))
    with _float64():
        low, high = low.astype(jnp.float64), high.astype(jnp.float64)
        if scale is not None:
            scale = jax.lax.stop_gradient(jnp.abs(scale))
            low, high = low * scale.astype(jnp.float64), high * scale.astype(jnp.float64)
        centre = ((low + high) / 2).astype(jnp.float32)
        reach = jnp.max(jnp.maximum(high - centre, centre - low)).astype(jnp.float32)
    reach = jnp.maximum(reach * jnp.float32(1 + 2**-22), jnp.float32(2**-100))  # rounded up
    return (centre, reach) if scale is None else (centre, reach, scale)


def _grid_integers(points, grid, count):
    """r of float32 points [n, D] (times the grid's scale per feature, if it has one) on ``grid``'s m + r h,
    h = R 2^(2 - 8 count) (int32). In float64 r is within 2^-22 of (x - m) / h before it is rounded, and
    |r| <= 2^(8 count - 2)."""
    centre, reach, *per_feature = grid
    with _float64():
        scale = jnp.float64(2.0 ** (8 * count - 2)) / reach.astype(jnp.float64)
        points = points.astype(jnp.float64) * per_feature[0].astype(jnp.float64) if per_feature else points
        return jnp.round((points.astype(jnp.float64) - centre.astype(jnp.float64)) * scale).astype(jnp.int32)


def _grid_step(grid, count):
    """h = R 2^(2 - 8 count), the step of ``grid`` (_grid) for ``count`` digits, in float64 (inside _float64)."""
    return grid[1].astype(jnp.float64) * 2.0 ** (2 - 8 * count)


def _grid_moves(points, grid, count):
    """x - (m + r h): how far the grid moves float32 points [n, D] (float32, taken in float64)."""
    with _float64():
        step = _grid_step(grid, count)
        on_grid = grid[0].astype(jnp.float64) + _grid_integers(points, grid, count).astype(jnp.float64) * step
        return (points.astype(jnp.float64) - on_grid).astype(jnp.float32)


def _digits(points, grid, count):
    """Float32 points [n, D] on ``grid`` (_grid_integers): [count, n, D] int8 digits of r, top first."""
    r = _grid_integers(points, grid, count)
    digits = []
    for _ in range(count):
        low = ((r + 128) & 255) - 128  # r = 256 q + low
        digits.append(low.astype(jnp.int8))
        r = (r - low) >> 8
    return jnp.stack(digits[::-1])


def _packed(digits, chunks, variant, left):
    """One side's operand of the products: rows [n, W] (left) or columns [W, n] (right), bf16 or int8; and the
    exact norms of the chunks without folded ones, [n, U] (float32; int32 for int8, one per level)."""
    n, kind = digits.shape[1], jnp.bfloat16 if variant == "bf16" else jnp.int8  # built in it: exact, and small
    blocks, norms = [], []
    for chunk in chunks:
        part = jnp.concatenate([digits[i if left else j, :, d0:d1] for i, j, d0, d1 in chunk.pairs], 1).astype(kind)
        wide = lambda i, d0, d1: digits[i, :, d0:d1].astype(jnp.int32)  # noqa: E731
        norm = sum(jnp.sum(wide(i, d0, d1) * wide(j, d0, d1), 1, jnp.int32) for i, j, d0, d1 in chunk.pairs)
        part = part if left or variant == "int8" else part * jnp.bfloat16(-2)
        if chunk.fold:  # the norm as 3 base-256 digits, times 2^16, 2^8 and 1 on the other side
            low = ((norm + 128) & 255) - 128
            middle = ((((norm - low) >> 8) + 128) & 255) - 128
            high = (norm - low - 256 * middle) >> 16
            mine = jnp.stack([high, middle, low], 1).astype(kind)
            powers = jnp.broadcast_to(jnp.asarray([65536.0, 256.0, 1.0], kind), (n, 3))
            part = jnp.concatenate([part, mine, powers] if left else [part, powers, mine], 1)
        else:
            norms.append(norm)
        blocks.append(jnp.pad(part, ((0, 0), (0, chunk.padded - part.shape[1]))))
    packed = jnp.concatenate(blocks, 1)
    norms = jnp.stack(norms, 1) if norms else jnp.zeros((n, 1), jnp.int32)
    return packed if left else packed.T, norms if variant == "int8" else norms.astype(jnp.float32)


def _tile_squared_distances(rows, row_norms, cols, col_norms, scales, chunks, variant):
    """d^2 for a tile of pairs, exactly on the grid, then times each level's weight (``scales[l]``, holding s^2
    and the grid step): the kernel's arithmetic, on arrays or on Pallas refs alike. rows [tm, W] and cols [W, tn]
    are packed digits (_packed); the norms are the unfolded chunks'."""
    levels = chunks[-1].level + 1
    exact_below = 2**31 if variant == "int8" else 2**24
    accumulate = jnp.int32 if variant == "int8" else jnp.float32
    t, bound = [None] * levels, [0] * levels  # the levels' sums so far, and bounds on their magnitude

    def carry(level):  # t[level] into [0, 256), its quotient into the level above
        if level > 1 and t[level - 1] is not None and bound[level - 1] + bound[level] // 256 + 1 > exact_below:
            carry(level - 1)
        if variant == "int8":
            quotient, t[level] = t[level] >> 8, t[level] & 255
        else:
            quotient = jnp.floor(t[level] * (1.0 / 256.0))
            t[level] = t[level] - 256.0 * quotient
        t[level - 1] = quotient if t[level - 1] is None else t[level - 1] + quotient
        bound[level - 1] += bound[level] // 256 + 1
        bound[level] = 256

    for level in reversed(range(levels)):  # the lowest first: its carries reach the sums above
        for chunk in (c for c in chunks if c.level == level):
            columns = slice(chunk.offset, chunk.offset + chunk.padded)
            a, b = rows[:, columns], cols[columns, :]
            part = jax.lax.dot(a, b, precision=jax.lax.Precision.DEFAULT, preferred_element_type=accumulate)  # exact
            if not chunk.fold:  # bf16's columns hold -2 b already
                norms = row_norms[:, chunk.plain : chunk.plain + 1] + col_norms[chunk.plain : chunk.plain + 1, :]
                part = norms - (part + part) if variant == "int8" else norms + part
            if t[level] is None:
                t[level], bound[level] = part, chunk.width * 2**16
                continue
            if level > 0 and bound[level] + chunk.width * 2**16 > exact_below:
                carry(level)
            t[level], bound[level] = t[level] + part, bound[level] + chunk.width * 2**16
        if level + 1 < levels:
            carry(level + 1)
    d2 = t[levels - 1].astype(jnp.float32) * scales[levels - 1]
    for level in reversed(range(levels - 1)):  # non-negative terms, the smallest first
        d2 = d2 + t[level].astype(jnp.float32) * scales[level]
    return d2


def _bf16_pieces(x):
    """Float32 ``x`` as three bf16-exact float32 pieces that add up to it exactly (by bit masks, which no
    compiler allowed excess precision can fold away, as it can a round trip through bf16)."""
    top = lambda v: jax.lax.bitcast_convert_type(  # noqa: E731
        jax.lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32
    )
    first = top(x)
    second = top(x - first)
    return first, second, x - first - second


def _padded(points, size):
    """``points`` with copies of the first appended up to ``size``: real points, whose K is finite."""
    extra = jnp.broadcast_to(points[:1], (size - points.shape[0], points.shape[1]))
    return jnp.concatenate([points, extra]) if size > points.shape[0] else points


def _padded_operand(rhs, columns):
    """The operand [N, k] in float32, its rows padded with zeros to ``columns`` (as the packed columns are)."""
    return jnp.pad(rhs.astype(jnp.float32), ((0, columns - rhs.shape[0]), (0, 0)))


def _fused_operand(rhs, columns):
    """The operand [N, k] as the kernel reads it (_padded_operand): for k = 1, a row [1, columns]; else three bf16
    blocks [X1 | X2 | X3], [X1 | X2], [X1] of its exact pieces (the six products HIGHEST takes, no more)."""
    rhs = _padded_operand(rhs, columns)
    if rhs.shape[1] == 1:
        return (rhs.T,)
    pieces = _bf16_pieces(rhs)
    return tuple(jnp.concatenate(pieces[:count], 1).astype(jnp.bfloat16) for count in (3, 2, 1))


class _Scalars(NamedTuple):
    """Where the kernels read their scalars in the SMEM vector: the levels' weights (s^2 h^2 256^k), the tail's
    constants, then (the backward's) s^2."""

    levels: int
    constants: int

    def constant(self, i):
        return self.levels + i

    @property
    def s2(self):
        return self.levels + self.constants + 1


def _fused_kernel(
    tail, chunks, variant, width, scalars_ref, rows_ref, row_norms_ref, cols_ref, col_norms_ref, *operand_and_out_refs
):
    """One tile of a block's product: d^2, K by the tail, and K times the operand's tile, added into the
    output's tile (its rows' sums over the columns, on the grid's second axis)."""
    *operand_refs, out_ref = operand_and_out_refs
    at = _Scalars(chunks[-1].level + 1, len(tail.constvars))
    d2 = _tile_squared_distances(rows_ref, row_norms_ref, cols_ref, col_norms_ref, scalars_ref, chunks, variant)
    tail_consts = [scalars_ref[at.constant(i)] for i in range(at.constants)]
    k = _on_tile(tail, tail_consts, d2).astype(jnp.float32)

    @pl.when(pl.program_id(1) == 0)
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)

    if width == 1:  # K @ v on the vector unit, into 128 lanes; the lanes are added outside
        total = _lane_sums(k * operand_refs[0][...])
        out_ref[...] += total
    else:  # HIGHEST's six bf16 products, in three dots: K's bf16 pieces times [X1 | X2 | X3], [X1 | X2], [X1]
        dot = functools.partial(jax.lax.dot, precision=jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32)
        for piece, x_ref in zip(_bf16_pieces(k), operand_refs, strict=True):
            out_ref[:, : x_ref.shape[1]] += dot(piece.astype(jnp.bfloat16), x_ref[...])


def _fused_backward_kernel(tail, chunks, variant, squares, per_feature, scalars_ref, *refs):
    """One tile of a block's cotangents, for ``K @ X`` with cotangent ct: d^2 exactly as the product has it, K
    and C tail'(d^2) (C = ct_i . X_j) by the tail's own derivative; then per feature, the differences pair by pair
    (no cancellation): row sums of A (x_i - y_j) into g1, column sums of -A (x_i - y_j) into g2, A = 2 s^2 C tail';
    ct^T K into gv; and into gs the tile's sums of C dtail/dc for each constant c of the tail, after
    three for the cotangent of s^2: with ``squares``, of C tail' |x - y|^2 (the differences' squares, as the vmap
    form has it); else of C tail' d^2, |C tail'| and |C tail'| d^2 on the grid (see _fused_cotangents). With
    ``per_feature`` (a step per feature, in the grid's points; s^2 is then 1), instead of the three, D: for each
    feature C tail' (x_d - y_d)^2, summed over the rows and folded into 128 lanes (no reduction across lanes)."""
    rows_ref, row_norms_ref, cols_ref, col_norms_ref, x_ref, yt_ref, ct_ref, xt_ref, *out_refs = refs
    g1_ref, g2_ref, gv_ref, gs_ref = out_refs
    at = _Scalars(chunks[-1].level + 1, len(tail.constvars))
    d2 = _tile_squared_distances(rows_ref, row_norms_ref, cols_ref, col_norms_ref, scalars_ref, chunks, variant)
    tail_consts = [scalars_ref[at.constant(i)] for i in range(at.constants)]
    on_tile = lambda z, *c: _on_tile(tail, list(c), z).astype(jnp.float32)  # noqa: E731
    k, pullback = jax.vjp(on_tile, d2, *tail_consts)
    vector = xt_ref.shape[0] == 1  # K @ v: C = ct v^T by a broadcast, and ct^T K into gv below
    by_d2, *by_consts = pullback(ct_ref[...] * xt_ref[...] if vector else _operand_columns(ct_ref, xt_ref, k, gv_ref))
    s2 = scalars_ref[at.s2]
    a = by_d2 * (2 * s2)  # 2 s^2 C tail'

    @pl.when(pl.program_id(1) == 0)
    def _():
        g1_ref[...] = jnp.zeros_like(g1_ref)

    if vector:
        gv_ref[...] = jnp.sum(ct_ref[...] * k, 0, keepdims=True)[None]
    x = x_ref[...]
    x_features = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    lane_features = jax.lax.broadcasted_iota(jnp.int32, (x.shape[1], 128), 0)

    def one_feature(feature, sums):  # a loop, 4 features a step: what Mosaic compiles does not grow with D
        in_column = x_features == feature  # no index across lanes: x[:, feature] by a select, exactly
        column = jnp.sum(jnp.where(in_column, x, 0.0), 1, keepdims=True)
        difference = column - yt_ref[pl.ds(feature, 1), :]  # y[:, feature] as a row, read by its index
        if squares:
            sums["summed"] = sums["summed"] + difference * difference
        products = a * difference
        if per_feature:  # s^2 = 1: products times the difference is 2 C tail' (x_d - y_d)^2, halved after the loop
            by_lanes = _lane_sums(jnp.sum(products * difference, 0, keepdims=True))
            sums["by_feature"] = sums["by_feature"] + jnp.where(lane_features == feature, by_lanes, 0.0)
        g2_ref[0, pl.ds(feature, 1), :] = -jnp.sum(products, 0, keepdims=True)
        sums["g1"] = sums["g1"] + jnp.where(in_column, jnp.sum(_lane_sums(products), 1, keepdims=True), 0.0)
        return sums

    zeros = {"g1": jnp.zeros_like(x)}
    zeros.update({"summed": jnp.zeros_like(d2)} if squares else {})
    zeros.update({"by_feature": jnp.zeros(lane_features.shape, jnp.float32)} if per_feature else {})
    sums = jax.lax.fori_loop(0, x.shape[1], one_feature, zeros, unroll=4)
    g1, summed, by_feature = sums["g1"], sums.get("summed"), sums.get("by_feature")
    g1_ref[...] += g1
    if per_feature:
        by_s2 = [0.5 * by_feature[feature : feature + 1] for feature in range(x.shape[1])]
    else:
        weights = jnp.abs(by_d2)
        by_s2 = (
            [jnp.sum(by_d2 * summed), 0.0, 0.0]
            if squares
            else [jnp.sum(by_d2 * d2), jnp.sum(weights), jnp.sum(weights * d2)]
        )
    totals = [*by_s2, *(jnp.sum(c) for c in by_consts)]
    gs_ref[...] = jnp.concatenate([jnp.broadcast_to(total, (1, 128)) for total in totals], 1)[None, None]


def _operand_columns(ct_ref, xt_ref, k, gv_ref):
    """C = ct X^T for the tile, [rows, k] times [k, cols], a column of the operand at a time on the vector unit (in
    float32, as HIGHEST has it on the matrix unit); and into gv_ref, row by row, ct^T K."""
    ct = ct_ref[...]
    in_column = jax.lax.broadcasted_iota(jnp.int32, ct.shape, 1)

    def one_column(column, weights):  # no index across lanes: ct[:, column] by a select, exactly
        ct_column = jnp.sum(jnp.where(in_column == column, ct, 0.0), 1, keepdims=True)
        gv_ref[0, pl.ds(column, 1), :] = jnp.sum(ct_column * k, 0, keepdims=True)
        return weights + ct_column * xt_ref[pl.ds(column, 1), :]

    return jax.lax.fori_loop(0, ct.shape[1], one_column, jnp.zeros_like(k), unroll=4)


def _lane_sums(values):
    """[r, c] values (c a multiple of 128) summed into [r, 128]: lane slices added, no reduction across lanes."""
    lanes = values[:, :128]
    for lane in range(128, values.shape[1], 128):
        lanes = lanes + values[:, lane : lane + 128]
    return lanes


def _tile(count, most, align):
    """A tile of at most ``most`` (rounded up to ``align``) along an axis of ``count``, and the axis padded to
    whole tiles."""
    tile = min(most, -(-count // align) * align)
    return tile, -(-count // tile) * tile


def _tiled_call(kernel, grid, inputs, out_specs, out_shape, form):
    """One pallas_call of ``kernel`` over (row tiles, column tiles) for the product and the backward alike:
    ``inputs`` as (array, BlockSpec) pairs, the column axis accumulated ("arbitrary")."""
    with jax.enable_x64(False):  # Mosaic takes no 64-bit values: the kernel's literals and index maps in 32 bits
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[spec for _, spec in inputs],
            out_specs=out_specs,
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=form.tiles.vmem_limit_bytes
            ),
            interpret=form.interpret,
        )(*(array for array, _ in inputs))


def _by_row(shape):
    return pl.BlockSpec(shape, lambda i, j: (i, 0))


def _by_col(shape):
    return pl.BlockSpec(shape, lambda i, j: (0, j))


def _in_smem():
    return pl.BlockSpec(memory_space=pltpu.SMEM)


def _fused_product(rows, cols, operand, verdict, tail, form, digits):
    """One block's product by the Pallas kernel, on ``digits`` digits: rows [b, D] float32 points, ``cols``
    their packed columns and norms, ``operand`` its pieces (_fused_operand), ``verdict`` _verdicts'."""
    (cols, col_norms), (variant, chunks) = cols, form.packing(digits)
    b, n, width = rows.shape[0], cols.shape[1], operand[0].shape[0] if len(operand) == 1 else operand[0].shape[1] // 3
    tile_rows, padded = _tile(b, form.tiles.rows, 32)
    tile_cols = min(form.tiles.cols, n)
    rows, row_norms = _packed(_digits(_padded(rows, padded), verdict.grid, digits), chunks, variant, left=True)
    out_width = 128 if width == 1 else 3 * width
    operand_specs = (  # v's row by tiles of columns; else each operand block by tiles of rows
        [_by_col((1, tile_cols))]
        if width == 1
        else [pl.BlockSpec((tile_cols, piece.shape[1]), lambda i, j: (j, 0)) for piece in operand]
    )
    inputs = [
        (verdict.scalars, _in_smem()),
        (rows, _by_row((tile_rows, rows.shape[1]))),
        (row_norms, _by_row((tile_rows, row_norms.shape[1]))),
        (cols, _by_col((cols.shape[0], tile_cols))),
        (col_norms, _by_col((col_norms.shape[0], tile_cols))),
        *zip(operand, operand_specs, strict=True),
    ]
    out = _tiled_call(
        functools.partial(_fused_kernel, tail, chunks, variant, width),
        (padded // tile_rows, n // tile_cols),
        inputs,
        _by_row((tile_rows, out_width)),
        jax.ShapeDtypeStruct((padded, out_width), jnp.float32),
        form,
    )[:b]
    if width == 1:
        return jnp.sum(out, 1, keepdims=True)
    return out[:, :width] + out[:, width : 2 * width] + out[:, 2 * width :]


def _fused_backward(rows, cols, points, xt, ct, verdict, s2, tail, form, digits, squares=False, per_feature=False):
    """The cotangents of one block's ``K @ X``, by the Pallas kernel on ``digits`` digits: of the rows [b, D] and
    of the columns' ``points`` [N', D] (padded as the packed columns ``cols`` are), of X, the kernel's three sums
    for s^2 (``squares`` as _fused_backward_kernel's) and its sums of C dtail/dc (C = ct_i . X_j). ``xt``: X^T
    [k, N'], its columns padded with zeros; ``verdict`` as _fused_product's."""
    (cols, col_norms), (variant, chunks) = cols, form.packing(digits)
    (b, dim), n, width = rows.shape, cols.shape[1], xt.shape[0]
    tile_rows, padded = _tile(b, form.tiles.rows, 32)
    tile_cols = min(form.tiles.cols, n)
    tiles = (padded // tile_rows, n // tile_cols)
    x = _padded(rows, padded)
    packed, row_norms = _packed(_digits(x, verdict.grid, digits), chunks, variant, left=True)
    ct = jnp.pad(ct.astype(jnp.float32), ((0, padded - b), (0, 0)))
    by_s2 = dim if per_feature else 3  # the sums for s^2's cotangent
    sums = by_s2 + len(tail.constvars)
    inputs = [
        (jnp.concatenate([verdict.scalars, jnp.stack([s2])]), _in_smem()),
        (packed, _by_row((tile_rows, packed.shape[1]))),
        (row_norms, _by_row((tile_rows, row_norms.shape[1]))),
        (cols, _by_col((cols.shape[0], tile_cols))),
        (col_norms, _by_col((col_norms.shape[0], tile_cols))),
        (x, _by_row((tile_rows, dim))),
        (points.T, _by_col((dim, tile_cols))),
        (ct, _by_row((tile_rows, width))),
        (xt, _by_col((width, tile_cols))),
    ]
    g1, g2, gv, gs = _tiled_call(
        functools.partial(_fused_backward_kernel, tail, chunks, variant, squares, per_feature),
        tiles,
        inputs,
        [
            _by_row((tile_rows, dim)),
            pl.BlockSpec((1, dim, tile_cols), lambda i, j: (i, 0, j)),
            pl.BlockSpec((1, width, tile_cols), lambda i, j: (i, 0, j)),
            pl.BlockSpec((1, 1, 1, 128 * sums), lambda i, j: (i, j, 0, 0)),
        ],
        [
            jax.ShapeDtypeStruct((padded, dim), jnp.float32),
            jax.ShapeDtypeStruct((tiles[0], dim, n), jnp.float32),
            jax.ShapeDtypeStruct((tiles[0], width, n), jnp.float32),
            jax.ShapeDtypeStruct((*tiles, 1, 128 * sums), jnp.float32),
        ],
        form,
    )
    by_tile = gs.reshape(-1, sums, 128)  # a step per feature's sums by lanes, each other sum in every lane
    totals = jnp.sum(by_tile[:, :, 0], 0)
    return (
        g1[:b],
        g2.sum(0).T,
        gv.sum(0).T,
        jnp.sum(by_tile[:, :by_s2], (0, 2)) if per_feature else totals[:by_s2],
        totals[by_s2:],
    )


def _sensitivity(tail, derivative=False):
    """lambda: the largest |tail'(d^2) / tail(d^2)| at _SENSITIVITY_AT, in float64 (inf where it is not finite);
    with ``derivative``, of |tail'' / tail'| too (the backward's tail')."""
    widened = _in_float64(tail)
    if widened is None:
        return jnp.float32(jnp.inf)
    with _float64():
        value, slope, curvature = _tail_derivatives(widened, jnp.asarray(_SENSITIVITY_AT, jnp.float64))
        ratio = jnp.where(value == 0, 0.0, jnp.abs(slope) / jnp.abs(value))
        if derivative:
            ratio = jnp.maximum(ratio, jnp.where(slope == 0, 0.0, jnp.abs(curvature) / jnp.abs(slope)))
        worst = jnp.max(jnp.where(jnp.isnan(ratio), jnp.inf, ratio))
        return jax.lax.convert_element_type(worst, jnp.float32)


class _Verdict(NamedTuple):
    """The rule's verdict on the points for one digit count: whether it vouches, the grid, and the scalars the
    kernels read (_Scalars: the levels' weights and the tail's constants)."""

    vouched: jax.Array
    grid: tuple
    scalars: jax.Array


def _verdicts(grid, fusion, dim, form, derivative=False):
    """For points on ``grid`` (_grid), a _Verdict for each digit count of ``form``: whether the rule (see this
    layer's head) vouches, for the backward's tail' too with ``derivative``."""
    eps, sensitivity = float(jnp.finfo(jnp.float32).eps), _sensitivity(fusion.tail, derivative)
    finite = jnp.isfinite(grid[1]) & jnp.all(jnp.isfinite(grid[0]))
    verdicts = []
    for digits, _, _ in form.packings:
        levels = 2 * digits - 1
        step = jnp.abs(fusion.step) if len(grid) == 2 else 1.0  # a step per feature is in the grid's points
        h = step * jnp.ldexp(grid[1], 2 - 8 * digits)  # the grid's step, in d's units (rounded once)
        rho = math.sqrt(dim) * h * (1 + 2**-20)
        kappa = (4 * (dim + fusion.steps + 1) - (levels + 2 * fusion.steps + 3)) * eps / 2
        h2 = h * h
        vouched = (sensitivity * rho * rho * (1 + 1 / kappa) <= 16 * eps) & (h2 >= 2.0**-100) & (h2 <= 2.0**60)
        weights = h2 * 256.0 ** jnp.arange(levels - 1, -1, -1, dtype=jnp.float32)
        scalars = jnp.concatenate([weights, jnp.stack([*fusion.tile_consts, jnp.float32(0)])])
        verdicts.append(_Verdict(vouched & finite, grid, scalars))
    return jax.lax.stop_gradient(tuple(verdicts))


class _FusedOperands(NamedTuple):
    """What a block's fused product reads besides its rows: the columns' packed digits and norms by digit count,
    the operand's pieces, the verdicts, the columns' points, the backward's verdicts and the columns' grid moves."""

    packed: tuple
    operand: tuple
    verdicts: tuple
    points: jax.Array
    backward_vouched: tuple
    moves: tuple


def _first_vouched(vouched):
    """The index of the first digit count vouched for; len(vouched) where none is."""
    return jnp.argmax(jnp.stack([*vouched, jnp.bool_(True)]))


def _fused_or_fallback(forms, fallback, given, rows, cols, rhs, *consts):
    """The block's product by the first of the fused kernels (``forms[0]``, by digit count) whose verdicts in
    ``given`` vouch for it, else by ``fallback``; a primitive (_fused_primitives): forward-mode derivatives by
    ``fallback``, reverse mode by the fused backward (``forms[1]``) where there is one and the verdicts vouch."""
    leaves, tree = jax.tree_util.tree_flatten(given)
    operands = [rows, cols, rhs, *consts, *leaves]
    operands = [a + _zeros_varying_like((), a.dtype, operands) for a in operands]  # as the type rules assume
    product, _ = _fused_primitives()
    return product.bind(*operands, forms=forms, fallback=fallback, tree=tree, count=3 + len(consts))


def _fused_value(*operands, forms, fallback, tree, count):
    """The product: the first vouched fused kernel's, else the fallback's."""
    (rows, cols, rhs, *consts), given = operands[:count], tree.unflatten(operands[count:])
    on_grids = [
        functools.partial(f, rows, p, given.operand, v)
        for f, p, v in zip(forms[0], given.packed, given.verdicts, strict=True)
    ]
    first = _first_vouched([verdict.vouched for verdict in given.verdicts])
    return jax.lax.switch(first, [*on_grids, lambda: fallback(rows, cols, rhs, *consts)])


class _FusedBackward(NamedTuple):
    """The fused backward of a block's ``K @ X``: ``back`` by digit count (_fused_backward), ``scalars`` (the
    kernel's constants -> s^2 and the tail's constants), ``fallback``, its vmap form on float64 values (``wide``;
    None on a TPU, or where the kernel does not run so) and the digit counts."""

    back: tuple
    scalars: object
    fallback: object
    wide: object
    digit_counts: tuple

    def __call__(self, tree, primals, leaves, ct):
        """The cotangents of (rows, cols, rhs, *consts) for the output's cotangent ``ct``."""
        return _fused_cotangents(self, tree.unflatten(leaves), ct, *primals)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _fused_cotangents(backward, given, ct, rows, cols, rhs, *consts):
    """The block's cotangents by the first fused backward whose verdicts vouch, else by the fallback's vjp.

    The cotangent of s^2, sum C tail' |x - y|^2, from the grid: with e the grid's moves (x = x~ + e),
    |x - y|^2 = |x~ - y~|^2 + 2 (x - y).(e_x - e_y) - |e_x - e_y|^2. The middle term's sum is the moves against the
    points' cotangents; the last is at most D h^2 a pair. Where that bound is over 4 eps of sum |C tail'| d^2 (a
    quarter of the contract's 16), as for pairs nearer than the grid's step, the differences' squares are summed
    instead, in a second pass. A step per feature takes the squares' sums per feature, in one pass."""
    n = cols.shape[0]
    (s2, tail_consts), by_scalars = jax.vjp(backward.scalars, *consts)
    # X^T padded as the columns are: K @ v's is the product's operand as it is
    xt = given.operand[0] if rhs.shape[1] == 1 else _padded_operand(rhs, given.points.shape[0]).T
    eps = float(jnp.finfo(jnp.float32).eps)

    def fused(back, digits, cols_packed, verdict, col_moves):
        if jnp.ndim(s2):  # a step per feature, in the grid's points: the points' cotangents scaled after
            one = jnp.ones((), s2.dtype)
            ct_rows, ct_cols, ct_rhs, by_s2, by_tail = back(
                rows, cols_packed, given.points, xt, ct, verdict, one, per_feature=True
            )
            ct_consts = by_scalars((by_s2, list(by_tail[: len(tail_consts)])))
            return (ct_rows * s2, (ct_cols * s2)[:n], ct_rhs[:n], *ct_consts)
        ct_rows, ct_cols, ct_rhs, (on_grid, weights, weighted), by_tail = back(
            rows, cols_packed, given.points, xt, ct, verdict, s2
        )
        row_moves = _grid_moves(rows, verdict.grid, digits)
        from_grid = (on_grid + jnp.sum(row_moves * ct_rows) + jnp.sum(col_moves * ct_cols)) / s2
        with _float64():
            step = _grid_step(verdict.grid, digits)
            bound = rows.shape[1] * s2.astype(jnp.float64) * step * step * weights.astype(jnp.float64)
            near = ~(bound < 4 * eps * weighted.astype(jnp.float64))
        squares = functools.partial(back, squares=True)
        by_s2 = jax.lax.cond(
            near,
            lambda: squares(rows, cols_packed, given.points, xt, ct, verdict, s2)[3][0],
            lambda: from_grid,
        )
        ct_consts = by_scalars((by_s2, list(by_tail[: len(tail_consts)])))
        return (ct_rows, ct_cols[:n], ct_rhs[:n], *ct_consts)

    parts = zip(backward.back, backward.digit_counts, given.packed, given.verdicts, given.moves, strict=True)
    branches = [functools.partial(fused, *part) for part in parts]
    by_fallback = (
        functools.partial(_wide_cotangents, backward.wide, ct, rows, cols, rhs, *consts)
        if backward.wide
        else functools.partial(_fallback_cotangents, backward.fallback, ct, rows, cols, rhs, *consts)
    )
    return tuple(jax.lax.switch(_first_vouched(given.backward_vouched), [*branches, by_fallback]))


def _fallback_cotangents(fallback, ct, *primals):
    """The cotangents of ``fallback`` (the unfused form) at ``primals`` for the output's cotangent ``ct``."""
    return jax.vjp(fallback, *primals)[1](ct)


def _wide_cotangents(wide, ct, rows, cols, rhs, *consts):
    """The cotangents of ``wide`` (_wide_fallback) at the primals for ``ct``: the points, the operand and ``ct`` in
    float64, the results rounded back. In float32, for a kernel that scales the points first (x / s - y / s) at
    points far from the origin, XLA:CPU's program of the unfused vjp in the fused backward's branch took the
    lengthscales' cotangents far from the vmap form's (right outside the branch, or without XLA's algsimp)."""
    primals = (rows, cols, rhs, *consts)
    with _float64():
        widened = [a.astype(jnp.float64) for a in (rows, cols, rhs)]
        cts = jax.vjp(wide, *widened, *consts)[1](ct.astype(jnp.float64))
    return tuple(c.astype(p.dtype) for c, p in zip(cts, primals, strict=True))


@_fused_cotangents.defjvp
def _fused_cotangents_jvp(backward, primals, tangents):
    """Second order by the fallback's: the derivative of its vjp."""
    _, *primals = primals
    _, *tangents = tangents
    return jax.jvp(functools.partial(_fallback_cotangents, backward.fallback), primals, tangents)


@functools.cache
def _fused_primitives():
    """The primitives of a fused block's product and of its tangent. The tangent's is linear in its tangents,
    computed (and differentiated, and vmapped) by the fallback's jvp; its transpose, reverse mode, runs the fused
    backward where vouched for. JAX's internals (``jax.interpreters``) because no public API serves: a custom_jvp's
    rule is transposed by JAX (a Pallas kernel has none), a custom_vjp has no forward mode, and
    ``custom_derivatives.linear_call`` has no batching rule and no derivative of its own (vmap, second order)."""
    from jax.interpreters import ad, batching, mlir

    product = jax.extend.core.Primitive("lazy_kernel_fused_product")
    tangent = jax.extend.core.Primitive("lazy_kernel_fused_tangent")

    def tangent_of(*operands, fallback, backward, count):
        return jax.jvp(fallback, tuple(operands[:count]), tuple(operands[-count:]))[1]

    def product_jvp(operands, tangents, *, forms, fallback, tree, count):
        value = product.bind(*operands, forms=forms, fallback=fallback, tree=tree, count=count)
        linear = tuple(ad.instantiate_zeros(t) for t in tangents[:count])
        if forms[1] is None:
            return value, tangent_of(*operands, *linear, fallback=fallback, backward=None, count=count)
        backward = functools.partial(forms[1], tree)
        return value, tangent.bind(*operands, *linear, fallback=fallback, backward=backward, count=count)

    def transpose(ct, *operands, fallback, backward, count):
        primals, linear = operands[:-count], operands[-count:]
        if type(ct) is ad.Zero:
            zeros = [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in linear]
            return [None] * len(primals) + zeros
        cts = backward(primals[:count], primals[count:], ct)
        return [None] * len(primals) + [
            c if ad.is_undefined_primal(t) else None for c, t in zip(cts, linear, strict=True)
        ]

    def tangent_jvp(primals, tangents, **params):
        tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
        return jax.jvp(functools.partial(tangent_of, **params), tuple(primals), tangents)

    def vmapped(impl, args, dims, **params):  # the batching rule: ``impl`` vmapped
        return jax.vmap(functools.partial(impl, **params), in_axes=dims)(*args), 0

    for primitive, impl in ((product, _fused_value), (tangent, tangent_of)):
        primitive.def_impl(impl)
        primitive.def_abstract_eval(lambda rows, cols, rhs, *_, **__: rhs.update(shape=(rows.shape[0], rhs.shape[1])))
        mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results=False))
        batching.primitive_batchers[primitive] = functools.partial(vmapped, impl)
    ad.primitive_jvps[product] = product_jvp
    ad.primitive_jvps[tangent] = tangent_jvp
    ad.primitive_transposes[tangent] = transpose
    return product, tangent


_LAYERS.append(_fused_plan)
# --- end optional layer: fused TPU product ---


if __name__ == "__main__":
    sys.exit(main())
