"""The SAE feature browser's data: top activating contexts, activation histograms, logit effects.

Bounded by construction: `num_examples` held-out texts (each cut to the SAE's context length)
are read through the model up to the hookpoint (the forward stops there). One pass counts how
often every latent fires and each example's peak per latent, and keeps the per-token
activations of the lowest-index latents; the shown latents are the first `num_latents` live
ones by index (an unbiased sample, not the loudest). Only when fewer of those live than asked
does a second pass fetch the per-token activations of the chosen latents.

Output tokens: a latent's decoder row W_dec[l] [d_in] times the unembedding W_U [V, d_in]
gives its direct effect on the logits (the "logit lens" view; the final norm and any later
layers are ignored), so it is meaningful for residual-stream hookpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from assay.bridge.latent import HookedSae

TOP_CONTEXTS = 8
TOP_TOKENS = 8
WINDOW_BEFORE, WINDOW_AFTER = 24, 8


@dataclass
class Context:
    """One example's tokens around the latent's peak, with the latent's activation per token."""

    example: int  # source row id
    tokens: list[str]
    acts: list[float]
    peak: int  # index into tokens
    max_act: float


@dataclass
class Feature:
    latent: int
    density: float  # fraction of sampled tokens where it fires
    max_act: float
    contexts: list[Context] = field(default_factory=list)
    values: np.ndarray = field(default_factory=lambda: np.zeros(0))  # its nonzero activations
    promoted: list[tuple[str, float]] = field(default_factory=list)
    suppressed: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class FeatureBrowser:
    features: list[Feature]
    density: np.ndarray  # [d_sae] firing fraction over the sample
    tokens: int  # real tokens read
    examples: int
    l0: float  # mean active latents per token on the sample


def _batches(lengths: list[int], batch: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch] for i in range(0, len(order), batch)]


