"""Schedule-free sign-SGD ("signum"): the recurrence against a direct fp64 computation, the
x/y/z relations, the decoder constraint, and the --optimizer option."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from assay.core.errors import AssayError
from assay.sae.config import SaeArchConfig, SaeTrainConfig
from assay.sae.optim import ScheduleFreeSignSGD, averaged
from assay.sae.train import default_learning_rate, make_optimizer, normalise_decoder

BETA = 0.95


def _grad(w: np.ndarray, a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Gradient of sum(a * w + (w - t)^3 / 3): a + (w - t)^2."""
    return a + (w - t) ** 2


def _reference(
    w0: np.ndarray, a: np.ndarray, targets: list, lrs: list, beta: float, r: float
) -> tuple[list, np.ndarray]:
    """Schedule-free sign-SGD written out in fp64: y_t (each step) and the final x as an explicit
    weighted average of the z's (weights s^r lr_max_s^2), not as a running interpolation."""
    z, zs, weights, ys = w0.copy(), [], [], []
    y, lr_max = w0.copy(), 0.0
    for step, (t, lr) in enumerate(zip(targets, lrs), start=1):
        g = _grad(y, a, t)
        assert np.abs(g).min() > 1e-3  # signs well away from 0: fp32 and fp64 agree on them
        z = z - lr * np.sign(g)
        lr_max = max(lr_max, lr)
        zs.append(z)
        weights.append(step**r * lr_max**2)
        x = sum(w * zz for w, zz in zip(weights, zs)) / sum(weights)
        y = beta * x + (1 - beta) * z
        ys.append(y)
    return ys, x


# sparsify's; assay's default; with a step scale (the reference takes it as scaled rates, which
# leaves the averaging weights' ratios unchanged)
@pytest.mark.parametrize(("beta", "r", "scale"), [(0.95, 0.0, 1.0), (0.98, 1.0, 1.0), (0.98, 1.0, 0.37)])
def test_signum_follows_the_schedule_free_recurrence_computed_directly(
    beta: float, r: float, scale: float
) -> None:
    rng = np.random.default_rng(0)
    w0, a = rng.normal(size=(6, 5)), rng.choice([-1.0, 1.0], size=(6, 5)) * rng.uniform(0.5, 1, (6, 5))
    targets = [rng.normal(size=(6, 5)) for _ in range(6)]
    lrs = [0.02, 0.05, 0.1, 0.1, 0.03, 0.08]  # a warm-up, then a dip: lr_max differs from lr
    ys, x = _reference(w0, a, targets, [lr * scale for lr in lrs], beta, r)
    p = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float32))
    opt = ScheduleFreeSignSGD([{"params": [p], "step_scale": scale}], lr=lrs[0], momentum=beta, r=r)
    a_t = torch.tensor(a, dtype=torch.float32)
    for t, lr, y_ref in zip(targets, lrs, ys):
        opt.param_groups[0]["lr"] = lr
        tt = torch.tensor(t, dtype=torch.float32)
        ((a_t * p).sum() + ((p - tt) ** 3).sum() / 3).backward()
        opt.step()
        opt.zero_grad()
        np.testing.assert_allclose(p.detach().numpy(), y_ref, rtol=0, atol=1e-6)
    with averaged(opt):
        np.testing.assert_allclose(p.detach().numpy(), x, rtol=0, atol=1e-6)
    np.testing.assert_allclose(p.detach().numpy(), ys[-1], rtol=0, atol=1e-6)  # back at y


