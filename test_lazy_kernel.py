"""LazyKernel against a dense oracle built independently of the code under test.

The oracles are NumPy float64 twins of the test kernels, evaluated pair by
pair into a full matrix; gradients are checked against ``jax.grad`` of the
same loss on a dense matrix built by broadcasting (no blocks, no loop).
"""

import functools
import os
import socket
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lazy_kernel
from lazy_kernel import RBF, LazyKernel, kernel_block

JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:2])

# -- test kernels and their NumPy twins ---------------------------------------


def skewed(x, y):
    """A kernel with k(x, y) != k(y, x)."""
    return jnp.exp(-0.5 * jnp.sum((x - y) ** 2)) * (1.5 + jnp.sin(x[0]))


def skewed_np(x, y):
    return np.exp(-0.5 * np.sum((x - y) ** 2)) * (1.5 + np.sin(x[0]))


def scaled_laplace(x, y, scale):
    return jnp.exp(-jnp.sum(jnp.abs(x - y)) / scale)


def rbf_np(x, y, lengthscale=0.8, variance=1.7):
    return variance * np.exp(-0.5 * np.sum(((x - y) / lengthscale) ** 2))


KERNELS = {
    "rbf-pytree": (RBF(0.8, 1.7), rbf_np),
    "skewed-function": (skewed, skewed_np),
    "laplace-partial": (
        functools.partial(scaled_laplace, scale=1.3),
        lambda x, y: np.exp(-np.sum(np.abs(x - y)) / 1.3),
    ),
}


def dense_oracle(kernel_np, x1, x2):
    """K[i, j] = kernel_np(x1[i], x2[j]) in float64, one pair at a time."""
    x1, x2 = np.asarray(x1, np.float64), np.asarray(x2, np.float64)
    return np.array([[kernel_np(a, b) for b in x2] for a in x1]).reshape(len(x1), len(x2))


def rbf_dense_jnp(x1, x2, lengthscale, variance):
    """The dense RBF matrix by broadcasting: the gradient oracle."""
    return variance * jnp.exp(-0.5 * jnp.sum(((x1[:, None] - x2[None]) / lengthscale) ** 2, -1))


def rtol(dtype):
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-11


def assert_close(actual, expected, dtype, scale=None):
    """|actual - expected| <= rtol * scale elementwise, scale defaulting to max|expected| (at least 1)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if scale is None:
        scale = max(1.0, np.abs(expected).max(initial=0.0))
    np.testing.assert_array_less(np.abs(actual - expected), rtol(dtype) * scale + 1e-300)


def transpose(a):
    """Swap the last two axes (a no-op on vectors), as matmul's transpose rules need."""
    return a if a.ndim == 1 else a.swapaxes(-1, -2)


def points(rng, n, dim, dtype):
    return jnp.asarray(rng.normal(size=(n, dim)), dtype)


# -- products against the oracle ----------------------------------------------

OPERAND_SHAPES = {  # rank -> (right operand shape, left operand shape) given K's (M, N)
    1: lambda m, n: ((n,), (m,)),
    2: lambda m, n: ((n, 3), (2, m)),
    3: lambda m, n: ((2, n, 3), (2, 3, m)),
    4: lambda m, n: ((2, 1, n, 2), (1, 2, 2, m)),
}