def _pad(seqs: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.from_numpy(s.astype(np.int64))
        mask[r, : len(s)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def _latents(model: Any, sae: HookedSae, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T, d_sae] fp32 latent activations (0 at padding); the forward stops at the hookpoint."""
    return sae.latents(model, {"input_ids": ids, "attention_mask": mask})


def _token_text(tokenizer: Any, cache: dict[int, str], tok: int) -> str:
    if tok not in cache:
        text = tokenizer.decode([tok])
        if "\ufffd" in text:  # a partial UTF-8 byte: show the raw BPE symbol instead of "�"
            text = str(tokenizer.convert_ids_to_tokens(tok))
        cache[tok] = text.replace("\n", "⏎").replace("\t", "⇥") or "∅"
    return cache[tok]


def _logit_effects(model: Any, sae: HookedSae, latents: list[int], tokenizer: Any, cache: dict) -> dict:
    """{latent: (promoted, suppressed)} top output tokens of W_dec[latent] @ W_Uᵀ."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not latents:
        return {}
    w_u = head.weight.detach().float().to(sae.sae.W_dec.device)  # [V, d_in]
    if w_u.shape[1] != sae.sae.W_dec.shape[1]:
        return {}
    effects = sae.sae.W_dec[latents] @ w_u.T  # [n, V]
    k = min(TOP_TOKENS, effects.shape[1])
    out = {}
    for row, latent in enumerate(latents):
        top = effects[row].topk(k)
        bottom = (-effects[row]).topk(k)
        out[latent] = (
            [(_token_text(tokenizer, cache, int(i)), float(v)) for v, i in zip(top.values, top.indices)],
            [
                (_token_text(tokenizer, cache, int(i)), -float(v))
                for v, i in zip(bottom.values, bottom.indices)
            ],
        )
    return out


def _context(
    seq: np.ndarray, acts: np.ndarray, example: int, tokenizer: Any, cache: dict,
    before: int = WINDOW_BEFORE, after: int = WINDOW_AFTER,
) -> Context:  # fmt: skip
    """The tokens around the peak activation (`before` tokens before it, `after` after)."""
    peak = int(np.argmax(acts))
    lo, hi = max(0, peak - before), min(len(seq), peak + after + 1)
    return Context(
        example=example,
        tokens=[_token_text(tokenizer, cache, int(t)) for t in seq[lo:hi]],
        acts=[float(a) for a in acts[lo:hi]],
        peak=peak - lo,
        max_act=float(acts[peak]),
    )


def browse(
    model: Any, tokenizer: Any, sae: HookedSae, seqs: list[np.ndarray], ids: list[int], num_latents: int,
    device: torch.device, batch: int = 8, first: tuple[int, ...] = (),
) -> FeatureBrowser:  # fmt: skip
    """Read `seqs` (token arrays) once (twice when few low-index latents live) and assemble the
    browser for `first` (e.g. latents attributed elsewhere in the report), then the first
    `num_latents` live latents by index."""
    sae.to(device)
    d = sae.sae.d_sae
    head = min(d, 4 * num_latents)  # per-token activations kept in pass 1: latents [0, head)
    fired = torch.zeros(d, dtype=torch.float64)
    peaks = np.zeros((len(seqs), d), dtype=np.float32)  # [N, d_sae] each example's max per latent
    kept: dict[int, np.ndarray] = {}  # position -> [T_i, head]
    n_tokens = 0
    groups = _batches([len(s) for s in seqs], batch)
    for group in groups:  # pass 1: densities, per-example peaks, activations of the first latents
        ids_t, mask = _pad([seqs[i] for i in group], device)
        z = _latents(model, sae, ids_t, mask)  # [B, T, d]
        fired += (z > 0).sum((0, 1)).double().cpu()
        n_tokens += int(mask.sum())
        peaks[group] = z.amax(1).cpu().numpy()
        low = z[:, :, :head].cpu().numpy()  # [B, T, head]
        for r, i in enumerate(group):
            kept[i] = low[r, : len(seqs[i])]
    density = (fired / max(n_tokens, 1)).numpy()
    pinned = [int(i) for i in dict.fromkeys(first) if 0 <= int(i) < d]
    chosen = pinned + [int(i) for i in np.flatnonzero(density > 0) if int(i) not in pinned][:num_latents]
    if chosen and max(chosen) < head:
        per_example = {i: a[:, chosen] for i, a in kept.items()}  # position -> [T_i, len(chosen)]
    else:
        per_example = _second_pass(model, sae, seqs, groups, chosen, device)
    features = _features(model, tokenizer, sae, seqs, ids, chosen, density, peaks, per_example)
    return FeatureBrowser(features, density, n_tokens, len(seqs), float(fired.sum()) / max(n_tokens, 1))


def _second_pass(model: Any, sae: HookedSae, seqs: list[np.ndarray], groups: list[list[int]],
                 chosen: list[int], device: torch.device) -> dict[int, np.ndarray]:  # fmt: skip
    """{position: [T_i, len(chosen)]} per-token activations of the chosen latents only."""
    per_example: dict[int, np.ndarray] = {}
    if not chosen:
        return per_example
    cols = torch.tensor(chosen, device=device)
    for group in groups:
        ids_t, mask = _pad([seqs[i] for i in group], device)
        acts = _latents(model, sae, ids_t, mask)[:, :, cols].cpu().numpy()  # [B, T, n_chosen]
        for r, i in enumerate(group):
            per_example[i] = acts[r, : len(seqs[i])]
    return per_example


def _features(model: Any, tokenizer: Any, sae: HookedSae, seqs: list[np.ndarray], ids: list[int],
              chosen: list[int], density: np.ndarray, peaks: np.ndarray,
              per_example: dict[int, np.ndarray]) -> list[Feature]:  # fmt: skip
    """One Feature per chosen latent: top contexts, nonzero activations, logit effects."""
    cache: dict[int, str] = {}
    effects = _logit_effects(model, sae, chosen, tokenizer, cache)
    features = []
    for c, latent in enumerate(chosen):
        order = [
            i for i in np.argsort(-peaks[:, latent], kind="stable")[:TOP_CONTEXTS] if peaks[i, latent] > 0
        ]
        values = np.concatenate([per_example[i][:, c] for i in range(len(seqs))])
        feat = Feature(
            latent, float(density[latent]), float(peaks[:, latent].max()), values=values[values > 0]
        )
        feat.contexts = [_context(seqs[i], per_example[i][:, c], ids[i], tokenizer, cache) for i in order]
        feat.promoted, feat.suppressed = effects.get(latent, ([], []))
        features.append(feat)
    return features
