"""A kernel matrix K(x1, x2) that you can multiply by without ever storing it.

``LazyKernel(kernel, x1, x2) @ X`` gives what the dense matrix ``K @ X`` gives,
but computes K a block of rows at a time inside a ``jax.lax.fori_loop``:

    for each block I of rows of x1:
        out[I] = K(x1[I], x2) @ X          # one [block, N] piece of K at a time

so memory is one block plus the output, not the [M, N] matrix. ``X @ K``
runs the same loop over blocks of columns (the rows of the transpose).
With ``checkpoint=True`` every block is recomputed in the backward pass
instead of stored, so gradients stay a few blocks too.

The file depends on ``jax`` alone: copy it into your project if you like.
Run ``python lazy_kernel.py`` to check a machine (CPU or GPU) against a
dense NumPy oracle.
"""

from __future__ import annotations

import argparse
import math
import numbers
import sys
import time
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CrossCovarianceKernel", "LazyKernel", "PairKernel", "RBF", "kernel_block"]


# --------------------------------------------------------------------------
# Kernel protocols
# --------------------------------------------------------------------------


@runtime_checkable
class PairKernel(Protocol):
    """A kernel evaluated on one pair of points: ``kernel(x: [D], y: [D]) -> scalar``.

    A plain function, a ``functools.partial`` or a pytree (whose array leaves
    are hyperparameters that gradients reach) all qualify.
    """

    def __call__(self, x: jax.Array, y: jax.Array) -> jax.Array: ...


@runtime_checkable
class CrossCovarianceKernel(PairKernel, Protocol):
    """A pair kernel that can also fill a whole block: ``[m, D], [n, D] -> [m, n]``.

    When a kernel has ``cross_covariance``, every block is computed with it:
    this is the fast path (GPJax's kernels have it).
    """

    def cross_covariance(self, x1: jax.Array, x2: jax.Array) -> jax.Array: ...


def kernel_block(kernel: PairKernel, xa: jax.Array, xb: jax.Array) -> jax.Array:
    """The dense block K(xa, xb), shape [len(xa), len(xb)]."""
    if hasattr(kernel, "cross_covariance"):
        return kernel.cross_covariance(xa, xb)
    return jax.vmap(jax.vmap(kernel, in_axes=(None, 0)), in_axes=(0, None))(xa, xb)


@jax.tree_util.register_pytree_node_class
class RBF:
    """Squared-exponential kernel ``variance * exp(-|x - y|^2 / (2 lengthscale^2))``.

    A reference for both protocols. ``lengthscale`` may be a scalar or one
    value per feature. ``cross_covariance`` uses the GEMM form
    ``|a|^2 + |b|^2 - 2 a.b`` (fast everywhere), made careful: both inputs are
    shifted by a shared offset so points far from the origin do not cancel
    catastrophically, the product runs at full float32 precision even on
    TF32 GPUs, and the squared distance is clamped at zero.
    """

    def __init__(self, lengthscale=1.0, variance=1.0):
        self.lengthscale = jnp.asarray(lengthscale)
        self.variance = jnp.asarray(variance)

    def __call__(self, x, y):
        r = (x - y) / self.lengthscale
        return self.variance * jnp.exp(-0.5 * jnp.sum(r * r))

    def cross_covariance(self, x1, x2):
        offset = jnp.mean(x2, axis=0) if x2.shape[0] else 0.0
        a = (x1 - offset) / self.lengthscale
        b = (x2 - offset) / self.lengthscale
        ab = jnp.matmul(a, b.T, precision=jax.lax.Precision.HIGHEST)
        # Squared norms summed over the leading axis of a.T: XLA on CPU runs a
        # sum over a tiny trailing axis (features) several times slower.
        sq_dist = jnp.sum(a.T**2, axis=0)[:, None] + jnp.sum(b.T**2, axis=0)[None, :] - 2 * ab
        return self.variance * jnp.exp(-0.5 * jnp.maximum(sq_dist, 0.0))

    def __repr__(self):
        return f"RBF(lengthscale={self.lengthscale}, variance={self.variance})"

    def tree_flatten(self):
        return (self.lengthscale, self.variance), None

    @classmethod
    def tree_unflatten(cls, _, children):
        kernel = object.__new__(cls)
        kernel.lengthscale, kernel.variance = children
        return kernel


