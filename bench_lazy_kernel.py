"""Benchmark LazyKernel against the dense matrix, the seed's algorithm and an exp + matvec ceiling.

    python bench_lazy_kernel.py            # the README's run: about 10 minutes on 2 CPU cores
    python bench_lazy_kernel.py --quick    # a smoke run
    python bench_lazy_kernel.py --gp 100000  # a GP solve whose dense K (40 GB) would not fit
    python bench_lazy_kernel.py --checkpoint 8192  # what checkpoint costs and saves
    python bench_lazy_kernel.py --kernels 8192  # users' kernels: pair program vs vmap form vs RBF (interop extra)
    python bench_lazy_kernel.py --budget 4096  # the budget against XLA's measured peak (interop extra)

Everything runs in this one process on the same data (float32, D = 3, an RBF
kernel in GEMM form), except the multi-device row, which needs its own
process with 4 virtual CPU devices. Per case: the median time, elements of K
per second, the ratio to the dense matrix and XLA's temporary memory. Prints
progress, then a table, and writes bench_lazy_kernel.png. Not a test: times
depend on the machine and its load; compare ratios within one run.
"""

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import lazy_kernel
from lazy_kernel import RBF, LazyKernel, _median_seconds

KERNEL = RBF(jnp.float32(0.7), jnp.float32(1.3))


def compiled(f, *args):
    """The compiled function and its temporary memory in MiB (XLA's accounting)."""
    executable = jax.jit(f).lower(*args).compile()
    return executable, executable.memory_analysis().temp_size_in_bytes / 2**20


def case(method, side, mode, n, block, f, args):
    return dict(method=method, side=side, mode=mode, n=n, block=block, f=f, args=args)


def measure(cases, budget_s=30.0):
    """Time the cases round-robin, one run of each per round (3 to 7 rounds), so that
    load drifting on a shared machine hits all of them alike. Returns their rows."""
    runs = []
    for c in cases:
        executable, temp_mib = compiled(c["f"], *c["args"])
        jax.block_until_ready(executable(*c["args"]))  # warm up
        runs.append((executable, temp_mib, []))
    start = time.perf_counter()
    while len(runs[0][2]) < 3 or (len(runs[0][2]) < 7 and time.perf_counter() - start < budget_s):
        for c, (executable, _, times) in zip(cases, runs, strict=True):
            begin = time.perf_counter()
            jax.block_until_ready(executable(*c["args"]))
            times.append(time.perf_counter() - begin)
    rows = []
    for c, (_, temp_mib, times) in zip(cases, runs, strict=True):
        row = {k: c[k] for k in ("method", "side", "mode", "n", "block")}
        row.update(seconds=float(np.median(times)), temp_mib=temp_mib)
        rows.append(row)
        print(
            f"  {row['method']:<30} {row['side']} {row['mode']:<8} n={row['n']:<6} block={row['block']!s:<6} "
            f"{row['seconds'] * 1e3:10.1f} ms  {row['n'] ** 2 / row['seconds']:9.3g} el/s  temp {temp_mib:9.1f} MiB",
            flush=True,
        )
    return rows


# -- the methods -------------------------------------------------------------------


def dense(kernel, x1, x2, v, side):
    k = kernel.cross_covariance(x1, x2)  # materialise the whole matrix
    return k @ v if side == "K @ v" else v @ k


