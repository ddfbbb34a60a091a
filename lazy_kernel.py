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
import functools
import math
import numbers
import sys
import time
import warnings
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.extend.core
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
    """The dense block K(xa, xb), shape [len(xa), len(xb)], evaluated as ``block_evaluation`` says."""
    if _own_cross_covariance(kernel, xa, xb):
        return kernel.cross_covariance(xa, xb)
    if jax.default_backend() == "cpu" and xa.shape[0] and xb.shape[0]:
        return _pair_program_block(kernel, xa, xb, fallbacks=[])
    return _vmap_block(kernel, xa, xb)


def _vmap_block(kernel, xa, xb):
    """The block by vmapping the pair call: the reference every faster form must equal."""
    return jax.vmap(jax.vmap(kernel, in_axes=(None, 0)), in_axes=(0, None))(xa, xb)


def _own_cross_covariance(kernel, xa, xb):
    """Whether ``kernel`` has a ``cross_covariance`` that is more than a vmap of its pair call.

    GPJax's kernels have one that is exactly ``_vmap_block``; the module's
    ``RBF`` has a GEMM form. The two are told apart by their jaxprs on small
    blocks of the same dtypes.
    """
    if not hasattr(kernel, "cross_covariance"):
        return False
    a = jax.ShapeDtypeStruct((2, xa.shape[1]), xa.dtype)
    b = jax.ShapeDtypeStruct((3, xb.shape[1]), xb.dtype)
    own = jax.make_jaxpr(kernel.cross_covariance)(a, b)
    return str(own) != str(jax.make_jaxpr(functools.partial(_vmap_block, kernel))(a, b))


def block_evaluation(kernel: PairKernel, dim: int, dtype=jnp.float32) -> str:
    """How blocks of ``kernel`` on ``dim`` features are computed on the default backend.

    ``"cross_covariance"`` (the kernel's own), ``"vmap"`` (of the pair call;
    off CPU), or ``"pair program"`` (CPU, see the section on fast blocks),
    followed by the equations that the pair program evaluates by vmap, if any.
    """
    a, b = jax.ShapeDtypeStruct((2, dim), dtype), jax.ShapeDtypeStruct((3, dim), dtype)
    if _own_cross_covariance(kernel, a, b):
        return "cross_covariance"
    if jax.default_backend() != "cpu":
        return "vmap"
    fallbacks = []
    jax.eval_shape(functools.partial(_pair_program_block, kernel, fallbacks=fallbacks), a, b)
    return "pair program" + (f" (by vmap: {', '.join(sorted(set(fallbacks)))})" if fallbacks else "")


def _half_squared_distances(a, b):
    """``|a_i - b_j|^2 / 2`` for a [m, K] and b [n, K], shape [m, n], from one GEMM.

    ``[a, -|a|^2/2, 1] . [b, 1, -|b|^2/2]`` is ``a.b - |a|^2/2 - |b|^2/2``, the
    negated result, for any K, with nothing left to do but a clamp: on CPU it
    ran 1.13x faster than adding the norms to ``a.b`` after the product. Made
    careful: both inputs are shifted by b's mean so points far from the origin
    do not cancel catastrophically, the product runs at full float32 precision
    even on TF32 GPUs, and the result is clamped at zero.
    """
    offset = jnp.mean(b, axis=0) if b.shape[0] else 0.0
    a, b = a - offset, b - offset
    # Squared norms summed over the leading axis of a.T: XLA on CPU runs a
    # sum over a tiny trailing axis (features) several times slower.
    half_a, half_b = -0.5 * jnp.sum(a.T**2, axis=0)[:, None], -0.5 * jnp.sum(b.T**2, axis=0)[:, None]
    a = jnp.concatenate([a, half_a, jnp.ones_like(half_a)], axis=1)
    b = jnp.concatenate([b, jnp.ones_like(half_b), half_b], axis=1)
    return -jnp.minimum(jnp.matmul(a, b.T, precision=jax.lax.Precision.HIGHEST), 0.0)