@given(
    m=st.integers(0, 40),
    n=st.integers(0, 40),
    dim=st.integers(1, 4),
    kernel_name=st.sampled_from(sorted(KERNELS)),
    rank=st.sampled_from(sorted(OPERAND_SHAPES)),
    dtype=st.sampled_from([jnp.float32, jnp.float64]),
    batch_size=st.one_of(st.none(), st.integers(1, 50)),
    max_memory_mb=st.sampled_from([0, 2e-4, 1e-3, 2**10]),
    checkpoint=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_products_match_dense(m, n, dim, kernel_name, rank, dtype, batch_size, max_memory_mb, checkpoint, seed, device):
    rng = np.random.default_rng(seed)
    kernel, kernel_np = KERNELS[kernel_name]
    x1, x2 = points(rng, m, dim, dtype), points(rng, n, dim, dtype)
    op = LazyKernel(kernel, x1, x2, max_memory_mb=max_memory_mb, batch_size=batch_size, checkpoint=checkpoint)
    dense = dense_oracle(kernel_np, x1, x2)
    right_shape, left_shape = OPERAND_SHAPES[rank](m, n)
    right = jnp.asarray(rng.normal(size=right_shape), dtype)
    left = jnp.asarray(rng.normal(size=left_shape), dtype)

    product = op @ right
    assert product.devices() == {device}
    assert_close(product, dense @ np.asarray(right, np.float64), dtype, scale=max(1, n))
    assert_close(left @ op, np.asarray(left, np.float64) @ dense, dtype, scale=max(1, m))
    assert_close(op.T @ transpose(left), transpose(np.asarray(left, np.float64) @ dense), dtype, scale=max(1, m))


@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_transpose_dense_and_diagonal(kernel_name, dtype, device):
    rng = np.random.default_rng(0)
    kernel, kernel_np = KERNELS[kernel_name]
    x1, x2 = points(rng, 13, 3, dtype), points(rng, 8, 3, dtype)
    op = LazyKernel(kernel, x1, x2, batch_size=3)
    dense = dense_oracle(kernel_np, x1, x2)
    assert_close(op.to_dense(), dense, dtype)
    assert_close(op.T.to_dense(), dense.T, dtype)
    assert_close(op.diagonal(), np.diag(dense), dtype)
    assert_close(op.T.diagonal(), np.diag(dense), dtype)
    assert op.to_dense().devices() == {device}
    assert op.T.shape == (8, 13) and op.T.T.kernel is kernel and op.T.T.x1 is x1
    for result in (op.to_dense(), op.diagonal(), op @ jnp.ones(8, dtype)):
        assert result.dtype == dtype


def test_nonsymmetric_transpose_is_not_the_original():
    rng = np.random.default_rng(1)
    x = points(rng, 9, 2, jnp.float64)
    op = LazyKernel(skewed, x, x, batch_size=4)
    dense = dense_oracle(skewed_np, x, x)
    assert np.abs(dense - dense.T).max() > 0.1  # the test kernel really is non-symmetric
    v = np.random.default_rng(2).normal(size=9)
    assert_close(op.T @ v, dense.T @ v, jnp.float64)
    assert_close(v @ op, v @ dense, jnp.float64)


@pytest.mark.parametrize("block", [1, 2, 5, 7, 23, 24, 100])
def test_blocks_have_one_size_and_cover_every_row(block):
    """One block size throughout (the last block overlaps the one before it); nothing padded or dropped."""
    seen = []

    class Recording:
        def __call__(self, x, y):
            return jnp.exp(-jnp.sum((x - y) ** 2))

        def cross_covariance(self, a, b):
            if b.shape[0] == 6:  # not the small blocks that tell this apart from a vmap
                seen.append(a.shape[0])
            return jnp.exp(-jnp.sum((a[:, None] - b[None]) ** 2, -1))

    rng = np.random.default_rng(3)
    x1, x2 = points(rng, 23, 2, jnp.float64), points(rng, 6, 2, jnp.float64)
    op = LazyKernel(Recording(), x1, x2, batch_size=block)
    v = rng.normal(size=6)
    np.testing.assert_allclose(op @ v, dense_oracle(lambda a, b: np.exp(-np.sum((a - b) ** 2)), x1, x2) @ v, rtol=1e-12)
    assert seen == [min(block, 23)] and op.block_rows == min(block, 23) <= op.batch_size_row == block


# -- sizes and settings --------------------------------------------------------


@given(
    m=st.integers(0, 5000),
    n=st.integers(0, 5000),
    max_memory_mb=st.one_of(st.integers(0, 4096), st.floats(0, 64)),
    batch_size=st.one_of(st.none(), st.integers(1, 10_000)),
    dtype=st.sampled_from([jnp.float32, jnp.float64, jnp.float16]),
)
def test_batch_size_arithmetic_is_the_seeds(m, n, max_memory_mb, batch_size, dtype):
    op = LazyKernel(
        RBF(), jnp.zeros((m, 2), dtype), jnp.zeros((n, 2), dtype), max_memory_mb=max_memory_mb, batch_size=batch_size
    )
    itemsize = jnp.dtype(dtype).itemsize
    assert op.dtype == dtype and op.shape == (m, n)
    assert op.max_elements == int(max_memory_mb * 2**20) // itemsize
    if batch_size is None:
        assert op.batch_size_row == (max(1, op.max_elements // n) if n else max(1, op.max_elements))
        assert op.batch_size_col == (max(1, op.max_elements // m) if m else max(1, op.max_elements))
    else:
        assert op.batch_size_row == op.batch_size_col == batch_size
    assert 1 <= op.block_rows <= op.batch_size_row and 1 <= op.block_cols <= op.batch_size_col
    if batch_size is not None:
        assert op.block_rows == min(batch_size, max(m, 1)) and op.block_cols == min(batch_size, max(n, 1))
    if batch_size is None and op.max_elements >= max(n, 1) * max(m, 1):
        assert op.block_rows * n <= op.max_elements


def test_constructor_keeps_what_was_passed():
    x1, x2 = np.zeros((4, 2), np.float32), jnp.zeros((5, 2), jnp.float32)
    kernel = RBF()
    op = LazyKernel(kernel, x1, x2, max_memory_mb=0.5, batch_size=3, checkpoint=True)
    assert op.kernel is kernel and op.x1 is x1 and op.x2 is x2
    assert (op.max_memory_mb, op.batch_size, op.checkpoint) == (0.5, 3, True)
    assert op.shape == (4, 5) and op.dtype == jnp.float32
    text = repr(op)
    assert "shape=(4, 5)" in text and "block_rows=3" in text and "RBF" in text


@pytest.mark.parametrize("m, n", [(0, 5), (5, 0), (0, 0)])
def test_empty_inputs_behave_like_the_dense_matrix(m, n):
    x1, x2 = jnp.zeros((m, 2)), jnp.ones((n, 2))
    op = LazyKernel(RBF(), x1, x2, batch_size=2)
    dense = np.zeros((m, n))
    for right in (np.ones(n), np.ones((n, 3)), np.ones((2, n, 3))):
        np.testing.assert_array_equal(op @ right, dense @ right)
    for left in (np.ones(m), np.ones((3, m)), np.ones((2, 3, m))):
        np.testing.assert_array_equal(left @ op, left @ dense)
    assert op.to_dense().shape == (m, n) and op.diagonal().shape == (0,) and op.T.shape == (n, m)


# -- operands: kinds and dtypes -----------------------------------------------


def test_numpy_and_jax_operands_on_either_side():
    rng = np.random.default_rng(4)
    x1, x2 = rng.normal(size=(7, 2)), rng.normal(size=(5, 2))
    op = LazyKernel(RBF(0.8, 1.7), x1, x2, batch_size=2)
    dense = dense_oracle(rbf_np, x1, x2)
    v_np, w_np = rng.normal(size=5), rng.normal(size=(3, 7))
    for v in (v_np, jnp.asarray(v_np), v_np.tolist()):
        assert_close(op @ v, dense @ v_np, jnp.float64)
    for w in (w_np, jnp.asarray(w_np)):
        result = w @ op  # a NumPy array on the left must defer, not convert the operator
        assert isinstance(result, jax.Array)
        assert_close(result, w_np @ dense, jnp.float64)
    assert_close(jax.jit(lambda w: w @ op)(w_np), w_np @ dense, jnp.float64)  # a tracer on the left


@pytest.mark.parametrize("kernel_dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("operand_dtype", [jnp.float32, jnp.float64, jnp.int32, jnp.bfloat16])
def test_result_dtype_follows_jnp_matmul(kernel_dtype, operand_dtype):
    x = jnp.linspace(0, 1, 8, dtype=kernel_dtype).reshape(4, 2)
    op = LazyKernel(RBF(), x, x)
    v = jnp.ones((4, 2), operand_dtype)
    dense = rbf_dense_jnp(x, x, 1.0, 1.0)
    assert (op @ v).dtype == jnp.matmul(dense, v).dtype
    assert (v.T @ op).dtype == jnp.matmul(v.T, dense).dtype


# -- transformations ------------------------------------------------------------


@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
def test_jit_and_vmap_with_every_kernel_kind(kernel_name):
    rng = np.random.default_rng(5)
    kernel, kernel_np = KERNELS[kernel_name]
    x1, x2 = points(rng, 9, 2, jnp.float64), points(rng, 6, 2, jnp.float64)
    op = LazyKernel(kernel, x1, x2, batch_size=4)
    dense = dense_oracle(kernel_np, x1, x2)
    vs = rng.normal(size=(3, 6))
    assert_close(jax.jit(lambda op, v: op @ v)(op, vs[0]), dense @ vs[0], jnp.float64)
    ws = rng.normal(size=(2, 9))
    assert_close(jax.jit(lambda op, w: w @ op)(op, ws), ws @ dense, jnp.float64)
    assert_close(jax.vmap(lambda v: op @ v)(vs), vs @ dense.T, jnp.float64)
    x1s = points(rng, 2 * 9, 2, jnp.float64).reshape(2, 9, 2)
    batched = jax.vmap(lambda x1, v: LazyKernel(kernel, x1, x2, batch_size=4) @ v)(x1s, vs[:2])
    for i in range(2):
        assert_close(batched[i], dense_oracle(kernel_np, x1s[i], x2) @ vs[i], jnp.float64)
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), op, op)  # a batch of two operators
    assert_close(jax.vmap(lambda op, v: op @ v)(stacked, vs[:2]), vs[:2] @ dense.T, jnp.float64)


def test_pytree_leaves_are_the_arrays():
    x1, x2 = jnp.zeros((3, 2)), jnp.zeros((4, 2))
    kernel = RBF(jnp.array([1.0, 2.0]), 3.0)
    leaves = jax.tree_util.tree_leaves(LazyKernel(kernel, x1, x2, batch_size=2))
    assert len(leaves) == 4 and all(isinstance(leaf, jax.Array) for leaf in leaves)
    assert jax.tree_util.tree_leaves(LazyKernel(skewed, x1, x2)) == [x1, x2]
    op = LazyKernel(kernel, x1, x2, batch_size=2)
    placeholders = jax.tree_util.tree_map(lambda _: object(), op)  # as JAX's own axis specs are built
    assert jax.tree_util.tree_structure(placeholders) == jax.tree_util.tree_structure(op)
    rebuilt = jax.tree_util.tree_map(lambda a: a + 1, op)
    assert rebuilt.batch_size == 2 and float(rebuilt.kernel.variance) == 4.0 and rebuilt.kernel(x1[0], x1[0]) == 4.0


def skewed_dense_jnp(x1, x2):
    """The dense ``skewed`` matrix by broadcasting: the gradient oracle for a pair function."""
    return jnp.exp(-0.5 * jnp.sum((x1[:, None] - x2[None]) ** 2, -1)) * (1.5 + jnp.sin(x1[:, :1]))


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("pair_function", [False, True])
def test_gradients_match_dense(checkpoint, side, pair_function):
    rng = np.random.default_rng(6)
    x1, x2 = points(rng, 11, 3, jnp.float64), points(rng, 7, 3, jnp.float64)
    lengthscale, variance = jnp.array([0.7, 1.1, 0.9]), jnp.array(1.3)
    v = jnp.asarray(rng.normal(size=(7, 2)) if side == "right" else rng.normal(size=(2, 11)))
    weights = jnp.asarray(rng.normal(size=(11, 2) if side == "right" else (2, 7)))

    def lazy_loss(x1, x2, v, lengthscale, variance):
        kernel = skewed if pair_function else RBF(lengthscale, variance)
        op = LazyKernel(kernel, x1, x2, batch_size=3, checkpoint=checkpoint)
        return jnp.sum(weights * jnp.sin(op @ v if side == "right" else v @ op))

    def dense_loss(x1, x2, v, lengthscale, variance):
        dense = skewed_dense_jnp(x1, x2) if pair_function else rbf_dense_jnp(x1, x2, lengthscale, variance)
        return jnp.sum(weights * jnp.sin(dense @ v if side == "right" else v @ dense))

    args = (x1, x2, v, lengthscale, variance)
    lazy = jax.grad(lazy_loss, argnums=range(5))(*args)
    dense = jax.grad(dense_loss, argnums=range(5))(*args)
    for got, want in zip(lazy, dense, strict=True):
        assert_close(got, want, jnp.float64)
    jitted = jax.jit(jax.grad(lazy_loss, argnums=range(5)))(*args)
    for got, want in zip(jitted, dense, strict=True):
        assert_close(got, want, jnp.float64)


def test_gradient_through_an_operator_argument():
    rng = np.random.default_rng(7)
    x1, x2 = points(rng, 6, 2, jnp.float64), points(rng, 5, 2, jnp.float64)
    v = jnp.asarray(rng.normal(size=5))
    op = LazyKernel(RBF(jnp.array(0.9), jnp.array(1.2)), x1, x2, batch_size=2, checkpoint=True)
    grads = jax.jit(jax.grad(lambda op: jnp.sum((op @ v) ** 2)))(op)
    dense = jax.grad(lambda x1, x2, ls, var: jnp.sum((rbf_dense_jnp(x1, x2, ls, var) @ v) ** 2), argnums=range(4))(
        x1, x2, jnp.array(0.9), jnp.array(1.2)
    )
    for got, want in zip((grads.x1, grads.x2, grads.kernel.lengthscale, grads.kernel.variance), dense, strict=True):
        assert_close(got, want, jnp.float64)


# -- memory (XLA's own accounting) ------------------------------------------------


def temp_bytes(f, *args):
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("block", [256, 250])  # 250 does not divide 4096: no separate remainder block
def test_forward_memory_is_one_block_not_the_matrix(block):
    m = n = 4096
    x = jnp.zeros((m, 3), jnp.float32)
    v = jnp.zeros(n, jnp.float32)
    block_bytes = block * n * 4
    # Measured: one block on JAX 0.10; two on JAX 0.4.30, whose XLA keeps the
    # block's GEMM result beside its exponential instead of fusing them.
    blocks = 1.5 if JAX_VERSION >= (0, 10) else 2.1
    temp = temp_bytes(lambda x, v: LazyKernel(RBF(), x, x, batch_size=block) @ v, x, v)
    assert temp <= blocks * block_bytes, (temp, block_bytes)
    temp_left = temp_bytes(lambda x, v: v @ LazyKernel(RBF(), x, x, batch_size=block), x, v)
    assert temp_left <= blocks * block_bytes, (temp_left, block_bytes)
    dense_temp = temp_bytes(lambda x, v: RBF().cross_covariance(x, x) @ v, x, v)
    assert dense_temp >= m * n * 4  # the accounting does see a materialised matrix


@pytest.mark.parametrize("block", [256, 250])
def test_checkpointed_gradient_memory_is_a_few_blocks(block):
    m = n = 4096
    x = jnp.zeros((m, 3), jnp.float32)
    v = jnp.zeros(n, jnp.float32)
    block_bytes = block * n * 4

    def grad_temp(checkpoint):
        loss = lambda x, v: jnp.sum(LazyKernel(RBF(), x, x, batch_size=block, checkpoint=checkpoint) @ v)  # noqa: E731
        return temp_bytes(jax.grad(loss, argnums=(0, 1)), x, v)

    assert grad_temp(True) <= 4 * block_bytes, (grad_temp(True), block_bytes)
    assert grad_temp(False) >= m * n * 4  # without checkpoint every block is stored


# -- the reference kernel ---------------------------------------------------------


def test_rbf_gemm_form_is_accurate_far_from_the_origin():
    rng = np.random.default_rng(8)
    offset = np.array([1e3, -2e3, 5e2])
    x1 = (rng.normal(size=(50, 3)) + offset).astype(np.float32)
    x2 = (rng.normal(size=(40, 3)) + offset).astype(np.float32)
    kernel = RBF(jnp.float32(0.9), jnp.float32(1.5))
    want = dense_oracle(lambda a, b: rbf_np(a, b, 0.9, 1.5), x1, x2)
    got = kernel.cross_covariance(jnp.asarray(x1), jnp.asarray(x2))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5 * 1.5)
    pair = kernel_block(lambda a, b: kernel(a, b), jnp.asarray(x1), jnp.asarray(x2))
    np.testing.assert_allclose(np.asarray(pair, np.float64), want, atol=1e-5 * 1.5)
    assert float(kernel.cross_covariance(x1[:1], x1[:1])[0, 0]) == pytest.approx(1.5, rel=1e-6)


# -- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((RBF(), np.zeros(3), np.zeros((3, 2))), {}, ValueError, r"x1 must be 2-D.*\(3,\)"),
        ((RBF(), np.zeros((3, 2)), np.zeros((3, 2, 1))), {}, ValueError, r"x2 must be 2-D.*\(3, 2, 1\)"),
        ((RBF(), np.zeros((3, 2)), np.zeros((4, 3))), {}, ValueError, r"same number of features.*\(3, 2\).*\(4, 3\)"),
        ((RBF(), [[0.0]], np.zeros((1, 1))), {}, TypeError, "x1 must be an array"),
        ((RBF(), np.zeros((3, 2)), np.zeros((3, 2))), {"batch_size": 0}, ValueError, "batch_size.*0"),
        ((RBF(), np.zeros((3, 2)), np.zeros((3, 2))), {"batch_size": 2.5}, ValueError, "batch_size.*2.5"),
        ((RBF(), np.zeros((3, 2)), np.zeros((3, 2))), {"batch_size": True}, ValueError, "batch_size.*True"),
        ((RBF(), np.zeros((3, 2)), np.zeros((3, 2))), {"max_memory_mb": -1}, ValueError, "max_memory_mb.*-1"),
        ((RBF(), np.zeros((3, 2)), np.zeros((3, 2))), {"max_memory_mb": "1"}, ValueError, "max_memory_mb.*'1'"),
        ((RBF(), np.zeros((3, 2)), np.zeros((3, 2))), {"max_memory_mb": float("nan")}, ValueError, "max_memory_mb"),
        ((RBF(), np.zeros((3, 2)), np.zeros((3, 2))), {"checkpoint": 1}, TypeError, "checkpoint"),
        (("rbf", np.zeros((3, 2)), np.zeros((3, 2))), {}, TypeError, "kernel must be callable"),
        (
            (lambda x, y: x - y, np.zeros((3, 2)), np.zeros((3, 2))),
            {},
            TypeError,
            r"kernel\(x: \[D\], y: \[D\]\) -> scalar.*\(2,\)",
        ),
    ],
)
def test_bad_construction_is_refused(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        LazyKernel(*args, **kwargs)


def test_bad_cross_covariance_is_refused():
    class Transposing(RBF):
        def cross_covariance(self, x1, x2):
            return super().cross_covariance(x1, x2).T

    with pytest.raises(TypeError, match=r"must return \[m, n\].*\(3, 2\)"):
        LazyKernel(Transposing(), np.zeros((3, 2)), np.zeros((3, 2)))


def test_bad_operands_are_refused():
    op = LazyKernel(RBF(), np.zeros((4, 2)), np.zeros((5, 2)))
    with pytest.raises(ValueError, match=r"0-d"):
        op @ 2.0
    with pytest.raises(ValueError, match=r"0-d"):
        2.0 @ op
    with pytest.raises(ValueError, match=r"\(4, 5\).*\(4,\).*5 columns.*4 rows"):
        op @ np.ones(4)
    with pytest.raises(ValueError, match=r"\(4, 5\) @ operand of shape \(2, 4, 3\).*5 columns.*4 rows"):
        op @ np.ones((2, 4, 3))
    with pytest.raises(ValueError, match=r"\(3, 5\).*\(4, 5\).*5 columns, K 4 rows"):
        np.ones((3, 5)) @ op
    with pytest.raises(TypeError, match="two LazyKernels"):
        op @ op.T


# -- the sanity check -----------------------------------------------------------


def test_sanity_check_passes(capsys):
    assert lazy_kernel.main(["--n", "300", "--batch-size", "7", "--check", "16"]) == 0
    out = capsys.readouterr().out
    assert "blocks used: 7 rows of 300" in out and out.rstrip().endswith("PASS")


# -- many devices and processes: jax.shard_map --------------------------------------


def check_sharded():
    """``K @ v``, ``w @ K`` and gradients of a psum'd loss under ``jax.shard_map`` on every device.

    Runs in a subprocess with several (virtual) CPU devices, possibly in several
    processes; each process checks its own shards against the dense oracle.
    """
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_enable_x64", True)
    shard_map = lazy_kernel._shard_map()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    count = len(jax.devices())
    rng = np.random.default_rng(0)  # the same data in every process
    x1, x2 = rng.normal(size=(5 * count, 2)), rng.normal(size=(3 * count, 2))
    v, w = rng.normal(size=(3 * count, 2)), rng.normal(size=(2, 5 * count))
    dense = dense_oracle(rbf_np, x1, x2)

    def put(a, spec):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda index: a[index])

    def check(result, expected):
        assert result.shape == expected.shape
        for shard in result.addressable_shards:
            assert_close(shard.data, expected[shard.index], jnp.float64)

    def rbf_pair(ls, variance):  # the same RBF as a pair function: the pair program on CPU
        return lambda a, b: variance * jnp.exp(-0.5 * jnp.sum(((a - b) / ls) ** 2))

    def check_products(checkpoint, make_kernel):
        lazy = functools.partial(LazyKernel, batch_size=2, checkpoint=checkpoint)
        right = shard_map(
            lambda x1, x2, v, ls: lazy(make_kernel(ls, 1.7), x1, x2) @ v,
            mesh=mesh,
            in_specs=(P("d"), P(), P(), P()),
            out_specs=P("d"),
        )
        left = shard_map(
            lambda x1, x2, w, ls: w @ lazy(make_kernel(ls, 1.7), x1, x2),
            mesh=mesh,
            in_specs=(P(), P("d"), P(), P()),
            out_specs=P(None, "d"),
        )
        ls = jnp.asarray(0.8)
        check(jax.jit(right)(put(x1, P("d")), put(x2, P()), put(v, P()), ls), dense @ v)
        check(jax.jit(left)(put(x1, P()), put(x2, P("d")), put(w, P()), ls), w @ dense)

        def loss(x1, x2, v, ls):
            local = jnp.sum(jnp.sin(lazy(make_kernel(ls, 1.7), x1, x2) @ v))
            return jax.lax.psum(local, "d")

        sharded_loss = shard_map(loss, mesh=mesh, in_specs=(P("d"), P(), P(), P()), out_specs=P())
        grads = jax.jit(jax.grad(sharded_loss, argnums=range(4)))(put(x1, P("d")), put(x2, P()), put(v, P()), ls)
        dense_loss = lambda x1, x2, v, ls: jnp.sum(jnp.sin(rbf_dense_jnp(x1, x2, ls, 1.7) @ v))  # noqa: E731
        want = jax.grad(dense_loss, argnums=range(4))(x1, x2, v, ls)
        for got, expected in zip(grads, want, strict=True):
            check(got, np.asarray(expected))

    for kernel in (RBF, rbf_pair):
        check_products(checkpoint=False, make_kernel=kernel)
        check_products(checkpoint=True, make_kernel=kernel)
    print(f"sharded check passed on {count} devices in process {jax.process_index()} of {jax.process_count()}")


def run_python(code, env, timeout=300, processes=1):
    """Run ``code`` in fresh Python processes (CPU only); fail with their output if any fails."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code.format(process=i)],
            cwd=here,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out
    return outputs


@pytest.fixture
def cpu_only(device):
    if device.platform != "cpu":
        pytest.skip("the multi-device tests use virtual CPU devices")


@pytest.mark.usefixtures("cpu_only")
def test_shard_map_on_four_devices():
    (out,) = run_python(
        "import test_lazy_kernel as t; t.check_sharded()",
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    )
    assert "passed on 4 devices" in out


@pytest.mark.usefixtures("cpu_only")
def test_sanity_check_on_all_devices():
    (out,) = run_python(
        "import sys, lazy_kernel; sys.exit(lazy_kernel.main(['--n', '402', '--devices', 'all', '--batch-size', '30']))",
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    )
    assert "devices: 4 x cpu" in out and "K: 400 x 400" in out and "30 rows of 100" in out and "PASS" in out


@pytest.mark.usefixtures("cpu_only")
@pytest.mark.skipif(JAX_VERSION < (0, 10), reason="run on JAX 0.10; JAX 0.4.30's gloo CPU collectives aborted")
def test_shard_map_on_two_processes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import jax; jax.config.update('jax_cpu_collectives_implementation', 'gloo'); "
        f"jax.distributed.initialize('127.0.0.1:{port}', num_processes=2, process_id={{process}}); "
        "import test_lazy_kernel as t; t.check_sharded()"
    )
    outputs = run_python(code, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, processes=2)
    for i, out in enumerate(outputs):
        assert f"passed on 4 devices in process {i} of 2" in out


# -- real use: solvers, GPJax kernels, the README's examples ----------------------------


def test_gp_posterior_mean_by_cg_matches_cholesky():
    rng = np.random.default_rng(9)
    x, x_test = rng.uniform(size=(300, 2)), rng.uniform(size=(50, 2))
    y = np.sin(6 * x.sum(1)) + 0.1 * rng.normal(size=300)
    noise = 0.05
    op = LazyKernel(RBF(0.8, 1.7), jnp.asarray(x), jnp.asarray(x), batch_size=64, checkpoint=True)
    alpha, _ = jax.scipy.sparse.linalg.cg(lambda v: op @ v + noise * v, jnp.asarray(y), tol=1e-12, maxiter=2000)
    mean = LazyKernel(RBF(0.8, 1.7), jnp.asarray(x_test), jnp.asarray(x), batch_size=16) @ alpha

    chol = np.linalg.cholesky(dense_oracle(rbf_np, x, x) + noise * np.eye(300))
    want = dense_oracle(rbf_np, x_test, x) @ np.linalg.solve(chol.T, np.linalg.solve(chol, y))
    np.testing.assert_allclose(np.asarray(mean), want, atol=1e-7 * np.abs(want).max())


def test_lineax_cg_solve():
    lineax = pytest.importorskip("lineax", reason="lineax is in the 'interop' extra")
    rng = np.random.default_rng(10)
    x, y = jnp.asarray(rng.uniform(size=(200, 2))), jnp.asarray(rng.normal(size=200))
    op = LazyKernel(RBF(0.5, 1.0), x, x, batch_size=32)
    operator = lineax.FunctionLinearOperator(
        lambda v: op @ v + 0.1 * v, jax.ShapeDtypeStruct((200,), x.dtype), lineax.positive_semidefinite_tag
    )
    solution = lineax.linear_solve(operator, y, lineax.CG(rtol=1e-12, atol=1e-12, max_steps=2000)).value
    want = np.linalg.solve(dense_oracle(lambda a, b: rbf_np(a, b, 0.5, 1.0), x, x) + 0.1 * np.eye(200), y)
    np.testing.assert_allclose(np.asarray(solution), want, atol=1e-7 * np.abs(want).max())


def gpjax_np(name, x, y, lengthscale=0.7, variance=1.3):
    """NumPy twins of GPJax's RBF, Matern52 and RationalQuadratic (alpha = 1), from their definitions."""
    r = np.sqrt(np.sum((x - y) ** 2)) / lengthscale
    if name == "RBF":
        return variance * np.exp(-0.5 * r**2)
    if name == "Matern52":
        return variance * (1 + np.sqrt(5) * r + 5 * r**2 / 3) * np.exp(-np.sqrt(5) * r)
    return variance / (1 + 0.5 * r**2)


@pytest.mark.parametrize("dim", [2, 12])  # written out, and the GEMM form
@pytest.mark.parametrize("name", ["RBF", "Matern52", "RationalQuadratic"])
def test_gpjax_kernels_as_they_are(name, dim):
    gpjax = pytest.importorskip("gpjax", reason="gpjax is in the 'interop' extra")
    kernel = getattr(gpjax.kernels, name)(lengthscale=0.7, variance=1.3)
    rng = np.random.default_rng(11)
    x1, x2, v = (jnp.asarray(rng.normal(size=s)) for s in [(13, dim), (9, dim), (9,)])
    op = LazyKernel(kernel, x1, x2, batch_size=4, checkpoint=True)
    assert isinstance(kernel, lazy_kernel.CrossCovarianceKernel)
    assert "pair program" in repr(op) or jax.default_backend() != "cpu"  # GPJax's cross_covariance is a vmap
    oracle = dense_oracle(functools.partial(gpjax_np, name), x1, x2)
    dense = kernel.cross_covariance(x1, x2)  # GPJax's own dense matrix: the vmap form
    assert_close(dense, oracle, dense.dtype)
    assert_close(op @ v, oracle @ np.asarray(v), dense.dtype)
    assert_close(v @ op.T, np.asarray(v) @ oracle.T, dense.dtype)
    lazy_grad = jax.grad(lambda k: jnp.sum(jnp.sin(LazyKernel(k, x1, x2, batch_size=4, checkpoint=True) @ v)))(kernel)
    dense_grad = jax.grad(lambda k: jnp.sum(jnp.sin(k.cross_covariance(x1, x2) @ v)))(kernel)
    for got, want in zip(jax.tree_util.tree_leaves(lazy_grad), jax.tree_util.tree_leaves(dense_grad), strict=True):
        assert_close(got, want, dense.dtype)


def readme_python_blocks():
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "README.md")) as f:
        text = f.read()
    return [block.split("\n", 1)[1] for block in text.split("```")[1::2] if block.startswith("python\n")]


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_examples_run(index):
    code = readme_python_blocks()[index]
    for optional in ("lineax", "gpjax"):
        if f"import {optional}" in code:
            pytest.importorskip(optional, reason=f"{optional} is in the 'interop' extra")
    if "jax.shard_map" in code and not hasattr(jax, "shard_map"):
        pytest.skip(f"jax.shard_map is not in JAX {jax.__version__}")
    exec(compile(code, f"README.md python block {index}", "exec"), {})


