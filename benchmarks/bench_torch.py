"""W1 SCAFFOLD against per-client loops in PyTorch, measured side by side.

Most simulators run a round as a Python loop over the sampled clients, each doing its K
local steps with the framework's autograd. This script times, interleaved (JAX, then each
PyTorch variant, repeated), the same round of workload W1 (1,000 clients × 60 examples of
28×28 uint8 images, 10 classes, logistic regression, S = 100, K = 5, B = 12, SCAFFOLD
option II, η_l = 0.1):

* ``engine``: ``Simulation.run_rounds`` (the public API; R rounds in one program);
* ``jax_loop``: the per-client loop of jitted JAX functions (``workloads.loop_program``);
* ``torch_1t``: PyTorch, one thread: for each sampled client, K steps of
  ``autograd.grad`` on ``cross_entropy(x W^T + b)`` and the corrected SGD update, then the
  control update and the server average — what a PyTorch simulator does;
* ``torch_2t``: the same with two intra-op threads;
* ``torch_2p``: the same split over two worker processes (half the sampled clients each,
  the server state sent to them every round): the best use of both cores by a loop.

PyTorch is an optional benchmark dependency: it runs in the interpreter given by
``--torch-python`` (a virtualenv with ``torch`` and ``numpy``; default this one), as a
worker process that this script talks to over pipes, so that JAX and PyTorch never share
a process (each would spin its own thread pools).

Examples:
  python benchmarks/bench_torch.py --torch-python /path/to/torchvenv/bin/python \\
      --out benchmarks/results/torch.json
  python benchmarks/bench_torch.py --quick
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- the worker
def _worker() -> None:
    """Reads ``{"setup": ...}`` then ``{"time": variant, "rounds": R}`` lines on stdin;
    answers each with a JSON line. Imports only torch and numpy."""
    from multiprocessing import get_context

    import torch

    setup = json.loads(sys.stdin.readline())["setup"]
    world = _TorchW1(**setup)
    pool = None
    print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        variant, rounds = ask["time"], ask["rounds"]
        if variant == "torch_2p" and pool is None:
            pool = get_context("fork").Pool(2, initializer=_pool_init, initargs=(setup,))
        torch.set_num_threads(2 if variant == "torch_2t" else 1)
        start = time.perf_counter()
        for _ in range(rounds):
            world.round(pool if variant == "torch_2p" else None)
        seconds = (time.perf_counter() - start) / rounds
        print(json.dumps({"ms": 1e3 * seconds, "check": world.checksum()}), flush=True)


_POOL_WORLD = None


def _pool_init(setup) -> None:
    import torch

    global _POOL_WORLD
    torch.set_num_threads(1)
    _POOL_WORLD = _TorchW1(**setup)


def _pool_clients(args):
    server, control, ids, rows, seeds = args
    return _POOL_WORLD.clients(server, control, ids, rows, seeds)


class _TorchW1:
    """W1's data and SCAFFOLD's state in PyTorch tensors; one round at a time."""

    def __init__(self, num_clients, per_client, num_classes, sampled, steps, batch, lr, seed):
        import torch

        self.torch = torch
        rng = np.random.default_rng(seed)
        n = num_clients * per_client
        self.x = torch.from_numpy(rng.integers(0, 256, (n, 784), dtype=np.uint8))
        self.y = torch.from_numpy(rng.integers(0, num_classes, n).astype(np.int64))
        self.n, self.per, self.s, self.k, self.b, self.lr = (
            num_clients, per_client, sampled, steps, batch, lr,
        )  # fmt: skip
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float32)  # noqa: E731
        self.server = [zeros(num_classes, 784), zeros(num_classes)]
        self.control = [zeros(num_classes, 784), zeros(num_classes)]
        self.table = [zeros(num_clients, num_classes, 784), zeros(num_clients, num_classes)]
        self.rng = np.random.default_rng(seed + 1)

    def local_steps(self, server, i, seed, offset=None):
        """Client ``i``'s K SGD steps from ``server`` on batches drawn with ``seed``, each
        gradient plus SCAFFOLD's correction ``offset`` (None: plain SGD, FedAvg's client;
        ``bench_peers.py`` reuses it); returns the client's ``[W, b]``."""
        torch = self.torch
        f = torch.nn.functional
        rng = np.random.default_rng(seed)
        w, b = (p.clone().requires_grad_(True) for p in server)
        for _ in range(self.k):
            idx = torch.from_numpy(i * self.per + rng.choice(self.per, self.b, replace=False))
            xb = self.x[idx].float() * (1.0 / 255.0)
            loss = f.cross_entropy(xb @ w.T + b, self.y[idx])
            gw, gb = torch.autograd.grad(loss, (w, b))
            if offset is not None:
                gw, gb = gw + offset[0], gb + offset[1]
            with torch.no_grad():
                w -= self.lr * gw
                b -= self.lr * gb
        return [w.detach(), b.detach()]

    def clients(self, server, control, ids, rows, seeds):
        """The local work of clients ``ids`` (their control rows ``rows``): returns the
        summed Δy, summed Δc and the new rows."""
        torch = self.torch
        sum_dy = [torch.zeros_like(p) for p in server]
        sum_dc = [torch.zeros_like(p) for p in server]
        new_rows = []
        for i, row, seed in zip(ids, rows, seeds, strict=True):
            offset = [c - ci for c, ci in zip(control, row, strict=True)]
            y = self.local_steps(server, i, seed, offset)
            with torch.no_grad():
                new = [
                    ci - c + (x - yi) / (self.k * self.lr)
                    for ci, c, x, yi in zip(row, control, server, y, strict=True)
                ]
                for acc, yi, x in zip(sum_dy, y, server, strict=True):
                    acc += yi - x
                for acc, ni, ci in zip(sum_dc, new, row, strict=True):
                    acc += ni - ci
                new_rows.append(new)
        return sum_dy, sum_dc, new_rows

    def round(self, pool=None) -> None:
        ids = self.rng.choice(self.n, self.s, replace=False)
        seeds = self.rng.integers(0, 2**31, self.s)
        rows = [[t[i] for t in self.table] for i in ids]
        if pool is None:
            parts = [self.clients(self.server, self.control, ids, rows, seeds)]
        else:
            half = self.s // 2
            jobs = [
                (self.server, self.control, ids[:half], rows[:half], seeds[:half]),
                (self.server, self.control, ids[half:], rows[half:], seeds[half:]),
            ]
            parts = pool.map(_pool_clients, jobs)
        new_rows = [r for part in parts for r in part[2]]
        for j, p in enumerate(self.server):
            p += sum(part[0][j] for part in parts) / self.s  # η_g = 1
            self.control[j] += sum(part[1][j] for part in parts) / self.n
            self.table[j][ids] = self.torch.stack([r[j] for r in new_rows])

    def checksum(self) -> float:
        return float(self.server[0].abs().sum())