def seed(kernel, x1, x2, v, side, checkpoint, max_memory_mb=2**10):
    """The seed's algorithm: ``jax.lax.map`` over single rows (or columns), batched by its arithmetic."""
    if side == "v @ K":
        x1, x2 = x2, x1  # columns of K are rows of K^T (the RBF is symmetric)
    batch = max(1, (max_memory_mb * 2**20 // 4) // x2.shape[0])

    def one_row(x):
        return (kernel.cross_covariance(x[None], x2) @ v)[0]

    return jax.lax.map(jax.checkpoint(one_row) if checkpoint else one_row, x1, batch_size=batch)


def lazy(kernel, x1, x2, v, side, checkpoint, **settings):
    op = LazyKernel(kernel, x1, x2, checkpoint=checkpoint, **settings)
    return op @ v if side == "K @ v" else v @ op


def forward(method, *settings):
    return lambda x1, x2, v: method(KERNEL, x1, x2, v, *settings)


def gradient(method, *settings):
    """The gradient of w.(product) with respect to v and the lengthscale."""

    def loss(v, lengthscale, x1, x2, w):
        return jnp.vdot(w, method(RBF(lengthscale, KERNEL.variance), x1, x2, v, *settings))

    return jax.grad(loss, argnums=(0, 1))


def ceiling_case(n, rows):
    """exp + matvec over LazyKernel's own block structure: [rows, n] blocks, the exponential
    recomputed in every block from a precomputed block. No kernel evaluation can beat it."""
    rng = np.random.default_rng(0)
    block = jnp.asarray(-rng.uniform(size=(rows, n)), jnp.float32)
    v = jnp.asarray(rng.normal(size=n), jnp.float32)

    def run(block, v):
        def body(i, out):  # the scale keeps XLA from computing exp(block) once for all blocks
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.exp(block * (1 + i * 1e-7)) @ v, i * rows, 0)

        return jax.lax.fori_loop(0, n // rows, body, jnp.zeros(n, jnp.float32))

    return case("ceiling: exp + matvec", "K @ v", "forward", n, rows, run, (block, v))


def ceiling_elements_per_second(n=16384, rows=64):
    (row,) = measure([ceiling_case(n, rows)])
    return n * n / row["seconds"]


def ceiling_fraction(n):
    """lazy_kernel.RBF's default K @ v against the ceiling on its own blocks, timed round-robin together."""
    x1, x2, v, _ = data(n)
    block = LazyKernel(KERNEL, x1, x2).block_rows
    lazy_case = case(
        "lazy_kernel.RBF default", "K @ v", "forward", n, block, forward(lazy, "K @ v", False), (x1, x2, v)
    )
    ceiling, rbf = measure([ceiling_case(n, block), lazy_case])
    print(f"lazy_kernel.RBF K @ v at n = {n}: {ceiling['seconds'] / rbf['seconds']:.2f} of the ceiling", flush=True)
    return n * n / ceiling["seconds"]


class VmapForm:
    """A kernel evaluated as main did before the pair program: ``jax.vmap(jax.vmap(pair))``."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, x, y):
        return self.kernel(x, y)

    def cross_covariance(self, x1, x2):
        return lazy_kernel._vmap_block(self.kernel, x1, x2) * 1  # "* 1": not a bare vmap, so it is used


jax.tree_util.register_pytree_node(VmapForm, lambda k: ((k.kernel,), None), lambda _, c: VmapForm(*c))


def user_kernels(dim):
    """The kernels users bring, and the module's RBF, each made from its lengthscales."""
    import gpjax

    return {
        "lazy_kernel.RBF": lambda ls: RBF(ls, jnp.float32(1.3)),
        "GPJax RBF": lambda ls: gpjax.kernels.RBF(lengthscale=ls, variance=1.3),
        "GPJax Matern52": lambda ls: gpjax.kernels.Matern52(lengthscale=ls, variance=1.3),
        "pair, jnp.sum": lambda ls: lambda x, y: 1.3 * jnp.exp(-0.5 * jnp.sum(((x - y) / ls) ** 2)),
    }


def kernels_table(n, n_grad):
    """K @ v and the checkpointed gradient (x, v, lengthscales) for users' kernels: pair program vs vmap form."""
    rows = []
    for dim in (3, 16, 64):
        lengthscale = jnp.linspace(0.5, 1.5, dim, dtype=jnp.float32) * np.sqrt(dim / 3)
        for mode, size in (("forward", n), ("gradient", n_grad)):
            if mode == "gradient" and dim == 64:
                continue
            rng = np.random.default_rng(0)
            x = jnp.asarray(rng.normal(size=(size, dim)), jnp.float32)
            v = jnp.asarray(rng.normal(size=size), jnp.float32)
            cases = []
            for name, make in user_kernels(dim).items():
                forms = {"default": make} if name == "lazy_kernel.RBF" else {"default": make, "vmap": make}
                for form in forms:
                    wrap = VmapForm if form == "vmap" else lambda k: k
                    kernel = wrap(make(lengthscale))
                    label = f"{name}, D={dim} [{form}: {lazy_kernel.block_evaluation(kernel, dim)}]"
                    block = LazyKernel(kernel, x, x, checkpoint=mode == "gradient").block_rows

                    def loss(ls, x, v, make=make, wrap=wrap):
                        return jnp.sum(jnp.sin(LazyKernel(wrap(make(ls)), x, x, checkpoint=True) @ v))

                    f = (
                        (lambda x, v, k=kernel: LazyKernel(k, x, x) @ v)
                        if mode == "forward"
                        else jax.grad(loss, (0, 1, 2))
                    )
                    args = (x, v) if mode == "forward" else (lengthscale, x, v)
                    cases.append(case(label, "K @ v", mode, size, block, f, args))
            print(f"kernels, D = {dim}, {mode}, n = {size}", flush=True)
            rows += measure(cases, budget_s=10.0)
    return rows


def budget_table(n, budgets):
    """The budget against XLA's measured peak, before (the block from the budget alone) and after."""
    import gpjax

    kernels = {
        "pair, jnp.sum": lambda d: lambda x, y: jnp.exp(-0.5 * jnp.sum((x - y) ** 2)),
        "partial (Laplace)": lambda d: functools.partial(lambda x, y, s: jnp.exp(-jnp.sum(jnp.abs(x - y)) / s), s=1.3),
        "lazy_kernel.RBF": lambda d: RBF(jnp.float32(0.7)),
        "GPJax RBF": lambda d: gpjax.kernels.RBF(lengthscale=jnp.linspace(0.5, 1.5, d, dtype=jnp.float32)),
        "GPJax Matern52": lambda d: gpjax.kernels.Matern52(lengthscale=jnp.float32(0.7)),
    }
    lines = [
        "| kernel | D | budget MiB | limit MiB | before: blocks, forward, gradient MiB "
        "| after: blocks, forward, gradient MiB | gradient without checkpoint |",
        "|---|---:|---:|---:|---|---|---:|",
    ]
    for name, make in kernels.items():
        for dim in (1, 3, 16, 64):
            x = jax.ShapeDtypeStruct((n, dim), jnp.float32)
            v = jax.ShapeDtypeStruct((n,), jnp.float32)
            kernel = make(dim)
            zeros = jnp.zeros((n, dim), jnp.float32)

            def loss(x, v, checkpoint, settings, kernel=kernel):
                return jnp.sum(LazyKernel(kernel, x, x, checkpoint=checkpoint, **settings) @ v)

            stored = compiled(jax.grad(lambda x, v: loss(x, v, False, {}), argnums=(0, 1)), x, v)[1]
            for budget in budgets:
                cells = []
                # before: the block main chose (the budget sized one block of K), nothing measured
                before = LazyKernel(kernel, zeros, zeros, max_memory_mb=budget)._preferred_block_rows()
                for settings in (dict(batch_size=before), dict(max_memory_mb=budget)):
                    fwd = compiled(lambda x, v, s=settings: loss(x, v, False, s), x, v)[1]
                    grad = compiled(jax.grad(lambda x, v, s=settings: loss(x, v, True, s), argnums=(0, 1)), x, v)[1]
                    blocks = [
                        LazyKernel(kernel, zeros, zeros, checkpoint=c, **settings).block_rows for c in (False, True)
                    ]
                    cells.append(f"{blocks[0]}/{blocks[1]}, {fwd:.1f}, {grad:.1f}")
                limit = budget + 2 * (2 * n * dim + 2 * n) * 4 / 2**20  # x1, x2, operand, result
                lines.append(
                    f"| {name} | {dim} | {budget:g} | {limit:.2f} | {cells[0]} | {cells[1]} "
                    f"| {stored * 2**20 / (4 * n * n):.1f}x the matrix |"
                )
                print(lines[-1], flush=True)
    return "\n".join(lines)


def construction_cost(n):
    """What measuring the budget costs: first construction, again (cached), and a product's compile."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    v = jnp.asarray(rng.normal(size=n), jnp.float32)
    for checkpoint in (False, True):
        for name, make in list(user_kernels(3).items())[1:3]:
            kernel = make(jnp.ones(3, jnp.float32))
            start = time.perf_counter()
            block = LazyKernel(kernel, x, x, checkpoint=checkpoint).block_rows
            first = time.perf_counter() - start
            start = time.perf_counter()
            assert LazyKernel(kernel, x, x, checkpoint=checkpoint).block_rows == block
            again = time.perf_counter() - start
            times = {}
            for label, settings in (("given", dict(batch_size=block)), ("measured", {})):
                start = time.perf_counter()
                f = jax.jit(lambda x, v, s=settings, k=kernel: LazyKernel(k, x, x, **s) @ v).lower(x, v).compile()
                times[label] = (time.perf_counter() - start, _median_seconds(f, x, v, repeats=5))
            print(
                f"  {name}, checkpoint={checkpoint}: first construction {first * 1e3:.0f} ms, "
                f"again {again * 1e3:.1f} ms; K @ v compile + run with batch_size={block} given: "
                f"{times['given'][0] * 1e3:.0f} ms + {times['given'][1] * 1e3:.1f} ms, "
                f"measured (cached): {times['measured'][0] * 1e3:.0f} ms + {times['measured'][1] * 1e3:.1f} ms",
                flush=True,
            )


# -- the runs ----------------------------------------------------------------------


def data(n):
    rng = np.random.default_rng(0)
    x1, x2 = (jnp.asarray(rng.normal(size=(n, 3)), jnp.float32) for _ in range(2))
    v, w = (jnp.asarray(rng.normal(size=n), jnp.float32) for _ in range(2))
    return x1, x2, v, w


def run_single_device(sizes, dense_sizes, dense_grad_sizes, lazy_grad_sizes, sweep_n, sweep_blocks):
    rows = []
    for n in sizes:
        x1, x2, v, w = data(n)
        op = LazyKernel(KERNEL, x1, x2)
        fwd, grad = (x1, x2, v), (v, KERNEL.lengthscale, x1, x2, w)
        cases = []
        for side in ("K @ v", "v @ K"):
            block = op.block_rows if side == "K @ v" else op.block_cols
            seed_block = min(n, op.batch_size_row if side == "K @ v" else op.batch_size_col)
            if n in dense_sizes:
                cases.append(case("dense", side, "forward", n, n, forward(dense, side), fwd))
                cases.append(case("seed", side, "forward", n, seed_block, forward(seed, side, False), fwd))
            cases.append(case("lazy", side, "forward", n, block, forward(lazy, side, False), fwd))
            if n in dense_grad_sizes:
                cases.append(case("dense", side, "gradient", n, n, gradient(dense, side), grad))
                cases.append(case("seed", side, "gradient", n, seed_block, gradient(seed, side, True), grad))
            if n in lazy_grad_sizes:
                cases.append(case("lazy", side, "gradient", n, block, gradient(lazy, side, True), grad))
        print(f"n = {n}", flush=True)
        rows += measure(cases)

    x1, x2, v, w = data(sweep_n)
    fwd, grad = (x1, x2, v), (v, KERNEL.lengthscale, x1, x2, w)
    small = LazyKernel(KERNEL, x1, x2, max_memory_mb=16)
    in_16_mb = functools.partial(lazy, max_memory_mb=16)
    cases = []
    for side in ("K @ v", "v @ K"):
        block = small.block_rows if side == "K @ v" else small.block_cols
        cases.append(case("lazy default", side, "forward", sweep_n, block, forward(lazy, side, False), fwd))
        for b in sweep_blocks:
            f = forward(functools.partial(lazy, batch_size=b), side, False)
            cases.append(case("lazy sweep", side, "forward", sweep_n, b, f, fwd))
        cases.append(case("lazy 16 MB", side, "forward", sweep_n, block, forward(in_16_mb, side, False), fwd))
        cases.append(case("lazy 16 MB", side, "gradient", sweep_n, block, gradient(in_16_mb, side, True), grad))
    print(f"block sweep, n = {sweep_n}", flush=True)
    return rows + measure(cases)


def sharded_worker(n):
    """In a process with 4 CPU devices: K @ v with the rows of x1 split over 1, 2 and 4 of them."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from lazy_kernel import _shard_map

    x1, x2, v, _ = data(n)
    cases = []
    for count in (1, 2, 4):
        mesh = Mesh(np.array(jax.devices()[:count]), ("d",))
        f = _shard_map()(
            lambda a, b, c: LazyKernel(KERNEL, a, b) @ c, mesh=mesh, in_specs=(P("d"), P(), P()), out_specs=P("d")
        )
        block = LazyKernel(KERNEL, x1[: n // count], x2).block_rows
        cases.append(case(f"lazy {count} dev", "K @ v", "forward", n, block, f, (x1, x2, v)))
    for row in measure(cases):
        print(json.dumps(row), flush=True)


def run_sharded(n):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, __file__, "--sharded-worker", str(n)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for row in rows:
        print(
            f"  {row['method']:<14} per device: block {row['block']}, temp {row['temp_mib']:.1f} MiB, "
            f"{row['seconds'] * 1e3:.1f} ms",
            flush=True,
        )
    return rows


def checkpoint_cost(n):
    """The gradient through LazyKernel with and without checkpoint: time and XLA's temporary memory."""
    x1, x2, v, w = data(n)
    cases = []
    for side in ("K @ v", "v @ K"):
        block = LazyKernel(KERNEL, x1, x2).block_rows
        for checkpoint in (False, True):
            name = "lazy, checkpoint" if checkpoint else "lazy, no checkpoint"
            f = gradient(lazy, side, checkpoint)
            cases.append(case(name, side, "gradient", n, block, f, (v, KERNEL.lengthscale, x1, x2, w)))
    return measure(cases)


def gp_regression(n, dim=3, noise=1.0, tol=1e-4):
    """GP posterior mean at n points by conjugate gradients on (K + noise I) alpha = y, K lazy."""
    import resource

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(size=(n, dim)), jnp.float32)
    y = jnp.asarray(np.sin(12 * np.asarray(x).sum(1)) + np.sqrt(noise) * rng.normal(size=n), jnp.float32)
    kernel = RBF(jnp.float32(0.02), jnp.float32(1.0))

    def solve(x, y):
        op = LazyKernel(kernel, x, x)
        alpha, _ = jax.scipy.sparse.linalg.cg(lambda v: op @ v + noise * v, y, tol=tol, maxiter=500)
        residual = jnp.linalg.norm(op @ alpha + noise * alpha - y) / jnp.linalg.norm(y)
        return op @ alpha, residual  # the posterior mean at the training points

    block = LazyKernel(kernel, x, x).block_rows
    print(
        f"GP regression: n = {n}, D = {dim}, float32, {block}-row blocks; dense K would need {4 * n * n / 1e9:.1f} GB"
    )
    executable, temp_mib = compiled(solve, x, y)
    start = time.perf_counter()
    mean, residual = jax.block_until_ready(executable(x, y))
    seconds = time.perf_counter() - start
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"  CG solve + posterior mean: {seconds:.1f} s, relative residual {float(residual):.1e}, "
        f"XLA temporaries {temp_mib:.1f} MiB, process peak RSS {peak_gib:.2f} GiB",
        flush=True,
    )


# -- the report ---------------------------------------------------------------------


def machine():
    device = jax.devices()[0]
    cpu = platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    kind = "" if device.platform == "cpu" else f" {device.device_kind},"
    return f"{device.platform}{kind} {os.cpu_count()} cores {cpu}, jax {jax.__version__}"


def table(rows, ceiling):
    dense_seconds = {(r["side"], r["mode"], r["n"]): r["seconds"] for r in rows if r["method"] == "dense"}
    lines = [
        "| method | product | mode | n | block | median ms | elements/s | vs dense | vs ceiling | temp MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = r["n"] ** 2 / r["seconds"]
        ref = dense_seconds.get((r["side"], r["mode"], r["n"]))
        ratio = f"{r['seconds'] / ref:.3f}" if ref else ""
        lines.append(
            f"| {r['method']} | {r['side']} | {r['mode']} | {r['n']} | {r['block']} | {r['seconds'] * 1e3:.1f} | "
            f"{rate:.3g} | {ratio} | {rate / ceiling:.0%} | {r['temp_mib']:.1f} |"
        )
    return "\n".join(lines)


def plot(rows, path, label):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, style in (("dense", "o-"), ("seed", "s--"), ("lazy", "^-")):
        for mode, colour in (("forward", "C0"), ("gradient", "C3")):
            pts = sorted(
                (r["n"], r["seconds"], r["temp_mib"])
                for r in rows
                if r["method"] == method and r["side"] == "K @ v" and r["mode"] == mode
            )
            if pts:
                n, seconds, temp = zip(*pts, strict=True)
                kw = dict(color=colour, alpha=1.0 if method == "lazy" else 0.55, label=f"{method} {mode}")
                ax_time.loglog(n, seconds, style, **kw)
                ax_mem.loglog(n, temp, style, **kw)
    ax_time.set(xlabel="N = M", ylabel="median seconds, K @ v", title="time")
    ax_mem.set(xlabel="N = M", ylabel="XLA temporary MiB", title="memory")
    sizes = sorted({r["n"] for r in rows})
    for ax in (ax_time, ax_mem):
        ax.set_xticks(sizes, [f"{n // 1024}k" if n >= 1024 else str(n) for n in sizes])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"LazyKernel vs dense, float32 RBF, D = 3 — {label}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only: a smoke run")
    parser.add_argument("--sharded-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--png", default="bench_lazy_kernel.png")
    parser.add_argument("--gp", type=int, metavar="N", help="instead: time a GP regression solve at N points")
    parser.add_argument("--checkpoint", type=int, metavar="N", help="instead: gradients with and without checkpoint")
    parser.add_argument("--kernels", type=int, metavar="N", help="instead: users' kernels, pair program vs vmap")
    parser.add_argument("--budget", type=int, metavar="N", help="instead: the budget against XLA's measured peak")
    args = parser.parse_args()
    if args.kernels:
        print(f"machine: {machine()}", flush=True)
        ceiling_fraction(16384)
        x = data(args.kernels)[0]
        ceiling = ceiling_elements_per_second(args.kernels, LazyKernel(KERNEL, x, x).block_rows)
        rows = kernels_table(args.kernels, args.kernels // 2)
        return print("\n" + table(rows, ceiling))
    if args.budget:
        print(f"machine: {machine()}", flush=True)
        construction_cost(args.budget)
        return print("\n" + budget_table(args.budget, budgets=(4, 64)))
    if args.sharded_worker:
        return sharded_worker(args.sharded_worker)
    if args.gp:
        return gp_regression(args.gp)
    if args.checkpoint:
        print(f"machine: {machine()}", flush=True)
        return print("\n" + table(checkpoint_cost(args.checkpoint), ceiling_elements_per_second()))

    if args.quick:
        sizes, dense_sizes, dense_grad_sizes, lazy_grad_sizes = [1024, 2048], [1024, 2048], [1024], [1024, 2048]
        sweep_n, sweep_blocks = 2048, [64]
    else:
        sizes = [2048, 4096, 8192, 16384, 32768, 65536]
        dense_sizes, dense_grad_sizes, lazy_grad_sizes = sizes[:5], sizes[:4], sizes[:5]
        sweep_n, sweep_blocks = 16384, [16, 32, 64, 128, 256, 512, 1024, 4096]
    label = machine()
    print(f"machine: {label}", flush=True)
    ceiling = ceiling_elements_per_second()
    print(f"ceiling (exp + matvec over 64-row blocks): {ceiling:.3g} elements/s", flush=True)
    rows = run_single_device(sizes, dense_sizes, dense_grad_sizes, lazy_grad_sizes, sweep_n, sweep_blocks)
    rows += run_sharded(sweep_n)
    print(f"\nmachine: {label}; ceiling {ceiling:.3g} elements/s\n")
    print(table(rows, ceiling))
    plot(rows, args.png, label)
    print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
