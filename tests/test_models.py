"""The convolutional and recurrent models: McMahan et al.'s CNN, ResNet-18 with GroupNorm
and LEAF's next-character LSTM (issue #16).

Each model is checked for its params (counted by hand from the architecture), its logits,
its gradient (against finite differences in float64), its loss convention (per-example
cross-entropy of the logits), its input handling (uint8 pixels, refused shapes), the
registry, and a few SGD steps that fit a tiny separable batch. Everything runs on tiny
widths and a handful of examples.
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

from scaffold_jax import models


def count(params) -> int:
    return sum(math.prod(a.shape) for a in jax.tree.leaves(params))


def conv_params(k, c_in, c_out, bias=True):
    return k * k * c_in * c_out + (c_out if bias else 0)


def dense_params(n_in, n_out):
    return n_in * n_out + n_out


def image_batch(n, shape, num_classes, seed=0):
    """Separable images: class c has its pixels bright in the c-th band of rows."""
    rng = np.random.default_rng(seed)
    y = np.arange(n, dtype=np.int32) % num_classes
    x = rng.uniform(0, 60, (n, *shape))
    band = shape[0] // num_classes
    for i, c in enumerate(y):
        x[i, c * band : (c + 1) * band] += 180
    return {"x": x.astype(np.uint8), "y": y}


def char_batch(n, length, vocab, seed=0):
    """Windows whose label is their last character (the LSTM must read the last step)."""
    x = np.random.default_rng(seed).integers(0, vocab, (n, length)).astype(np.int32)
    return {"x": x, "y": x[:, -1].copy()}


# The tiny models the gradient, loss and SGD checks use: (module, problem, batch), built
# once (initialising a ResNet compiles its initialisers, seconds on a CPU).
@functools.cache
def tiny_cnn():
    problem = models.build("cnn", (8, 8), 3, key=jr.key(1))
    return models.CNN(3), problem, image_batch(6, (8, 8), 3)


@functools.cache
def tiny_resnet():
    problem = models.build("resnet18", (8, 8, 3), 3, key=jr.key(2), options={"resnet_width": 4})
    return models.ResNet18(3, width=4), problem, image_batch(6, (8, 8, 3), 3)


@functools.cache
def tiny_lstm():
    options = {"lstm_hidden": 6, "embed_dim": 3}
    problem = models.build("char_lstm", (5,), 4, key=jr.key(3), options=options)
    return models.CharLSTM(4, embed_dim=3, hidden=6), problem, char_batch(8, 5, 4)


TINY = {"cnn": tiny_cnn, "resnet18": tiny_resnet, "char_lstm": tiny_lstm}


def _resnet_slow(names):
    """``names`` for parametrize, ResNet-18's marked slow (its compile takes seconds)."""
    return [pytest.param(n, marks=pytest.mark.slow) if n == "resnet18" else n for n in names]


# SGD step sizes that fit each tiny batch in a few steps (the small LSTM's gradients are
# small at its initial params).
LEARNING_RATE = {"cnn": 0.1, "resnet18": 0.1, "char_lstm": 2.0}


@functools.cache
def mcmahan_cnn():
    return models.build("cnn", (28, 28), 10, key=jr.key(0))


# ----------------------------------------------------------------------------- params, logits
def test_cnn_has_mcmahan_et_al_params_and_logits():
    problem = mcmahan_cnn()
    shapes = jax.tree.map(lambda a: a.shape, problem.params)
    assert shapes == {
        "conv_0": {"kernel": (5, 5, 1, 32), "bias": (32,)},
        "conv_1": {"kernel": (5, 5, 32, 64), "bias": (64,)},
        "hidden": {"kernel": (512, 7 * 7 * 64), "bias": (512,)},  # Dense: [out, in]
        "output": {"kernel": (10, 512), "bias": (10,)},
    }
    # 28 -> 14 -> 7 after the two pools (SAME convolutions keep the size).
    by_hand = (
        conv_params(5, 1, 32)  # 832
        + conv_params(5, 32, 64)  # 51,264
        + dense_params(7 * 7 * 64, 512)  # 1,606,144
        + dense_params(512, 10)  # 5,130
    )
    assert by_hand == count(problem.params) == 1_663_370  # the paper's count
    x = jnp.zeros((3, 28, 28), jnp.uint8)
    assert models.CNN(10).apply({"params": problem.params}, x).shape == (3, 10)
    assert problem.num_classes == 10

    # CIFAR images: 32 -> 16 -> 8, three input channels.
    cifar = jax.eval_shape(lambda key: models.cnn((32, 32, 3), 10, key=key).params, jr.key(0))
    assert count(cifar) == (
        conv_params(5, 3, 32) + conv_params(5, 32, 64) + dense_params(8 * 8 * 64, 512)
    ) + dense_params(512, 10)
    x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    logits = jax.eval_shape(lambda p, x: models.CNN(10).apply({"params": p}, x), cifar, x)
    assert logits.shape == (2, 10)


