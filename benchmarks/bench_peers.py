"""W1 FedAvg and SCAFFOLD in scaffold_jax against FedJAX, pfl-research, Flower and a
PyTorch per-client loop, each peer in its own virtualenv, measured side by side.

The workload is W1 (1,000 clients × 60 uint8 28×28 images, 10 classes, logistic
regression, S = 100 clients a round, K = 5 local steps of B = 12, η_l = 0.05, η_g = 1),
the same images everywhere, labelled by a fixed random linear teacher so that the loss
can fall (``w1_arrays``). Each peer runs as the peer's documentation writes a simulation:

* ``engine``: scaffold_jax, ``Simulation.run_rounds`` (R rounds in one compiled program),
  in this interpreter; APFL adaptive, α⁰ = 0.25 (its x trains as FedAvg's, in both);
* ``torch``: the PyTorch per-client loop of ``bench_torch.py`` (``_TorchW1``, one intra-op
  thread: autograd on ``cross_entropy(x Wᵀ + b)``, K steps per sampled client) — the loop
  Flower's and FL-bench's clients run, without their data loaders and optimizer objects;
* ``fedjax``: ``fedjax.algorithms.fed_avg.federated_averaging`` and
  ``fedjax.algorithms.apfl.adaptive_personalized_federated_learning`` (adaptive APFL, its
  clients' states in a host dict; ``fedjax.for_each_client`` underneath) over an
  ``InMemoryFederatedData`` with a haiku model, clients drawn by
  ``UniformGetClientSampler``; FedJAX has no SCAFFOLD;
* ``pfl``: pfl-research's ``FederatedAveraging`` and ``SCAFFOLD`` (option II) on its
  ``SimulatedBackend`` with a ``PyTorchModel``, users from a ``FederatedDataset``;
* ``flower``: Flower's simulation engine (``flwr.simulation.run_simulation``, Ray backend,
  one CPU per ClientApp) with its ``FedAvg`` strategy; each ClientApp runs the ``torch``
  peer's local steps, so Flower's column is that loop plus Flower's machinery. Flower has
  no SCAFFOLD strategy, so FedAvg only.

A peer runs in the interpreter given by its flag (``--torch-python``, ``--fedjax-python``,
``--pfl-python``, ``--flower-python``; ``benchmarks/peers/setup.sh`` builds them), as a
worker process this script talks to over pipes; a peer without its flag is left out.
Everything is interleaved (engine, then each peer, ``--repeats`` passes after a warm-up),
each timed call lasting about ``--block-s`` seconds; each column is the minimum per round
over the passes, and the ratio to the engine the median of the per-pass ratios. Start-up
(compilation, JIT, Ray) is reported apart: ``first_call_s`` is the first call's wall time,
Flower's ``overhead_s`` the start-up each ``run_simulation`` call pays before its rounds.
Last, each variant runs 20 rounds from zero parameters and the training loss over all
60,000 examples after rounds 5, 10, 15 and 20 is printed, to show they train alike.

Examples:
  bash benchmarks/peers/setup.sh     # the virtualenvs under /tmp/peers
  .venv/bin/python benchmarks/bench_peers.py --torch-python /tmp/peers/torch/bin/python \\
      --fedjax-python /tmp/peers/fedjax/bin/python --pfl-python /tmp/peers/pfl/bin/python \\
      --flower-python /tmp/peers/flower/bin/python --out benchmarks/results/peers.json
  .venv/bin/python benchmarks/bench_peers.py --quick --torch-python /tmp/peers/torch/bin/python

``--robust`` measures something else instead (:func:`robust_main`): Flower's ``FedMedian``
and ``Krum`` aggregation of S W1-sized replies against our median and Krum (the W1 FedAvg
round with each, and the aggregator alone), interleaved:
  .venv/bin/python benchmarks/bench_peers.py --robust --flower-python \\
      /tmp/peers/flower/bin/python --out benchmarks/results/peers_robust.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PEERS = {  # peer: the algorithms it has
    "torch": ("fedavg", "scaffold"),
    "fedjax": ("fedavg", "apfl"),
    "pfl": ("fedavg", "scaffold"),
    "flower": ("fedavg",),
}
ALGORITHMS = ("fedavg", "scaffold", "apfl")
APFL_ALPHA = 0.25  # APFL's initial mixing weight (adaptive), FedJAX's client_coefficient
TRACE_EVERY, TRACE_BLOCKS = 5, 4  # the loss after rounds 5, 10, 15, 20


# ----------------------------------------------------------------------------- the data
def w1_arrays(num_clients, per_client, num_classes, seed, **_):
    """W1's images (``[n, 28, 28]`` uint8, drawn as ``workloads.make_data`` draws them:
    client i holds rows ``[i n_i, (i + 1) n_i)``) and labels (int64) of a fixed random
    linear teacher on the centred pixels, which the logistic regression can learn."""
    rng = np.random.default_rng(seed)
    n = num_clients * per_client
    x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    teacher = np.random.default_rng(seed + 7).standard_normal((28 * 28, num_classes))
    y = np.empty(n, np.int64)
    for s in range(0, n, 10_000):  # in slices: float64 pixels of all 60,000 are 376 MB
        y[s : s + 10_000] = np.argmax((x[s : s + 10_000].reshape(-1, 784) / 255 - 0.5) @ teacher, 1)
    return x, y


def mean_loss(params, x, y) -> float:
    """Mean cross-entropy of the logistic regression ``params = (W [C, 784], b [C])`` over
    all of ``x``, ``y``."""
    w, b = (np.asarray(p, np.float32) for p in params)
    total = 0.0
    for s in range(0, len(x), 10_000):
        z = (x[s : s + 10_000].reshape(-1, 784) / np.float32(255)) @ w.T + b
        z -= z.max(axis=1, keepdims=True)
        picked = z[np.arange(len(z)), y[s : s + 10_000]]
        total += float(np.sum(np.log(np.exp(z).sum(axis=1)) - picked))
    return total / len(x)


# ----------------------------------------------------------------------------- the peers
class _Peer:
    """A peer's simulation: ``new(algorithm)`` a state at zero parameters, ``run(state, R)``
    R rounds (returns the state and None, or, when the peer times its own rounds,
    ``{"seconds", "rounds"}``), ``params(state)`` as ``(W [C, 784], b [C])``."""

    warmups = 2  # calls before timing: the first compiles, the second sizes the blocks

    def __init__(self, setup):
        self.setup = setup
        self.x, self.y = w1_arrays(**setup)

    def trace(self, algorithm, every, blocks):
        state, out = self.new(algorithm), []
        for _ in range(blocks):
            state, _ = self.run(state, every)
            out.append(self.params(state))
        return out


def _torch_world(setup, x, y):
    """``bench_torch._TorchW1`` (one intra-op thread) on the given images and labels."""
    import torch
    from bench_torch import _TorchW1

    torch.set_num_threads(1)
    keys = ("num_clients", "per_client", "num_classes", "lr", "seed")
    world = _TorchW1(
        **{k: setup[k] for k in keys},
        sampled=setup["clients_per_round"],
        steps=setup["steps"],
        batch=setup["batch"],
    )
    world.x, world.y = torch.from_numpy(x.reshape(len(x), -1)), torch.from_numpy(y)
    return world


class _TorchPeer(_Peer):
    def versions(self):
        import torch

        return {"torch": torch.__version__}

    def new(self, algorithm):
        return algorithm, _torch_world(self.setup, self.x, self.y)

    def run(self, state, rounds):
        algorithm, world = state
        for _ in range(rounds):
            if algorithm == "scaffold":
                world.round()
            else:
                _torch_fedavg_round(world)
        return state, None

    def params(self, state):
        return [p.numpy().copy() for p in state[1].server]


def _torch_fedavg_round(world) -> None:
    """FedAvg with ``_TorchW1``'s local steps and sampling: ``x ← mean of the clients' y``."""
    ids = world.rng.choice(world.n, world.s, replace=False)
    seeds = world.rng.integers(0, 2**31, world.s)
    total = [world.torch.zeros_like(p) for p in world.server]
    for i, seed in zip(ids, seeds, strict=True):
        for acc, p in zip(total, world.local_steps(world.server, i, seed), strict=True):
            acc += p
    for p, acc in zip(world.server, total, strict=True):
        p.copy_(acc / world.s)


class _FedJAXPeer(_Peer):
    def __init__(self, setup):
        super().__init__(setup)
        import fedjax
        import haiku as hk
        import jax.numpy as jnp
        from fedjax.algorithms import apfl, fed_avg

        n, c = setup["per_client"], setup["num_classes"]
        self.fd = fedjax.InMemoryFederatedData(
            {
                str(i).encode(): {
                    "x": self.x[i * n : (i + 1) * n],
                    "y": self.y[i * n : (i + 1) * n],
                }
                for i in range(setup["num_clients"])
            }
        )

        def forward(batch):
            h = batch["x"].reshape(batch["x"].shape[0], -1).astype(jnp.float32) / 255.0
            return hk.Linear(c, w_init=hk.initializers.Constant(0.0))(h)

        self.model = fedjax.create_model_from_haiku(
            hk.transform(forward),
            {"x": self.x[:1]},
            lambda batch, preds: fedjax.metrics.unreduced_cross_entropy_loss(batch["y"], preds),
        )
        common = (
            fedjax.model_grad(self.model),
            fedjax.optimizers.sgd(setup["lr"]),
            fedjax.optimizers.sgd(1.0),
            fedjax.ShuffleRepeatBatchHParams(
                batch_size=setup["batch"], num_epochs=None, num_steps=setup["steps"]
            ),
        )
        self.algorithms = {
            "fedavg": fed_avg.federated_averaging(*common),
            # Adaptive (FedJAX learns its coefficients always), client states in a dict.
            "apfl": apfl.adaptive_personalized_federated_learning(*common, APFL_ALPHA),
        }

    def versions(self):
        import haiku
        import jax
        from fedjax import version

        return {"fedjax": version.__version__, "jax": jax.__version__, "haiku": haiku.__version__}

    def new(self, algorithm):
        import fedjax
        import jax

        chosen = self.algorithms[algorithm]
        state = chosen.init(self.model.init(jax.random.PRNGKey(self.setup["seed"])))
        sampler = fedjax.client_samplers.UniformGetClientSampler(
            self.fd, self.setup["clients_per_round"], self.setup["seed"]
        )
        return state, sampler, chosen

    def run(self, state, rounds):
        import jax

        server, sampler, chosen = state
        for _ in range(rounds):
            server, _ = chosen.apply(server, sampler.sample())
        jax.block_until_ready(server.params)
        return (server, sampler, chosen), None

    def params(self, state):
        linear = state[0].params["linear"]
        return [np.asarray(linear["w"]).T, np.asarray(linear["b"])]


class _PflPeer(_Peer):
    def __init__(self, setup):
        super().__init__(setup)
        import torch
        from pfl.data.dataset import Dataset

        torch.set_num_threads(1)  # as the torch peer: faster for W1's tiny products
        n = setup["per_client"]
        x, y = torch.from_numpy(self.x), torch.from_numpy(self.y)
        self.users = {
            i: Dataset([x[i * n : (i + 1) * n], y[i * n : (i + 1) * n]], user_id=i)
            for i in range(setup["num_clients"])
        }

    def versions(self):
        import torch
        from pfl.version import __version__

        return {"pfl": __version__, "torch": torch.__version__}

    def new(self, algorithm):
        import torch
        from pfl.aggregate.simulate import SimulatedBackend
        from pfl.data.federated_dataset import FederatedDataset
        from pfl.data.sampling import get_user_sampler
        from pfl.metrics import Weighted
        from pfl.model.pytorch import PyTorchModel

        class LogReg(torch.nn.Module):
            def __init__(self, classes):
                super().__init__()
                self.linear = torch.nn.Linear(784, classes)
                torch.nn.init.zeros_(self.linear.weight)
                torch.nn.init.zeros_(self.linear.bias)

            def forward(self, x):
                return self.linear(x.reshape(len(x), -1).float() * (1 / 255))

            def loss(self, x, y, eval=False):  # noqa: A002 (pfl's signature)
                return torch.nn.functional.cross_entropy(self(x), y)

            def metrics(self, x, y, eval=False):  # noqa: A002
                return {"loss": Weighted.from_unweighted(self.loss(x, y).item())}

        net = LogReg(self.setup["num_classes"])
        model = PyTorchModel(
            net,
            local_optimizer_create=torch.optim.SGD,
            central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
        )
        data = FederatedDataset(
            self.users.__getitem__, get_user_sampler("minimize_reuse", list(self.users))
        )
        return algorithm, net, model, SimulatedBackend(training_data=data, val_data=None)

    def _run(self, state, rounds, callbacks=()):
        from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
        from pfl.algorithm.scaffold import SCAFFOLD, SCAFFOLDParams
        from pfl.data.user_state import InMemoryUserStateStorage
        from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams

        algorithm, _, model, backend = state[:4]
        common = dict(
            central_num_iterations=rounds,
            evaluation_frequency=rounds + 1,  # no evaluation during the run
            train_cohort_size=self.setup["clients_per_round"],
            val_cohort_size=None,
        )
        if algorithm == "scaffold":
            if len(state) == 4:  # the clients' controls outlive one run() call
                state = (*state, InMemoryUserStateStorage())
            algo = SCAFFOLD()
            params = SCAFFOLDParams(
                **common,
                population=self.setup["num_clients"],
                use_gradient_as_control_variate=False,
                user_state_storage=state[4],
            )
        else:
            algo, params = FederatedAveraging(), NNAlgorithmParams(**common)
        algo.run(
            algorithm_params=params,
            backend=backend,
            model=model,
            model_train_params=NNTrainHyperParams(
                local_batch_size=self.setup["batch"],
                # W1's K·B is one pass over a client's n_i examples (pfl's SCAFFOLD
                # takes epochs, not steps)
                local_num_epochs=self.setup["steps"]
                * self.setup["batch"]
                // self.setup["per_client"],
                local_learning_rate=self.setup["lr"],
            ),
            model_eval_params=NNEvalHyperParams(local_batch_size=None),
            callbacks=list(callbacks),
        )
        return state

    def run(self, state, rounds):
        return self._run(state, rounds), None

    def params(self, state):
        linear = state[1].linear
        return [linear.weight.detach().numpy().copy(), linear.bias.detach().numpy().copy()]

    def trace(self, algorithm, every, blocks):
        """One run of ``every × blocks`` rounds (pfl's SCAFFOLD zeroes its server control
        at the start of each ``run``), the parameters kept after every ``every``."""
        from pfl.callback.base import TrainingProcessCallback
        from pfl.metrics import Metrics

        state, out, params = self.new(algorithm), [], self.params

        class Snapshot(TrainingProcessCallback):
            def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
                if (central_iteration + 1) % every == 0:
                    out.append(params(state))
                return False, Metrics()

        self._run(state, every * blocks, [Snapshot()])
        return out


_FLOWER_WORLD: dict = {}  # a Ray actor's _TorchW1, built by its first ClientApp call


def _flower_train(msg, context):
    """Flower ClientApp ``train``: the ``torch`` peer's K local steps from the received
    arrays, on the client's rows (``partition-id``), batches drawn from (seed, round,
    client); replies the new arrays weighted by the client's example count."""
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    setup = json.loads(msg.content["config"]["setup"])
    if not _FLOWER_WORLD:
        _FLOWER_WORLD["world"] = _torch_world(setup, *w1_arrays(**setup))
    world = _FLOWER_WORLD["world"]
    i = int(context.node_config["partition-id"])
    server = [torch.tensor(a) for a in msg.content["arrays"].to_numpy_ndarrays()]
    seed = [setup["seed"], int(msg.content["config"]["server-round"]), i]
    params = [p.numpy() for p in world.local_steps(server, i, seed)]
    content = RecordDict(
        {
            "arrays": ArrayRecord(params),
            "metrics": MetricRecord({"num-examples": setup["per_client"]}),
        }
    )
    return Message(content=content, reply_to=msg)