@jax.tree_util.register_pytree_node_class
class RBF:
    """Squared-exponential kernel ``variance * exp(-|x - y|^2 / (2 lengthscale^2))``.

    A reference for both protocols. ``lengthscale`` may be a scalar or one
    value per feature. ``cross_covariance`` uses the careful GEMM form of
    ``_half_squared_distances``, on points shifted by the mean of x2 before they
    are scaled, so that even the scaling does not round away small distances.
    """

    def __init__(self, lengthscale=1.0, variance=1.0):
        self.lengthscale = jnp.asarray(lengthscale)
        self.variance = jnp.asarray(variance)

    def __call__(self, x, y):
        r = (x - y) / self.lengthscale
        return self.variance * jnp.exp(-0.5 * jnp.sum(r * r))

    def cross_covariance(self, x1, x2):
        offset = jnp.mean(x2, axis=0) if x2.shape[0] else 0.0
        half_sq_dist = _half_squared_distances((x1 - offset) / self.lengthscale, (x2 - offset) / self.lengthscale)
        return self.variance * jnp.exp(-half_sq_dist)

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
# Fast blocks for pair kernels: the kernel's own program, run on a block
# --------------------------------------------------------------------------
#
# ``_vmap_block`` turns a pair kernel into a [b, n, D] computation, and XLA on
# CPU runs its sum over the tiny feature axis D several times slower than
# the exponential after it. A hand-written kernel avoids that by writing the
# feature sum out. ``_pair_program_block`` does the same for any pair kernel:
# it runs the kernel's jaxpr (its program on one pair of points) once for the
# whole block, keeping each value of shape S (say [D] or []) in the cheapest
# exact form:
#
# - an array [B, N, *S], B in {1, b} and N in {1, n}: a value of x alone is
#   [b, 1, *S], of y alone [1, n, *S], of neither [1, 1, *S], a scalar of
#   both [b, n]. These broadcast against each other like NumPy arrays, so
#   whatever depends on one point is computed once per point, not per pair.
# - ``_Split``: a value of both points with features, as a NumPy object array
#   of shape S holding [b, n] arrays. A sum over features is then a Python
#   sum of D arrays: the hand-written kernel.
# - ``_Difference``: x' - y', of x alone and y alone, not yet computed, so that
#   ``sum((x' - y')**2)`` becomes ``2 * _half_squared_distances(x', y')``, one GEMM,
#   when there are more than ``SUM_FEATURES_MAX`` features (else the sum is
#   written out, which is exact and as fast).
#
# An equation the rules below do not cover is evaluated by ``jax.vmap`` on
# its own, so every result is what ``_vmap_block`` computes.

SUM_FEATURES_MAX = 8  # more features: their squared distances in GEMM form (bench_lazy_kernel.py --kernels)

_ELEMENTWISE = frozenset(
    "abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy copy_p cos "
    "cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt integer_pow is_finite le lgamma log log1p "
    "logistic lt max min mul ne neg nextafter not or pow reduce_precision rem round rsqrt select_n sign sin sinh "
    "sqrt square sub tan tanh xor".split()
)


class _Split:
    def __init__(self, parts):
        self.parts = parts  # a NumPy object array of shape S holding [B, N] arrays


class _Difference:
    def __init__(self, row, col, scales=(), squared=False):
        self.row, self.col = row, col  # x' [B, 1, *S] and y' [1, N, *S]
        self.scales = scales  # ("mul" or "div", constant [1, 1, *S]), in order: the difference is scaled
        self.squared = squared

    @functools.cached_property
    def sides(self):
        """x'' [B, 1, *S] and y'' [1, N, *S] whose difference is this one, scales applied to each side.

        Scaled after a shared shift (y''s mean), as ``RBF.cross_covariance`` does,
        so that scaling rounds no more than the difference would, equal points
        still differ by exactly zero, and each pair costs a subtraction alone.
        """
        if not self.scales:
            return self.row, self.col
        offset = jnp.mean(self.col, axis=1, keepdims=True)
        row, col = self.row - offset, self.col - offset
        for name, constant in self.scales:
            row, col = (row * constant, col * constant) if name == "mul" else (row / constant, col / constant)
        return row, col

    def part(self, index):
        """The [B, N] array of one feature."""
        row, col = self.sides
        at = (slice(None), slice(None), *index)
        a = row[at] - col[at]
        return a * a if self.squared else a