def resnet18_params_by_hand(width, c_in, num_classes):
    def norm(c):
        return 2 * c  # GroupNorm: a scale and a bias per channel

    total = conv_params(3, c_in, width, bias=False) + norm(width)  # stem
    c = width
    for multiple, stride in zip((1, 2, 4, 8), (1, 2, 2, 2), strict=True):
        out = width * multiple
        for block in range(2):
            total += conv_params(3, c, out, bias=False) + norm(out)
            total += conv_params(3, out, out, bias=False) + norm(out)
            if block == 0 and (stride != 1 or c != out):
                total += conv_params(1, c, out, bias=False) + norm(out)  # projection
            c = out
    return total + dense_params(8 * width, num_classes)


def test_resnet18_params_and_logits():
    # The full-width network, traced only (no 11M-param init): the count of the
    # BatchNorm ResNet-18 it replaces on CIFAR-10.
    full = jax.eval_shape(lambda key: models.resnet18((32, 32, 3), 10, key=key).params, jr.key(0))
    assert count(full) == resnet18_params_by_hand(64, 3, 10) == 11_173_962
    assert full["stem"]["kernel"].shape == (3, 3, 3, 64)
    assert full["stage_3_block_1"]["conv_1"]["kernel"].shape == (3, 3, 512, 512)
    assert full["output"]["kernel"].shape == (10, 512)  # Dense: [out, in]
    assert "proj" not in full["stage_0_block_0"] and "proj" in full["stage_1_block_0"]
    # GroupNorm, no running statistics: the params are the whole state.
    assert set(full["stage_0_block_0"]["norm_0"]) == {"scale", "bias"}


@pytest.mark.slow  # compiling even a tiny ResNet-18 takes ~8 s here
def test_tiny_resnet18_params_and_logits():
    module, problem, batch = tiny_resnet()
    assert count(problem.params) == resnet18_params_by_hand(4, 3, 3)
    assert module.apply({"params": problem.params}, batch["x"]).shape == (6, 3)
    # Grayscale (H, W) images get a channel axis.
    gray = jax.eval_shape(
        lambda key: models.resnet18((8, 8), 3, key=key, resnet_width=2).params, jr.key(0)
    )
    assert gray["stem"]["kernel"].shape == (3, 3, 1, 2)


def test_char_lstm_params_and_logits_from_the_last_step():
    # LEAF's Shakespeare model: 80 characters, windows of 80, embedding 8, 2 x LSTM 256.
    full = jax.eval_shape(lambda key: models.char_lstm((80,), 80, key=key).params, jr.key(0))

    def lstm(n_in, n_hidden):  # 4 gates: input and recurrent kernels, one bias
        return 4 * (n_in * n_hidden + n_hidden * n_hidden + n_hidden)

    assert count(full) == 80 * 8 + lstm(8, 256) + lstm(256, 256) + dense_params(256, 80)
    assert count(full) == 817_872
    assert full["embed"]["embedding"].shape == (80, 8)
    assert full["output"]["kernel"].shape == (80, 256)

    module, problem, batch = tiny_lstm()
    logits = module.apply({"params": problem.params}, batch["x"])
    assert logits.shape == (8, 4)
    # Ids are ids whatever their integer dtype (uint8 saves memory): no pixel scaling.
    as_uint8 = module.apply({"params": problem.params}, batch["x"].astype(np.uint8))
    np.testing.assert_array_equal(as_uint8, logits)
    # The logits are read at the last step: changing the last character changes them,
    # and so does the first one (the state carries it).
    for t in (0, -1):
        x = batch["x"].copy()
        x[:, t] = (x[:, t] + 1) % 4
        changed = module.apply({"params": problem.params}, x)
        assert np.all(np.abs(np.asarray(changed - logits)).max(axis=1) > 1e-6)