# -- fast blocks for pair kernels: against the vmap form and the dense oracle ---------


def rbf_sum(x, y):
    """An RBF written the usual way, ``jnp.sum`` over the features (the GEMM form above 8 features)."""
    return 1.7 * jnp.exp(-0.5 * jnp.sum(((x - y) / 0.8) ** 2))


def polynomial(x, y):
    return (1.0 + jnp.dot(x, y) / 4) ** 2


def sorted_features(x, y):
    """A kernel with an equation the fast path does not know (sort): evaluated by vmap."""
    return jnp.exp(-jnp.sum(jnp.sort(jnp.abs(x - y)) * jnp.linspace(0.5, 1.0, x.shape[0], dtype=x.dtype)))


PAIR_KERNELS = {
    "rbf-sum": (rbf_sum, rbf_np),
    "skewed": (skewed, skewed_np),
    "laplace-partial": KERNELS["laplace-partial"],
    "polynomial": (polynomial, lambda x, y: (1.0 + np.dot(x, y) / 4) ** 2),
    "sorted": (
        sorted_features,
        lambda x, y: np.exp(-np.sum(np.sort(np.abs(x - y)) * np.linspace(0.5, 1.0, x.shape[0]))),
    ),
}


@given(
    m=st.integers(1, 9),
    n=st.integers(1, 9),
    dim=st.sampled_from([1, 2, 3, 8, 9, 20]),
    kernel_name=st.sampled_from(sorted(PAIR_KERNELS)),
    dtype=st.sampled_from([jnp.float32, jnp.float64]),
    seed=st.integers(0, 2**16),
)
def test_pair_program_blocks_match_vmap_and_dense(m, n, dim, kernel_name, dtype, seed, device):
    rng = np.random.default_rng(seed)
    kernel, kernel_np = PAIR_KERNELS[kernel_name]
    x1, x2 = points(rng, m, dim, dtype), points(rng, n, dim, dtype)
    fallbacks = []
    fast = jax.jit(lambda a, b: lazy_kernel._pair_program_block(kernel, a, b, fallbacks))(x1, x2)
    vmapped = lazy_kernel._vmap_block(kernel, x1, x2)
    dense = dense_oracle(kernel_np, x1, x2)
    assert fast.dtype == vmapped.dtype == dtype
    assert_close(fast, dense, dtype, scale=max(1, np.abs(dense).max()))
    assert_close(vmapped, dense, dtype, scale=max(1, np.abs(dense).max()))
    assert fallbacks == (["sort"] if kernel_name == "sorted" and m > 1 and n > 1 else [])  # on pairs only


