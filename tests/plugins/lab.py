"""A research lab's own entries, defined OUTSIDE the package, each with an option of its
own that no ``RunConfig`` field names:

* model ``dropout_mlp``: a one-hidden-layer MLP with dropout (``dropout_rate``, ``width``);
* partitioner ``lognormal``: i.i.d. examples, log-normal client sizes (``size_sigma``);
* dataset ``blobs_npz``: a pooled dataset read from an ``.npz`` file by its own loader
  (``data_dir/blobs.npz``; ``feature_scale`` multiplies the features);
* client sampler ``cyclic``: round r takes the clients ``(r·S + j·stride) mod N``
  (``cyclic_stride``), every client equally often (deterministic, like a fixed rota).

Importing this module registers them (``scaffold-jax run --plugin tests/plugins/lab.py``,
or the config key ``plugins``). ``write_blobs(folder)`` writes the dataset's file.
"""

from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from scaffold_jax import models, sampling, weighting
from scaffold_jax.data import partition, sources
from scaffold_jax.registry import Option

BLOBS_FILE = "blobs.npz"


class DropoutMLP(nn.Module):
    num_classes: int
    width: int
    rate: float

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape((x.shape[0], -1)).astype(jnp.float32)
        x = nn.relu(nn.Dense(self.width)(x))
        x = nn.Dropout(self.rate, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)


def dropout_mlp(input_shape, num_classes, *, key, dropout_rate=0.0, width=16):
    module = DropoutMLP(num_classes, width, dropout_rate)
    return models.classification_problem(module, input_shape, key, train_arg="train")


models.MODELS.register(
    "dropout_mlp",
    models.ModelSpec(
        dropout_mlp,
        "MLP with dropout",
        {
            "dropout_rate": Option(
                0.0, "dropout rate of the hidden layer", "float", low=0.0, high=0.95
            ),
            "width": Option(16, "hidden units", "int", low=1),
        },
    ),
)


def lognormal_split(labels, num_clients, *, seed, sigma):
    return partition.iid_split(len(labels), num_clients, seed, sizes="lognormal", sigma=sigma)


partition.PARTITIONERS.register(
    "lognormal",
    partition.PartitionerSpec(
        lognormal_split,
        {
            "size_sigma": Option(
                1.0, "log-normal sigma of the client sizes", "float", low=0.0, argument="sigma"
            )
        },
    ),
)


def write_blobs(folder, n_train=600, n_test=200, num_classes=4, dim=6, seed=0) -> Path:
    """Gaussian blobs, one centre per class, as ``folder/blobs.npz``."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(num_classes, dim)) * 3

    def split(n):
        y = rng.integers(0, num_classes, n)
        return (centres[y] + rng.normal(size=(n, dim))).astype(np.float32), y.astype(np.int32)

    (x_train, y_train), (x_test, y_test) = split(n_train), split(n_test)
    path = Path(folder) / BLOBS_FILE
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return path


def load_blobs(data_dir, feature_scale=1.0) -> sources.Dataset:
    if data_dir is None:
        raise FileNotFoundError("blobs_npz needs data_dir (--data-dir): a folder with blobs.npz")
    path = Path(data_dir) / BLOBS_FILE
    z = np.load(path)
    return sources.Dataset(
        "blobs_npz",
        str(path),
        {"x": z["x_train"] * np.float32(feature_scale), "y": z["y_train"]},
        {"x": z["x_test"] * np.float32(feature_scale), "y": z["y_test"]},
        int(z["y_train"].max()) + 1,
    )


sources.DATASETS.register(
    "blobs_npz",
    sources.DatasetSpec(
        4,
        loader=load_blobs,
        options={
            "feature_scale": Option(1.0, "multiplies every feature", "float", low=0.0, strict=True)
        },
    ),
)


def cyclic(key, round_index, num_clients, clients_per_round, *, stride=1):
    del key  # deterministic
    start = round_index * clients_per_round
    return (start + jnp.arange(clients_per_round) * stride) % num_clients


sampling.SAMPLERS.register(
    "cyclic",
    sampling.SamplerSpec(
        cyclic,
        {
            "cyclic_stride": Option(
                1, "distance between a round's clients", "int", low=1, argument="stride"
            )
        },
    ),
)


def capped_examples(counts, *, cap):
    """Each client counts its examples up to ``cap`` (a large client does not dominate)."""
    return jnp.minimum(counts, cap)


weighting.WEIGHTINGS.register(
    "capped_examples",
    weighting.WeightingSpec(
        capped_examples,
        "each client counts min(n_i, cap)",
        {"weight_cap": Option(100.0, "the most a client counts", "float", low=0.0, strict=True,
                              argument="cap")},
    ),
)  # fmt: skip


if __name__ == "__main__":  # `python tests/plugins/lab.py FOLDER`: the example dataset's file
    import sys

    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    print(f"wrote {write_blobs(folder)}")