# ----------------------------------------------------------------------------- conventions
@pytest.mark.parametrize("name", _resnet_slow(TINY))
def test_loss_is_the_per_example_cross_entropy_of_the_logits(name):
    module, problem, batch = TINY[name]()
    logits = module.apply({"params": problem.params}, batch["x"])
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    loss = problem.loss_fn(problem.params, batch)
    assert loss.shape == (len(batch["y"]),)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    accuracy = problem.accuracy_fn(problem.params, batch)
    np.testing.assert_array_equal(accuracy, np.argmax(logits, axis=-1) == batch["y"])
    assert set(np.unique(accuracy)) <= {0.0, 1.0}


@pytest.mark.parametrize("name", _resnet_slow(["cnn", "resnet18"]))
def test_uint8_pixels_are_scaled_like_floats_over_255(name):
    _, problem, batch = TINY[name]()
    scaled = {"x": batch["x"].astype(np.float32) / 255, "y": batch["y"]}
    # Equal up to float32 rounding: x * (1/255) and x / 255 may differ in the last bit,
    # which the normalisation of a near-constant group can amplify a little.
    np.testing.assert_allclose(
        problem.loss_fn(problem.params, batch), problem.loss_fn(problem.params, scaled), rtol=1e-5
    )


def test_images_without_a_channel_axis_are_one_channel_images():
    problem = models.cnn((8, 8), 3, key=jr.key(0))
    batch = image_batch(4, (8, 8), 3)
    with_axis = {"x": batch["x"][..., None], "y": batch["y"]}
    np.testing.assert_array_equal(
        problem.loss_fn(problem.params, batch), problem.loss_fn(problem.params, with_axis)
    )


@pytest.mark.parametrize("name", _resnet_slow(TINY))
def test_gradient_matches_finite_differences_in_float64(name):
    """The reverse-mode gradient g of the mean loss L, projected on random unit directions
    v, against the central difference (L(θ + hv) − L(θ − hv)) / 2h, all in float64.

    Tolerance, relative to ‖g‖ (which bounds |g·v| for a unit v): with h = 1e-5 the
    rounding error is about eps·|L|/h ≈ 1e-16·2/1e-5 = 2e-11 and the truncation error
    (h²/6 times the third derivative along v) measured at most 3e-8·|g·v| over 8
    directions per model, so 1e-6·‖g‖ leaves a wide margin. A wrong gradient (a missing
    term, a leaf transposed or zeroed) is off by about the true g·v, ~‖g‖/√(number of
    params) ≥ 4e-3·‖g‖ on these tiny models. The kinks of ReLU and max-pool are crossed
    by a step of 1e-5 along a unit direction only by pre-activations within ~1e-5 of 0:
    a few at most, each moving the mean loss's slope by a small fraction. (Along
    unnormalised N(0, 1) directions, hundreds of times longer, the ResNet's kinks do
    show, at 4e-5 relative.) Standard dtype promotion inside: flax's GroupNorm promotes
    its statistics to at least float32, a float64/float32 mix that the suite's strict
    promotion refuses.
    """
    _, problem, batch = TINY[name]()
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), problem.params)
        if name != "char_lstm":  # pixels as float64, so the whole model runs in float64
            batch = {"x": jnp.asarray(batch["x"], jnp.float64) / 255, "y": batch["y"]}

        @jax.jit
        def mean_loss(p):
            return jnp.mean(problem.loss_fn(p, batch))

        @jax.jit
        def central_difference(v, h):
            def shifted(t):
                return mean_loss(jax.tree.map(lambda a, d: a + t * d, params, v))

            return (shifted(h) - shifted(-h)) / (2 * h)

        grad = jax.grad(mean_loss)(params)
        assert all(g.dtype == jnp.float64 for g in jax.tree.leaves(grad))
        grad_norm = float(optax.tree.norm(grad))
        assert grad_norm > 1e-3  # a point where the gradient says something
        for seed in range(3):
            rng = np.random.default_rng(seed)  # numpy: no sampler to compile per leaf shape
            v = jax.tree.map(lambda a, rng=rng: rng.standard_normal(a.shape), params)
            norm = np.sqrt(sum(np.vdot(d, d) for d in jax.tree.leaves(v)))
            v = jax.tree.map(lambda d, norm=norm: jnp.asarray(d / norm), v)  # a unit direction
            analytic = float(sum(jax.tree.leaves(jax.tree.map(jnp.vdot, grad, v))))
            numeric = float(central_difference(v, 1e-5))
            assert abs(numeric - analytic) <= 1e-6 * grad_norm, (numeric, analytic, grad_norm)