class _FlowerPeer(_Peer):
    """Each ``run`` is one ``run_simulation`` (Ray started and stopped); its first round
    waits for Ray and the ClientApp actors, so it is run untimed before the R timed ones."""

    warmups = 1  # every call starts afresh; its own first round is the warm-up

    def versions(self):
        import flwr
        import ray
        import torch

        return {"flwr": flwr.__version__, "ray": ray.__version__, "torch": torch.__version__}

    def new(self, algorithm):
        c = self.setup["num_classes"]
        return [np.zeros((c, 784), np.float32), np.zeros(c, np.float32)]

    def _simulate(self, params, rounds, every=None):
        """``rounds`` Flower rounds from ``params``: the times at which each ended
        (``[0]``: before the first; ``evaluate_fn`` is called then and after each round)
        and the parameters after every ``every``-th round and at the end."""
        import bench_peers  # by name, so that Ray's actors import it rather than unpickle it
        from flwr.app import ArrayRecord, ConfigRecord
        from flwr.clientapp import ClientApp
        from flwr.serverapp import ServerApp
        from flwr.serverapp.strategy import FedAvg
        from flwr.simulation import run_simulation

        ends, kept = [], []

        def evaluate(server_round, arrays):
            ends.append(time.perf_counter())
            if every and server_round and server_round % every == 0:
                kept.append(arrays.to_numpy_ndarrays())

        client = ClientApp()
        client.train()(bench_peers._flower_train)
        server = ServerApp()

        @server.main()
        def main(grid, context):
            n = self.setup["num_clients"]
            strategy = FedAvg(
                fraction_train=self.setup["clients_per_round"] / n,
                fraction_evaluate=0.0,
                min_available_nodes=n,
            )
            result = strategy.start(
                grid=grid,
                initial_arrays=ArrayRecord(params),
                num_rounds=rounds,
                train_config=ConfigRecord({"setup": json.dumps(self.setup)}),
                evaluate_fn=evaluate,
            )
            kept.append(result.arrays.to_numpy_ndarrays())

        run_simulation(
            server_app=server,
            client_app=client,
            num_supernodes=self.setup["num_clients"],
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )
        return ends, kept

    def run(self, state, rounds):
        ends, kept = self._simulate(state, rounds + 1)
        return kept[-1], {"seconds": ends[-1] - ends[-rounds - 1], "rounds": rounds}

    def params(self, state):
        return state

    def trace(self, algorithm, every, blocks):
        return self._simulate(self.new(algorithm), every * blocks, every)[1][:blocks]