@pytest.mark.parametrize(
    "kernel, kernel_np",
    [
        (lambda x, y: jnp.exp(-jnp.sum((x - y[0]) ** 2)), lambda x, y: np.exp(-np.sum((x - y[0]) ** 2))),
        (lambda x, y: jnp.exp(-jnp.dot((x - y) * 2.0, (x - y) / 2.0)), lambda x, y: np.exp(-np.dot(x - y, x - y))),
    ],
    ids=["vector minus scalar", "two scalings of one difference"],
)
def test_pair_program_keeps_near_misses_of_its_rules_apart(kernel, kernel_np):
    rng = np.random.default_rng(18)
    x1, x2 = points(rng, 6, 12, jnp.float64), points(rng, 5, 12, jnp.float64)
    got = lazy_kernel._pair_program_block(kernel, x1, x2, [])
    assert_close(got, dense_oracle(kernel_np, x1, x2), jnp.float64)
    assert_close(got, lazy_kernel._vmap_block(kernel, x1, x2), jnp.float64)


@pytest.mark.parametrize("dim", [3, 20])  # written out below 9 features, GEMM form above
def test_pair_program_is_accurate_far_from_the_origin(dim):
    rng = np.random.default_rng(12)
    offset = rng.uniform(-2e3, 2e3, size=dim)
    x1 = (rng.normal(size=(30, dim)) + offset).astype(np.float32)
    x2 = (rng.normal(size=(20, dim)) + offset).astype(np.float32)
    x1[:5] = x2[:5]  # some pairs at distance zero
    got = lazy_kernel._pair_program_block(rbf_sum, jnp.asarray(x1), jnp.asarray(x2), [])
    want = dense_oracle(rbf_np, x1, x2)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5 * 1.7)
    # at distance zero: exact when written out; the GEMM form leaves about eps * D of the squared norms
    np.testing.assert_allclose(np.diag(np.asarray(got[:5, :5], np.float64)), 1.7, rtol=1e-6 if dim < 9 else 1e-5)