@pytest.mark.parametrize("name", _resnet_slow(TINY))
def test_a_few_sgd_steps_fit_a_tiny_separable_batch(name):
    _, problem, batch = TINY[name]()
    value_and_grad = jax.jit(jax.value_and_grad(lambda p: jnp.mean(problem.loss_fn(p, batch))))
    params, losses = problem.params, []
    for _ in range(8):
        loss, grad = value_and_grad(params)
        losses.append(float(loss))
        params = jax.tree.map(lambda p, g: p - LEARNING_RATE[name] * g, params, grad)
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(np.isfinite(losses))


# ----------------------------------------------------------------------------- registry
def test_the_models_are_registered_with_their_options():
    assert {"cnn", "resnet18", "char_lstm"} <= set(models.MODELS)
    assert tuple(models.MODELS["cnn"].options) == ()
    assert tuple(models.MODELS["resnet18"].options) == (
        "resnet_width",
        "resnet_norm",
        "state_policy",
    )
    assert tuple(models.MODELS["char_lstm"].options) == ("lstm_hidden", "embed_dim")
    problem = mcmahan_cnn()  # models.build("cnn", (28, 28), 10, key=jr.key(0))
    assert count(problem.params) == 1_663_370
    # A whole config's fields may be passed: the model takes those it declares.
    lstm = models.build(
        "char_lstm",
        (7,),
        5,
        key=jr.key(0),
        options={"lstm_hidden": 3, "embed_dim": 2, "hidden_sizes": [9]},
    )
    assert lstm.params["embed"]["embedding"].shape == (5, 2)
    assert lstm.params["lstm_0"]["ii"]["kernel"].shape == (2, 3)  # flax's cell: [in, out]
    assert lstm.params["lstm_1"]["hi"]["kernel"].shape == (3, 3)
    # The same key gives the same params; another key others.
    again = models.build("cnn", (28, 28), 10, key=jr.key(0))
    other = models.build("cnn", (28, 28), 10, key=jr.key(1))
    np.testing.assert_array_equal(
        again.params["hidden"]["kernel"], problem.params["hidden"]["kernel"]
    )
    assert not np.array_equal(other.params["hidden"]["kernel"], problem.params["hidden"]["kernel"])


# ----------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: models.build("cnn", (784,), 10, key=jr.key(0)),
            r"model 'cnn' takes images of shape \(H, W\) or \(H, W, C\) per example, got "
            r"input_shape=\(784,\)\. It looks like a flattened image: keep the dataset's "
            r"examples as images .* or use model 'mlp' or 'logreg'",
        ),
        (
            lambda: models.build("resnet18", (784,), 10, key=jr.key(0)),
            r"model 'resnet18' takes images .* got input_shape=\(784,\)\. It looks like a "
            r"flattened image",
        ),
        (
            lambda: models.cnn((28, 28, 1, 1), 10),
            r"model 'cnn' takes images .* got input_shape=\(28, 28, 1, 1\)\.$",
        ),
        (
            lambda: models.cnn((3, 32, 32), 10),
            r"channels-first: transpose the examples to \(32, 32, 3\)",
        ),
        (lambda: models.cnn((28, 28), 1), r"num_classes=1 must be >= 2"),
        (
            lambda: models.resnet18((8, 8), 3, resnet_width=3),
            r"resnet_width=3 must be a positive even integer",
        ),
        (
            lambda: models.resnet18((8, 8), 3, resnet_width=2.5),
            r"resnet_width=2.5 must be a positive even integer",
        ),
        (
            lambda: models.char_lstm((80, 1), 80),
            r"model 'char_lstm' takes windows of character ids, input_shape=\(T,\), got "
            r"input_shape=\(80, 1\)",
        ),
        (lambda: models.char_lstm((80,), 80, lstm_hidden=0), r"lstm_hidden=0 must be a positive"),
        (lambda: models.char_lstm((80,), 80, embed_dim=True), r"embed_dim=True must be a posit"),
    ],
)
def test_bad_shapes_and_options_are_refused_with_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_batches_of_the_wrong_kind_are_refused_when_traced():
    cnn = models.cnn((8, 8), 3, key=jr.key(0))
    flat = {"x": np.zeros((2, 64), np.float32), "y": np.zeros(2, np.int32)}
    with pytest.raises(ValueError, match=r"model 'cnn' takes a batch of images \[B, H, W\]"):
        cnn.loss_fn(cnn.params, flat)
    lstm = models.char_lstm((5,), 4, key=jr.key(0), lstm_hidden=3, embed_dim=2)
    floats = {"x": np.zeros((2, 5), np.float32), "y": np.zeros(2, np.int32)}
    with pytest.raises(ValueError, match=r"integer character ids \[B, T\], got .* float32"):
        lstm.loss_fn(lstm.params, floats)