# ----------------------------------------------------------------------------- the driver
def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-python", default=sys.executable, help="interpreter with torch")
    parser.add_argument("--quick", action="store_true", help="test-sized W1 (seconds)")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved repeats")
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(HERE))
    import jax
    import workloads

    w = workloads.get_workload("W1", quick=args.quick)
    k, b = w.steps_and_batch
    setup = dict(
        num_clients=w.num_clients, per_client=w.per_client, num_classes=w.num_classes,
        sampled=w.clients_per_round, steps=k, batch=b, lr=0.1, seed=0,
    )  # fmt: skip
    worker = subprocess.Popen(
        [args.torch_python, str(Path(__file__).resolve()), "--worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip

    def ask(message):
        worker.stdin.write(json.dumps(message) + "\n")
        worker.stdin.flush()
        return json.loads(worker.stdout.readline())

    hello = ask({"setup": setup})
    data, problem = workloads.make_data(w), workloads.make_problem(w)
    sim, engine, state, compile_s, _ = workloads.engine_program(w, "scaffold", data, problem)
    loop = workloads.loop_program(sim, data, workloads.make_hparams("scaffold", sim.algorithm))
    lstate = loop(sim.init(data))  # compiles the loop's functions
    torch_rounds = max(1, w.loop_rounds)
    times: dict[str, list[float]] = {
        k: [] for k in ("engine", "jax_loop", "torch_1t", "torch_2t", "torch_2p")
    }
    for pair in range(args.pairs + 1):  # pair 0 warms everything up
        start = time.perf_counter()
        state = jax.block_until_ready(engine(state))
        engine_ms = 1e3 * (time.perf_counter() - start) / w.rounds
        start = time.perf_counter()
        for _ in range(w.loop_rounds):
            lstate = loop(lstate)
        jax.block_until_ready(lstate)
        loop_ms = 1e3 * (time.perf_counter() - start) / w.loop_rounds
        torch_ms = {v: ask({"time": v, "rounds": torch_rounds})["ms"] for v in list(times)[2:]}
        if pair:
            times["engine"].append(engine_ms)
            times["jax_loop"].append(loop_ms)
            for v, ms in torch_ms.items():
                times[v].append(ms)
        print(
            f"pair {pair}{' (warm-up)' if not pair else ''}: engine {engine_ms:.2f} ms, "
            f"JAX loop {loop_ms:.1f}, " + ", ".join(f"{v} {ms:.1f}" for v, ms in torch_ms.items()),
            flush=True,
        )
    worker.stdin.close()
    worker.wait(timeout=60)
    best = {k: min(v) for k, v in times.items()}
    loops = ("jax_loop", "torch_1t", "torch_2t", "torch_2p")
    ratios = {
        f"{v}_over_engine": float(np.median(np.divide(times[v], times["engine"]))) for v in loops
    }
    best_loop = min(loops, key=lambda v: best[v])
    result = {
        "workload": w.describe(),
        "torch": hello["torch"],
        "jax": jax.__version__,
        "compile_s": compile_s[0],
        "best_ms": best,
        "all_ms": times,
        **ratios,
        "best_loop": best_loop,
        "best_loop_over_engine": ratios[f"{best_loop}_over_engine"],
        "flops_per_round": workloads.flops_per_round(w, "scaffold"),
        "engine_gflops": workloads.flops_per_round(w, "scaffold") / best["engine"] / 1e6,
    }
    print(
        "median per-pair ratio loop/engine: "
        + ", ".join(f"{v} {ratios[f'{v}_over_engine']:.1f}×" for v in loops)
        + f"; engine {best['engine']:.2f} ms/round = {result['engine_gflops']:.1f} GFLOP/s",
        flush=True,
    )
    if args.out:
        from common import write_json

        write_json(args.out, result)
    return result


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker()
    else:
        main()
