"""What flax's ``nn.Conv`` costs against ``sj.models.Conv`` in a user's own model on CPU:
the number behind the warning of ``models.classification_problem`` and the README's
"Bringing your own model".

Two models, each built twice, identical but for the convolution layer (``nn.Conv`` or
``sj.models.Conv``: the same params and outputs): ``small``, the README's example (one
3×3 convolution of 16 channels, a 2×2 max-pool, a dense layer), and ``mcmahan``, the
McMahan et al. CNN of ``models.CNN`` (two 5×5 convolutions of 32 and 64 channels, a dense
layer of 512). Data: N clients of 28×28 uint8 images (random, Fashion-MNIST's layout),
10 classes; a round samples S clients for K steps of B examples (a fixed plan).
``Simulation.run_rounds`` as users get it (``client_chunk="auto"``: one client at a time
on CPU for a convolutional model); ms per round, min of ``--repeats`` calls of
``--rounds`` rounds, the two variants interleaved after a warm-up call.

Measured on the 2-core AMD EPYC VM while other jobs ran on it (load average 10-14, so
the absolute times are inflated and noisy; each row one process, defaults unless noted),
ms per round, nn.Conv / sj.models.Conv:

======== ========= ======================================================================
model    algorithm runs
======== ========= ======================================================================
small    FedAvg    1008 / 242 (4.17×); 612 / 296 (2.07×, ``--repeats 6``); 466 / 233 (2.00×,
                   ``--repeats 8``)
small    SCAFFOLD  1057 / 820 (1.29×); 622 / 249 (2.50×, ``--repeats 6``); 798 / 521 (1.53×,
                   ``--repeats 8``)
mcmahan  FedAvg    38,720 / 4,107 (9.43×); 57,692 / 5,232 (11.03×, ``--rounds 1 --repeats 2``)
mcmahan  SCAFFOLD  86,367 / 8,683 (9.95×, ``--rounds 1 --repeats 2``)
======== ========= ======================================================================

Examples:
  python benchmarks/bench_flax_conv.py
  python benchmarks/bench_flax_conv.py --models small --algorithms fedavg --repeats 5
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import workloads  # noqa: E402
from common import write_json  # noqa: E402

import scaffold_jax as sj  # noqa: E402


class SmallCNN(nn.Module):
    """The README's example CNN, with the convolution layer ``conv``."""

    conv: Callable = sj.models.Conv

    @nn.compact
    def __call__(self, x):
        x = x[..., None].astype("float32") / 255.0
        x = nn.relu(self.conv(16, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


class McMahanCNN(nn.Module):
    """``models.CNN`` (two 5×5 convolutions, 32 and 64 channels, a dense layer of 512),
    with the convolution layer ``conv``."""

    conv: Callable = sj.models.Conv

    @nn.compact
    def __call__(self, x):
        h = x[..., None].astype("float32") / 255.0
        for features in (32, 64):
            h = nn.relu(self.conv(features, (5, 5), padding="SAME")(h))
            h = nn.max_pool(h, (2, 2), strides=(2, 2))
        h = nn.relu(nn.Dense(512)(h.reshape((h.shape[0], -1))))
        return nn.Dense(10)(h)


MODELS = {"small": SmallCNN, "mcmahan": McMahanCNN}
CONVS = {"nn.Conv": nn.Conv, "sj.models.Conv": sj.models.Conv}


def make_data(num_clients: int, per_client: int, seed: int = 0) -> sj.FederatedData:
    rng = np.random.default_rng(seed)
    clients = [
        {"x": rng.integers(0, 256, (per_client, 28, 28), dtype=np.uint8),
         "y": rng.integers(0, 10, per_client).astype(np.int32)}
        for _ in range(num_clients)
    ]  # fmt: skip
    return sj.from_client_arrays(clients, test={"x": clients[0]["x"], "y": clients[0]["y"]})


def program(model: str, conv: str, algorithm: str, data, args):
    """``(run, state)``: ``run(state)`` runs ``args.rounds`` rounds, compiled."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nn.Conv's warning is what this measures
        problem = sj.models.classification_problem(MODELS[model](CONVS[conv]), (28, 28), jr.key(0))
    alg = workloads.make_algorithm(algorithm, problem.loss_fn)
    plan = sj.BatchPlan.fixed(args.batch_size, args.local_steps)
    sim = sj.Simulation(alg, problem, plan, args.clients_per_round)
    hp, key = workloads.make_hparams(algorithm, alg), jr.key(0)
    state = sim.init(data)
    compiled = sim.run_rounds.lower(hp, state, data, key, num_rounds=args.rounds).compile()
    return (lambda st: compiled(hp, st, data, key)[0]), state


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=sorted(MODELS), choices=sorted(MODELS))
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "scaffold"])
    parser.add_argument("--num-clients", type=int, default=20)
    parser.add_argument("--per-client", type=int, default=100)
    parser.add_argument("--clients-per-round", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per timed call")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per variant")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    data = make_data(args.num_clients, args.per_client)
    print(
        f"N={args.num_clients} x {args.per_client} images, S={args.clients_per_round}, "
        f"K={args.local_steps}, B={args.batch_size}; {jax.devices()[0].device_kind}",
        flush=True,
    )
    rows = []
    for model in args.models:
        for algorithm in args.algorithms:
            runs = {conv: program(model, conv, algorithm, data, args) for conv in CONVS}
            states = {conv: state for conv, (_, state) in runs.items()}
            times: dict[str, list[float]] = {conv: [] for conv in CONVS}
            for repeat in range(args.repeats + 1):  # call 0 is the warm-up
                for conv, (run, _) in runs.items():
                    start = time.perf_counter()
                    states[conv] = jax.block_until_ready(run(states[conv]))
                    if repeat:
                        times[conv].append((time.perf_counter() - start) / args.rounds)
            best = {conv: min(t) * 1e3 for conv, t in times.items()}
            ratio = best["nn.Conv"] / best["sj.models.Conv"]
            rows.append({"model": model, "algorithm": algorithm, "ms": best, "ratio": ratio})
            print(
                f"{model:<8} {algorithm:<9} nn.Conv {best['nn.Conv']:8.1f} ms  "
                f"sj.models.Conv {best['sj.models.Conv']:8.1f} ms  ratio {ratio:.2f}",
                flush=True,
            )
    out = {"settings": vars(args), "rows": rows}
    if args.out:
        write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