# ----------------------------------------------------------------------- dropout, BatchNorm
class _DropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.relu(nn.Dense(16)(x.reshape((x.shape[0], -1)).astype(jnp.float32)))
        h = nn.Dropout(0.5, deterministic=not train)(h)
        return nn.Dense(3)(h)


def test_a_dropout_model_gets_a_fresh_key_every_local_step_and_none_in_evaluation():
    import scaffold_jax as sj
    from scaffold_jax.engine import client_keys, round_key_and_ids
    from scaffold_jax.local import local_sgd, takes_key

    problem = sj.models.classification_problem(_DropoutNet(), (4,), jr.key(0), train_arg="train")
    assert takes_key(problem.loss_fn) and not takes_key(problem.accuracy_fn)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 4)).astype(np.float32)
    batch = {"x": x, "y": rng.integers(0, 3, 6).astype(np.int32)}
    # Evaluation (no key) is deterministic; a key switches dropout on.
    a, b = problem.loss_fn(problem.params, batch), problem.loss_fn(problem.params, batch)
    np.testing.assert_array_equal(a, b)
    c = problem.loss_fn(problem.params, batch, key=jr.key(1))
    d = problem.loss_fn(problem.params, batch, key=jr.key(2))
    assert not np.allclose(a, c) and not np.allclose(c, d)
    # The engine's local steps: step k of a client uses fold_in(client key, k).
    data = sj.from_client_arrays([batch, batch])  # two clients with the same data
    sim = sj.Simulation(sj.fedavg(problem.loss_fn), problem,
                        sj.BatchPlan.full(3), clients_per_round=2, client_chunk=None)  # fmt: skip
    hp = sim.resolve_hparams(sj.hparams(client_lr=0.1))
    state, metrics = sim.round(hp, sim.init(data), data, jr.key(7))
    round_key, ids = round_key_and_ids(jr.key(7), 0, 2, 2)
    keys = client_keys(round_key, ids)
    mask = jnp.ones((3, 6), jnp.float32)
    batches = jax.tree.map(lambda v: jnp.broadcast_to(v, (3, *v.shape)), batch)
    ys = [local_sgd(problem.loss_fn, problem.params, batches, mask, hp.client_lr, key=k)[0]
          for k in keys]  # fmt: skip
    mean = jax.tree.map(lambda p, *y: p + sum(v - p for v in y) / 2, problem.params, *ys)
    for got, want in zip(jax.tree.leaves(state.server.params), jax.tree.leaves(mean),
                         strict=True):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Same data, different clients: different dropout masks, different updates.
    assert not np.allclose(jax.tree.leaves(ys[0])[0], jax.tree.leaves(ys[1])[0])


class _BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x.reshape((x.shape[0], -1)))
        return nn.Dense(3)(nn.BatchNorm(use_running_average=True)(h))