@jax.tree_util.register_pytree_node_class
class _Transposed:
    """The kernel (x, y) -> kernel(y, x): what ``LazyKernel.T`` evaluates."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, x, y):
        return self.kernel(y, x)

    def cross_covariance(self, x1, x2):
        return kernel_block(self.kernel, x2, x1).T

    def __repr__(self):
        return f"transposed({self.kernel!r})"

    def tree_flatten(self):
        return (self.kernel,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def _check_kernel(kernel, dim, dtype):
    """The dtype ``kernel`` returns, checking its shapes without evaluating it."""
    point = jax.ShapeDtypeStruct((dim,), dtype)
    protocol = "a kernel is called on one pair of points, kernel(x: [D], y: [D]) -> scalar"
    out = jax.eval_shape(kernel, point, point)
    if not hasattr(out, "shape") or out.shape != ():
        shape = getattr(out, "shape", type(out).__name__)
        raise TypeError(f"{protocol}; kernel({dim}-vector, {dim}-vector) returned {shape}")
    if hasattr(kernel, "cross_covariance"):
        block = jax.eval_shape(
            kernel.cross_covariance,
            jax.ShapeDtypeStruct((2, dim), dtype),
            jax.ShapeDtypeStruct((3, dim), dtype),
        )
        if getattr(block, "shape", None) != (2, 3):
            raise TypeError(
                "cross_covariance(x1: [m, D], x2: [n, D]) must return [m, n]; "
                f"on [2, {dim}] and [3, {dim}] it returned {getattr(block, 'shape', block)}"
            )
    return jnp.dtype(out.dtype)


# --------------------------------------------------------------------------
# The blockwise engine
# --------------------------------------------------------------------------


def _is_array(leaf):
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _zeros_varying_like(shape, dtype, tree):
    """Zeros that, inside ``jax.shard_map``, vary over the mesh axes of every array in ``tree``.

    A ``fori_loop`` carry must have the type its body returns, and inside
    ``shard_map`` that type includes the mesh axes a value varies over. The
    blocks vary like the inputs; plain zeros vary over none. ``lax.full_like``
    keeps the axes of its template, and a sum varies over all of its terms'.
    """
    zero = jnp.zeros((), dtype)
    for leaf in filter(_is_array, jax.tree_util.tree_leaves(tree)):
        zero = zero + jax.lax.full_like(leaf, 0, dtype, shape=())
    return jnp.broadcast_to(zero, shape)


def _blockwise_matmul(kernel, rows, cols, rhs, block, checkpoint):
    """``K(rows, cols) @ rhs`` for rhs [len(cols), B], ``block`` rows of K at a time."""
    n = rows.shape[0]
    dtype = rhs.dtype

    def product(row_block):
        if isinstance(kernel, _Transposed):  # contract K's block along its rows: no transposed copy
            block = kernel_block(kernel.kernel, cols, row_block).astype(dtype)
            return jnp.einsum("nb,nk->bk", block, rhs)
        return jnp.matmul(kernel_block(kernel, row_block, cols).astype(dtype), rhs)

    if checkpoint:
        product = jax.checkpoint(product, prevent_cse=False)

    def body(i, out):
        start = i * block
        row_block = jax.lax.dynamic_slice_in_dim(rows, start, block)
        return jax.lax.dynamic_update_slice_in_dim(out, product(row_block), start, axis=0)

    out = _zeros_varying_like((n, rhs.shape[1]), dtype, (kernel, rows, cols, rhs))
    full_blocks, rest = divmod(n, block)
    if full_blocks:
        out = jax.lax.fori_loop(0, full_blocks, body, out)
    if rest:  # the last, shorter block, computed at its exact size
        out = out.at[n - rest :].set(product(rows[n - rest :]))
    return out


# --------------------------------------------------------------------------
# The operator
# --------------------------------------------------------------------------


CPU_BLOCK_BYTES = 4 * 2**20  # the best block size measured on a CPU; see LazyKernel.block_rows
CPU_MIN_BLOCK = 64  # 16-column blocks made X @ K 1.5x slower than 64 at N = 65536


@jax.tree_util.register_pytree_node_class
class LazyKernel:
    """The kernel matrix ``K[i, j] = kernel(x1[i], x2[j])``, shape [M, N], never stored whole.

    Supports ``K @ X`` and ``X @ K`` with NumPy's matmul rules (1-D, 2-D and
    batched operands), ``.T``, ``.to_dense()`` and ``.diagonal()``. It is a
    pytree: pass it through ``jax.jit``, ``jax.grad`` and ``jax.vmap``; its
    arrays (x1, x2 and the kernel's array leaves) are the leaves, everything
    else is static.

    Memory: ``max_memory_mb`` caps one block of K; ``batch_size`` fixes the
    rows (or columns) per block instead. ``checkpoint=True`` recomputes blocks
    in the backward pass rather than storing them.
    """

    __array_ufunc__ = None  # NumPy arrays on the left defer to __rmatmul__

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
        if (
            isinstance(max_memory_mb, bool)
            or not isinstance(max_memory_mb, numbers.Real)
            or not math.isfinite(max_memory_mb)
            or max_memory_mb < 0
        ):
            raise ValueError(f"max_memory_mb must be a finite number >= 0; got {max_memory_mb!r}")
        if not isinstance(checkpoint, bool):
            raise TypeError(f"checkpoint must be True or False; got {checkpoint!r}")
        self.kernel = kernel
        self.x1 = x1
        self.x2 = x2
        self.max_memory_mb = max_memory_mb
        self.batch_size = batch_size
        self.checkpoint = checkpoint
        self.dtype = _check_kernel(kernel, x1.shape[1], jnp.result_type(x1.dtype, x2.dtype))
        # Which kernel leaves are arrays (pytree children) is fixed here, not at each
        # flatten: JAX flattens pytrees whose leaves are placeholders, not arrays.
        self._array_leaves = tuple(map(_is_array, jax.tree_util.tree_leaves(kernel)))

    # -- sizes ---------------------------------------------------------------

    @property
    def shape(self):
        return (self.x1.shape[0], self.x2.shape[0])

    @property
    def max_elements(self) -> int:
        """Most elements of K held at once: the budget in elements of ``dtype``."""
        return int(self.max_memory_mb * 2**20) // self.dtype.itemsize

    @property
    def batch_size_row(self) -> int:
        """Most rows of K per block in ``K @ X``."""
        if self.batch_size is not None:
            return self.batch_size
        return max(1, self.max_elements // max(self.shape[1], 1))

    @property
    def batch_size_col(self) -> int:
        """Most columns of K per block in ``X @ K``."""
        if self.batch_size is not None:
            return self.batch_size
        return max(1, self.max_elements // max(self.shape[0], 1))

    # -- products ------------------------------------------------------------

    def _operand(self, other, side):
        """``other`` as a JAX array, with its size along K's ``side`` axis checked."""
        if isinstance(other, LazyKernel):
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

    def __matmul__(self, other):
        x = self._operand(other, "right")
        if x.ndim == 1:
            return (self @ x[:, None])[:, 0]
        m, n = self.shape
        dtype = jnp.result_type(self.dtype, x.dtype)
        batch, k = x.shape[:-2], x.shape[-1]
        width = math.prod(batch) * k
        rhs = jnp.moveaxis(x, -2, 0).reshape(n, width).astype(dtype)  # every batch in one pass over K
        x1, x2 = jnp.asarray(self.x1), jnp.asarray(self.x2)
        out = _blockwise_matmul(self.kernel, x1, x2, rhs, self.block_rows, self.checkpoint)
        return jnp.moveaxis(out.reshape(m, *batch, k), 0, -2)

    def __rmatmul__(self, other):
        x = self._operand(other, "left")
        if x.ndim == 1:
            return self.T @ x
        return jnp.swapaxes(self.T @ jnp.swapaxes(x, -1, -2), -1, -2)  # X @ K = (K^T @ X^T)^T

    # -- views ---------------------------------------------------------------

    @property
    def block_rows(self) -> int:
        """Rows of K per block that ``K @ X`` really uses, at most ``batch_size_row``.

        A given ``batch_size`` is used as it is. Otherwise, on GPU, the budget
        decides (``batch_size_row``); on the CPU, blocks of about
        ``CPU_BLOCK_BYTES``, and at least ``CPU_MIN_BLOCK`` rows, ran 9x faster
        than one budget-sized block at N = 16384 (see the README's measurements).
        """
        rows = self.batch_size_row
        if self.batch_size is None and jax.default_backend() == "cpu":
            cache_sized = CPU_BLOCK_BYTES // (self.dtype.itemsize * max(self.shape[1], 1))
            rows = min(rows, max(CPU_MIN_BLOCK, cache_sized))
        return max(1, min(rows, self.shape[0]))

    @property
    def block_cols(self) -> int:
        """Columns of K per block that ``X @ K`` really uses."""
        return self.T.block_rows

    @property
    def T(self) -> LazyKernel:
        """The transpose, ``K.T[i, j] = kernel(x1[j], x2[i])``, also lazy."""
        kernel = self.kernel.kernel if isinstance(self.kernel, _Transposed) else _Transposed(self.kernel)
        return LazyKernel(
            kernel,
            self.x2,
            self.x1,
            max_memory_mb=self.max_memory_mb,
            batch_size=self.batch_size,
            checkpoint=self.checkpoint,
        )

    def to_dense(self) -> jax.Array:
        """The whole [M, N] matrix (it is materialised: for small problems and checks)."""
        return kernel_block(self.kernel, jnp.asarray(self.x1), jnp.asarray(self.x2)).astype(self.dtype)

    def diagonal(self) -> jax.Array:
        """``K[i, i]`` for ``i < min(M, N)``, from ``min(M, N)`` pair evaluations."""
        k = min(self.shape)
        return jax.vmap(self.kernel)(jnp.asarray(self.x1)[:k], jnp.asarray(self.x2)[:k]).astype(self.dtype)

    def __repr__(self):
        return (
            f"LazyKernel({self.kernel!r}, shape={self.shape}, dtype={self.dtype}, "
            f"max_memory_mb={self.max_memory_mb}, batch_size={self.batch_size}, "
            f"block_rows={self.block_rows}, block_cols={self.block_cols}, checkpoint={self.checkpoint})"
        )

    # -- pytree --------------------------------------------------------------

    def tree_flatten(self):
        leaves, treedef = jax.tree_util.tree_flatten(self.kernel)
        is_array = self._array_leaves
        arrays = [leaf for leaf, a in zip(leaves, is_array, strict=True) if a]
        static = tuple(leaf for leaf, a in zip(leaves, is_array, strict=True) if not a)
        settings = (self.max_memory_mb, self.batch_size, self.checkpoint, self.dtype, is_array)
        return (arrays, self.x1, self.x2), (treedef, static, settings)

    @classmethod
    def tree_unflatten(cls, aux, children):
        treedef, static, settings = aux
        arrays, x1, x2 = children
        op = object.__new__(cls)
        op.max_memory_mb, op.batch_size, op.checkpoint, op.dtype, op._array_leaves = settings
        arrays, static = iter(arrays), iter(static)
        op.kernel = treedef.unflatten([next(arrays) if a else next(static) for a in op._array_leaves])
        op.x1, op.x2 = x1, x2
        return op


# --------------------------------------------------------------------------
# python lazy_kernel.py: check this machine against a dense NumPy oracle
# --------------------------------------------------------------------------


def _rbf_numpy(x1, x2, lengthscale, variance):
    """Dense RBF rows in NumPy float64, independent of everything above."""
    sq_dist = np.sum(((x1[:, None, :] - x2[None, :, :]) / lengthscale) ** 2, axis=-1)
    return variance * np.exp(-0.5 * sq_dist)


def _median_seconds(f, *args, repeats=3):
    jax.block_until_ready(f(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _shard_map():
    """``jax.shard_map``, or its older home in ``jax.experimental``."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map

    return shard_map


def _products(kernel, settings, checkpoint, devices):
    """jit-compiled ``K @ v``, ``w @ K`` and ``grad_v w.(K @ v) = K^T w``.

    On several devices, each runs under ``jax.shard_map``: ``K @ v`` with the
    rows of x1 split over the devices, ``w @ K`` with the rows of x2 split, and
    the gradient of a ``psum``'d loss with x1 and w split.
    """
    lazy = lambda x1, x2, checkpoint=False: LazyKernel(kernel, x1, x2, checkpoint=checkpoint, **settings)  # noqa: E731
    right = lambda x1, x2, v: lazy(x1, x2) @ v  # noqa: E731
    left = lambda x1, x2, w: w @ lazy(x1, x2)  # noqa: E731
    loss = lambda x1, x2, v, w: jnp.vdot(w, lazy(x1, x2, checkpoint) @ v)  # noqa: E731
    if len(devices) > 1:
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P

        shard_map = _shard_map()
        mesh = Mesh(np.array(devices), ("devices",))
        split, whole = P("devices"), P()
        right = shard_map(right, mesh=mesh, in_specs=(split, whole, whole), out_specs=split)
        left = shard_map(left, mesh=mesh, in_specs=(whole, split, whole), out_specs=split)
        local_loss = loss
        loss = shard_map(
            lambda *a: jax.lax.psum(local_loss(*a), "devices"),
            mesh=mesh,
            in_specs=(split, whole, whole, split),
            out_specs=whole,
        )
    return jax.jit(right), jax.jit(left), jax.jit(jax.grad(loss, argnums=2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Check LazyKernel on this machine against dense NumPy rows.")
    parser.add_argument("--n", type=int, help="points in x1 and in x2 (M = N); default 16384, 65536 on GPU")
    parser.add_argument("--dim", type=int, default=3, help="features per point")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--max-memory-mb", type=float, default=2**10, help="budget for one block of K")
    parser.add_argument("--batch-size", type=int, default=None, help="fixed rows/columns per block")
    parser.add_argument(
        "--checkpoint",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="checkpoint the blocks in the gradient check",
    )
    parser.add_argument("--devices", choices=["1", "all"], default="1", help="'all': shard over every device")
    parser.add_argument("--check", type=int, default=64, help="rows and columns compared with NumPy")
    args = parser.parse_args(argv)
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 rounding on GPUs
    tolerance = {"float32": 1e-4, "float64": 1e-10}[args.dtype]
    devices = jax.devices() if args.devices == "all" else jax.devices()[:1]
    n = args.n or (16384 if jax.default_backend() == "cpu" else 65536)
    n -= n % len(devices)  # equal shards
    lengthscale, variance = 0.7, 1.3

    rng = np.random.default_rng(0)
    x1, x2 = rng.normal(size=(n, args.dim)) + 5.0, rng.normal(size=(n, args.dim)) + 5.0
    v, w = rng.normal(size=n), rng.normal(size=n)
    as_jax = lambda a: jnp.asarray(a, args.dtype)  # noqa: E731
    kernel = RBF(as_jax(lengthscale), as_jax(variance))
    settings = dict(max_memory_mb=args.max_memory_mb, batch_size=args.batch_size)
    right, left, grad_v = _products(kernel, settings, args.checkpoint, devices)
    local = n // len(devices)
    op_right = LazyKernel(kernel, as_jax(x1[:local]), as_jax(x2), **settings)  # what one device holds
    op_left = LazyKernel(kernel, as_jax(x1), as_jax(x2[:local]), **settings)

    print(f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform})")
    print(f"K: {n} x {n}, D = {args.dim}, {args.dtype}, RBF(lengthscale={lengthscale}, variance={variance})")
    print(
        f"budget {args.max_memory_mb:g} MB: batch_size_row {op_right.batch_size_row}, "
        f"batch_size_col {op_left.batch_size_col}" + (" (per device)" if len(devices) > 1 else "")
    )
    print(
        f"blocks used: {op_right.block_rows} rows of {local} in K @ v, {op_left.block_cols} columns of {local} in w @ K"
    )

    rows = rng.choice(n, size=min(args.check, n), replace=False)
    dense_rows = _rbf_numpy(x1[rows], x2, lengthscale, variance)  # K[rows, :]
    dense_cols = _rbf_numpy(x1, x2[rows], lengthscale, variance)  # K[:, rows]
    w_times_cols = (w @ dense_cols, np.abs(w) @ np.abs(dense_cols))
    cases = {  # name: (function, arguments, expected values at `rows`, their error scale)
        "K @ v": (right, (x1, x2, v), dense_rows @ v, np.abs(dense_rows) @ np.abs(v)),
        "w @ K": (left, (x1, x2, w), *w_times_cols),
        "grad_v w.(K @ v)": (grad_v, (x1, x2, v, w), *w_times_cols),
    }
    passed = True
    for name, (f, f_args, want, scale) in cases.items():
        f_args = [as_jax(a) for a in f_args]
        seconds = _median_seconds(f, *f_args)
        error = float(np.max(np.abs(np.asarray(f(*f_args), np.float64)[rows] - want) / scale))
        ok = error <= tolerance
        passed &= ok
        print(
            f"{name:>18}: {seconds * 1e3:9.2f} ms, {n * n / seconds:.3g} elements/s, "
            f"max relative error {error:.2e} (tolerance {tolerance:.0e}) {'ok' if ok else 'FAIL'}"
        )
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