def test_block_evaluation_says_which_path(device):
    on_cpu = jax.default_backend() == "cpu"
    assert lazy_kernel.block_evaluation(RBF(), 3) == "cross_covariance"
    assert lazy_kernel.block_evaluation(rbf_sum, 3) == ("pair program" if on_cpu else "vmap")
    assert lazy_kernel.block_evaluation(sorted_features, 3) == ("pair program (by vmap: sort)" if on_cpu else "vmap")

    class VmapCrossCovariance:  # a cross_covariance that is only a vmap of the pair call, as GPJax's
        __call__ = staticmethod(rbf_sum)

        def cross_covariance(self, a, b):
            return jax.vmap(jax.vmap(self, (None, 0)), (0, None))(a, b)

    assert lazy_kernel.block_evaluation(VmapCrossCovariance(), 3) == ("pair program" if on_cpu else "vmap")
    x = jnp.zeros((4, 3))
    assert "blocks='pair program'" in repr(LazyKernel(rbf_sum, x, x)) or not on_cpu


def pair_kernel_of(name, ls, var):
    """A pair kernel closing over (possibly traced) hyperparameters, as users write them."""
    if name == "laplace":
        return lambda x, y: var * jnp.exp(-jnp.sum(jnp.abs(x - y) / ls))
    return lambda x, y: var * jnp.exp(-0.5 * jnp.sum(((x - y) / ls) ** 2))