def test_a_batchnorm_model_without_a_training_mode_argument_is_refused_naming_it():
    import scaffold_jax as sj

    with pytest.raises(ValueError, match=r"running statistics \(batch_stats.*train_arg="):
        sj.models.classification_problem(_BatchNormNet(), (4,), jr.key(0))
    with pytest.raises(ValueError, match="state_policy='fedbn' is unknown"):
        sj.models.classification_problem(_BatchNormNet(), (4,), jr.key(0), state_policy="fedbn")


# ----------------------------------------------------------------------- the convolution
@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding"),
    [((8, 8), 5, 1, "SAME"), ((9, 7), 3, 2, 1), ((8, 8), 1, 2, 0), ((10, 10), 3, 2, "SAME"),
     ((7, 9), 3, 1, "VALID"), ((11, 11), 3, 3, ((2, 0), (1, 2)))],
)  # fmt: skip
def test_conv2d_and_its_gradients_equal_lax_and_autodiff(size, kernel, stride, padding):
    """The hand-written backward pass (standard-layout convolutions, for XLA CPU's fast
    kernels inside loops) against JAX's autodiff of the same convolution, in float64."""
    rng = np.random.default_rng(0)
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        x = jnp.asarray(rng.normal(size=(2, *size, 3)))
        w = jnp.asarray(rng.normal(size=(kernel, kernel, 3, 4)))
        strides = (stride, stride)
        pads = models._pads(size, (kernel, kernel), strides, padding)

        def reference(x, w):
            return jax.lax.conv_general_dilated(
                x, w, strides, pads, dimension_numbers=("NHWC", "HWIO", "NHWC")
            )

        y = models.conv2d(x, w, strides, pads)
        np.testing.assert_allclose(y, reference(x, w), rtol=1e-12)
        cotangent = jnp.asarray(rng.normal(size=y.shape))
        ours = jax.vjp(lambda x, w: models.conv2d(x, w, strides, pads), x, w)[1](cotangent)
        theirs = jax.vjp(reference, x, w)[1](cotangent)
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_conv_has_the_params_and_outputs_of_flax_conv():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 9, 9, 3)), jnp.float32)
    for kwargs in ({"padding": "SAME"}, {"strides": 2, "padding": 1, "use_bias": False}):
        ours, theirs = models.Conv(5, (3, 3), **kwargs), nn.Conv(5, (3, 3), **kwargs)
        p = ours.init(jr.key(0), x)
        q = theirs.init(jr.key(0), x)
        assert jax.tree.map(jnp.shape, p) == jax.tree.map(jnp.shape, q)
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q), strict=True):
            np.testing.assert_array_equal(a, b)  # the same initial numbers
        np.testing.assert_allclose(ours.apply(p, x), theirs.apply(q, x), rtol=1e-5, atol=1e-6)


def test_the_engine_runs_convolutional_and_recurrent_clients_one_at_a_time_on_cpu():
    import scaffold_jax as sj

    rng = np.random.default_rng(0)
    clients = [{"x": rng.integers(0, 255, (6, 8, 8), dtype=np.uint8),
                "y": rng.integers(0, 3, 6).astype(np.int32)} for _ in range(4)]  # fmt: skip
    data = sj.from_client_arrays(clients)
    plan = sj.BatchPlan.fixed(batch_size=3, num_steps=2)
    cnn = sj.models.build("cnn", (8, 8), 3, key=jr.key(0))
    mlp = sj.models.build("mlp", (8, 8), 3, key=jr.key(0), options={"hidden_sizes": [4]})
    for problem, sequential in ((cnn, True), (mlp, False)):
        sim = sj.Simulation(sj.fedavg(problem.loss_fn), problem, plan, clients_per_round=4)
        assert sim.one_client_at_a_time(data) is sequential
        chunk = sim.resolve_client_chunk(data)
        if jax.default_backend() == "cpu":
            assert (chunk == 1) is sequential
    ids = [{"x": rng.integers(0, 9, (6, 5)).astype(np.int32), "y": rng.integers(0, 9, 6)
            .astype(np.int32)} for _ in range(4)]  # fmt: skip
    lstm = sj.models.build("char_lstm", (5,), 9, key=jr.key(0),
                           options={"lstm_hidden": 4, "embed_dim": 2})  # fmt: skip
    sim = sj.Simulation(sj.fedavg(lstm.loss_fn), lstm, plan, clients_per_round=4)
    assert sim.one_client_at_a_time(sj.from_client_arrays(ids))


