"""Benchmark LazyKernel: users' kernels against the module's RBF, the inexact GEMM form and a ceiling.

    python bench_lazy_kernel.py --kernels 8192   # speed: K @ v and the checkpointed gradient, D = 3 to 256
    python bench_lazy_kernel.py --real           # the GP gradient on scikit-learn's data sets (the 'real' extra)
    python bench_lazy_kernel.py --first-use 3000 # what measuring a block costs against the compile it guards
    python bench_lazy_kernel.py --eager 3000     # K @ v and v @ K outside jit against the jitted call
    python bench_lazy_kernel.py --split 8192     # feature sums written out against a loop, by D
    python bench_lazy_kernel.py --blocks 16384   # K @ v and v @ K by block size
    python bench_lazy_kernel.py --sides 8192     # both sides (K @ X, X @ K, gradients) for every form of block
    python bench_lazy_kernel.py --gemm 8192      # squared distances by GEMM against the loop, D = 64 to 256
    python bench_lazy_kernel.py --wide 8192      # float32 distances by the float64 GEMM, by D, x64 off and on
    python bench_lazy_kernel.py --chunks 8192    # the loop over features by sum_chunk
    python bench_lazy_kernel.py --precision 32768  # K @ X's contraction at HIGHEST against JAX's default, by width
    python bench_lazy_kernel.py --accelerator 32768  # off the CPU: --kernels at N for every D
    python bench_lazy_kernel.py --accelerator-blocks 32768  # off the CPU: blocks by size, D = 3 to 256
    python bench_lazy_kernel.py --accelerator-features 32768  # off the CPU: features written out against vmap
    python bench_lazy_kernel.py --fused 32768    # off the CPU: fused products (one lengthscale) by D
    python bench_lazy_kernel.py --fused-gradient 16384  # off the CPU: their checkpointed gradients by D
        (either with --per-feature: a lengthscale per feature; --dims 16,64: those D; --only RBF,Matern: those
        kernels; --first-use takes --dims and --only too; --fused and --fused-gradient take --columns 16,128,512)
    python bench_lazy_kernel.py ... --set fused_width_max=512   # any mode, with a field of lazy_kernel.SETTINGS set
    python bench_lazy_kernel.py                  # all ten at those sizes (not the accelerator tables)

The fields of lazy_kernel.SETTINGS, and what these modes measured for them:

    split_features_max = 2        --split: from 3 features the loop was faster than features written out
    sum_chunk = 4                 --chunks: features summed pairwise per step of the loop
    wide_gemm_features_min = 8    --wide: at D = 4 the loop's K @ v was faster than the float64 GEMM, at 8 slower
    gemm_features_min = 128       --gemm: at D = 64 random points had 2.2 pairs per row the GEMM cannot vouch
                                  for, so every block fell back to the loop, and took 1.2x the loop's time
    cpu_block_bytes = 4 MiB       --blocks: cache-sized blocks beat larger ones; cpu_min_block = 64: 16 rows slower
    accelerator_features = 2..64  --accelerator-features (TPU v5e, N = 32768): RBF's K @ v took the vmap form's
                                  time times 0.61, 0.63 at D = 2, 3; 0.58 at 8; 0.72 at 16; 0.90 at 32 (Matern52's
                                  0.58 to 0.96); the same at 1 and 4; 0.75, 0.76 at 48, 64 (in 256 MiB blocks)
    accelerator_block_bytes = 64 MiB   --accelerator-blocks (TPU v5e, N = 32768): 512-row blocks took RBF's K @ v
                                  0.48x the time of 8192-row ones at D = 3, 0.86x at 16, 0.97x at 256, its
                                  gradient 0.58x at D = 3; the vmap form's 2048-row blocks 1.05x 512-row ones at 64
    accelerator_wide_block_bytes = 256 MiB  the same, blocks the pair program writes out, against 64 MiB: K @ v
                                  0.92x the time at D = 3, 8, 16 (N = 32768), 0.90x-0.92x at 48, 64 (RBF, GPJax RBF,
                                  Matern52, Laplace), 0.90x at 256 (N = 65536; 1.03x at 32768); the gradient by the
                                  GEMM (half the bytes) 0.94x at 256; at D = 3 (vmap derivatives) 2x rows took 1.45x
    fused_features_min = 16       --fused (TPU v5e): at D = 3 the unfused form took 0.24x the fused one's time
    fused_backward_features_max = 127  --fused-gradient's programs (v5e, N = 16384), the setting moved: at D = 96
                                  the fused backward took 2.85x the GEMM RBF's gradient (per feature 3.63x), the
                                  vmap form's derivatives 8.93x; at 256 the fused backward 6.26x, the unfused vjp
                                  1.31x; at 64 per feature 2.75x (45 s to compile), the unfused vjp 6.82x (37 s)
    fused_width_max = 512         --fused --columns 128,512 (v5e, N = 32768): fused K @ X at 128 and 512 columns
                                  took 0.65x to 1.08x the GEMM RBF's time, the unfused form 1.04x to 3.48x
    the pair program's own derivatives (TPU v5e): one gradient of its block compiled for minutes, and at D = 8
                                  ran 3.3x the vmap form's time; so its blocks differentiate as the vmap form

GPJax comes from the 'interop' extra, scikit-learn from the 'real' extra.
Everything a table compares runs in this one process on the same data
(float32), timed round-robin so that load drifting on a shared machine hits
all cases alike; each row is a median. Not a test: times depend on the
machine; compare ratios within one run.
"""

import argparse
import ast
import concurrent.futures
import functools
import itertools
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import lazy_kernel
from lazy_kernel import RBF, LazyKernel


def median_times(functions, args, budget_s=20.0):
    """Median seconds of each jitted function on ``args``, run round-robin (3 to 9 rounds). Traced one at a time
    (tracing may change ``lazy_kernel.SETTINGS``), compiled in parallel."""
    lowered = [jax.jit(f).lower(*args) for f in functions]
    with concurrent.futures.ThreadPoolExecutor() as pool:
        compiled = list(pool.map(lambda program: program.compile(), lowered))
    for f in compiled:
        jax.block_until_ready(f(*args))
    times = [[] for _ in compiled]
    start = time.perf_counter()
    while len(times[0]) < 3 or (len(times[0]) < 9 and time.perf_counter() - start < budget_s):
        for f, t in zip(compiled, times, strict=True):
            begin = time.perf_counter()
            jax.block_until_ready(f(*args))
            t.append(time.perf_counter() - begin)
    return [float(np.median(t)) for t in times]


