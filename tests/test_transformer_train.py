"""Optimizers (exact update formulas), the training loop, the copy task and the CLI."""

import math

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from summasim.transformer import model, train


def _pg(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    params = {"w": rng.standard_normal((3, 4)).astype(dtype),
              "b": rng.standard_normal(4).astype(dtype)}
    grads = [{k: rng.standard_normal(v.shape).astype(dtype) for k, v in params.items()}
             for _ in range(3)]
    return params, grads


def test_sgd_plain_and_momentum():
    params, grads = _pg()
    ref = {k: v.copy() for k, v in params.items()}
    w_id = id(params["w"])
    opt = train.SGD(lr=0.1)
    for g in grads:
        opt.step(params, g)
        for k in ref:
            ref[k] -= 0.1 * g[k]
    assert id(params["w"]) == w_id                   # updated in place
    for k in ref:
        np.testing.assert_allclose(params[k], ref[k], rtol=1e-15)

    params, grads = _pg()
    ref = {k: v.copy() for k, v in params.items()}
    buf = {k: np.zeros_like(v) for k, v in params.items()}
    opt = train.SGD(lr=0.1, momentum=0.9, weight_decay=0.01)
    for g in grads:
        for k in ref:
            buf[k] = 0.9 * buf[k] + g[k] + 0.01 * ref[k]
            ref[k] = ref[k] - 0.1 * buf[k]
        opt.step(params, g)
    for k in ref:
        np.testing.assert_allclose(params[k], ref[k], rtol=1e-14)
    assert set(opt.state) == {"w", "b"}


def test_adam_bias_corrected_with_decoupled_decay():
    params, grads = _pg()
    ref = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v = {k: np.zeros_like(x) for k, x in ref.items()}
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.1
    opt = train.Adam(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for t, g in enumerate(grads, start=1):
        opt.step(params, g)
        for k in ref:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            if k == "w":                           # matrices decay, vectors do not
                ref[k] = ref[k] * (1 - lr * wd)
            ref[k] = ref[k] - lr * (m[k] / (1 - b1 ** t)) / (np.sqrt(v[k] / (1 - b2 ** t)) + eps)
        for k in ref:
            np.testing.assert_allclose(params[k], ref[k], rtol=1e-13)
    assert opt.state["w"]["step"] == 3


@pytest.mark.parametrize("block", [7, None])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adam_scratch_gives_the_bits_of_fresh_temporaries(dtype, block, monkeypatch):
    """Same-dtype keys go through two kept scratch arrays, block by block (7 items: the
    30-item matrix in 5 blocks, the last one short); the update is the formula's with
    fresh temporaries bit for bit, and a later step allocates no new scratch. A strided
    parameter (a transposed view) takes the whole-array chain; a key whose gradient has
    another dtype (float64 into float32), and bfloat16 (whose products with a float are
    float32), take the fresh path."""
    import ml_dtypes

    if block is not None:
        monkeypatch.setattr(train, "ADAM_BLOCK_BYTES", block * np.dtype(dtype).itemsize)
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((6, 5)).astype(dtype),
              "b": rng.standard_normal(5).astype(dtype),
              "x": rng.standard_normal(7).astype(np.float32),
              "t": rng.standard_normal((5, 4)).astype(dtype).T,
              "h": rng.standard_normal((40, 50)).astype(ml_dtypes.bfloat16)}
    assert not params["t"].flags.c_contiguous
    ref = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v = {k: np.zeros_like(x) for k, x in ref.items()}
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.1
    opt = train.Adam(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for t in range(1, 4):
        grads = {k: rng.standard_normal(p.shape).astype(
                     np.float64 if k == "x" else p.dtype) for k, p in params.items()}
        opt.step(params, grads)
        if t == 1:
            kept = [id(a) for a in opt._flat[("numpy", np.dtype(dtype))]]
        for k, g in grads.items():               # the formula, one fresh array per op
            m[k] *= b1
            m[k] += (1.0 - b1) * g
            v[k] *= b2
            v[k] += (1.0 - b2) * (g * g)
            denom = np.sqrt(v[k] * (1.0 / (1.0 - b2 ** t)))
            denom += eps
            if ref[k].ndim >= 2:
                ref[k] *= 1.0 - lr * wd
            ref[k] -= (lr / (1.0 - b1 ** t)) * m[k] / denom
        for k in ref:
            assert params[k].dtype == ref[k].dtype
            np.testing.assert_array_equal(params[k], ref[k], err_msg=k)
    assert [id(a) for a in opt._flat[("numpy", np.dtype(dtype))]] == kept


def test_adam_first_step_is_lr_sign():
    """With bias correction the first step is lr * g / (|g| + eps) = lr * sign(g)."""
    params, grads = _pg(dtype=np.float32)
    before = {k: x.copy() for k, x in params.items()}
    train.Adam(lr=1e-3).step(params, grads[0])
    for k in params:
        assert params[k].dtype == np.float32
        np.testing.assert_allclose(before[k] - params[k], 1e-3 * np.sign(grads[0][k]), rtol=1e-4)


def test_optimizer_state_per_key_works_on_a_subset():
    """A parallel scheme may step only some keys (its shards): state is per key."""
    params, grads = _pg()
    opt = train.Adam(lr=1e-2)
    opt.step(params, {"w": grads[0]["w"]})
    opt.step(params, grads[1])
    assert opt.state["w"]["step"] == 2 and opt.state["b"]["step"] == 1


@pytest.mark.parametrize("cls, kwargs", [(train.SGD, dict(lr=0)), (train.SGD, dict(momentum=-1)),
                                         (train.Adam, dict(betas=(1.0, 0.9))),
                                         (train.Adam, dict(eps=0))])
def test_optimizer_validation(cls, kwargs):
    with pytest.raises(ValueError):
        cls(**kwargs)


def test_copy_task_batch():
    rng = np.random.default_rng(0)
    tokens, targets = train.copy_task_batch(rng, 5, 10, 7, 3)
    assert tokens.shape == targets.shape == (5, 10)
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])
    np.testing.assert_array_equal(tokens[:, 3:], tokens[:, :-3])      # period 3
    assert tokens.min() >= 0 and tokens.max() < 7
    assert train.copy_task_floor(16, 16, 4) == pytest.approx(3 / 16 * math.log(16))
    with pytest.raises(ValueError, match="period"):
        train.copy_task_batch(rng, 1, 4, 5, 0)