def _flower_replies(setup, seed):
    """``clients_per_round`` Flower reply Messages as a ClientApp sends them after training
    (``bench_peers._flower_train``): W1's arrays (``W [C, 784]``, ``b [C]``, float32, drawn
    N(0, 0.01²)) and ``num-examples``, with reply metadata (built directly: no Ray run)."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.common import Metadata

    rng = np.random.default_rng(seed)
    c, replies = setup["num_classes"], []
    for i in range(setup["clients_per_round"]):
        arrays = [
            (0.01 * rng.standard_normal((c, 784))).astype(np.float32),
            (0.01 * rng.standard_normal(c)).astype(np.float32),
        ]
        content = RecordDict(
            {"arrays": ArrayRecord(arrays),
             "metrics": MetricRecord({"num-examples": setup["per_client"]})}
        )  # fmt: skip
        metadata = Metadata(
            run_id=1, message_id=str(i), src_node_id=i + 1, dst_node_id=0,
            reply_to_message_id="train", group_id="1", created_at=time.time(), ttl=3600.0,
            message_type="train",
        )  # fmt: skip
        replies.append(Message(content=content, metadata=metadata))
    return replies


def _flower_aggregate(setup, strategy: str, calls: int, malicious: int) -> list[float]:
    """Seconds of each of ``calls`` aggregations of fresh replies (built untimed: FedMedian
    pops the arrays out of the replies it reads) by a Flower strategy's
    ``aggregate_train`` (``fedavg``, ``fedmedian``, ``krum`` with ``malicious`` assumed
    Byzantine nodes), or by the numpy median at its core (``numpy_median``: ``np.median``
    of the stacked arrays, layer by layer, as FedMedian takes it)."""
    from flwr.serverapp.strategy import FedAvg, FedMedian, Krum

    strategies = {
        "fedavg": FedAvg(),
        "fedmedian": FedMedian(),
        "krum": Krum(num_malicious_nodes=malicious),
    }
    times = []
    for call in range(calls):
        replies = _flower_replies(setup, call)
        if strategy == "numpy_median":
            layers = [[r.content["arrays"][k].numpy() for r in replies]
                      for k in replies[0].content["arrays"]]  # fmt: skip
            start = time.perf_counter()
            [np.median(np.stack(layer), axis=0) for layer in layers]
        else:
            start = time.perf_counter()
            arrays, _ = strategies[strategy].aggregate_train(1, replies)
        times.append(time.perf_counter() - start)
    return times


PEER_CLASSES = {"torch": _TorchPeer, "fedjax": _FedJAXPeer, "pfl": _PflPeer, "flower": _FlowerPeer}


def _worker(peer: str) -> None:
    """Reads ``{"setup": ...}``, then ``{"time": algorithm, "rounds": R}``, ``{"trace":
    algorithm}`` and (Flower, ``--robust``) ``{"aggregate": strategy, "calls": n,
    "malicious": F}`` lines on stdin; answers each with one JSON line. The peers' own printing
    (pfl's metrics, Flower's and Ray's logs) goes to stderr, the answers to the original
    stdout."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # offline: no usage reports
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(HERE))

    def answer(message):
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    setup = json.loads(sys.stdin.readline())["setup"]
    start = time.perf_counter()
    simulation = PEER_CLASSES[peer](setup)
    answer(
        {
            "versions": simulation.versions(),
            "setup_s": time.perf_counter() - start,
            "warmups": simulation.warmups,
            "data": [int(simulation.x.sum()), int(simulation.y.sum())],
        }
    )
    states = {}
    for line in sys.stdin:
        ask = json.loads(line)
        if "aggregate" in ask:  # --robust: a Flower strategy's aggregation alone
            times = _flower_aggregate(setup, ask["aggregate"], ask["calls"], ask["malicious"])
            answer({"seconds": times})
            continue
        if "trace" in ask:
            params = simulation.trace(ask["trace"], TRACE_EVERY, TRACE_BLOCKS)
            answer({"params": [[np.asarray(p).tolist() for p in ps] for ps in params]})
            continue
        algorithm, rounds = ask["time"], ask["rounds"]
        if algorithm not in states:
            states[algorithm] = simulation.new(algorithm)
        start = time.perf_counter()
        states[algorithm], own = simulation.run(states[algorithm], rounds)
        wall = time.perf_counter() - start
        own = own or {"seconds": wall, "rounds": rounds}
        answer({"s_per_round": own["seconds"] / own["rounds"], "overhead_s": wall - own["seconds"]})


