"""The ONE resource policy: how much a program may hold, and how work is cut into chunks.

Used by the engine (how many sampled clients one vmapped chunk of a round runs, and whether
a client table fits), by sweeps (how many configs one chunk of a sweep holds, laid out over
seeds) and by the diagnostics (how many clients one chunk of a full-gradient pass reads).
Everything here is a pure function of sizes and of the memory the device reports, so a
policy is changed (or monkeypatched in a test) in one place.
"""

from __future__ import annotations

import math

import jax

CLIENT_CHUNK_BYTES = 16 * 2**20
"""Working-set budget of one chunk of clients on CPU (``client_chunk="auto"``), sized so
that a chunk's K local steps run from a server core's L2/L3 caches."""


_FALLBACK_AVAILABLE_BYTES = 2 << 30


def available_memory_bytes(device: jax.Device | None = None) -> int:
    """Free memory on ``device`` (default the first): ``bytes_limit − bytes_in_use`` on an
    accelerator; on CPU ``MemAvailable`` of ``/proc/meminfo``, or less when the process's
    address space is limited (``ulimit -v``, ``prlimit --as``: what the limit leaves of it);
    2 GiB when none can be read. (A sweep sizes its chunks from it; :meth:`Simulation.check`
    refuses a client table larger than it, :func:`scaffold_jax.models.build` a model.)"""
    device = jax.devices()[0] if device is None else device
    if device.platform != "cpu":
        try:
            stats = device.memory_stats() or {}
            if "bytes_limit" in stats:
                return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        except Exception:  # backends without memory stats raise their own errors
            pass
    known = [m for m in (_meminfo_available(), _address_space_left()) if m is not None]
    return min(known) if known else _FALLBACK_AVAILABLE_BYTES


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _address_space_left(status: str = "/proc/self/status") -> int | None:
    """What RLIMIT_AS (``ulimit -v``, ``prlimit --as``) leaves of the process's address
    space: the limit minus ``VmSize``; None when there is no limit or it cannot be read.
    (An allocation beyond it fails inside XLA, which aborts the process.)"""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):  # not POSIX
        return None
    if limit == resource.RLIM_INFINITY or limit < 0:
        return None
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return max(0, limit - int(line.split()[1]) * 1024)  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def format_bytes(num: int) -> str:
    """``1073741824`` -> ``'1.0 GiB'``."""
    value, unit = float(num), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            break
        value /= 1024
    return f"{int(value)} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