def test_training_loss_falls_well_below_ln_vocab():
    """2 layers on the copy task: from ln(16) = 2.77 to near the floor 0.52."""
    config = model.Config(vocab=16, seq=16, hidden=32, heads=2, layers=2, dtype=np.float32)
    params = model.init_params(config, 0)
    rng = np.random.default_rng(1)
    logged = []
    with threadpool_limits(1):
        losses = train.train(params, config,
                             lambda step: train.copy_task_batch(rng, 32, 16, 16, 4),
                             train.Adam(lr=3e-3), 160,
                             callback=lambda step, loss: logged.append((step, loss)))
    assert len(losses) == 160 and logged[-1] == (159, losses[-1])
    assert abs(losses[0] - math.log(16)) < 0.1
    final = float(np.mean(losses[-10:]))
    assert final < 0.35 * math.log(16), final        # 0.97 (measured ~0.6); floor 0.52


def test_cli_prints_losses(capsys):
    losses = train.main(["--steps", "6", "--log-every", "3", "--layers", "1", "--checkpoint"])
    out = capsys.readouterr().out
    assert len(losses) == 6
    assert "ln(vocab) = 2.773" in out
    assert "step     3  loss" in out and "step     6  loss" in out


def test_cli_refuses_momentum_with_adam(capsys):
    """--momentum is SGD's: with Adam it would be dropped silently and the run exit 0."""
    with pytest.raises(SystemExit) as exc:
        train.main(["--optimizer", "adam", "--momentum", "0.5", "--steps", "1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--momentum" in err and "Traceback" not in err
    losses = train.main(["--optimizer", "sgd", "--momentum", "0.5", "--steps", "2",
                         "--layers", "1"])
    assert len(losses) == 2