def _pair_program_block(kernel, xa, xb, fallbacks):
    """The block K(xa, xb) from the kernel's jaxpr run on whole blocks (see above).

    ``fallbacks`` collects the names of the equations evaluated by vmap.
    """
    program = jax.make_jaxpr(kernel)(xa[0], xb[0])
    (out,) = _run(program.jaxpr, program.consts, [xa[:, None, :], xb[None, :, :]], fallbacks)
    return jnp.broadcast_to(_dense(out), (xa.shape[0], xb.shape[0]))


def _run(jaxpr, consts, args, fallbacks):
    env = dict(zip(jaxpr.invars, args, strict=True))
    env.update((var, jnp.asarray(c)[None, None]) for var, c in zip(jaxpr.constvars, consts, strict=True))

    def read(var):
        if isinstance(var, jax.extend.core.Literal):
            return jnp.asarray(var.val, var.aval.dtype)[None, None]
        return env[var]

    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, _evaluate(eqn, [read(v) for v in eqn.invars], fallbacks), strict=True))
    return [read(var) for var in jaxpr.outvars]


def _evaluate(eqn, args, fallbacks):
    """The outputs of one equation on block values: the rules of this section."""
    name, params = eqn.primitive.name, eqn.params
    shape = eqn.outvars[0].aval.shape
    arrays = not any(isinstance(a, (_Split, _Difference)) for a in args)
    if name in ("pjit", "jit", "closed_call"):
        inner = params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"]
        return _run(inner.jaxpr, inner.consts, args, fallbacks)
    if arrays and all(a.shape[:2] == (1, 1) for a in args):  # a value of neither point
        return [out[None, None] for out in _bind(eqn, [a[0, 0] for a in args])]
    difference = _difference_rule(name, params, args) if len(args) in (1, 2) else None
    if difference is not None:
        return [difference]
    features_of_both = bool(shape) and not (arrays and _one_sided(args))
    if name in _ELEMENTWISE and features_of_both:  # one array per feature
        split = [_split(a, shape) for a in args]
        parts = np.empty(shape, object)
        for index in np.ndindex(shape):
            (parts[index],) = _elementwise(eqn, [s.parts[index] for s in split])
        return [_Split(parts)]
    if name in _ELEMENTWISE:
        return _elementwise(eqn, args)
    x = args[0]
    if (
        not shape
        and isinstance(x, _Difference)
        and (name == "reduce_sum" and x.squared or name == "dot_general" and _same_difference(x, args[1]))
    ):  # sum((x' - y')**2) over all features, or (x' - y').(x' - y')
        if math.prod(x.row.shape[2:]) > SUM_FEATURES_MAX:
            row, col = x.sides
            return [2 * _half_squared_distances(row.reshape(row.shape[0], -1), col.reshape(col.shape[1], -1))]
        return [np.sum(_split(_Difference(x.row, x.col, x.scales, squared=True)).parts)]  # written out: exact
    if name in _STRUCTURAL and (features_of_both or not arrays):
        parts = _STRUCTURAL[name]([_split(a).parts for a in args], params, shape)
        return [_Split(parts) if shape else parts[()] if isinstance(parts, np.ndarray) else parts]
    if name == "dot_general" and not shape and arrays and x.ndim == 3 and (_side(x), _side(args[1])) == ("x", "y"):
        return [jnp.matmul(x[:, 0], args[1][0].T, precision=params["precision"])]  # x' . y' of vectors: a GEMM
    if not (arrays and _one_sided(args)):
        fallbacks.append(name)  # on values of both points: what block_evaluation reports
    return _by_vmap(eqn, args)


def _broadcast_in_dim(parts, params, shape):
    expanded = [1] * len(shape)
    for axis, size in zip(params["broadcast_dimensions"], parts.shape, strict=True):
        expanded[axis] = size
    return np.broadcast_to(parts.reshape(expanded), shape)