def pair_dense_jnp(name, x1, x2, ls, var):
    """The same matrix by broadcasting: the derivative oracle."""
    diff = (x1[:, None] - x2[None]) / ls
    if name == "laplace":
        return var * jnp.exp(-jnp.sum(jnp.abs(diff), -1))
    return var * jnp.exp(-0.5 * jnp.sum(diff**2, -1))


@pytest.mark.parametrize("name, dim", [("rbf", 3), ("rbf", 12), ("laplace", 3)])
def test_pair_program_derivatives_match_dense(name, dim):
    rng = np.random.default_rng(13)
    x1, x2 = points(rng, 11, dim, jnp.float64), points(rng, 7, dim, jnp.float64)
    v, w = jnp.asarray(rng.normal(size=7)), jnp.asarray(rng.normal(size=11))
    ls, var = jnp.asarray(rng.uniform(0.8, 1.5, size=dim)), jnp.array(1.3)

    def lazy_loss(x1, x2, v, ls, var):
        op = LazyKernel(pair_kernel_of(name, ls, var), x1, x2, batch_size=3, checkpoint=True)
        return jnp.sum(jnp.sin(op @ v)) + jnp.sum(jnp.cos(w @ op))

    def dense_loss(x1, x2, v, ls, var):
        k = pair_dense_jnp(name, x1, x2, ls, var)
        return jnp.sum(jnp.sin(k @ v)) + jnp.sum(jnp.cos(w @ k))

    args = (x1, x2, v, ls, var)
    assert_close(lazy_loss(*args), dense_loss(*args), jnp.float64)
    for got, want in zip(
        jax.jit(jax.grad(lazy_loss, argnums=range(5)))(*args),
        jax.grad(dense_loss, argnums=range(5))(*args),
        strict=True,
    ):
        assert_close(got, want, jnp.float64)
    tangents = tuple(jnp.asarray(rng.normal(size=a.shape)) for a in args)
    assert_close(jax.jvp(lazy_loss, args, tangents)[1], jax.jvp(dense_loss, args, tangents)[1], jnp.float64)
    hessian = jax.hessian(lazy_loss, argnums=3)(*args)  # second derivatives in the lengthscales
    assert_close(hessian, jax.hessian(dense_loss, argnums=3)(*args), jnp.float64)
    vs = jnp.asarray(rng.normal(size=(3, 7)))
    batched = jax.vmap(lambda v: LazyKernel(pair_kernel_of(name, ls, var), x1, x2, batch_size=4) @ v)(vs)
    assert_close(batched, vs @ np.asarray(pair_dense_jnp(name, x1, x2, ls, var)).T, jnp.float64)


