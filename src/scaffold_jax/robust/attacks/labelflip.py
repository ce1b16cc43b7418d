"""Label flipping, a data-poisoning attack: a malicious client trains on labels
y → C − 1 − y for everything it computes (its update, its own state, its messages), all
honest with respect to the flipped data; classification only (C classes of integer labels
``batch["y"]``).

``labelflip(batches, malicious, num_classes) -> batches``: one client's ``[K, B, ...]``
batches, with ``malicious`` its (traced) bool. Unlike the message attacks it acts before
the local work, so the attack wrapper applies it to the batches the client trains on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp


def labelflip(batches: Mapping[str, Any], malicious: jax.Array, num_classes: int) -> dict:
    """``batches`` with ``y`` flipped to C − 1 − y where ``malicious``."""
    if "y" not in batches:
        raise ValueError(
            "attack = 'labelflip' flips the integer labels batch['y'] of a classifier; this "
            f"data has no 'y' (it holds {', '.join(batches)}): use a message attack."
        )
    y = batches["y"]
    return {**batches, "y": jnp.where(malicious, num_classes - 1 - y, y).astype(y.dtype)}
