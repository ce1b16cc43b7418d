"""Why a sweep is not faster than sequential runs on CPU: the config axis of the local step.

A sweep (``scaffold_jax.sweep``) vmaps the round over configs; the configs of one seed
share the sampled clients and minibatches, so their local steps read the SAME batches with
DIFFERENT params. If XLA turned that into wider matmuls (``[B, d] @ [d, M·C]`` instead of M
products ``[B, d] @ [d, C]``), M configs would cost much less than M single runs. This
benchmark measures exactly that part, the K local SGD steps of the S sampled clients
(``scaffold_jax.local.local_sgd``, the engine's solver), in one process, interleaved, min of
``--repeats``:

* ``separate``: M calls of one compiled program (one config each);
* ``vmapped``: one program, ``vmap`` over the M configs, batches shared (``in_axes=None``);
* ``vmapped, chunks of c``: the same with the S clients in ``lax.map`` chunks of c
  (as the engine runs them on CPU, ``client_chunk``);
* ``configs inside each client, chunks of c``: the clients outside, the M configs vmapped
  inside each client's steps (client-major params, ``[c, M, ...]``);
* ``wide, chunks of c``: an upper bound, hand-written for this model only: the M configs'
  kernels stacked into ONE ``[M·C, d]`` matrix, so every step is one wider matmul per
  client (what a sweep-aware dense layer could do; the library's sweep does not).

``/ separate`` below 1 is what a sweep could gain per round from the config axis.

Examples:
  python benchmarks/bench_config_axis.py --out results/config_axis_cpu2.json
  python benchmarks/bench_config_axis.py --configs 4 --clients 20
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import write_json

import scaffold_jax as sj
from scaffold_jax.local import local_sgd


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=8, help="M step sizes of one seed")
    parser.add_argument("--clients", type=int, default=100, help="S sampled clients")
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--chunks", type=int, nargs="*", default=[50, 20, 10])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    s, k, b, m = args.clients, args.local_steps, args.batch_size, args.configs

    problem = sj.models.logistic_regression((28, 28), 10)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.integers(0, 256, (s, k, b, 28, 28), dtype=np.uint8))
    ys = jnp.asarray(rng.integers(0, 10, (s, k, b)).astype(np.int32))
    mask = jnp.ones((s, k, b), jnp.float32)

    def client(params, x, y, msk, lr):
        return local_sgd(problem.loss_fn, params, {"x": x, "y": y}, msk, lr)[0]

    def all_clients(params, lr, chunk=None):
        if chunk is None:
            return jax.vmap(client, in_axes=(None, 0, 0, 0, None))(params, xs, ys, mask, lr)
        return jax.lax.map(lambda a: client(params, *a, lr), (xs, ys, mask), batch_size=chunk)

    one = jax.jit(all_clients)
    params = jax.tree.map(lambda a: jnp.broadcast_to(a, (m, *a.shape)), problem.params)
    lrs = jnp.linspace(0.01, 0.1, m)
    programs = {"separate": lambda: [one(problem.params, lrs[i]) for i in range(m)]}
    for chunk in [None, *args.chunks]:
        fn = jax.jit(jax.vmap(lambda p, lr, c=chunk: all_clients(p, lr, c)))
        name = "vmapped" if chunk is None else f"vmapped, chunks of {chunk}"
        programs[name] = lambda fn=fn: fn(params, lrs)
    for chunk in args.chunks:
        # Client-major: the configs vmapped INSIDE each client (batches shared), the
        # nesting a sweep's round would use to avoid carrying its params config-major.
        def inner(p, lr, c_=chunk):
            def per_client(x, y, msk):
                return jax.vmap(lambda q, r: client(q, x, y, msk, r))(p, lr)

            return jax.lax.map(lambda a: per_client(*a), (xs, ys, mask), batch_size=c_)

        fn = jax.jit(inner)
        programs[f"configs inside each client, chunks of {chunk}"] = lambda fn=fn: fn(params, lrs)
    d, c = 28 * 28, 10

    def wide_client(x, y, msk):
        # Kernels [M·C, d] (the compute layout), biases [M, C]; the summed loss gives each
        # config its own gradient because their params are disjoint.
        def loss(p, xb, yb, mb):
            flat = xb.reshape(b, d).astype(jnp.float32) / 255.0
            logits = (flat @ p[0].T).reshape(b, m, c) + p[1]
            ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None, None], -1)
            return jnp.sum(ce[..., 0] * mb[:, None]) / jnp.maximum(jnp.sum(mb), 1.0)

        def step(p, batch):
            g = jax.grad(loss)(p, *batch)
            return (p[0] - jnp.repeat(lrs, c)[:, None] * g[0], p[1] - lrs[:, None] * g[1]), None

        start = (jnp.zeros((m * c, d)), jnp.zeros((m, c)))
        return jax.lax.scan(step, start, (x, y, msk))[0]

    for chunk in args.chunks:
        fn = jax.jit(
            lambda c_=chunk: jax.lax.map(lambda a: wide_client(*a), (xs, ys, mask), batch_size=c_)
        )
        programs[f"wide, chunks of {chunk} (hand-written upper bound)"] = fn
    for program in programs.values():
        jax.block_until_ready(program())  # compile
    times = {name: [] for name in programs}
    for _ in range(args.repeats):
        for name, program in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(program())
            times[name].append(time.perf_counter() - start)
    best = {name: min(t) * 1e3 for name, t in times.items()}
    print(f"{m} configs sharing batches; S={s}, K={k}, B={b}, 784x10 logistic regression")
    print("| program | ms for all configs | / separate |\n|---|---|---|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.1f} | {ms / best['separate']:.2f} |")
    result = {
        "machine": platform.processor() or platform.machine(),
        "backend": jax.default_backend(),
        "args": vars(args),
        "best_ms": best,
        "all_ms": {n: [t * 1e3 for t in v] for n, v in times.items()},
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