class GemmRBF:
    """The squared-distance GEMM form (``|a|^2 + |b|^2 - 2 a.b``) with no repair: fast, inexact for near pairs;
    a speed reference only."""

    def __init__(self, lengthscale):
        self.lengthscale = lengthscale

    def __call__(self, x, y):
        return 1.3 * jnp.exp(-0.5 * jnp.sum(((x - y) / self.lengthscale) ** 2))

    def cross_covariance(self, x1, x2):
        offset = jnp.mean(x2, axis=0)
        a, b = (x1 - offset) / self.lengthscale, (x2 - offset) / self.lengthscale
        half_a, half_b = -0.5 * jnp.sum(a.T**2, axis=0)[:, None], -0.5 * jnp.sum(b.T**2, axis=0)[:, None]
        a = jnp.concatenate([a, half_a, jnp.ones_like(half_a)], axis=1)
        b = jnp.concatenate([b, jnp.ones_like(half_b), half_b], axis=1)
        product = jnp.matmul(a, b.T, precision=jax.lax.Precision.HIGHEST)
        return 1.3 * jnp.exp(jnp.minimum(product, 0.0))


jax.tree_util.register_pytree_node(GemmRBF, lambda k: ((k.lengthscale,), None), lambda _, c: GemmRBF(*c))


class VmapForm:
    """A kernel whose blocks are the vmap form, as GPJax computes them (and the pair program must beat)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, x, y):
        return self.kernel(x, y)

    def cross_covariance(self, x1, x2):
        return lazy_kernel._vmap_block(self.kernel, x1, x2) * 1  # "* 1": not a bare vmap, so it is used


jax.tree_util.register_pytree_node(VmapForm, lambda k: ((k.kernel,), None), lambda _, c: VmapForm(*c))


REFERENCE = "inexact GEMM RBF (reference)"  # what the speed tables divide by


def kernels(gpjax):
    """Each kernel made from its lengthscales (one per feature): the module's, users', the references."""
    found = {
        "lazy_kernel.RBF": lambda ls: RBF(ls, jnp.float32(1.3)),
        REFERENCE: GemmRBF,
        "pair: jnp.sum RBF": lambda ls: lambda x, y: 1.3 * jnp.exp(-0.5 * jnp.sum(((x - y) / ls) ** 2)),
        "pair: Laplace": lambda ls: lambda x, y: jnp.exp(-jnp.sum(jnp.abs(x - y) / ls)),
    }
    if gpjax is not None:
        found["GPJax RBF"] = lambda ls: gpjax.kernels.RBF(lengthscale=ls, variance=1.3)
        found["GPJax Matern52"] = lambda ls: gpjax.kernels.Matern52(lengthscale=ls, variance=1.3)
        found["GPJax RBF, vmap form"] = lambda ls: VmapForm(gpjax.kernels.RBF(lengthscale=ls, variance=1.3))
    return found


def ceiling(n, rows):
    """exp + matvec over [rows, n] blocks of values generated in place, nothing read from memory: no kernel
    evaluation can beat it."""

    def run(_, v):
        def body(i, out):  # i in the values keeps XLA from computing one block for all
            values = jax.lax.broadcasted_iota(jnp.float32, (rows, n), 0) * 1e-4
            values += jax.lax.broadcasted_iota(jnp.float32, (rows, n), 1) * 1e-5
            start = jnp.minimum(i * rows, n - rows)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.exp(-values * (1 + i * 1e-7)) @ v, start, 0)

        return jax.lax.fori_loop(0, -(-n // rows), body, jnp.zeros(n, jnp.float32))

    return run


def lengthscales(dim):
    return jnp.linspace(0.5, 1.5, dim, dtype=jnp.float32) * jnp.float32(np.sqrt(dim / 3))  # float32 with x64 on


def products(makes):
    """``(ls, x, v) -> K @ v`` for each kernel made from per-feature lengthscales."""
    return [lambda ls, x, v, make=make: LazyKernel(make(ls), x, x) @ v for make in makes]


def gradients(makes):
    """``(ls, x, v) ->`` the checkpointed gradient of sum(sin(K @ v)) w.r.t. all three, for each kernel."""
    loss = lambda ls, x, v, make: jnp.sum(jnp.sin(LazyKernel(make(ls), x, x, checkpoint=True) @ v))  # noqa: E731
    return [jax.grad(functools.partial(loss, make=make), argnums=(0, 1, 2)) for make in makes]


def forward_seconds(made, x, v):
    """Median seconds of K @ v for each kernel made from per-feature lengthscales, round-robin with the
    ceiling on the same blocks; and those blocks' rows."""
    ls = lengthscales(x.shape[1])
    rows = LazyKernel(RBF(ls), x, x).block_rows
    seconds = median_times([*products(made.values()), lambda ls, x, v: ceiling(x.shape[0], rows)(x, v)], (ls, x, v))
    return seconds[:-1], seconds[-1], rows


def gradient_seconds(made, x, v):
    """Median seconds of the checkpointed gradient of sum(sin(K @ v)) (lengthscales, points, v), round-robin."""
    return median_times(gradients(made.values()), (lengthscales(x.shape[1]), x, v))