def balanced_chunk(num: int, chunk: int) -> int | None:
    """A chunk size of at most ``chunk`` that splits ``num`` evenly when it can.

    The largest divisor of ``num`` in ``[chunk / 2, chunk]``, else ``ceil(num / n)`` for the
    fewest chunks n; None when one chunk holds all ``num``.
    """
    if chunk >= num:
        return None
    for size in range(chunk, max(1, chunk // 2) - 1, -1):
        if num % size == 0:
            return size
    return -(-num // -(-num // chunk))


#: Examples (times vectors, for batched Hessian-vector products) one vmapped chunk of
#: clients processes in the diagnostics' full-data passes. 2**17 float32 logits of width 10
#: is ~5 MB; an MLP of width 256 needs ~130 MB of activations per chunk.
DEFAULT_EXAMPLES_PER_CHUNK = 2**17


def clients_per_chunk(examples_per_chunk: int, per_client: int, num: int) -> int:
    """Clients per vmapped chunk of a full-data pass: ~``examples_per_chunk`` examples, at
    least 1, at most ``num``."""
    return int(max(1, min(num, examples_per_chunk // max(1, per_client))))


#: Per sampled client, the number of params-sized float32 buffers the round keeps live.
WORK_BUFFERS_PER_CLIENT = 8
#: Fraction of the free memory a sweep may use when no budget is given.
DEFAULT_MEMORY_FRACTION = 0.5


def choose_chunk_size(
    num_configs: int,
    bytes_per_config: int,
    memory_budget_bytes: int | None = None,
    max_configs_per_chunk: int | None = None,
) -> int:
    """The most configs a chunk may hold: as many as the budget holds, capped, at least 1.

    :func:`chunk_shape` then lays the chunk out over seeds and configs.

    Args:
      num_configs: C.
      bytes_per_config: from :func:`scaffold_jax.sweep.config_bytes`.
      memory_budget_bytes: the budget (default: half of :func:`available_memory_bytes`).
      max_configs_per_chunk: an upper bound set by the caller.

    Returns:
      An int in ``[1, C]``.

    Examples:
      >>> choose_chunk_size(10, bytes_per_config=100, memory_budget_bytes=450)
      4
      >>> choose_chunk_size(10, bytes_per_config=100, memory_budget_bytes=10**6)
      10
    """
    if memory_budget_bytes is None:
        memory_budget_bytes = int(DEFAULT_MEMORY_FRACTION * available_memory_bytes())
    chunk = min(num_configs, max(1, int(memory_budget_bytes // max(bytes_per_config, 1))))
    if max_configs_per_chunk is not None:
        if int(max_configs_per_chunk) < 1:
            raise ValueError(
                f"max_configs_per_chunk = {max_configs_per_chunk} is invalid: it must be >= 1."
            )
        chunk = min(chunk, int(max_configs_per_chunk))
    return chunk


def chunk_shape(num_seeds: int, group_size: int, max_configs: int) -> tuple[int, int]:
    """``(g, m)``: seeds and configs per seed in a chunk, with ``g × m ≤ max_configs``.

    Whole seed groups first (m = M, as many seeds as fit), else parts of one group; both
    evened out so the chunks are as equal as they can be (less padding).

    Examples:
      >>> chunk_shape(4, 8, 32), chunk_shape(4, 8, 20), chunk_shape(4, 8, 5)
      ((4, 8), (2, 8), (1, 4))
    """
    m = min(group_size, max(1, max_configs))
    m = math.ceil(group_size / math.ceil(group_size / m))
    g = min(num_seeds, max(1, max_configs // m))
    g = math.ceil(num_seeds / math.ceil(num_seeds / g))
    return g, m


# ------------------------------------------------------- the round's chunks of clients on CPU
def _has_primitive(jaxpr, name: str) -> bool:
    """Whether ``jaxpr`` or any jaxpr nested in its equations (custom_vjp, pjit, scan...)
    applies the primitive ``name``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return True
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr holds a Jaxpr
                if hasattr(inner, "eqns") and _has_primitive(inner, name):
                    return True
    return False


def _batch_like(data, plan):
    """One local step's batch of client 0, as shapes (nothing is read or allocated)."""
    import jax.numpy as jnp
    import jax.random as jr

    return jax.eval_shape(lambda: data.client_batches(jnp.int32(0), jr.key(0), plan))[0]


def one_client_at_a_time(problem, plan, data) -> bool:
    """Whether the loss contains a convolution or a loop (a recurrent model), read from its
    jaxpr. On CPU such models run one client at a time: vmapped clients, each with its own
    kernels, make every convolution a grouped one and every recurrent matmul a batched
    one, which XLA's CPU backend runs several times slower than one client's own
    (benchmarks/README.md, W4 and W5)."""
    batches = _batch_like(data, plan)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batches)
    jaxpr = jax.make_jaxpr(problem.loss_fn)(problem.params, batch).jaxpr
    return any(_has_primitive(jaxpr, name) for name in ("conv_general_dilated", "scan", "while"))


def client_bytes(problem, plan, data) -> int:
    """The working set of one sampled client's local steps, in bytes: its ``[K, B, ...]``
    batches, one step's batch in float32 and four params-sized buffers."""
    batches = _batch_like(data, plan)
    params = jax.tree.leaves(problem.params)
    return sum(
        math.prod(a.shape) * a.dtype.itemsize + 4 * math.prod(a.shape[1:])
        for a in jax.tree.leaves(batches)
    ) + 4 * sum(4 * math.prod(getattr(a, "shape", ())) for a in params)


def client_chunk(setting, num_sampled: int, splits_clients: bool, one_at_a_time: bool,
                 per_client_bytes) -> int | None:  # fmt: skip
    """How many sampled clients one vmapped chunk of a round runs (None: all of them), for
    ``client_chunk`` = ``setting`` (see :meth:`Simulation.resolve_client_chunk
    <scaffold_jax.engine.Simulation.resolve_client_chunk>`): "auto" picks None on an
    accelerator or a layout that ``splits_clients`` over devices, one client at a time
    for ``one_at_a_time`` models on CPU, and otherwise as many clients as fit
    :data:`CLIENT_CHUNK_BYTES` (``per_client_bytes()`` each), balanced."""
    if setting is None or splits_clients:
        return None
    if setting != "auto":
        return None if setting >= num_sampled else setting
    if jax.default_backend() != "cpu":
        return None
    if one_at_a_time:
        return 1
    return balanced_chunk(num_sampled, max(1, CLIENT_CHUNK_BYTES // per_client_bytes()))