def test_an_nnx_model_is_split_once_and_trains_in_the_engine():
    from flax import nnx

    import scaffold_jax as sj

    class TwoLayer(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(5, 8, rngs=rngs)
            self.out = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    model = TwoLayer(nnx.Rngs(0))
    problem = sj.models.nnx_classification_problem(model, num_classes=3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 5)).astype(np.float32)
    y = rng.integers(0, 3, 6).astype(np.int32)
    np.testing.assert_allclose(
        problem.loss_fn(problem.params, {"x": x, "y": y}),
        optax.softmax_cross_entropy_with_integer_labels(model(jnp.asarray(x)), y),
        rtol=1e-6,
    )
    data = sj.from_client_arrays([{"x": x[:3], "y": y[:3]}, {"x": x[3:], "y": y[3:]}],
                                 test={"x": x, "y": y})  # fmt: skip
    sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, sj.BatchPlan.full(3), 2)
    result = sim.run(data, sj.hparams(client_lr=0.3), num_rounds=5, eval_every=5)
    assert result.records[-1]["test_loss"] < result.records[0]["test_loss"]

    class WithDropout(nnx.Module):
        def __init__(self, rngs):
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(x)

    with pytest.raises(ValueError, match="keeps state besides its nnx.Param s and nnx.BatchStat"):
        sj.models.nnx_classification_problem(WithDropout(nnx.Rngs(0)), 5)


# ------------------------------------------------------------------ bringing your own model
class _FlaxConvNet(nn.Module):
    dilation: int = 1

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Conv(4, (3, 3), kernel_dilation=self.dilation)(x[..., None]))
        return nn.Dense(3)(h.reshape((h.shape[0], -1)))


