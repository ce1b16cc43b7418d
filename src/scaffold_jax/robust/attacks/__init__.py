"""Byzantine attacks: on one uplink entry, ``fn(u, malicious, benign, key, **params) ->
[S, D]``; label flipping on a client's batches before its local work."""

from scaffold_jax.robust.attacks.alie import alie
from scaffold_jax.robust.attacks.gaussian import gaussian
from scaffold_jax.robust.attacks.ipm import ipm
from scaffold_jax.robust.attacks.labelflip import labelflip
from scaffold_jax.robust.attacks.signflip import signflip

__all__ = ["alie", "gaussian", "ipm", "labelflip", "signflip"]