_STRUCTURAL = {  # NumPy's twins of JAX's structural primitives, on object arrays of [B, N] arrays
    "broadcast_in_dim": lambda p, params, shape: _broadcast_in_dim(p[0], params, shape),
    "concatenate": lambda p, params, shape: np.concatenate(p, axis=params["dimension"]),
    "reduce_prod": lambda p, params, shape: np.prod(p[0], axis=tuple(params["axes"])),
    "reduce_sum": lambda p, params, shape: np.sum(p[0], axis=tuple(params["axes"])),
    "reshape": lambda p, params, shape: p[0].reshape(shape),
    "squeeze": lambda p, params, shape: p[0].reshape(shape),
    "stack": lambda p, params, shape: np.stack(p, axis=params["axis"]),
    "transpose": lambda p, params, shape: p[0].transpose(params["permutation"]),
}


def _difference_rule(name, params, args):
    """x' - y' as a _Difference, negated, scaled by a constant or squared; else None."""
    x, y = (*args, None)[:2]
    if name in ("sub", "add") and not any(isinstance(a, (_Split, _Difference)) for a in args):
        if {_side(x), _side(y)} == {"x", "y"} and x.shape[2:] == y.shape[2:]:
            row, col = (x, y) if _side(x) == "x" else (y, x)
            if name == "add":
                return _Difference(row, -col)
            return _Difference(row, col) if row is x else _Difference(-row, -col)
        return None
    if not isinstance(x, _Difference) or x.squared:
        if name == "mul" and isinstance(y, _Difference) and not y.squared:
            return _difference_rule(name, params, [y, x])  # constant * difference
        return None
    if name == "neg":
        return _Difference(x.row, x.col, (*x.scales, ("mul", jnp.full((1, 1, *x.row.shape[2:]), -1, x.row.dtype))))
    if name in ("integer_pow", "square") and params.get("y", 2) == 2 or name == "mul" and _same_difference(x, y):
        return _Difference(x.row, x.col, x.scales, squared=True)
    constant = name in ("mul", "div") and not isinstance(y, (_Split, _Difference)) and y.shape[:2] == (1, 1)
    if constant and y.ndim <= x.row.ndim:
        constant = jnp.broadcast_to(_expand(y, x.row.ndim - 2), (1, 1, *x.row.shape[2:]))
        return _Difference(x.row, x.col, (*x.scales, (name, constant)))
    return None


def _same_difference(a, b):
    """Whether two unsquared _Differences are the same computation (a kernel may compute x - y twice)."""
    same = isinstance(b, _Difference) and not (a.squared or b.squared) and a.row is b.row and a.col is b.col
    return (
        same
        and len(a.scales) == len(b.scales)
        and all(s[0] == t[0] and s[1] is t[1] for s, t in zip(a.scales, b.scales, strict=True))
    )


def _side(a):
    """ "x" for an array of x alone, "y" for one of y alone, else None."""
    if a.shape[1] == 1 and a.shape[0] > 1:
        return "x"
    if a.shape[0] == 1 and a.shape[1] > 1:
        return "y"
    return None


def _one_sided(args):
    return not (any(a.shape[0] > 1 for a in args) and any(a.shape[1] > 1 for a in args))


def _expand(a, rank):
    """[B, N, *S] with ones inserted after B, N up to ``rank`` trailing axes, for broadcasting."""
    return a.reshape(a.shape[:2] + (1,) * (rank + 2 - a.ndim) + a.shape[2:])


def _dense(a):
    """A block value as one array [B, N, *S]."""
    if isinstance(a, _Difference):
        row, col = a.sides
        return (row - col) ** 2 if a.squared else row - col
    if isinstance(a, _Split):
        lead = jnp.broadcast_shapes(*(part.shape for part in a.parts.flat))
        parts = [jnp.broadcast_to(part, lead) for part in a.parts.flat]
        return jnp.stack(parts, axis=-1).reshape(lead + a.parts.shape)
    return a


