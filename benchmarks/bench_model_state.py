"""What running statistics (BatchNorm) cost a round: W1's clients and plan with a one-hidden-
layer MLP, without a norm, with BatchNorm under each state policy, and with BatchNorm whose
statistics are not updated (the same loss, ``update_state`` the identity: what the
statistics' own forward pass costs, if XLA does not share it with the gradient's).

All programs are compiled first and then timed interleaved in one process (min and median
of ``--repeats`` calls of R rounds each), with their compile time and XLA's temp memory.

Examples:
  python benchmarks/bench_model_state.py --out benchmarks/results/model_state.json
  python benchmarks/bench_model_state.py --quick
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import workloads
from common import engine_parser, write_json

import scaffold_jax as sj


class Net(nn.Module):
    """784 → ``hidden`` (→ BatchNorm) → ReLU → 10."""

    hidden: int = 200
    batch_norm: bool = True

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        h = x.astype(jnp.float32).reshape((x.shape[0], -1)) * (1.0 / 255.0)
        h = nn.Dense(self.hidden)(h)
        if self.batch_norm:
            m = None if mask is None else mask[:, None]
            h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h, mask=m)
        return nn.Dense(10)(nn.relu(h))


def problems() -> dict[str, sj.Problem]:
    shape = workloads.IMAGE_SHAPE
    key = jr.key(0)
    plain = sj.models.classification_problem(Net(batch_norm=False), shape, key)

    def bn(policy):
        return sj.models.classification_problem(
            Net(), shape, key, train_arg="train", mask_arg="mask", state_policy=policy
        )

    frozen = bn("average")
    frozen = frozen._replace(update_state=lambda params, state, batch, mask, key=None: state)
    return {
        "no_norm": plain,
        "bn_average": bn("average"),
        "bn_local": bn("local"),
        "bn_frozen_stats": frozen,
    }


def main(argv=None) -> dict:
    args = engine_parser(__doc__).parse_args(argv)
    w = workloads.get_workload("W1", quick=args.quick)
    w = dataclasses.replace(w, model="bn-mlp")
    data = workloads.make_data(w)
    print(f"{w.describe()}; model 784-200(-BN)-10", flush=True)
    rows = []
    for name in args.algorithms:
        programs, rounds, info = {}, {}, {}
        for label, problem in problems().items():
            _, run, state, compile_s, memory = workloads.engine_program(w, name, data, problem)
            programs[label], rounds[label] = (run, state), w.rounds
            info[label] = {"compile_s": compile_s[0], "temp_bytes": (memory or {}).get(
                "temp_size_in_bytes")}  # fmt: skip
        wall, _, _ = workloads._interleaved(programs, args.repeats, rounds, stateless=())
        base = min(wall["no_norm"])
        for label, times in wall.items():
            row = {
                "algorithm": name,
                "model": label,
                "ms_per_round_min": 1e3 * min(times),
                "ms_per_round_median": 1e3 * float(np.median(times)),
                "vs_no_norm": min(times) / base,
                **info[label],
            }
            rows.append(row)
            print(
                f"{name:9s} {label:16s} {row['ms_per_round_min']:8.2f} ms/round (median "
                f"{row['ms_per_round_median']:.2f}) {row['vs_no_norm']:5.2f}x no-norm  compile "
                f"{row['compile_s']:.2f} s  temp {(row['temp_bytes'] or 0) / 2**20:.1f} MiB",
                flush=True,
            )
    result = {"workload": w.describe(), "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