def kernels_table(n, gpjax, halved_at_256=True):
    print(f"\n## Speed, float32, ratios to the inexact GEMM RBF in the same run: K @ v at M = N = {n}, the")
    print(f"## checkpointed gradient of sum(sin(K @ v)) (lengthscales, points, v) at M = N = {n // 2}")
    print("## (at D = 256 half of each)\n" if halved_at_256 else "")
    print("| kernel | D | K @ v, ms | ratio | checkpointed gradient, ms | ratio |")
    print("|---|---|---|---|---|---|")
    made = kernels(gpjax)
    reference = list(made).index(REFERENCE)
    for dim in (3, 16, 64, 256):
        rng = np.random.default_rng(0)
        size = n if dim < 256 or not halved_at_256 else n // 2
        x = jnp.asarray(rng.normal(size=(size, dim)), jnp.float32)
        v = jnp.asarray(rng.normal(size=size), jnp.float32)
        forward_s, ceiling_s, rows = forward_seconds(made, x, v)
        gradient_s = gradient_seconds(made, x[: size // 2], v[: size // 2])
        for i, name in enumerate(made):
            print(
                f"| {name} | {dim} | {forward_s[i] * 1e3:.1f} | {forward_s[i] / forward_s[reference]:.2f} "
                f"| {gradient_s[i] * 1e3:.1f} | {gradient_s[i] / gradient_s[reference]:.2f} |",
                flush=True,
            )
        print(
            f"| ceiling: exp + matvec on {rows}-row blocks | {dim} | {ceiling_s * 1e3:.1f} "
            f"| lazy_kernel.RBF at {ceiling_s / forward_s[0]:.2f} of it | | |",
            flush=True,
        )


def real_sets(npz):
    """name -> points: scikit-learn's bundled data sets, or the arrays of an .npz saved from them (digits,
    breast_cancer, diabetes) for a machine without scikit-learn; None where neither is there."""
    if npz:
        return {name.replace("_", " "): data for name, data in np.load(npz).items()}
    try:
        from sklearn import datasets
    except ImportError:
        return None
    return {name: getattr(datasets, f"load_{name.replace(' ', '_')}")().data for name in REAL_SETS}


REAL_SETS = ("digits", "breast cancer", "diabetes")


def real_table(gpjax, npz=None):
    """The GP gradient on scikit-learn's bundled data sets (standardised), ratios to the inexact GEMM RBF."""
    sets = real_sets(npz)
    if sets is None:
        print("\nscikit-learn is not installed: no real-data table")
        return
    print("\n## Real data (scikit-learn, standardised), float32: the checkpointed gradient of sum(sin(K @ v))")
    print("## (lengthscales, points, v), ratios to the inexact GEMM RBF in the same run\n")
    print("| data | N x D | kernel | gradient, ms | ratio |")
    print("|---|---|---|---|---|")
    made = kernels(gpjax)
    reference = list(made).index(REFERENCE)
    for name, data in sets.items():
        data = (data - data.mean(0)) / np.maximum(data.std(0), 1e-12)
        x = jnp.asarray(data, jnp.float32)
        gradient_s = gradient_seconds(made, x, jnp.asarray(np.random.default_rng(0).normal(size=len(x)), jnp.float32))
        for i, kernel in enumerate(made):
            print(
                f"| {name} | {data.shape[0]} x {data.shape[1]} | {kernel} | {gradient_s[i] * 1e3:.1f} "
                f"| {gradient_s[i] / gradient_s[reference]:.2f} |",
                flush=True,
            )


def first_call_seconds(f, *args):
    begin = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - begin


def first_use_table(n, gpjax, only=None, dims=(3, 16), repeats=3):
    """The first call of a program whose block is measured against the same program with that block given.

    The difference is what measuring costs; each call meets a new shape (nothing cached), and each row is a
    median over ``repeats`` shapes.
    """
    print(f"\n## First use: M = N = about {n}, float32, a new shape for every call (nothing cached);")
    print(f"## medians over {repeats} shapes. The program: jit(K @ v), or with checkpoint=True")
    print("## jit(grad(sum(K @ v))) with respect to the lengthscale, x and v\n")
    print("| kernel | D | checkpoint | first call, block given, s | first call, block measured, s ", end="")
    print("| measuring: extra, s | extra / given |")
    print("|---|---|---|---|---|---|---|")
    made = {
        "closure Laplace": lambda s: lambda x, y: jnp.exp(-jnp.sum(jnp.abs(x - y)) / s),
        "lazy_kernel.RBF": lambda s: RBF(s),
    }
    if gpjax is not None:
        made["GPJax Matern52"] = lambda s: gpjax.kernels.Matern52(lengthscale=s)
    made = {name: make for name, make in made.items() if only is None or any(s in name for s in only)}
    wrt = ("kernel", "x1", "x2", "operand")

    def program(make, checkpoint, batch_size):
        def product(s, x, v):
            return LazyKernel(make(s), x, x, batch_size=batch_size, checkpoint=checkpoint) @ v

        return jax.jit(jax.grad(lambda *a: jnp.sum(product(*a)), argnums=(0, 1, 2)) if checkpoint else product)

    size = n
    for name, make in made.items():
        for dim in dims:
            for checkpoint in (True, False):
                given, measured = [], []
                for _ in range(repeats + 1):  # the first round warms up what every first call shares
                    size += 1
                    x = jnp.asarray(np.random.default_rng(size).normal(size=(size, dim)), jnp.float32)
                    v, s = jnp.ones(size, jnp.float32), jnp.float32(1.3)
                    measured.append(first_call_seconds(program(make, checkpoint, None), s, x, v))
                    op = LazyKernel(make(s), x, x, checkpoint=checkpoint)
                    rows = op.measure(wrt=wrt).rows if checkpoint else op.block_rows  # cached: nothing compiled
                    given.append(first_call_seconds(program(make, checkpoint, rows), s, x, v))
                given_s, measured_s = np.median(given[1:]), np.median(measured[1:])
                extra = np.median(np.subtract(measured[1:], given[1:]))
                print(
                    f"| {name} | {dim} | {checkpoint} | {given_s:.2f} | {measured_s:.2f} | {extra:.2f} "
                    f"| {extra / given_s:.2f} |",
                    flush=True,
                )


def eager_table(n, gpjax, rounds=15):
    """``K @ v`` and ``v @ K`` called outside ``jit`` (after the first call) against the same call jitted: medians
    of ``rounds``, round-robin, each call on an operator made anew from the same arrays."""
    print(f"\n## Outside jit: M = N = {n}, float32, medians of {rounds} calls round-robin after the first call\n")
    print("| kernel | D | K @ v jitted, ms | outside jit, ms | ratio | v @ K jitted, ms | outside jit, ms | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    made = {"lazy_kernel.RBF": lambda s: RBF(s), "pair Laplace": lambda s: jax.tree_util.Partial(laplace_pair, scale=s)}
    if gpjax is not None:
        made["GPJax Matern52"] = lambda s: gpjax.kernels.Matern52(lengthscale=s)
    calls = {  # (side, jitted): the call on an operator and v
        ("right", True): jax.jit(lambda op, v: op @ v),
        ("right", False): lambda op, v: op @ v,
        ("left", True): jax.jit(lambda op, v: v @ op),
        ("left", False): lambda op, v: v @ op,
    }
    for name, make in made.items():
        for dim in (3, 16):
            x = jnp.asarray(np.random.default_rng(dim).normal(size=(n, dim)), jnp.float32)
            v, s = jnp.ones(n, jnp.float32), jnp.float32(1.3)
            times = {case: [] for case in calls}
            for _ in range(rounds + 1):  # the first round compiles
                for case, call in calls.items():
                    begin = time.perf_counter()
                    jax.block_until_ready(call(LazyKernel(make(s), x, x), v))
                    times[case].append(time.perf_counter() - begin)
            ms = {case: np.median(t[1:]) * 1e3 for case, t in times.items()}
            sides = [
                f"{ms[side, True]:.2f} | {ms[side, False]:.2f} | {ms[side, False] / ms[side, True]:.2f}"
                for side in ("right", "left")
            ]
            print(f"| {name} | {dim} | {' | '.join(sides)} |", flush=True)


def laplace_pair(x, y, scale):
    return jnp.exp(-jnp.sum(jnp.abs(x - y)) / scale)


def split_table(n):
    """A pair kernel's feature sums written out (split) or in a loop over features, by D: K @ v, the
    checkpointed gradient, and that gradient's first call (mostly compile)."""
    print("\n## Feature sums written out against a loop over features, pair RBF, float32; each cell: written")
    print("## out, loop (ratio)\n")
    print(f"| D | K @ v at M = N = {n}, ms | checkpointed gradient at M = N = {n // 2}, ms ", end="")
    print("| the gradient's first call at M = N = 1000, s |")
    print("|---|---|---|---|")

    def kernel(a, b):
        return jnp.exp(-jnp.sum((a - b) ** 2))

    def product(x, v):
        return LazyKernel(kernel, x, x) @ v

    gradient = jax.grad(lambda x, v: jnp.sum(jnp.sin(LazyKernel(kernel, x, x, checkpoint=True) @ v)), argnums=(0, 1))
    for dim in (2, 3, 4, 16, 64):
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(n, dim)), jnp.float32)
        v = jnp.asarray(rng.normal(size=n), jnp.float32)
        forms = (dim, 0)  # split_features_max: every feature sum written out, or none
        half = (x[: n // 2], v[: n // 2])
        forward = median_times([traced_with(product, split_features_max=s) for s in forms], (x, v))
        backward = median_times([traced_with(gradient, split_features_max=s) for s in forms], half)
        first = []
        for split in forms:
            begin = time.perf_counter()
            jax.block_until_ready(jax.jit(traced_with(gradient, split_features_max=split))(x[:1000], v[:1000]))
            first.append(time.perf_counter() - begin)
        cells = [f"{a * 1e3:.0f}, {b * 1e3:.0f} ({a / b:.2f})" for a, b in (forward, backward)]
        print(
            f"| {dim} | {' | '.join(cells)} | {first[0]:.2f}, {first[1]:.2f} ({first[0] / first[1]:.2f}) |", flush=True
        )


def traced_with(f, **switches):
    """``f`` traced with ``lazy_kernel.SETTINGS`` (read while tracing) changed by ``switches``."""

    def traced(*args):
        original = lazy_kernel.SETTINGS
        try:
            lazy_kernel.SETTINGS = original.replace(**switches)
            return f(*args)
        finally:
            lazy_kernel.SETTINGS = original

    return traced


def blocks_table(n):
    print(f"\n## By block size, lazy_kernel.RBF, M = N = {n}, D = 3, float32\n")
    print("| rows (columns) per block | MiB per block | K @ v, ms | v @ K, ms |")
    print("|---|---|---|---|")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    v = jnp.asarray(rng.normal(size=n), jnp.float32)
    sizes = [16, 64, 256, 1024, 4096]
    right = [lambda x, v, rows=rows: LazyKernel(RBF(0.7), x, x, batch_size=rows) @ v for rows in sizes]
    left = [lambda x, v, rows=rows: v @ LazyKernel(RBF(0.7), x, x, batch_size=rows) for rows in sizes]
    seconds = median_times(right + left, (x, v))
    for i, rows in enumerate(sizes):
        print(
            f"| {rows} | {rows * n * 4 / 2**20:.1f} | {seconds[i] * 1e3:.0f} | {seconds[len(sizes) + i] * 1e3:.0f} |",
            flush=True,
        )


def side_kinds(gpjax):
    """Kernels of every form a block takes (made from lengthscales, one per feature), each with the switches it is
    traced under: name -> (make, switches)."""
    kinds = {
        "vmap form (RBF, pair_program = False)": (lambda ls: RBF(ls, jnp.float32(1.3)), {"pair_program": False}),
        "per-feature RBF (pair program; fused on a TPU from D = 16)": (lambda ls: RBF(ls, jnp.float32(1.3)), {}),
        "per-feature RBF, fused_product = False": (lambda ls: RBF(ls, jnp.float32(1.3)), {"fused_product": False}),
        "cross_covariance (inexact GEMM RBF)": (GemmRBF, {}),
        "one lengthscale (RBF; fused on a TPU from D = 16)": (lambda ls: RBF(jnp.mean(ls), jnp.float32(1.3)), {}),
    }
    if gpjax is not None:
        kinds["GPJax Matern52"] = (lambda ls: gpjax.kernels.Matern52(lengthscale=ls, variance=1.3), {})
    return kinds


def sides_table(n, gpjax, dims=(3, 16, 64)):
    """Both sides of the product for every form a block takes: K @ v against v @ K, K @ X against X @ K (16
    columns) and their checkpointed gradients (of sum(sin(.)) in the lengthscales, points and operand), so that a
    change that slows one side shows."""
    print(f"\n## Both sides, float32: products at M = N = {n}, gradients at {n // 2}; ms, and left / right\n")
    print("| kernel | D | K @ v, v @ K | K @ X, X @ K (16 columns) | gradients of K @ v, v @ K |")
    print("|---|---|---|---|---|")
    right = lambda make: lambda ls, x, r: LazyKernel(make(ls), x, x) @ r  # noqa: E731
    left = lambda make: lambda ls, x, r: r.T @ LazyKernel(make(ls), x, x)  # noqa: E731

    def gradient(product):
        return jax.grad(lambda ls, x, r: jnp.sum(jnp.sin(product(ls, x, r))), argnums=(0, 1, 2))

    def checkpointed(make):
        return lambda ls, x, r: LazyKernel(make(ls), x, x, checkpoint=True) @ r

    def checkpointed_left(make):
        return lambda ls, x, r: r.T @ LazyKernel(make(ls), x, x, checkpoint=True)

    for dim in dims:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(n, dim)), jnp.float32)
        v, wide = (jnp.asarray(rng.normal(size=(n, k)), jnp.float32) for k in (1, 16))
        ls = lengthscales(dim)
        for name, (make, switches) in side_kinds(gpjax).items():
            cells = []
            for forms, args in (
                ((right(make), left(make)), (ls, x, v)),
                ((right(make), left(make)), (ls, x, wide)),
                ((gradient(checkpointed(make)), gradient(checkpointed_left(make))), (ls, x[: n // 2], v[: n // 2])),
            ):
                a, b = median_times([traced_with(f, **switches) for f in forms], args)
                cells.append(f"{a * 1e3:.1f}, {b * 1e3:.1f} ({b / a:.2f})")
            print(f"| {name} | {dim} | {' | '.join(cells)} |", flush=True)


def unvouched_per_row(x, ls):
    """Pairs per row (mean) whose GEMM d^2 the module cannot vouch for: d^2 < (|a|^2 + |b|^2) / 2, on points
    centred and scaled, here in float64."""
    a = (np.asarray(x, np.float64) - np.mean(x, 0)) / np.asarray(ls, np.float64)
    norms = np.sum(a * a, 1)
    squared = norms[:, None] + norms[None, :] - 2 * a @ a.T
    return float(np.mean(np.sum(squared < (norms[:, None] + norms[None, :]) / 2, 1)))


def gemm_table(n, gpjax):
    """Squared distances by the GEMM with repair against the loop over features (gemm_features_min moved past D),
    on random points and on digits, standardised and randomly projected to 256 features."""
    print("\n## Squared distances by GEMM (with repair) against the loop over features, float32: K @ v and the")
    print(f"## checkpointed gradient as in --kernels (M = N = {n} and {n // 2}, at D = 256 half of each; digits 1797")
    print("## and 898), ratios to the inexact GEMM RBF in the same run; pairs per row the GEMM cannot vouch for\n")
    print("| data | kernel | GEMM: K @ v, gradient | loop: K @ v, gradient | unvouched pairs per row |")
    print("|---|---|---|---|---|")
    made = rbf_and_matern52(gpjax)
    rng = np.random.default_rng(0)
    data = {f"random, D = {dim}": rng.normal(size=(n if dim < 256 else n // 2, dim)) for dim in (64, 128, 256)}
    try:
        from sklearn import datasets

        digits = datasets.load_digits().data
        digits = (digits - digits.mean(0)) / np.maximum(digits.std(0), 1e-12)
        data["digits, projected to D = 256"] = digits @ rng.normal(size=(64, 256)) / 8
    except ImportError:
        print("scikit-learn is not installed: no digits row")
    for name, x in data.items():
        x, dim = jnp.asarray(x, jnp.float32), x.shape[1]
        v, ls = jnp.asarray(rng.normal(size=len(x)), jnp.float32), lengthscales(dim)
        switches = [{"gemm_features_min": dim + loop} for loop in (0, 1)]
        for kernel, (gemm, loop) in switched_ratios(made, switches, ls, x, v).items():
            print(f"| {name} | {kernel} | {gemm} | {loop} | {unvouched_per_row(x, ls):.2f} |", flush=True)


def rbf_and_matern52(gpjax):
    """The kernels the tables of forms compare: lazy_kernel.RBF and, where installed, GPJax's Matern52."""
    made = {"lazy_kernel.RBF": lambda ls: RBF(ls, jnp.float32(1.3))}
    if gpjax is not None:
        made["GPJax Matern52"] = lambda ls: gpjax.kernels.Matern52(lengthscale=ls, variance=1.3)
    return made


def switched_ratios(made, switches, ls, x, v):
    """For each kernel made from lengthscales, under each of ``switches``: "K @ v, gradient" (on x, and on its first
    half) as ratios to the inexact GEMM RBF's, timed in the same rounds."""
    makes = [GemmRBF] + [make for make in made.values() for _ in switches]
    settings = [{}] + [switch for _ in made for switch in switches]
    half = (ls, x[: len(x) // 2], v[: len(x) // 2])
    forward = median_times([traced_with(f, **s) for f, s in zip(products(makes), settings, strict=True)], (ls, x, v))
    gradient = median_times([traced_with(g, **s) for g, s in zip(gradients(makes), settings, strict=True)], half)
    cells = [f"{f / forward[0]:.2f}, {g / gradient[0]:.2f}" for f, g in zip(forward[1:], gradient[1:], strict=True)]
    return {kernel: cells[i * len(switches) : (i + 1) * len(switches)] for i, kernel in enumerate(made)}


def wide_table(n, gpjax):
    """Float32 distances by the float64 GEMM against the loop (and, from gemm_features_min, the float32 GEMM), by
    D, with x64 off and on; float64 points by the loop against their GEMM; and a product under vmap over two sets
    of lengthscales (where lax.cond runs both)."""
    print("\n## Float32 squared distances by the float64 GEMM (wide_gemm_features_min moved below D) against the")
    print(f"## forms without it, float32: K @ v at M = N = {n} and the checkpointed gradient at {n // 2} (at D = 256")
    print("## half of each), ratios to the inexact GEMM RBF in the same run\n")
    print("| x64 | D | kernel | float64 GEMM: K @ v, gradient | without: K @ v, gradient |")
    print("|---|---|---|---|---|")
    made = rbf_and_matern52(gpjax)
    switches = [{"wide_gemm_features_min": minimum} for minimum in (1, 10**9)]
    for x64 in (False, True):
        jax.config.update("jax_enable_x64", x64)
        for dim in (4, 8, 16, 64, 256):
            rng = np.random.default_rng(0)
            size = n if dim < 256 else n // 2
            x = jnp.asarray(rng.normal(size=(size, dim)), jnp.float32)
            v, ls = jnp.asarray(rng.normal(size=size), jnp.float32), lengthscales(dim)
            for kernel, (wide, without) in switched_ratios(made, switches, ls, x, v).items():
                print(f"| {'on' if x64 else 'off'} | {dim} | {kernel} | {wide} | {without} |", flush=True)
        if x64:  # float64 points: the loop below gemm_features_min, against their GEMM (with repair) there
            for dim in (16, 64):
                x = jnp.asarray(np.random.default_rng(0).normal(size=(n, dim)))
                v, ls = jnp.ones(n), lengthscales(dim).astype(jnp.float64)
                gemm = [{"gemm_features_min": minimum} for minimum in (1, 10**9)]
                for kernel, (by_gemm, loop) in switched_ratios(made, gemm, ls, x, v).items():
                    print(f"| on, float64 points | {dim} | {kernel} | GEMM {by_gemm} | loop {loop} |", flush=True)
    jax.config.update("jax_enable_x64", False)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n // 2, 16)), jnp.float32)
    v, ls = jnp.asarray(rng.normal(size=n // 2), jnp.float32), jnp.stack([lengthscales(16), 2 * lengthscales(16)])
    (rbf,) = products([lambda ls: RBF(ls, jnp.float32(1.3))])
    for name, f, args in (
        ("vmap over 2 sets of lengthscales", jax.vmap(rbf, (0, None, None)), (ls, x, v)),
        ("one set", rbf, (ls[0], x, v)),
    ):
        wide, without = median_times([traced_with(f, **s) for s in switches], args)
        print(
            f"\nD = 16, M = N = {n // 2}, RBF, {name}: {wide * 1e3:.0f} ms by the float64 GEMM, "
            f"{without * 1e3:.0f} ms without",
            end="",
        )
    print()


def chunks_table(n):
    """The loop over features by sum_chunk (one feature a step, or chunks summed pairwise), on Laplace and on RBF
    with the float64 GEMM off: K @ v at M = N = n and the checkpointed gradient at n / 2."""
    print(f"\n## The loop over features by sum_chunk, float32: K @ v at M = N = {n}, the checkpointed gradient at")
    print(f"## {n // 2}, ratios to the inexact GEMM RBF in the same run\n")
    print("| D | kernel | one at a time | chunks of 2 | chunks of 4 | chunks of 8 |")
    print("|---|---|---|---|---|---|")
    made = {
        "pair: Laplace": lambda ls: lambda x, y: jnp.exp(-jnp.sum(jnp.abs(x - y) / ls)),
        "lazy_kernel.RBF": lambda ls: RBF(ls, jnp.float32(1.3)),
    }
    switches = [{"sum_chunk": chunk, "wide_gemm_features_min": 10**9} for chunk in (10**9, 2, 4, 8)]
    for dim in (16, 64):
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(n, dim)), jnp.float32)
        v = jnp.asarray(rng.normal(size=n), jnp.float32)
        for kernel, cells in switched_ratios(made, switches, lengthscales(dim), x, v).items():
            print(f"| {dim} | {kernel} | {' | '.join(cells)} |", flush=True)


def precision_table(n):
    """The cost of the contraction at HIGHEST (the operator's default) against JAX's default precision (bf16 on
    a TPU): K @ X for RBF at M = N = n and D = 3 (where the contraction weighs most against the kernel), by width,
    and each one's worst error on 64 rows against NumPy float64."""
    print(f"\n## K @ X at M = N = {n}, D = 3, float32, RBF: the contraction at HIGHEST against JAX's default precision")
    print("## (ms; worst error relative to |K| |X| on 64 rows, X uniform on [-0.25, 1))\n")
    print("| width | HIGHEST (the operator's default) | JAX's default | ratio |")
    print("|---|---|---|---|")
    rng = np.random.default_rng(0)
    x = np.asarray(rng.normal(size=(n, 3)), np.float32)
    ls = float(np.float32(np.sqrt(3)))
    exact = lazy_kernel._rbf_numpy(x[:64].astype(np.float64), x.astype(np.float64), ls, 1.0)[0]

    def product(x, operand, precision):
        with jax.default_matmul_precision(precision):  # read when traced
            return LazyKernel(RBF(jnp.float32(ls)), x, x) @ operand

    forms = [functools.partial(product, precision=p) for p in (None, "default")]
    for width in (1, 16, 64):
        operand = np.asarray(rng.uniform(-0.25, 1, size=(n, width)), np.float32)
        seconds = median_times(forms, (jnp.asarray(x), jnp.asarray(operand)))
        want, scale = exact @ operand, exact @ np.abs(operand)
        errors = [np.max(np.abs(np.asarray(jax.jit(f)(x, operand))[:64] - want) / scale) for f in forms]
        cells = [f"{t * 1e3:.2f} ({e:.1e})" for t, e in zip(seconds, errors, strict=True)]
        print(f"| {width} | {' | '.join(cells)} | {seconds[0] / seconds[1]:.2f} |", flush=True)


def accelerator_blocks_table(n):
    """Off the CPU: lazy_kernel.RBF by rows per block (the default's, 2048 and batch_size_row's), with the inexact
    GEMM RBF and the exp + matvec ceiling at the default blocks for scale."""
    print(
        f"\n## By block size, float32: K @ v at M = N = {n}, the checkpointed gradient of sum(sin(K @ v)) at {n // 2}\n"
    )
    print("| kernel | D | rows per block | K @ v, ms | gradient, ms |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for dim in (3, 16, 64, 256):
        x = jnp.asarray(rng.normal(size=(n, dim)), jnp.float32)
        v = jnp.asarray(rng.normal(size=n), jnp.float32)
        ls = lengthscales(dim)
        op = LazyKernel(RBF(ls), x, x)
        default = op.block_rows
        sizes = sorted({default, min(2048, n), min(op.batch_size_row, n)})
        right = [lambda ls, x, v, rows=rows: LazyKernel(RBF(ls, 1.3), x, x, batch_size=rows) @ v for rows in sizes]

        def loss(ls, x, v, rows):
            return jnp.sum(jnp.sin(LazyKernel(RBF(ls, 1.3), x, x, batch_size=rows, checkpoint=True) @ v))

        grads = [jax.grad(functools.partial(loss, rows=max(1, rows // 2)), argnums=(0, 1, 2)) for rows in sizes]
        (gemm,), (gemm_gradient,) = products([GemmRBF]), gradients([GemmRBF])
        forward = median_times([*right, gemm, lambda ls, x, v, rows=default: ceiling(n, rows)(x, v)], (ls, x, v))
        half = (ls, x[: n // 2], v[: n // 2])
        backward = median_times([*grads, gemm_gradient], half)
        for i, rows in enumerate(sizes):
            mark = " (default)" if rows == default else ""
            print(f"| lazy_kernel.RBF | {dim} | {rows}{mark} | {forward[i] * 1e3:.1f} | {backward[i] * 1e3:.1f} |")
        print(f"| {REFERENCE} | {dim} | {default} | {forward[-2] * 1e3:.1f} | {backward[-1] * 1e3:.1f} |")
        print(f"| ceiling: exp + matvec | {dim} | {default} | {forward[-1] * 1e3:.1f} | |", flush=True)


def accelerator_features_table(n, gpjax):
    """Off the CPU: blocks with every feature written out (D added to accelerator_features) against the vmap
    form, by D, ratios to the inexact GEMM RBF in the same run."""
    print("\n## Every feature written out (D in accelerator_features) against the vmap form, float32: K @ v at")
    print(f"## M = N = {n} and the checkpointed gradient at {n // 2}, ratios to the inexact GEMM RBF in the same run\n")
    print("| D | kernel | written out: K @ v, gradient | vmap form: K @ v, gradient |")
    print("|---|---|---|---|")
    made = rbf_and_matern52(gpjax)
    for dim in (1, 4, 8, 16, 32, 64):
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(n, dim)), jnp.float32)
        v, ls = jnp.asarray(rng.normal(size=n), jnp.float32), lengthscales(dim)
        features = set(lazy_kernel.SETTINGS.accelerator_features)
        switches = [{"accelerator_features": tuple(sorted(f))} for f in (features | {dim}, features - {dim})]
        for kernel, (written, vmapped) in switched_ratios(made, switches, ls, x, v).items():
            print(f"| {dim} | {kernel} | {written} | {vmapped} |", flush=True)


def fused_kinds(gpjax, only=None):
    """Kernels of |x - y|^2 a TPU fuses, made from a lengthscale (or one per feature), each with the switches it is
    traced under: name -> (make, switches); ``only``: those whose names contain one of its strings. The inexact GEMM
    RBF first, always: the tables divide by it."""
    kinds = {
        "inexact GEMM RBF": (GemmRBF, {}),
        "lazy_kernel.RBF": (lambda ls: RBF(ls, jnp.float32(1.3)), {}),
        "RBF, fused_product off": (lambda ls: RBF(ls, jnp.float32(1.3)), {"fused_product": False}),
        "pair: x / ls - y / ls": (lambda ls: lambda x, y: 1.3 * jnp.exp(-0.5 * jnp.sum((x / ls - y / ls) ** 2)), {}),
    }
    if gpjax is not None:
        kinds["GPJax RBF"] = (lambda ls: gpjax.kernels.RBF(lengthscale=ls, variance=1.3), {})
        kinds["GPJax Matern52"] = (lambda ls: gpjax.kernels.Matern52(lengthscale=ls, variance=1.3), {})
    reference = next(iter(kinds))
    return {k: v for k, v in kinds.items() if k == reference or only is None or any(s in k for s in only)}


def fused_lengthscale(dim, per_feature):
    return lengthscales(dim) if per_feature else jnp.float32(np.sqrt(dim / 3))


def fused_table(n, gpjax, per_feature=False, only=None, dims=(3, 16, 32, 64, 128, 256), columns=(16,)):
    """Off the CPU: products of kernels a TPU fuses from fused_features_min, with one lengthscale or one per feature,
    against the same RBF with fused_product off and the inexact GEMM RBF, by D: K @ v, then K @ X for each width
    of ``columns``."""
    scale = "lengthscales 0.5 to 1.5 times sqrt(D / 3)" if per_feature else "lengthscale sqrt(D / 3)"
    widths = ", ".join(f"K @ X ({c} columns)" for c in columns)
    print(f"\n## Fused products, {scale}, float32, M = N = {n}: K @ v, {widths}")
    print("## in ms, ratios to the inexact GEMM RBF in the same run\n")
    kinds = fused_kinds(gpjax, only)
    print(f"| D | {' | '.join(kinds)} |")
    print("|---" * (len(kinds) + 1) + "|")
    for dim in dims:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(n, dim)), jnp.float32)
        operands = [jnp.asarray(rng.normal(size=n), jnp.float32)]
        operands += [jnp.asarray(rng.normal(size=(n, c)), jnp.float32) for c in columns]
        functions = [
            traced_with(lambda ls, points, rhs, make=make: LazyKernel(make(ls), points, points) @ rhs, **switches)
            for make, switches in kinds.values()
        ]
        ls = fused_lengthscale(dim, per_feature)
        seconds = [median_times(functions, (ls, x, operand)) for operand in operands]  # [operand][kind]
        cells = [
            ", ".join(f"{by_kind[i] * 1e3:.1f}" for by_kind in seconds)
            + f" ({', '.join(f'{by_kind[i] / by_kind[0]:.2f}' for by_kind in seconds)})"
            for i in range(len(kinds))
        ]
        print(f"| {dim} | {' | '.join(cells)} |", flush=True)


def fused_gradient_table(n, gpjax, per_feature=False, only=None, dims=(16, 32, 64, 128, 256), columns=(1,)):
    """Off the CPU: the checkpointed gradient of sum(sin(K @ X)) in (lengthscales, points, X), fused where the
    fused layer takes it, against the same RBF with fused_product off and the GEMM RBF, by D and X's ``columns``
    (1: a vector v)."""
    scale = "lengthscales 0.5 to 1.5 times sqrt(D / 3)" if per_feature else "lengthscale sqrt(D / 3)"
    print(f"\n## Fused gradients, {scale}, float32, M = N = {n}: ms, ratios to the GEMM's\n")
    kinds = fused_kinds(gpjax, only)
    print(f"| D (columns) | {' | '.join(kinds)} |")
    print("|---" * (len(kinds) + 1) + "|")
    for dim, width in itertools.product(dims, columns):
        rng = np.random.default_rng(0)
        shapes = (n, dim), (n, width) if width > 1 else (n,)
        x, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in shapes)
        makes, switches = zip(*kinds.values(), strict=True)
        functions = [traced_with(g, **s) for g, s in zip(gradients(makes), switches, strict=True)]
        seconds = median_times(functions, (fused_lengthscale(dim, per_feature), x, v))
        times = " | ".join(f"{t * 1e3:.1f} ({t / seconds[0]:.2f})" for t in seconds)
        print(f"| {dim} ({width}) | {times} |", flush=True)


def machine():
    device = jax.devices()[0]
    cpu = platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    kind = "" if device.platform == "cpu" else f" {device.device_kind},"
    return f"{device.platform}{kind} {os.cpu_count()} cores {cpu}, jax {jax.__version__}"


CPU_TABLES = dict(  # what a run without flags makes: every table but the accelerator ones
    kernels=8192,
    first_use=3000,
    eager=3000,
    split=8192,
    blocks=16384,
    sides=8192,
    real=True,
    gemm=8192,
    wide=8192,
    chunks=8192,
    precision=8192,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", type=int, metavar="N")
    parser.add_argument("--first-use", type=int, metavar="N")
    parser.add_argument("--repeats", type=int, default=3, help="--first-use: new shapes per row (after one warm-up)")
    parser.add_argument("--eager", type=int, metavar="N")
    parser.add_argument("--split", type=int, metavar="N")
    parser.add_argument("--blocks", type=int, metavar="N")
    parser.add_argument("--sides", type=int, metavar="N")
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--real-from", metavar="NPZ", help="--real's data sets from an .npz (no scikit-learn here)")
    parser.add_argument("--gemm", type=int, metavar="N")
    parser.add_argument("--wide", type=int, metavar="N")
    parser.add_argument("--chunks", type=int, metavar="N")
    parser.add_argument("--precision", type=int, metavar="N")
    parser.add_argument("--accelerator", type=int, metavar="N")
    parser.add_argument("--accelerator-blocks", type=int, metavar="N")
    parser.add_argument("--accelerator-features", type=int, metavar="N")
    parser.add_argument("--fused", type=int, metavar="N")
    parser.add_argument("--fused-gradient", type=int, metavar="N")
    parser.add_argument("--per-feature", action="store_true", help="--fused, --fused-gradient: ls per feature")
    parser.add_argument("--dims", help="--fused, --fused-gradient, --first-use: these D, comma-separated")
    parser.add_argument("--columns", help="--fused, --fused-gradient: X's widths, comma-separated (16; 1)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="lazy_kernel.SETTINGS")
    parser.add_argument(
        "--only", help="--fused, --fused-gradient, --first-use: kernels whose names contain one of these"
    )
    args = parser.parse_args()
    if not any(vars(args).values()):
        vars(args).update(CPU_TABLES)
    try:
        import gpjax
    except ImportError:
        gpjax = None
        print("gpjax is not installed (pip install -e '.[interop]'): its rows are left out")
    print(f"machine: {machine()}")
    dims = {"dims": tuple(int(d) for d in args.dims.split(","))} if args.dims else {}
    columns = {"columns": tuple(int(c) for c in args.columns.split(","))} if args.columns else {}
    for change in args.set:  # e.g. --set fused_width_max=512, for the whole run
        field, value = change.split("=", 1)
        lazy_kernel.SETTINGS = lazy_kernel.SETTINGS.replace(**{field: ast.literal_eval(value)})
        print(f"lazy_kernel.SETTINGS.{field} = {value}")
    only = args.only.split(",") if args.only else None
    if args.kernels:
        kernels_table(args.kernels, gpjax)
    if args.first_use:
        first_use_table(args.first_use, gpjax, only, repeats=args.repeats, **dims)
    if args.eager:
        eager_table(args.eager, gpjax)
    if args.split:
        split_table(args.split)
    if args.blocks:
        blocks_table(args.blocks)
    if args.sides:
        sides_table(args.sides, gpjax)
    if args.real:
        real_table(gpjax, args.real_from)
    if args.gemm:
        gemm_table(args.gemm, gpjax)
    if args.wide:
        wide_table(args.wide, gpjax)
    if args.chunks:
        chunks_table(args.chunks)
    if args.precision:
        precision_table(args.precision)
    if args.accelerator:
        kernels_table(args.accelerator, gpjax, halved_at_256=False)
    if args.accelerator_blocks:
        accelerator_blocks_table(args.accelerator_blocks)
    if args.accelerator_features:
        accelerator_features_table(args.accelerator_features, gpjax)
    if args.fused:
        fused_table(args.fused, gpjax, args.per_feature, only, **dims, **columns)
    if args.fused_gradient:
        fused_gradient_table(args.fused_gradient, gpjax, args.per_feature, only, **dims, **columns)


if __name__ == "__main__":
    main()
