"""A researcher's own algorithm, defined OUTSIDE the package: FedAvg with a damped server
step, ``x ← x + η_g (1 − β) Δx``, with its own declared hyper-parameter β (``damping``).

Importing this module registers it (``scaffold-jax --plugin tests/plugins/damped_fedavg.py``,
or the config key ``plugins``). Its identity, used by the tests: with damping β it equals
FedAvg with server step size η_g (1 − β).
"""

import optax

import scaffold_jax as sj
from scaffold_jax.algorithms import register
from scaffold_jax.algorithms.common import ServerState, aggregate_params, local_update
from scaffold_jax.types import STEP_SIZES, HParam

HPARAMS = {**STEP_SIZES, "damping": HParam(0.5, "server damping beta in [0, 1)", allow_zero=True)}


def damped_fedavg(loss_fn) -> sj.Algorithm:  # written for ONE client
    def init(params):
        return ServerState(params, ()), ()

    def client_update(hparams, server_state, client_state, batches, mask, key):
        _, output, _ = local_update(loss_fn, hparams, server_state.params, batches, mask)
        return client_state, output

    def server_update(hparams, state, outputs, total_weight):
        step = hparams.server_lr * (1.0 - hparams.damping)
        return ServerState(optax.tree.add_scale(state.params, step, aggregate_params(outputs)), ())

    return sj.Algorithm(
        "damped_fedavg",
        init,
        client_update,
        server_update,
        lambda state: state.params,
        hparams=HPARAMS,
    )


# replace=True: the file may be imported twice (by path and by module name) in one process.
register("damped_fedavg", damped_fedavg, "FedAvg (damped)", replace=True)