def _split(a, shape=None):
    """A block value as a _Split of [B, N] arrays, broadcast to ``shape`` if given."""
    if isinstance(a, _Split):
        return a if shape is None else _Split(np.broadcast_to(a.parts, shape))
    parts = np.empty(a.row.shape[2:] if isinstance(a, _Difference) else a.shape[2:], object)
    for index in np.ndindex(parts.shape):
        parts[index] = a.part(index) if isinstance(a, _Difference) else a[(slice(None), slice(None), *index)]
    return _Split(parts if shape is None else np.broadcast_to(parts, shape))


def _bind(eqn, args):
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)  # JAX < 0.5: (subfuns, params)
    out = eqn.primitive.bind(*subfuns, *args, **params)
    return out if eqn.primitive.multiple_results else [out]


def _elementwise(eqn, args):
    args = [_dense(a) for a in args]
    rank = max(a.ndim for a in args) - 2
    args = [_expand(a, rank) for a in args]
    shape = jnp.broadcast_shapes(*(a.shape for a in args))
    return _bind(eqn, [jnp.broadcast_to(a, shape) for a in args])


def _by_vmap(eqn, args):
    """Any equation: vmapped over the two leading axes, as ``_vmap_block`` would."""
    args = [_dense(a) for a in args]
    lead = jnp.broadcast_shapes(*(a.shape[:2] for a in args))
    args = [jnp.broadcast_to(a, lead + a.shape[2:]) for a in args]
    return jax.vmap(jax.vmap(lambda *a: _bind(eqn, a)))(*args)


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
    """``K(rows, cols) @ rhs`` for rhs [len(cols), B], ``block`` (at most len(rows)) rows of K at a time."""
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
        start = jnp.minimum(i * block, n - block)  # the last block overlaps the one before it
        row_block = jax.lax.dynamic_slice_in_dim(rows, start, block)
        return jax.lax.dynamic_update_slice_in_dim(out, product(row_block), start, axis=0)

    # Every block has the same size, so that no separate remainder block runs
    # beside the loop (XLA would keep both alive: almost twice the peak). The
    # rows the last block shares with the one before are computed twice and
    # written twice, with the same values.
    out = _zeros_varying_like((n, rhs.shape[1]), dtype, (kernel, rows, cols, rhs))
    return jax.lax.fori_loop(0, -(-n // block), body, out) if n else out


# --------------------------------------------------------------------------
# The memory budget, measured with XLA's own accounting
# --------------------------------------------------------------------------
#
# One block of K is not the peak. XLA keeps whatever temporaries the kernel's
# computation needs (a pair kernel's checkpointed gradient holds about D + 1
# blocks), and arrays the size of the data (inputs, operand, result, their
# cotangents) that no block size changes. So the block comes from a
# measurement on the backend in use: the product, and with checkpoint=True its
# gradients, are compiled on abstract inputs at two block sizes, and XLA's
# ``temp_size_in_bytes`` is fitted as ``fixed + per_row * rows``. The block is
# the most rows whose temporaries stay within the limit, ``max_memory_mb``
# plus twice the data (x1, x2, the kernel's arrays, operand and result: them
# and their cotangents); it is measured at that size (XLA's choices can
# jump), and shrunk until it fits.


class Memory(NamedTuple):
    """XLA's temporaries for one product (the largest over the programs measured), in MiB."""

    rows: int  # rows of K per block
    peak_mb: float  # the temporaries at that block
    limit_mb: float  # max_memory_mb + twice the data (x1, x2, kernel arrays, operand, result)
    per_row_mb: float  # what each row of a block adds


_MEMORY = {}  # what decides the peak -> Memory; see _memory


def _measure(op, rows, width):
    """XLA's temporaries in bytes for ``op @ [N, width]`` at ``rows`` rows per block.

    With ``checkpoint``, the largest of the reverse-mode gradients of its sum
    with respect to (x1, operand), (x2, operand) and all inputs (the worst
    cases seen; each holds more than the product alone).
    """
    leaves, treedef = jax.tree_util.tree_flatten(op)

    def product(leaves, rhs):
        new = jax.tree_util.tree_unflatten(treedef, leaves)
        x1, x2 = jnp.asarray(new.x1), jnp.asarray(new.x2)
        return _blockwise_matmul(new.kernel, x1, x2, rhs, rows, op.checkpoint)

    specs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in leaves]
    rhs = jax.ShapeDtypeStruct((op.shape[1], width), jnp.result_type(op.dtype, op.x1.dtype))
    program = jax.make_jaxpr(product)(specs, rhs)
    # A kernel may close over tracers (a hyperparameter under jit or grad):
    # they become inputs of the measured programs, like the leaves.
    traced = [isinstance(c, jax.core.Tracer) for c in program.consts]
    inputs = [*specs, rhs] + [
        jax.ShapeDtypeStruct(jnp.shape(c), c.dtype) for c, t in zip(program.consts, traced, strict=True) if t
    ]

    def run(*inputs):
        hoisted = iter(inputs[len(specs) + 1 :])
        consts = [next(hoisted) if t else c for c, t in zip(program.consts, traced, strict=True)]
        return jax.core.eval_jaxpr(program.jaxpr, consts, *inputs[: len(specs) + 1])[0]

    def gradient(argnums):
        argnums = tuple(i for i in argnums if jnp.issubdtype(inputs[i].dtype, jnp.inexact))
        return jax.grad(lambda *a: jnp.sum(run(*a)), argnums)

    x1, x2, v = len(leaves) - 2, len(leaves) - 1, len(leaves)
    programs = [gradient((x1, v)), gradient((x2, v)), gradient(range(len(inputs)))] if op.checkpoint else [run]
    return max(jax.jit(f).lower(*inputs).compile().memory_analysis().temp_size_in_bytes for f in programs)


def _memory(op, width):
    """The block for ``op @ [N, width]`` and its measured temporaries, cached by what decides them.

    A pytree kernel whose leaves are all arrays is known by the operator's
    structure (types, settings, shapes, dtypes): no tracing at all. Any other
    (a closure built anew in every trace, say) by its block's jaxpr on small
    blocks, which costs a trace of the kernel.
    """
    leaves, treedef = jax.tree_util.tree_flatten(op)
    shapes = (tuple((jnp.shape(a), jnp.result_type(a)) for a in leaves), width, jax.default_backend())
    structure = (treedef, shapes) if all(op._array_leaves) else None  # holds no closures (or their tracers)
    if structure not in _MEMORY:
        a = jax.ShapeDtypeStruct((2, op.x1.shape[1]), op.x1.dtype)
        b = jax.ShapeDtypeStruct((3, op.x2.shape[1]), op.x2.dtype)
        block_program = str(jax.make_jaxpr(functools.partial(kernel_block, op.kernel))(a, b))
        key = (block_program, op.max_memory_mb, op.batch_size, op.checkpoint, shapes)
        if key not in _MEMORY:
            _MEMORY[key] = _choose_block(op, width)
        if structure is None:
            return _MEMORY[key]
        _MEMORY[structure] = _MEMORY[key]
    return _MEMORY[structure]


def _choose_block(op, width):
    m, n = op.shape
    mib = 2**20
    preferred = op._preferred_block_rows()
    if op.batch_size is not None or m < 2:
        return Memory(preferred, _measure(op, preferred, width) / mib, math.nan, math.nan)
    data = sum(jnp.size(a) * jnp.result_type(a).itemsize for a in jax.tree_util.tree_leaves(op))
    data += (m + n) * width * jnp.result_type(op.dtype, op.x1.dtype).itemsize
    limit = op.max_memory_mb * mib + 2 * data  # the data and their cotangents: no block size removes them
    small, large = min(8, max(1, preferred // 2)), max(preferred, 2)
    peak_small, peak_large = _measure(op, small, width), _measure(op, large, width)
    per_row = max((peak_large - peak_small) / (large - small), 0.0)
    fixed = peak_small - per_row * small
    if fixed + per_row > limit:
        warnings.warn(
            f"LazyKernel{op.shape}: one row of a block needs {per_row / mib:.3g} MiB of temporaries "
            f"(checkpoint={op.checkpoint}) beside {fixed / mib:.3g} MiB that no block size changes: more than "
            f"max_memory_mb={op.max_memory_mb} plus twice the data ({2 * data / mib:.3g} MiB); using 1 row per block",
            stacklevel=5,
        )
    rows, peak = (large, peak_large) if large == preferred else (small, peak_small)
    while peak > limit and rows > 1:  # shrink, measuring again: XLA's choices can jump
        rows = max(1, min(rows - 1, int((limit - fixed) // max(per_row, 1.0))))
        peak = _measure(op, rows, width)
        per_row = max(per_row, (peak - fixed) / rows)
    return Memory(rows, peak / mib, limit / mib, per_row / mib)


@jax.custom_jvp
def _warn_if_differentiated(op_and_operand):
    """``(op, operand)`` as they are; differentiating through them warns that blocks are not checkpointed."""
    return op_and_operand


@_warn_if_differentiated.defjvp
def _warn_on_derivative(primals, tangents):
    ((op, _),) = primals
    m, n = op.shape
    warnings.warn(
        f"LazyKernel{op.shape} with checkpoint=False is differentiated: reverse mode (grad, vjp) stores "
        f"every block, at least the whole matrix ({m * n * op.dtype.itemsize / 2**20:.4g} MiB), whatever "
        "max_memory_mb says. Pass checkpoint=True to keep gradients within the budget.",
        stacklevel=1,  # the caller is inside JAX's differentiation
    )
    return primals[0], tangents[0]


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
        op, rhs = (self, rhs) if self.checkpoint else _warn_if_differentiated((self, rhs))
        block = self._preferred_block_rows() if self.batch_size else _memory(self, width).rows
        out = _blockwise_matmul(op.kernel, jnp.asarray(op.x1), jnp.asarray(op.x2), rhs, block, self.checkpoint)
        return jnp.moveaxis(out.reshape(m, *batch, k), 0, -2)

    def __rmatmul__(self, other):
        x = self._operand(other, "left")
        if x.ndim == 1:
            return self.T @ x
        return jnp.swapaxes(self.T @ jnp.swapaxes(x, -1, -2), -1, -2)  # X @ K = (K^T @ X^T)^T

    # -- blocks and memory ---------------------------------------------------

    def _preferred_block_rows(self):
        """The block before the budget is measured: ``batch_size``, or the fastest block allowed.

        On GPU that is ``batch_size_row``. On the CPU, blocks of about
        ``CPU_BLOCK_BYTES``, and at least ``CPU_MIN_BLOCK`` rows, ran 9x faster
        than one budget-sized block at N = 16384 (see the README's measurements).
        """
        rows = self.batch_size_row
        if self.batch_size is None and jax.default_backend() == "cpu":
            cache_sized = CPU_BLOCK_BYTES // (self.dtype.itemsize * max(self.shape[1], 1))
            rows = min(rows, max(CPU_MIN_BLOCK, cache_sized))
        return max(1, min(rows, self.shape[0]))

    @property
    def block_rows(self) -> int:
        """Rows of K per block that ``K @ v`` really uses, at most ``batch_size_row``.

        A given ``batch_size`` is used as it is. Otherwise the largest block,
        up to ``_preferred_block_rows``, whose measured temporaries fit the
        budget (see ``memory``); a wider operand may get a smaller block.
        """
        return self._preferred_block_rows() if self.batch_size else self.memory().rows

    @property
    def block_cols(self) -> int:
        """Columns of K per block that ``v @ K`` really uses."""
        return self.T.block_rows

    def memory(self, width: int = 1) -> Memory:
        """XLA's temporaries for ``K @ X`` with X of ``width`` columns, measured (and cached).

        The largest over the product and, with ``checkpoint=True``, its
        gradients. ``peak_mb <= limit_mb`` (``max_memory_mb`` plus twice the
        data) unless a warning said one row does not fit; with a given
        ``batch_size`` the limit is ``nan``. For ``X @ K`` ask ``K.T.memory(width)``.
        """
        return _memory(self, width)

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
            f"block_rows={self.block_rows}, block_cols={self.block_cols}, checkpoint={self.checkpoint}, "
            f"peak_mb={self.memory().peak_mb:.3g}, "
            f"blocks={block_evaluation(self.kernel, self.x1.shape[1], self.dtype)!r})"
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