# -- the memory budget: XLA's accounting of the real peak --------------------------------


def gaussian_pair(x, y):
    return jnp.exp(-0.5 * jnp.sum((x - y) ** 2))


def memory_kernel(name, dim):
    if name == "pair":
        return gaussian_pair
    if name == "partial":
        return functools.partial(scaled_laplace, scale=1.3)
    if name == "gemm-rbf":
        return RBF(jnp.float32(0.8), jnp.float32(1.7))
    gpjax = pytest.importorskip("gpjax", reason="gpjax is in the 'interop' extra")
    if name == "gpjax-rbf":
        return gpjax.kernels.RBF(lengthscale=jnp.linspace(0.5, 1.5, dim, dtype=jnp.float32))
    return gpjax.kernels.Matern52(lengthscale=jnp.float32(0.7))


@pytest.mark.parametrize("budget_mb", [0.25, 1.0])
@pytest.mark.parametrize("dim", [1, 3, 16, 64])
@pytest.mark.parametrize("kernel_name", ["pair", "partial", "gemm-rbf", "gpjax-rbf", "gpjax-matern52"])
def test_budget_bounds_the_peak(kernel_name, dim, budget_mb, device):
    """XLA's temporaries at the block chosen <= budget + twice the data (the data and their cotangents)."""
    m, n = 307, 211  # primes: no block divides them
    rng = np.random.default_rng(14)
    x1, x2 = points(rng, m, dim, jnp.float32), points(rng, n, dim, jnp.float32)
    v, w = points(rng, n, 1, jnp.float32)[:, 0], points(rng, m, 1, jnp.float32)[:, 0]
    kernel = memory_kernel(kernel_name, dim)
    budget = budget_mb * 2**20
    leaves, treedef = jax.tree_util.tree_flatten(kernel)
    is_param = [isinstance(leaf, (jax.Array, float)) for leaf in leaves]
    params = [jnp.asarray(leaf, jnp.float32) for leaf, p in zip(leaves, is_param, strict=True) if p]  # hyperparameters

    def lazy(params, x1, x2, checkpoint, rows):
        settings = dict(batch_size=rows) if rows else dict(max_memory_mb=budget_mb)
        it = iter(params)
        kernel = treedef.unflatten([next(it) if p else leaf for leaf, p in zip(leaves, is_param, strict=True)])
        return LazyKernel(kernel, x1, x2, checkpoint=checkpoint, **settings)

    def programs(rows):
        def loss(kernel, x1, x2, v):
            return jnp.sum(lazy(kernel, x1, x2, True, rows) @ v)

        right = lambda kernel, x1, x2, v: lazy(kernel, x1, x2, False, rows) @ v  # noqa: E731
        left = lambda kernel, x1, x2, w: w @ lazy(kernel, x1, x2, False, rows)  # noqa: E731
        return [
            (right, v),
            (left, w),
            (jax.grad(loss, argnums=(1, 3)), v),
            (jax.grad(loss, argnums=(2, 3)), v),
            (jax.grad(loss, argnums=(0, 1, 2, 3)), v),
        ]

    chosen = [temp_bytes(f, params, x1, x2, operand) for f, operand in programs(None)]
    data = sum(a.nbytes for a in [*params, x1, x2]) + (m + n) * 4  # the operand and the result
    for name, got in zip(["K @ v", "w @ K", "grad x1, v", "grad x2, v", "grad all"], chosen, strict=True):
        assert got <= budget + 2 * data, (name, got / 2**20, data / 2**20)
    forward, gradient = lazy(params, x1, x2, False, None), lazy(params, x1, x2, True, None)
    assert forward.block_rows <= forward.batch_size_row and forward.block_cols <= forward.batch_size_col
    assert gradient.block_rows <= forward.block_rows
    # what memory() reports is what XLA needs (its programs differ from these in their inputs only)
    assert forward.memory().peak_mb * 2**20 == pytest.approx(chosen[0], rel=0.05)
    assert gradient.memory().peak_mb * 2**20 == pytest.approx(max(chosen[2:]), rel=0.05)


