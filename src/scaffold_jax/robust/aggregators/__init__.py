"""Robust aggregators over the reporting rows of a round: pure JAX, jit- and vmap-compatible."""

from scaffold_jax.robust.aggregators.bucketing import bucket
from scaffold_jax.robust.aggregators.cclip import cclip
from scaffold_jax.robust.aggregators.geomed import geomed
from scaffold_jax.robust.aggregators.krum import krum, multikrum
from scaffold_jax.robust.aggregators.median import median
from scaffold_jax.robust.aggregators.trimmed_mean import trimmed_mean

__all__ = ["bucket", "cclip", "geomed", "krum", "median", "multikrum", "trimmed_mean"]