# ----------------------------------------------------------------------------- the driver
class _Worker:
    """A peer's worker process; its stderr goes to ``log``, whose end is shown if it stops."""

    def __init__(self, peer: str, python: str, setup: dict, log: Path):
        if not Path(python).exists():
            raise SystemExit(
                f"--{peer}-python {python}: no such interpreter; build the peers' "
                "virtualenvs with `bash benchmarks/peers/setup.sh`."
            )
        self.peer, self.log = peer, log
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", peer],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
        )
        self.hello = self.ask({"setup": setup})

    def ask(self, message: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it has stopped: the empty read below says so
        line = self.proc.stdout.readline()
        if not line:
            tail = "".join(self.log.read_text().splitlines(keepends=True)[-25:])
            raise SystemExit(f"the {self.peer} worker stopped; the end of its output:\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


ROBUST_F = 20  # Krum's assumed Byzantine count in --robust: f = 0.2 of S = 100


def robust_main(args, argv) -> dict:
    """``--robust``: Flower 1.42's FedMedian and Krum aggregation (``aggregate_train`` of
    S W1-sized replies, in the Flower environment) against scaffold_jax's median and Krum:
    its W1 FedAvg round with each (``Simulation.run_rounds``, weighting uniform) and its
    aggregator alone (jitted, on ``[S, 7850]`` rows), interleaved; Flower's FedAvg
    aggregation and our mean round are the baselines. Krum assumes F = ``ROBUST_F``
    (``⌊0.2 S⌋`` with ``--quick``) in both."""
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import workloads
    from common import write_json

    import scaffold_jax as sj
    from scaffold_jax import robust
    from scaffold_jax.robust import aggregators
    from scaffold_jax.types import resolve_hparams

    if not args.flower_python:
        raise SystemExit("--robust compares with Flower: give --flower-python.")
    w = workloads.get_workload("W1", quick=args.quick)
    k, b = w.steps_and_batch
    setup = dict(
        num_clients=w.num_clients, per_client=w.per_client, num_classes=w.num_classes,
        clients_per_round=w.clients_per_round, steps=k, batch=b, lr=0.05, seed=0,
    )  # fmt: skip
    f = ROBUST_F if not args.quick else w.clients_per_round // 5
    data, problem = workloads.make_data(w), workloads.make_problem(w)
    size = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(problem.params))

    rounds, info = {}, {}
    for label, aggregator, options in (
        ("mean", "mean", {}),
        ("median", "median", {}),
        ("krum", "krum", {"robust_f": f}),
    ):
        algorithm = workloads.make_algorithm("fedavg", problem.loss_fn)
        algorithm = robust.robustly_aggregated(algorithm, aggregator, **options)
        sim = sj.Simulation(algorithm, problem, w.plan, w.clients_per_round, weighting="uniform")
        hp = resolve_hparams(algorithm, workloads.make_hparams("fedavg"))
        run, compile_s, temp = workloads.compiled_rounds(
            sim, hp, sim.init(data), data, jr.key(0), w.rounds
        )
        rounds[label] = [run, sim.init(data)]
        info[f"ours/round/{label}"] = {"compile_s": compile_s, "temp_bytes": temp}

    rows = jr.normal(jr.key(0), (w.clients_per_round, size)) * 0.01
    mask = jnp.ones(w.clients_per_round, bool)
    alone = {
        "mean": jax.jit(lambda r, m: (m.astype(r.dtype) @ r) / m.sum()),
        "median": jax.jit(aggregators.median),
        "krum": jax.jit(lambda r, m: aggregators.krum(r, m, jnp.float32(f))[0]),
    }
    worker = _Worker("flower", args.flower_python, setup, Path(tempfile.mkdtemp()) / "flower.log")
    versions = worker.hello["versions"]
    print(f"flower: {versions}; S = {w.clients_per_round}, D = {size}, F = {f}", flush=True)
    calls = 4 if args.quick else 20

    def timed(label):
        kind, what = label.split("/", 1)
        if kind == "flower":
            got = worker.ask({"aggregate": what, "calls": calls, "malicious": f})["seconds"]
            return float(np.median(got)), calls
        if what.startswith("round/"):
            entry = rounds[what.split("/")[1]]
            start = time.perf_counter()
            entry[1] = jax.block_until_ready(entry[0](entry[1]))
            return (time.perf_counter() - start) / w.rounds, w.rounds
        fn = alone[what.split("/")[1]]
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(rows, mask)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / calls, calls

    labels = [f"ours/round/{a}" for a in rounds] + [f"ours/alone/{a}" for a in alone]
    labels += [f"flower/{s}" for s in ("fedavg", "fedmedian", "krum", "numpy_median")]
    times = {label: [] for label in labels}
    for repeat in range(args.repeats + 1):  # pass 0 is the warm-up
        for label in labels:
            seconds, _ = timed(label)
            if repeat:
                times[label].append(seconds)
    worker.close()

    out_rows = []
    for label in labels:
        best, median = min(times[label]), float(np.median(times[label]))
        row = {
            "what": label,
            "ms_min": 1e3 * best,
            "ms_median": 1e3 * median,
            "per_s_median": 1 / median,
            **info.get(label, {}),
        }
        out_rows.append(row)
        print(f"{label:24s} {row['ms_min']:9.3f} ms (median {row['ms_median']:9.3f}), "
              f"{row['per_s_median']:9.1f} /s", flush=True)  # fmt: skip
    med = {r["what"]: r["ms_median"] for r in out_rows}
    ratios = {
        "flower_fedmedian_over_ours_median_alone": med["flower/fedmedian"]
        / med["ours/alone/median"],
        "flower_krum_over_ours_krum_alone": med["flower/krum"] / med["ours/alone/krum"],
        "flower_fedmedian_over_ours_median_round": med["flower/fedmedian"]
        / med["ours/round/median"],
        "flower_krum_over_ours_krum_round": med["flower/krum"] / med["ours/round/krum"],
        "ours_median_round_minus_mean_round_ms": med["ours/round/median"] - med["ours/round/mean"],
        "ours_krum_round_minus_mean_round_ms": med["ours/round/krum"] - med["ours/round/mean"],
    }  # fmt: skip
    for k_, v in ratios.items():
        print(f"  {k_}: {v:.2f}", flush=True)
    result = {
        "workload": w.describe() + f", FedAvg, weighting uniform; D = {size}, Krum F = {f}",
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "load_average_after": os.getloadavg(),
        "jax": jax.__version__,
        "flower": versions,
        "repeats": args.repeats,
        "calls_per_aggregation_timing": calls,
        "rows": out_rows,
        "ratios_of_medians": ratios,
        "all_ms": {k_: [1e3 * t for t in v] for k_, v in times.items()},
        "command": " ".join(["python", "benchmarks/bench_peers.py", *(argv or sys.argv[1:])]),
    }
    write_json(args.out, result)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for peer in PEERS:
        parser.add_argument(f"--{peer}-python", help=f"interpreter with {peer} (else left out)")
    parser.add_argument("--quick", action="store_true", help="test-sized W1 (200 clients, S = 20)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed passes")
    parser.add_argument("--block-s", type=float, default=3.0, help="seconds per timed call")
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument(
        "--robust",
        action="store_true",
        help="instead: Flower's FedMedian and Krum aggregation against ours (needs "
        "--flower-python; see robust_main)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.block_s <= 0:
        parser.error("--repeats must be at least 1 and --block-s positive")
    if args.robust:
        sys.path.insert(0, str(HERE))
        return robust_main(args, argv)

    sys.path.insert(0, str(HERE))
    import dataclasses

    import jax
    import jax.numpy as jnp
    import workloads
    from common import ratio_rows, write_json

    w = workloads.get_workload("W1", quick=args.quick)
    k, b = w.steps_and_batch
    lr = float(workloads.make_hparams("fedavg").client_lr)
    setup = dict(
        num_clients=w.num_clients, per_client=w.per_client, num_classes=w.num_classes,
        clients_per_round=w.clients_per_round, steps=k, batch=b, lr=lr, seed=0,
    )  # fmt: skip
    x, y = w1_arrays(**setup)
    data = workloads.make_data(w)
    if not np.array_equal(np.asarray(data.examples["x"]), x):
        raise SystemExit("w1_arrays no longer draws workloads.make_data's images; align them.")
    data = data.replace(examples={"x": data.examples["x"], "y": jnp.asarray(y, jnp.int32)})
    problem = workloads.make_problem(w)

    logs = Path(tempfile.mkdtemp(prefix="bench_peers_"))
    workers = {}
    for peer in PEERS:
        python = getattr(args, f"{peer}_python")
        if python:
            workers[peer] = _Worker(peer, python, setup, logs / f"{peer}.log")
            if workers[peer].hello["data"] != [int(x.sum()), int(y.sum())]:
                raise SystemExit(f"the {peer} worker built other data than the engine's.")
            print(f"{peer}: {workers[peer].hello['versions']}", flush=True)

    engines, info = {}, {}
    for algorithm in ALGORITHMS:
        _, run, state, compile_s, _ = workloads.engine_program(w, algorithm, data, problem)
        engines[algorithm] = [run, state]
        info[("engine", algorithm)] = {"compile_s": compile_s[0]}
    variants = [("engine", a) for a in ALGORITHMS]
    variants += [(p, a) for p in workers for a in PEERS[p]]

    def call(variant, rounds):
        """Runs ``rounds`` rounds of ``variant`` (the engine: whole programs); returns
        seconds per round and the start-up paid outside the rounds."""
        peer, algorithm = variant
        if peer == "engine":
            run, state = engines[algorithm]
            start = time.perf_counter()
            for _ in range(rounds // w.rounds):
                state = run(state)
            engines[algorithm][1] = jax.block_until_ready(state)
            return (time.perf_counter() - start) / rounds, 0.0
        got = workers[peer].ask({"time": algorithm, "rounds": rounds})
        return got["s_per_round"], got["overhead_s"]

    rounds = {}
    for variant in variants:
        peer = variant[0]
        warmups = 2 if peer == "engine" else workers[peer].hello["warmups"]
        unit = w.rounds if peer == "engine" else 2
        for i in range(warmups):
            start = time.perf_counter()
            per_round, overhead = call(variant, unit)
            if i == 0:
                info.setdefault(variant, {})["first_call_s"] = time.perf_counter() - start
        rounds[variant] = unit * max(1, math.ceil(args.block_s / (per_round * unit)))
        info[variant]["rounds_per_call"] = rounds[variant]
        print(
            f"{variant}: first call {info[variant]['first_call_s']:.1f} s, "
            f"{1e3 * per_round:.1f} ms/round, {rounds[variant]} rounds a call",
            flush=True,
        )

    wall = {v: [] for v in variants}
    overheads = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:
            per_round, overhead = call(variant, rounds[variant])
            wall[variant].append(per_round)
            overheads[variant].append(overhead)
    for variant in variants:
        if any(overheads[variant]):
            info[variant]["overhead_s"] = float(np.median(overheads[variant]))
        if variant[0] in workers:
            info[variant]["setup_s"] = workers[variant[0]].hello["setup_s"]

    losses = {}
    for peer, algorithm in variants:
        if peer == "engine":
            short = dataclasses.replace(w, rounds=TRACE_EVERY)
            _, run, state, _, _ = workloads.engine_program(short, algorithm, data, problem)
            params = []
            for _ in range(TRACE_BLOCKS):
                state = run(state)
                linear = state.server.params["linear"]
                params.append((np.asarray(linear["kernel"]), np.asarray(linear["bias"])))
        else:
            params = workers[peer].ask({"trace": algorithm})["params"]
        losses[f"{peer}/{algorithm}"] = [mean_loss(p, x, y) for p in params]
    for worker in workers.values():
        worker.close()
    shutil.rmtree(logs)  # kept only when a worker fails (its end is shown then)

    rows = []
    for algorithm in ALGORITHMS:
        mine = [v for v in variants if v[1] == algorithm]
        rows += ratio_rows(
            algorithm,
            {v[0]: wall[v] for v in mine},
            {v[0]: info[v] for v in mine},
            base="engine",
        )
    for row in rows:
        row["rounds_per_s"] = 1e3 / row["ms_per_round_min"]
        row["loss_after"] = losses[f"{row['variant']}/{row['algorithm']}"]
    print(f"training loss over all {len(x):,} examples after rounds "
          f"{', '.join(str(TRACE_EVERY * (i + 1)) for i in range(TRACE_BLOCKS))} "
          f"(round 0: {math.log(w.num_classes):.3f}):")  # fmt: skip
    for name, values in losses.items():
        print(f"  {name:16s} " + "  ".join(f"{v:.3f}" for v in values))
    versions = {p: wk.hello["versions"] for p, wk in workers.items()}
    result = {
        "workload": w.describe() + f", η_l={lr:g}, η_g=1, labels of a linear teacher",
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "peers": versions,
        "repeats": args.repeats,
        "rows": rows,
        "all_ms": {f"{p}/{a}": [1e3 * t for t in ts] for (p, a), ts in wall.items()},
        "command": " ".join(["python", "benchmarks/bench_peers.py", *(argv or sys.argv[1:])]),
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker(sys.argv[sys.argv.index("--worker") + 1])
    else:
        main()