def many_intermediates(x, y):
    """A kernel whose gradient keeps several [rows, N] arrays per row: more than the data on one feature."""
    d = x - y
    return jnp.sum(jnp.exp(-jnp.abs(d)) * jnp.cos(d) + jnp.sin(d) ** 2 + jnp.tanh(d) * jnp.log1p(d * d))


def test_one_row_over_the_budget_is_said_once():
    x1, x2 = jnp.zeros((53, 1), jnp.float32), jnp.zeros((5300, 1), jnp.float32)
    op = LazyKernel(many_intermediates, x1, x2, max_memory_mb=1e-4, checkpoint=True)
    with pytest.warns(UserWarning, match=r"one row of a block needs [0-9.e-]+ MiB .*max_memory_mb=0.0001 plus"):
        assert op.block_rows == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = LazyKernel(many_intermediates, x1, x2, max_memory_mb=1e-4, checkpoint=True)
        assert again.block_rows == 1  # measured once, cached


def test_differentiating_without_checkpoint_warns():
    rng = np.random.default_rng(15)
    x, v = points(rng, 20, 2, jnp.float32), points(rng, 20, 1, jnp.float32)[:, 0]
    loss = lambda v, checkpoint: jnp.sum(LazyKernel(RBF(), x, x, batch_size=8, checkpoint=checkpoint) @ v)  # noqa: E731
    with pytest.warns(UserWarning, match=r"checkpoint=False is differentiated.*whole matrix"):
        jax.grad(loss)(v, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.grad(loss)(v, True)
        loss(v, False)


def test_measurements_are_cached_across_traces():
    rng = np.random.default_rng(16)
    x, v = points(rng, 40, 2, jnp.float32), points(rng, 40, 1, jnp.float32)[:, 0]
    before = len(lazy_kernel._MEMORY)
    for _ in range(2):  # a fresh closure over a traced hyperparameter, traced anew: as in training loops
        product = jax.jit(
            lambda s, x, v: LazyKernel(lambda a, b: scaled_laplace(a, b, s), x, x, max_memory_mb=0.01) @ v
        )
        product(1.5, x, v)
    assert len(lazy_kernel._MEMORY) == before + 1


def test_budget_under_vmap_is_per_example():
    rng = np.random.default_rng(17)
    xs, vs = points(rng, 3 * 60, 2, jnp.float32).reshape(3, 60, 2), points(rng, 3 * 60, 1, jnp.float32).reshape(3, 60)
    blocks = []

    def product(x, v):
        op = LazyKernel(gaussian_pair, x, x, max_memory_mb=0.01)
        blocks.append(op.block_rows)
        return op @ v

    jax.vmap(product)(xs, vs)
    assert blocks == [LazyKernel(gaussian_pair, xs[0], xs[0], max_memory_mb=0.01).block_rows]