def _stepped(n_steps: int = 4) -> tuple[torch.nn.Parameter, ScheduleFreeSignSGD]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 3))
    opt = ScheduleFreeSignSGD([p], lr=0.1, momentum=BETA)
    for _ in range(n_steps):
        (p * torch.randn(8, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    return p, opt


def test_y_is_the_interpolation_of_x_and_z_and_eval_train_round_trip_exactly() -> None:
    p, opt = _stepped()
    z, x = opt.state[p]["z"], opt.state[p]["x"]
    assert not torch.equal(x, z)  # the average lags the base iterate
    torch.testing.assert_close(p.detach(), BETA * x + (1 - BETA) * z, rtol=0, atol=1e-6)
    y = p.detach().clone()
    opt.eval()
    assert torch.equal(p.detach(), x)
    with pytest.raises(RuntimeError, match="eval mode"):
        opt.step()
    opt.train()
    assert torch.equal(p.detach(), y)  # bit for bit
    # shift_y_ (decoder renormalisation) keeps y = beta x + (1 - beta) z
    opt.shift_y_(p, p.detach() * 0.5)
    torch.testing.assert_close(p.detach(), BETA * x + (1 - BETA) * z, rtol=0, atol=1e-6)


def test_first_step_from_x_equal_y_equal_z() -> None:
    """At step 1 the averaging weight is 1: x becomes z, and y = z as well."""
    p, opt = _stepped(1)
    assert torch.equal(opt.state[p]["x"], opt.state[p]["z"])
    assert torch.equal(p.detach(), opt.state[p]["z"])


def test_unit_decoder_rows_stay_unit_at_the_base_and_averaged_points() -> None:
    """normalise_decoder puts z's and x's rows back on the sphere; y (between them) follows."""
    from assay.sae.model import SparseAutoencoder

    torch.manual_seed(0)
    sae = SparseAutoencoder(16, 64, SaeArchConfig(architecture="topk", k=4))
    opt = make_optimizer(sae, 0.05, "signum", momentum=BETA)
    assert isinstance(opt, ScheduleFreeSignSGD)
    for _ in range(3):
        out = sae.train_forward(torch.randn(32, 16), None, 0.0)
        out.loss.backward()
        sae.project_decoder_grad_()
        opt.step()
        opt.zero_grad()
        normalise_decoder(sae, opt)
        state = opt.state[sae.W_dec]
        for point in (state["z"], state["x"]):
            torch.testing.assert_close(point.norm(dim=1), torch.ones(64))
        torch.testing.assert_close(sae.W_dec.detach(), BETA * state["x"] + (1 - BETA) * state["z"])
        assert float(sae.W_dec.detach().norm(dim=1).max()) <= 1 + 1e-6  # y: a chord between two unit rows
    with averaged(opt):
        torch.testing.assert_close(sae.W_dec.detach().norm(dim=1), torch.ones(64))  # the saved SAE


@pytest.mark.parametrize(
    ("architecture", "given", "factor"),
    [("topk", None, 2**-0.5), ("batchtopk", None, 2**0.5), ("matryoshka", None, 2**0.5), ("topk", 1.5, 1.5)],
)
def test_signum_steps_the_encoder_in_proportion_to_its_fitted_size(
    architecture: str, given: float | None, factor: float
) -> None:
    """After the fitted unit start W_enc is c times W_dec's transpose: its sign steps are
    lr * c * factor per entry (the architecture's factor, or the one given), every other
    parameter's lr."""
    from assay.sae.model import SparseAutoencoder

    torch.manual_seed(0)
    sae = SparseAutoencoder(16, 64, SaeArchConfig(architecture=architecture, k=4, matryoshka_widths=[16, 32]))
    x = torch.randn(256, 16) * 3 + 1
    c = sae.fit_encoder_scale(x)
    assert 0 < c < 0.9  # the plain transpose over-shoots, so the fit shrinks the encoder
    opt = make_optimizer(sae, 0.05, "signum", encoder_step=given)
    start = {n: q.detach().clone() for n, q in sae.named_parameters()}
    sae.train_forward(x, None, 0.0).loss.backward()
    opt.step()
    for name, q in sae.named_parameters():
        moved = (opt.state[q]["z"] - start[name]).abs()
        step = 0.05 * (c * factor if name == "W_enc" else 1.0)
        assert float(moved.max()) == pytest.approx(step, rel=1e-4), name
        assert bool(((moved < 1e-7) | ((moved - step).abs() < 1e-5)).all()), name  # 0 or one step


def test_optimizer_option_resolves_and_round_trips_through_json() -> None:
    from assay.core.runs import config_from_dict, config_to_dict

    cfg = SaeTrainConfig(out="o")
    assert (cfg.optimizer_name, cfg.warmup_steps, cfg.decay_fraction) == ("signum", 0, 0.0)  # topk
    relu = SaeTrainConfig(out="o", sae=SaeArchConfig(architecture="relu"))
    assert (relu.optimizer_name, relu.warmup_steps, relu.decay_fraction) == ("adam", 50, 0.2)
    small = SaeTrainConfig(out="o", sae=SaeArchConfig(decoder_init="small"))  # topk, free row norms
    assert small.optimizer_name == "adam"
    explicit = SaeTrainConfig(out="o", optimizer="adam", lr_warmup_steps=3)
    assert (explicit.optimizer_name, explicit.warmup_steps, explicit.decay_fraction) == ("adam", 3, 0.2)
    back = config_from_dict(SaeTrainConfig, config_to_dict(explicit))
    assert back == explicit
    assert default_learning_rate(2**14, True, "signum") == pytest.approx(7e-3)
    assert default_learning_rate(2**16, True, "signum") == pytest.approx(3.5e-3)
    # AuxK's window: topk's short window with signum at 4,096-token batches, else the dead-latent
    # window, unless given (tests/sae/test_sae_architectures.py has the cases)
    assert cfg.aux_window == 16_384 and relu.aux_window == relu.dead_window_tokens
    assert SaeTrainConfig(out="o", optimizer="adam", aux_window_tokens=512).aux_window == 512
    with pytest.raises(AssayError, match="--aux_window_tokens must be positive"):
        SaeTrainConfig(out="o", aux_window_tokens=0)
    with pytest.raises(AssayError, match="--signum_encoder_step must be positive"):
        SaeTrainConfig(out="o", signum_encoder_step=0.0)


def test_unknown_optimizer_is_a_one_line_error(capsys) -> None:  # type: ignore[no-untyped-def]
    from assay.cli import main

    assert main(["sae", "train", "o", "--optimizer", "sgd"]) == 2  # a Literal: tyro refuses it
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'--optimizer'" in err and "'signum'" in err


def test_a_checkpoint_is_resumed_only_by_the_optimizer_and_layout_that_wrote_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from assay.core.runs import read_json, write_json
    from assay.sae.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from assay.sae.metrics import DeadLatents
    from assay.sae.model import SparseAutoencoder

    sae = SparseAutoencoder(8, 32, SaeArchConfig(architecture="topk", k=2))
    adam = make_optimizer(sae, 1e-3, "adam")
    sae.train_forward(torch.randn(16, 8), None, 0.0).loss.backward()
    adam.step()
    save_checkpoint(tmp_path, sae, adam, DeadLatents(32, 100), TrainState(1, 16))
    with pytest.raises(AssayError, match="holds adam state but this run uses signum"):
        load_checkpoint(tmp_path, sae, make_optimizer(sae, 1e-3, "signum"), DeadLatents(32, 100))
    assert load_checkpoint(tmp_path, sae, make_optimizer(sae, 1e-3, "adam"), DeadLatents(32, 100)).step == 1
    signum = make_optimizer(sae, 1e-3, "signum")
    save_checkpoint(tmp_path, sae, signum, DeadLatents(32, 100), TrainState(1, 16))
    path = tmp_path / "checkpoint" / "state.json"
    state = read_json(path)
    write_json(path, {**state, "optimizer_groups": state["optimizer_groups"][:1]})
    with pytest.raises(AssayError, match="older assay"):  # a checkpoint from before the encoder's group
        load_checkpoint(tmp_path, sae, make_optimizer(sae, 1e-3, "signum"), DeadLatents(32, 100))


def test_a_config_saved_before_the_options_existed_replays_as_it_ran() -> None:
    """`assay replay` of an old run: no --optimizer meant Adam, no --decoder_init the small start,
    no --jumprelu_threshold_lr thresholds at the weights' rate, no --signum_encoder_step the
    encoder at 1/sqrt(2) for every architecture, no --aux_straight_through AuxK behind the ReLU."""
    from assay.core.runs import config_from_dict, config_to_dict

    saved = config_to_dict(SaeTrainConfig(out="o"))
    del saved["optimizer"], saved["sae"]["decoder_init"], saved["sae"]["jumprelu_threshold_lr"]
    del saved["signum_encoder_step"], saved["sae"]["aux_straight_through"]
    old = config_from_dict(SaeTrainConfig, saved)
    assert (old.optimizer, old.sae.decoder_init, old.optimizer_name) == ("adam", "small", "adam")
    assert old.sae.jumprelu_threshold_lr == 1.0 and SaeArchConfig().jumprelu_threshold_lr == 10.0
    assert old.signum_encoder_step == 2**-0.5 and SaeTrainConfig(out="o").signum_encoder_step is None
    assert not old.sae.aux_straight_through and SaeArchConfig().aux_straight_through
    assert config_from_dict(SaeTrainConfig, config_to_dict(SaeTrainConfig(out="o"))).optimizer == "auto"


@pytest.mark.parametrize("kind", ["adam", "signum"])
def test_jumprelu_thresholds_step_at_their_own_multiple_of_the_learning_rate(kind: str) -> None:
    """Both optimizers move a parameter by about lr per step whatever its gradient (Adam's first
    step by exactly lr·sign(g)): the thresholds' first step is --jumprelu_threshold_lr times the
    step they take at 1, and every other parameter steps alike at either setting."""
    from assay.core.precision import PrecisionPolicy
    from assay.sae.metrics import DeadLatents
    from assay.sae.model import SparseAutoencoder
    from assay.sae.train import train_step

    x, moved = torch.randn(64, 8), {}
    for scale in (1.0, 10.0):
        torch.manual_seed(0)
        cfg = SaeArchConfig(architecture="jumprelu", jumprelu_init_threshold=0.5, jumprelu_threshold_lr=scale)
        sae = SparseAutoencoder(8, 32, cfg)
        with torch.no_grad():
            sae.jumprelu_threshold.copy_(torch.linspace(0.0, 0.4, 32))  # pre-acts near some of them
        start = {n: p.detach().clone() for n, p in sae.named_parameters()}
        opt = make_optimizer(sae, 1e-3, kind)
        train_step(sae, opt, x, DeadLatents(32, 100), PrecisionPolicy.resolve("fp32"), 1e-3, 1.0, 1.0, True)
        if kind == "signum":
            opt.eval()  # the averaged point, which moved as z did at the first step
        moved[scale] = {n: p.detach() - start[n] for n, p in sae.named_parameters()}
    step = moved[1.0]["jumprelu_threshold"]
    assert (step != 0).any()
    torch.testing.assert_close(moved[10.0]["jumprelu_threshold"], 10 * step, rtol=1e-4, atol=1e-9)
    for name in moved[1.0]:
        if name != "jumprelu_threshold":
            torch.testing.assert_close(moved[10.0][name], moved[1.0][name])
    with pytest.raises(AssayError, match="jumprelu_threshold_lr must be positive"):
        SaeArchConfig(architecture="jumprelu", jumprelu_threshold_lr=0.0)


@pytest.mark.parametrize(
    ("architecture", "given"), [("batchtopk", None), ("batchtopk", 0.25), ("topk", None)]
)
def test_the_training_run_gives_the_optimizer_its_encoder_step(tmp_path, architecture: str, given) -> None:  # type: ignore[no-untyped-def]
    """`--signum_encoder_step` (or the architecture's default) is what the run's optimizer steps
    W_enc with: scale = factor * |W_enc| / |W_dec| at the start."""
    from assay.sae.loop import Trainee
    from assay.sae.model import SparseAutoencoder

    torch.manual_seed(0)
    arch = SaeArchConfig(architecture=architecture, k=4)
    cfg = SaeTrainConfig(out=str(tmp_path / "o"), sae=arch, signum_encoder_step=given)
    trainee = Trainee(SparseAutoencoder(16, 64, arch), cfg, tmp_path)
    trainee.start(torch.randn(512, 16) * 3 + 1)
    sae = trainee.sae
    factor = given if given is not None else sae.rule.signum_encoder_step
    ratio = float(sae.W_enc.detach().norm() / sae.W_dec.detach().norm())
    assert trainee.opt.param_groups[0]["step_scale"] == pytest.approx(factor * ratio, rel=1e-5)
    assert trainee.opt.param_groups[0]["params"][0] is sae.W_enc