def test_a_model_with_flax_conv_is_warned_on_cpu_naming_sj_conv_and_its_cost(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.warns(UserWarning, match=r"_FlaxConvNet uses flax's nn.Conv \(Conv_0\)") as got:
        models.classification_problem(_FlaxConvNet(), (8, 8), jr.key(0))
    message = str(got[0].message)
    assert models.FLAX_CONV_COST in message and "sj.models.Conv" in message
    assert got[0].filename == __file__  # attributed to the caller, not to models.py
    # A dilated convolution is not what sj.models.Conv computes: no advice to switch.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        models.classification_problem(_FlaxConvNet(dilation=2), (8, 8), jr.key(0))
        models.cnn((8, 8), 3, key=jr.key(0))  # sj.models.Conv itself
        # On an accelerator nn.Conv is not slow: no warning.
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        models.classification_problem(_FlaxConvNet(), (8, 8), jr.key(0))


class _NeedsTrain(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Dense(4)(x.reshape((x.shape[0], -1)).astype(jnp.float32))
        return nn.Dropout(0.5, deterministic=not train)(h)


class _NeedsDeterministic(nn.Module):
    @nn.compact
    def __call__(self, x, *, deterministic):
        h = nn.Dense(4)(x.reshape((x.shape[0], -1)).astype(jnp.float32))
        return nn.Dropout(0.5)(h, deterministic=deterministic)


class _TrainByDefault(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(4)(x.reshape((x.shape[0], -1)).astype(jnp.float32))
        return nn.Dropout(0.5, deterministic=not train)(h)


def test_a_training_mode_argument_without_train_arg_is_a_clear_error():
    needs = (
        r"_NeedsTrain.__call__ requires 'train' besides the batch x.*\(\.\.\., train_arg='train'\)"
    )
    with pytest.raises(TypeError, match=needs):
        models.classification_problem(_NeedsTrain(), (4,), jr.key(0))
    # An inference-mode switch cannot be a train_arg (it is True in evaluation).
    inverted = r"'deterministic'.*inference-mode switch.*deterministic=not train.*train_arg='train'"
    with pytest.raises(TypeError, match=inverted):
        models.classification_problem(_NeedsDeterministic(), (4,), jr.key(0))
    absent = r"train_arg='training', but _NeedsTrain.__call__ takes no argument 'training'"
    with pytest.raises(TypeError, match=absent + r" \(it takes 'x', 'train'\)"):
        models.classification_problem(_NeedsTrain(), (4,), jr.key(0), train_arg="training")
    # A TypeError the signature does not explain is flax's own, unchanged.
    with pytest.raises(TypeError) as err:
        models.classification_problem(_Broken(), (4,), jr.key(0))
    assert "train_arg" not in str(err.value)
    problem = models.classification_problem(_NeedsTrain(), (4,), jr.key(0), train_arg="train")
    assert problem.params["Dense_0"]["kernel"].shape == (4, 4)


class _Broken(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x) + "not an array"


def test_dropout_without_train_arg_is_warned_as_never_acting():
    never = r"_TrainByDefault has nn.Dropout \(rate 0.5\) but classification_problem got no "
    with pytest.warns(UserWarning, match=never + "train_arg.*never acts"):
        models.classification_problem(_TrainByDefault(), (4,), jr.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        models.classification_problem(_TrainByDefault(), (4,), jr.key(0), train_arg="train")


EXAMPLE_PLUGIN = Path(__file__).resolve().parent.parent / "examples" / "small_cnn.py"
FASHION = "/usr/share/datasets/fashion-mnist"


def test_the_example_model_plugin_builds_what_its_options_say():
    from scaffold_jax import experiments
    from scaffold_jax.registry import load_plugins

    load_plugins([str(EXAMPLE_PLUGIN)])
    assert {"cnn_channels", "cnn_dropout"} <= set(experiments.declared_options())
    options = {"cnn_channels": [3, 5], "cnn_dropout": 0.5}
    problem = models.build("small_cnn", (28, 28), 10, key=jr.key(0), options=options)
    params = problem.params
    # Two convolutions of 3 and 5 channels on [28, 28] uint8 images, each halved by its
    # pool, then the output layer.
    assert params["conv_0"]["kernel"].shape == (3, 3, 1, 3)
    assert params["conv_1"]["kernel"].shape == (3, 3, 3, 5)
    assert params["output"]["kernel"].shape == (7 * 7 * 5, 10) and "conv_2" not in params
    # Its dropout acts in training (a key: train_arg) and not in evaluation.
    batch = {"x": np.full((4, 28, 28), 200, np.uint8), "y": np.zeros(4, np.int32)}
    inference = problem.loss_fn(params, batch)
    np.testing.assert_array_equal(inference, problem.loss_fn(params, batch))
    assert not np.allclose(inference, problem.loss_fn(params, batch, key=jr.key(1)))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist")
def test_the_example_model_plugin_runs_from_the_command_line_with_its_options(tmp_path):
    from scaffold_jax import experiments, results
    from scaffold_jax.cli import main

    out = tmp_path / "run"
    argv = [
        "run", "--plugin", str(EXAMPLE_PLUGIN), "--model", "small_cnn",
        "--cnn-channels", "3", "5", "--cnn-dropout", "0.5", "--dataset", "fashion_mnist",
        "--max-train-examples", "300", "--max-test-examples", "100", "--num-clients", "4",
        "--clients-per-round", "2", "--algorithm", "fedavg", "--rounds", "1",
        "--eval-every", "1", "--quiet", "--no-checkpoint", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"] == "small_cnn" and saved["plugins"] == [str(EXAMPLE_PLUGIN)]
    assert {k: saved["options"][k] for k in ("cnn_channels", "cnn_dropout")} == {
        "cnn_channels": [3, 5], "cnn_dropout": 0.5
    }  # fmt: skip
    records = results.read_records(out)
    assert [r["round"] for r in records] == [0, 1]
    assert all(np.isfinite(r["test_loss"]) for r in records)
    # The run's model is the one those options build: its round-0 test loss is that of
    # the initial params the plugin's build makes (seed 0) on the run's 100 test examples,
    # and not that of the default channels.
    test = experiments.build(experiments.RunConfig.from_dict(saved).validate()).data.test
    assert len(test["y"]) == 100

    def initial_loss(options):
        problem = models.build("small_cnn", (28, 28), 10, key=jr.key(0), options=options)
        return float(jnp.mean(problem.loss_fn(problem.params, test)))

    np.testing.assert_allclose(records[0]["test_loss"], initial_loss(saved["options"]), rtol=1e-5)
    assert abs(records[0]["test_loss"] - initial_loss({})) > 1e-3
