"""Attributing a sparse-autoencoder latent to training data: where the two pillars meet.

The query is not a loss but a feature: f(x) = Σ_t a_L(h_t(x)), the activation of SAE latent L
at the SAE's hookpoint summed over the query's real tokens (attention-masked). Its gradient
∇θ f goes through the same collector, projection, normalizer and preconditioner as the
index's loss gradients, so the index answers "which training examples most increase this
feature?".

Sign: one SGD step on a training example z changes f by Δf ≈ -η ⟨∇θ f, ∇θ L(z)⟩. A loss query
ranks z as a proponent when ⟨∇θ L_q, ∇θ L(z)⟩ > 0 (the step lowers the query's loss); to keep
that meaning ("the step moves the query the way we want") the objective is -f, a loss that
falls as the feature rises. Proponents are then the training examples whose step raises the
latent; opponents are those whose step suppresses it.

This module may see both pillars (`assay.attribution` and `assay.sae`); they never see each
other. The SAE is read from its SAELens-format folder (cfg.json + sae_weights.safetensors),
so SAEs trained elsewhere work too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from assay.core.errors import AssayError
from assay.core.precision import STATS_DTYPE, full_precision
from assay.lm.hooks import StopForward, get_module, output_tensor

Activation = Literal["post", "pre"]
SAE_WEIGHTS = "sae_weights.safetensors"
SAE_CONFIG = "cfg.json"


@dataclass
class SaeWeights:
    """An SAE as saved in SAELens format: fp32 tensors and what the encoder needs.

    Shapes: W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_in], b_dec [d_in],
    threshold [d_sae] (jumprelu only).
    """

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    threshold: torch.Tensor | None
    architecture: str  # "standard" (relu), "topk" or "jumprelu"
    k: int | None
    hookpoint: str
    apply_b_dec_to_input: bool
    cfg: dict[str, Any]

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    def to(self, device: torch.device | str) -> SaeWeights:
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        return self

    def pre_acts(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d_sae] encoder pre-activations of raw activations x [..., d_in] (fp32)."""
        x = x.to(STATS_DTYPE)
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        """[..., d_sae] latent activations from pre-activations (the architecture's rule)."""
        if self.architecture == "topk":
            assert self.k is not None
            vals, idx = pre.topk(min(self.k, pre.shape[-1]), dim=-1)
            return torch.zeros_like(pre).scatter(-1, idx, F.relu(vals))
        if self.architecture == "jumprelu":
            assert self.threshold is not None
            return pre * (pre > self.threshold)
        return F.relu(pre)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d_sae] latent activations of raw activations x [..., d_in]."""
        return self.activate(self.pre_acts(x))

    def latent(self, x: torch.Tensor, latent: int, activation: Activation = "post") -> torch.Tensor:
        """[...] activation of one latent, differentiable w.r.t. x.

        topk: the latent counts only where it is among the k largest (the selection itself is
        piecewise constant, so its gradient is the latent's own where selected, 0 elsewhere).
        """
        x = x.to(STATS_DTYPE)
        centred = x - self.b_dec if self.apply_b_dec_to_input else x
        pre_l = centred @ self.W_enc[:, latent] + self.b_enc[latent]  # [...]
        if activation == "pre":
            return pre_l
        if self.architecture == "topk":
            assert self.k is not None
            with torch.no_grad():
                pre = centred @ self.W_enc + self.b_enc  # [..., d_sae]
                kth = pre.topk(min(self.k, pre.shape[-1]), dim=-1).values[..., -1]  # [...]
            return F.relu(pre_l) * (pre_l >= kth)
        if self.architecture == "jumprelu":
            assert self.threshold is not None
            return pre_l * (pre_l > self.threshold[latent])
        return F.relu(pre_l)


def find_sae_folder(sae_dir: Path | str) -> Path:
    """The folder holding cfg.json + sae_weights.safetensors: SAE_DIR itself, or one level down."""
    folder = Path(sae_dir)
    candidates = [folder, folder / "sae"] + sorted(p.parent for p in folder.glob("*/" + SAE_WEIGHTS))
    found = next((c for c in candidates if (c / SAE_WEIGHTS).exists() and (c / SAE_CONFIG).exists()), None)
    if found is None:
        raise AssayError(
            f"{folder} holds no SAE ({SAE_CONFIG} + {SAE_WEIGHTS}); train one with `assay sae train`"
        )
    return found


def load_sae(sae_dir: Path | str, hookpoint: str | None = None) -> SaeWeights:
    """An SAE folder in SAELens format, read by the SAE pillar's own reader, as fp32 tensors.

    The reader folds `apply_b_dec_to_input = false` into b_enc and refuses unfolded activation
    normalisation, so the encoder here is always pre = (x - b_dec) @ W_enc + b_enc.
    """
    from assay.sae.saelens_format import load_sae as read_saelens

    found = find_sae_folder(sae_dir)
    sae, meta = read_saelens(found)
    hook = hookpoint or meta.get("hook_name")
    if not hook:
        raise AssayError(f"{found / SAE_CONFIG} names no hook_name; pass the hookpoint explicitly")
    arch = {"relu": "standard", "topk": "topk", "jumprelu": "jumprelu"}[sae.arch.architecture]
    with torch.no_grad():
        W_enc, b_enc, W_dec, b_dec = (
            t.detach().to(STATS_DTYPE).clone() for t in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec)
        )
        threshold = sae.threshold().detach().to(STATS_DTYPE).clone() if arch == "jumprelu" else None
    return SaeWeights(
        W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec, threshold=threshold, architecture=arch,
        k=sae.arch.k if arch == "topk" else None, hookpoint=str(hook), apply_b_dec_to_input=True,
        cfg=json.loads((found / SAE_CONFIG).read_text()),
    )  # fmt: skip


def _check_latent(sae: SaeWeights, latent: int) -> None:
    if not 0 <= latent < sae.d_sae:
        raise AssayError(f"--latent must be in [0, {sae.d_sae}), got {latent}")


def hook_activations(model: nn.Module, hookpoint: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, T, d_in] output of module `hookpoint` (graph kept); the forward stops right after it."""
    captured: list[torch.Tensor] = []

    def grab(module: nn.Module, inputs: Any, output: Any) -> None:
        captured.append(output_tensor(output))
        raise StopForward

    handle = get_module(model, hookpoint).register_forward_hook(grab)
    try:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    except StopForward:
        pass
    finally:
        handle.remove()
    if not captured:
        raise AssayError(f"the model's forward never reached the SAE's hookpoint {hookpoint!r}")
    return captured[0]


def latent_activations(
    model: nn.Module, sae: SaeWeights, batch: dict[str, torch.Tensor], latent: int, activation: Activation
) -> torch.Tensor:
    """[B, T] the latent's activation per token (0 at padding), connected to the model's graph."""
    h = hook_activations(model, sae.hookpoint, batch)  # [B, T, d_in] model dtype (bf16 under autocast)
    if h.shape[-1] != sae.W_enc.shape[0]:
        raise AssayError(f"the SAE reads {sae.W_enc.shape[0]} dims but {sae.hookpoint} outputs {h.shape[-1]}")
    with full_precision(h.device):  # the SAE in fp32, whatever the model's compute dtype
        acts = sae.latent(h.to(STATS_DTYPE), latent, activation)  # [B, T]
        return acts * batch["attention_mask"].to(STATS_DTYPE)


def latent_objective(sae: SaeWeights, latent: int, activation: Activation = "post"):
    """Objective (model, batch) -> [B]: minus the latent's activation summed over real tokens.

    Minus, so that proponents are the training examples whose gradient step raises the latent
    (see the module docstring). Usable with `assay.attribution.build.collect(..., objective=)`.
    """
    _check_latent(sae, latent)

    def objective(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        device = batch["input_ids"].device
        if sae.W_enc.device != device:
            sae.to(device)
        return -latent_activations(model, sae, batch, latent, activation).sum(dim=1)  # [B]

    return objective


def latent_query_gradients(
    index: Any,
    sae_dir: Path | str,
    latent: int,
    examples: Any,
    token_batch_size: int = 2048,
    activation: Activation = "post",
    setup: Any = None,
) -> np.ndarray:
    """[Q, D] float32 query gradients of -(latent L's activation summed over each example's tokens).

    Computed exactly like the index's rows (model, adapter, modules, projection, normalizer,
    precision), so they can be scored against it: `assay.attribution.score.score_index(index,
    torch.from_numpy(grads), ...)`. `setup` reuses an already loaded `setup_from_index(index)`.
    """
    from assay.attribution.build import collect, setup_from_index

    setup = setup if setup is not None else setup_from_index(index)
    sae = load_sae(sae_dir).to(setup.policy.device)
    grads = collect(setup, examples, token_batch_size, objective=latent_objective(sae, latent, activation))
    silent = np.flatnonzero(~np.any(grads != 0, axis=1))
    if len(silent):
        raise AssayError(
            f"latent {latent} never fires on query {int(silent[0])} (all-zero gradient); pick texts where it "
            "fires (`assay report` on the SAE run lists its top contexts) or use the pre-activation"
        )
    return grads


@torch.no_grad()
def most_active_latent(
    model: nn.Module, sae: SaeWeights, examples: Any, pad_id: int, token_batch_size: int = 2048
) -> int:
    """The latent with the largest activation summed over these examples' real tokens.

    A natural query for a demo: "this feature fires most on these texts; which training
    examples raise it?". Runs in fp32 on the model's device; the forward stops at the hookpoint.
    """
    from assay.lm.data import collate, token_batches

    device = next(model.parameters()).device
    sae.to(device)
    totals = torch.zeros(sae.d_sae, dtype=torch.float64, device=device)  # [d_sae]
    for positions in token_batches(examples, token_batch_size):
        batch = collate(examples, positions, pad_id, device)
        h = hook_activations(model, sae.hookpoint, batch)  # [B, T, d_in]
        z = sae.encode(h.to(STATS_DTYPE)) * batch["attention_mask"][:, :, None]  # [B, T, d_sae]
        totals += z.sum((0, 1)).double()
    return int(totals.argmax())


def score_latent(cfg: Any, sae_dir: str, latent: int | None = None) -> dict[str, Any]:
    """`assay score` with an SAE latent as the query; `latent=None` picks the latent most active
    on the queries themselves (`most_active_latent`). `cfg` is a ScoreConfig without an SAE."""
    import dataclasses

    from assay.attribution.build import setup_from_index
    from assay.attribution.index import open_index
    from assay.attribution.score import load_queries, run_score

    if latent is None:
        index = open_index(cfg.index)
        setup = setup_from_index(index, cfg.device)
        queries = load_queries(cfg, index, setup.tokenizer)
        latent = most_active_latent(setup.model, load_sae(sae_dir), queries.examples, setup.pad_id)
    return run_score(dataclasses.replace(cfg, query_sae=str(sae_dir), latent=latent))


def latent_demo(index_dir: str, sae_dir: str, out: str, queries: int = 3, overwrite: bool = False) -> dict:
    """The README's main job: the SAE latent most active on held-out O'Neill tunes, attributed to the
    training tunes of the index (the same queries as `score_demo`)."""
    from assay.attribution.score import ScoreConfig

    cfg = ScoreConfig(
        out=out, index=index_dir, query_dataset="abc-tunes", query_split="eval",
        query_filter_column="collection", query_filter_value="oneill", query_max_samples=queries,
        overwrite=overwrite,
    )  # fmt: skip
    return score_latent(cfg, sae_dir)
