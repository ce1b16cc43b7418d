"""The machine's limits, measured through JAX: dense matmul GFLOP/s and memory bandwidth.

These are the denominators of "achieved FLOP/s as a fraction of peak" in the workload
benchmarks. Both are measured, not taken from a data sheet: on a shared VM the peak you
can get is what matters, and it moves with the neighbours' load, so run this in the same
process (or at least the same minute) as the workloads. Min-of-N timing throughout.

* matmul: ``a @ b`` on square float32 (and bfloat16) matrices, 2·n³ FLOPs;
* bandwidth: a donated in-place ``x ← a·x + b`` on a 256 MiB float32 array (read + write,
  no allocation, so no page faults), and ``numpy.copyto`` between two preallocated arrays.

Usage:
  python benchmarks/bench_machine.py [--quick] [--out machine.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import write_json


def _min_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(n: int, dtype=jnp.float32, repeats: int = 7) -> float:
    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    return 2 * n**3 / _min_time(f, a, b, repeats=repeats) / 1e9


def stream_gbps(mib: int = 256, repeats: int = 7) -> float:
    """Read + write bandwidth of a donated in-place scale-and-add."""
    n = mib * 2**20 // 4
    step = jax.jit(lambda x: x * 0.999 + 0.001, donate_argnums=0)
    x = jnp.ones((n,), jnp.float32)
    x = step(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = step(x)
        jax.block_until_ready(x)
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best / 1e9


def numpy_copy_gbps(mib: int = 256, repeats: int = 7) -> float:
    n = mib * 2**20 // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best / 1e9


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def describe() -> dict:
    """Host and JAX environment (no measurements)."""
    devices = jax.devices()
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def machine_slug(info: dict | None = None) -> str:
    """A file name for the results of this machine, e.g. ``cpu-amd-epyc-2c``."""
    info = info or describe()
    if info["backend"] == "cpu":
        model = "".join(c if c.isalnum() else "-" for c in info["cpu_model"].lower())
        model = "-".join(p for p in model.split("-") if p)
        return f"cpu-{model}-{info['cpu_count']}c"
    kind = "".join(c if c.isalnum() else "-" for c in info["device_kind"].lower())
    return f"{info['backend']}-{kind}-{len(info['devices'])}x"


def measure(quick: bool = False) -> dict:
    """Matmul and bandwidth figures; ``peak_gflops`` is the best float32 matmul."""
    sizes = (512, 1024) if quick else (1024, 2048)
    repeats = 3 if quick else 7
    if jax.default_backend() != "cpu":
        sizes = (4096, 8192)
    result = {**describe(), "matmul_f32_gflops": {}, "matmul_bf16_gflops": {}}
    for n in sizes:
        result["matmul_f32_gflops"][str(n)] = matmul_gflops(n, jnp.float32, repeats)
        result["matmul_bf16_gflops"][str(n)] = matmul_gflops(n, jnp.bfloat16, repeats)
    mib = 64 if quick else 256
    result["stream_gbps"] = stream_gbps(mib, repeats)
    if jax.default_backend() == "cpu":
        result["numpy_copy_gbps"] = numpy_copy_gbps(mib, repeats)
    result["peak_gflops"] = max(result["matmul_f32_gflops"].values())
    result["peak_gbps"] = max(result["stream_gbps"], result.get("numpy_copy_gbps", 0.0))
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    result = measure(args.quick)
    print(f"{result['cpu_model']} ({result['cpu_count']} CPUs), {result['devices']}")
    for n, g in result["matmul_f32_gflops"].items():
        print(f"matmul {n}³ f32 {g:8.1f} GFLOP/s   bf16 {result['matmul_bf16_gflops'][n]:8.1f}")
    print(f"stream (in place, donated) {result['stream_gbps']:.1f} GB/s", end="")
    if "numpy_copy_gbps" in result:
        print(f"   numpy copy {result['numpy_copy_gbps']:.1f} GB/s", end="")
    print(f"   load average {result['load_average']}")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
