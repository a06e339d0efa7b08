"""The SAE feature browser's data: top activating contexts, activation histograms, logit effects.

Computed where the SAE is made (`assay sae train` writes it to OUT/features.json) so that the
report only reads it. Bounded by construction: `num_examples` held-out texts (each cut to the
SAE's context length) are read through the model up to the hookpoint (the forward stops there),
in the token batches of `assay.lm.data`. One pass counts how often every latent fires and each
example's peak per latent, and keeps the per-token activations of the pinned latents and of the
lowest-index ones; the shown latents are the pinned ones, then the first `num_latents` live ones
by index (an unbiased sample, not the loudest). Only when fewer of those live than asked does a
second pass fetch the per-token activations of the chosen latents.

Output tokens: a latent's decoder row W_dec[l] [d_out] times the unembedding W_U [V, d_out]
gives its direct effect on the logits (the "logit lens" view; the final norm and any later
layers are ignored), so it is meaningful for residual-stream hookpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from assay.core.errors import AssayError
from assay.core.precision import STATS_DTYPE, PrecisionPolicy, full_precision
from assay.core.runs import read_json, write_json
from assay.lm.data import Examples, collate, load_examples, token_batches
from assay.lm.hooks import capture_output
from assay.lm.models import load_model, load_tokenizer, resolve_device
from assay.sae.config import SaeTrainConfig
from assay.sae.model import SparseAutoencoder
from assay.sae.saelens_format import load_sae
from assay.sae.sources import held_out_data, split_contexts

FEATURES_FILE = "features.json"
"""Where `assay sae train` writes the browser in its run folder (the report reads it)."""
FORMAT = 1  # bump when the JSON layout changes; from_json refuses other versions
TOP_CONTEXTS = 8
TOP_TOKENS = 8
WINDOW_BEFORE, WINDOW_AFTER = 24, 8
HISTOGRAM_BINS = 30


@dataclass
class Context:
    """One example's tokens around the latent's peak, with the latent's activation per token."""

    example: int
    """The example's source row id."""
    tokens: list[str]
    """The window's tokens as text (newline shown as ⏎, tab as ⇥, empty as ∅)."""
    acts: list[float]
    """The latent's activation at each of those tokens."""
    peak: int
    """Index into `tokens` of the peak activation."""
    max_act: float
    """The peak activation."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Context:
        return cls(**data)


@dataclass
class Feature:
    """One latent as the browser shows it."""

    latent: int
    """The latent's index."""
    density: float
    """Fraction of the sampled tokens where it fires."""
    max_act: float
    """Its largest activation on the sample."""
    contexts: list[Context] = field(default_factory=list)
    """Its top activating examples (at most TOP_CONTEXTS), loudest first."""
    histogram: list[int] = field(default_factory=list)
    """Counts of its nonzero activations in HISTOGRAM_BINS equal bins over [0, max_act]."""
    nonzero: int = 0
    """Sampled tokens where it fires (the histogram's total)."""
    promoted: list[tuple[str, float]] = field(default_factory=list)
    """Output tokens its decoder direction raises most, with W_dec[l]·W_U[t]."""
    suppressed: list[tuple[str, float]] = field(default_factory=list)
    """Output tokens it lowers most, with W_dec[l]·W_U[t]."""

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "contexts": [c.to_json() for c in self.contexts]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Feature:
        pairs = {k: [(str(t), float(v)) for t, v in data.get(k, [])] for k in ("promoted", "suppressed")}
        contexts = [Context.from_json(c) for c in data.get("contexts", [])]
        return cls(**{**data, **pairs, "contexts": contexts})


@dataclass
class FeatureBrowser:
    """The browser of one SAE: the chosen latents, and how often every latent fired."""

    features: list[Feature]
    """The pinned latents, then the first live latents by index."""
    fired: np.ndarray
    """[d_sae] int64: sampled tokens on which each latent fired."""
    tokens: int
    """Real (unpadded) tokens read."""
    examples: int
    """Texts read."""
    source: dict[str, Any] = field(default_factory=dict)
    """Where the texts came from (model, dataset, split, context length, hookpoint, max_texts)."""

    @property
    def density(self) -> np.ndarray:
        """[d_sae] float64 firing fraction over the sample."""
        return self.fired / max(self.tokens, 1)

    @property
    def l0(self) -> float:
        """Mean active latents per token on the sample."""
        return float(self.fired.sum()) / max(self.tokens, 1)

    def feature(self, latent: int) -> Feature | None:
        """The record of `latent`, when it is among the shown ones."""
        return next((f for f in self.features if f.latent == latent), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "features": [f.to_json() for f in self.features],
            "fired": [int(v) for v in self.fired],
            "tokens": self.tokens,
            "examples": self.examples,
            "l0": self.l0,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FeatureBrowser:
        if data.get("format") != FORMAT:
            raise AssayError(f"feature browser format {data.get('format')!r} is not {FORMAT}; rewrite it")
        return cls(
            [Feature.from_json(f) for f in data["features"]],
            np.asarray(data["fired"], dtype=np.int64),
            int(data["tokens"]),
            int(data["examples"]),
            dict(data.get("source") or {}),
        )

    def save(self, path: Path) -> None:
        """Write atomically (a reader sees the old file or the new one)."""
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> FeatureBrowser:
        return cls.from_json(read_json(path))


@dataclass
class LatentReader:
    """A model read up to an SAE's hookpoint, in token batches: [B, T, d_sae] latent activations."""

    model: nn.Module
    """The language model (its forward stops after the hookpoint)."""
    sae: SparseAutoencoder
    """The SAE reading the hookpoint's output (moved to the model's device)."""
    hookpoint: str
    """The module whose output the SAE reads."""
    pad_id: int
    """Token id used for padding (masked out)."""
    token_batch_size: int = 2048
    """Most padded tokens per forward."""

    def __post_init__(self) -> None:
        self.sae.to(self.device)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def batches(self, examples: Examples) -> list[np.ndarray]:
        """Example positions grouped into token-budget batches (lm.data's batching)."""
        return token_batches(examples, self.token_batch_size)

    @torch.no_grad()
    def latents(self, examples: Examples, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, T, d_sae] fp32 activations, 0 at padding; [B, T] attention mask) of these examples."""
        batch = collate(examples, positions, self.pad_id, self.device)
        mask = batch["attention_mask"]
        h = capture_output(self.model, self.hookpoint, batch["input_ids"], mask)  # [B, T, d_in]
        if h.shape[-1] != self.sae.d_in:
            raise AssayError(f"the SAE reads {self.sae.d_in} dims but {self.hookpoint} outputs {h.shape[-1]}")
        with full_precision(h.device):  # the SAE in fp32, whatever the model computed in
            x = h.to(STATS_DTYPE).reshape(-1, self.sae.d_in) * self.sae.act_scale  # [B*T, d_in]
            z = self.sae.encode(x).reshape(*h.shape[:2], -1)  # [B, T, d_sae]
        return z * mask.to(STATS_DTYPE)[:, :, None], mask


def token_text(tokenizer: Any, tok: int, cache: dict[int, str]) -> str:
    """A token as readable text: newline ⏎, tab ⇥, empty ∅; a partial UTF-8 byte as its BPE symbol."""
    if tok not in cache:
        text = tokenizer.decode([tok])
        if "\ufffd" in text:  # a partial UTF-8 byte: show the raw BPE symbol instead of "�"
            text = str(tokenizer.convert_ids_to_tokens(tok))
        cache[tok] = text.replace("\n", "⏎").replace("\t", "⇥") or "∅"
    return cache[tok]


def context_window(
    seq: np.ndarray, acts: np.ndarray, example: int, tokenizer: Any, cache: dict[int, str],
    before: int = WINDOW_BEFORE, after: int = WINDOW_AFTER,
) -> Context:  # fmt: skip
    """The tokens of `seq` [T] around the peak of `acts` [T] (`before` tokens before it, `after` after)."""
    peak = int(np.argmax(acts))
    lo, hi = max(0, peak - before), min(len(seq), peak + after + 1)
    return Context(
        example=example,
        tokens=[token_text(tokenizer, int(t), cache) for t in seq[lo:hi]],
        acts=[float(a) for a in acts[lo:hi]],
        peak=peak - lo,
        max_act=float(acts[peak]),
    )


@torch.no_grad()
def logit_effects(
    model: nn.Module, sae: SparseAutoencoder, latents: list[int], tokenizer: Any, cache: dict[int, str]
) -> dict[int, tuple[list[tuple[str, float]], list[tuple[str, float]]]]:
    """{latent: (promoted, suppressed)}: the top output tokens of W_dec[latent] @ W_Uᵀ ({} when the
    model has no output head of the SAE's output width)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or not latents:
        return {}
    w_u = head.weight.detach().float().to(sae.W_dec.device)  # [V, d_out]
    if w_u.shape[1] != sae.W_dec.shape[1]:
        return {}
    effects = sae.W_dec.detach()[latents].float() @ w_u.T  # [n, V]
    k = min(TOP_TOKENS, effects.shape[1])
    out = {}
    for row, latent in enumerate(latents):
        top, low = effects[row].topk(k), (-effects[row]).topk(k)
        up = [(token_text(tokenizer, int(i), cache), float(v)) for v, i in zip(top.values, top.indices)]
        down = [(token_text(tokenizer, int(i), cache), -float(v)) for v, i in zip(low.values, low.indices)]
        out[latent] = (up, down)
    return out


@dataclass
class _FirstPass:
    """What one read of the sample gives: firing counts, per-example peaks, kept activations."""

    fired: np.ndarray  # [d_sae] int64
    peaks: np.ndarray  # [N, d_sae] float32: each example's max per latent
    kept: dict[int, np.ndarray]  # position -> [T_i, len(cols)] activations of the kept latents
    tokens: int  # real (unpadded) tokens read


def _first_pass(reader: LatentReader, examples: Examples, cols: list[int]) -> _FirstPass:
    """Densities and peaks of every latent; per-token activations of the latents `cols` only."""
    d = reader.sae.d_sae
    fired = torch.zeros(d, dtype=torch.int64)
    peaks = np.zeros((len(examples), d), dtype=np.float32)
    kept: dict[int, np.ndarray] = {}
    index = torch.tensor(cols, dtype=torch.long, device=reader.device)
    tokens = 0
    for positions in reader.batches(examples):
        z, mask = reader.latents(examples, positions)  # [B, T, d]
        fired += (z > 0).sum((0, 1)).cpu()
        tokens += int(mask.sum())
        peaks[positions] = z.amax(1).cpu().numpy()
        low = z[:, :, index].cpu().numpy()  # [B, T, len(cols)]
        for row, pos in enumerate(positions):
            kept[int(pos)] = low[row, : int(examples.lengths[pos])]
    return _FirstPass(fired.numpy(), peaks, kept, tokens)


def _second_pass(reader: LatentReader, examples: Examples, chosen: list[int]) -> dict[int, np.ndarray]:
    """{position: [T_i, len(chosen)]} per-token activations of the chosen latents only."""
    cols = torch.tensor(chosen, dtype=torch.long, device=reader.device)
    out: dict[int, np.ndarray] = {}
    for positions in reader.batches(examples):
        acts = reader.latents(examples, positions)[0][:, :, cols].cpu().numpy()  # [B, T, n_chosen]
        for row, pos in enumerate(positions):
            out[int(pos)] = acts[row, : int(examples.lengths[pos])]
    return out


def browse(
    reader: LatentReader, tokenizer: Any, examples: Examples, num_latents: int, first: tuple[int, ...] = ()
) -> FeatureBrowser:
    """Read `examples` once (twice when few low-index latents live) and assemble the browser of the
    latents in `first` (pinned, e.g. one attributed to training data), then the first `num_latents`
    live latents by index."""
    if len(examples) == 0:
        raise AssayError("the feature browser needs at least one text of two or more tokens")
    d = reader.sae.d_sae
    pinned = [int(i) for i in dict.fromkeys(first) if 0 <= int(i) < d]
    head = min(d, 4 * num_latents)  # the low-index latents whose activations pass 1 keeps
    cols = pinned + [i for i in range(head) if i not in pinned]
    sample = _first_pass(reader, examples, cols)
    live = [int(i) for i in np.flatnonzero(sample.fired > 0) if int(i) not in pinned][:num_latents]
    chosen = pinned + live
    where = {latent: c for c, latent in enumerate(cols)}
    if all(latent in where for latent in chosen):
        per_example = {p: a[:, [where[latent] for latent in chosen]] for p, a in sample.kept.items()}
    else:
        per_example = _second_pass(reader, examples, chosen)
    density = sample.fired / max(sample.tokens, 1)
    features = _features(reader, tokenizer, examples, chosen, density, sample.peaks, per_example)
    return FeatureBrowser(features, sample.fired.astype(np.int64), sample.tokens, len(examples))


def _features(
    reader: LatentReader, tokenizer: Any, examples: Examples, chosen: list[int], density: np.ndarray,
    peaks: np.ndarray, per_example: dict[int, np.ndarray],
) -> list[Feature]:  # fmt: skip
    """One Feature per chosen latent: top contexts, activation histogram, logit effects."""
    cache: dict[int, str] = {}
    effects = logit_effects(reader.model, reader.sae, chosen, tokenizer, cache)
    features = []
    for c, latent in enumerate(chosen):
        column = peaks[:, latent]  # [N]
        order = [int(i) for i in np.argsort(-column, kind="stable")[:TOP_CONTEXTS] if column[i] > 0]
        values = np.concatenate([per_example[p][:, c] for p in range(len(examples))])
        values = values[values > 0]
        top = float(column.max())
        counts, _ = np.histogram(values, bins=HISTOGRAM_BINS, range=(0.0, top or 1.0))
        ids = [int(examples.ids[i]) for i in order]
        contexts = [
            context_window(examples.tokens_of(i), per_example[i][:, c], row, tokenizer, cache)
            for i, row in zip(order, ids)
        ]
        promoted, suppressed = effects.get(latent, ([], []))
        features.append(
            Feature(
                latent=latent,
                density=float(density[latent]),
                max_act=top,
                contexts=contexts,
                histogram=[int(n) for n in counts],
                nonzero=len(values),
                promoted=promoted,
                suppressed=suppressed,
            )  # fmt: skip
        )
    return features


def held_out_examples(cfg: SaeTrainConfig, tokenizer: Any, num_examples: int) -> Examples:
    """The first `num_examples` texts of the SAE run's held-out data (sources.held_out_data), each
    cut to its context length; texts of fewer than two tokens are left out. A single training
    file's held-out part is its last --eval_contexts contexts (what training never saw)."""
    held = held_out_data(cfg)
    if held is None:
        contexts = split_contexts(cfg, tokenizer)[1][:num_examples]  # [n, T]
        n, width = contexts.shape
        return Examples(
            ids=np.arange(n, dtype=np.int64),
            offsets=np.arange(0, n * width + 1, width, dtype=np.int64),
            tokens=contexts.reshape(-1).astype(np.int32),
            loss_start=np.ones(n, dtype=np.int64),
        )
    data = dataclasses.replace(held, max_samples=num_examples, max_length=max(cfg.context_length, 2))
    _, examples = load_examples(data, tokenizer)
    return examples.subset(np.flatnonzero(examples.lengths > 1))


def browse_sae_run(
    cfg: SaeTrainConfig, sae_dir: Path | str, num_latents: int, num_examples: int,
    device: str = "auto", first: tuple[int, ...] = (),
) -> FeatureBrowser:  # fmt: skip
    """The browser of the SAE saved in `sae_dir` by an `assay sae train` run with config `cfg`: its
    model (fp32, as the SAE's activations were read) on its held-out texts."""
    return next(browse_sae_runs([(cfg, sae_dir)], num_latents, num_examples, device, first))


def browse_sae_runs(
    saes: Sequence[tuple[SaeTrainConfig, Path | str]], num_latents: int, num_examples: int,
    device: str = "auto", first: tuple[int, ...] = (),
) -> Iterator[FeatureBrowser]:  # fmt: skip
    """`browse_sae_run` of each (config, folder) of one run's SAEs (--hookpoints, --sweep_*), the
    model and held-out texts, which they share, loaded once."""
    cfg = saes[0][0]
    policy = PrecisionPolicy.resolve("fp32", resolve_device(device))
    tokenizer = load_tokenizer(cfg.model)
    examples = held_out_examples(cfg, tokenizer, num_examples)
    model = load_model(cfg.model, policy, cfg.runtime.attention)
    split = cfg.eval_split if held_out_data(cfg) is not None else "the file's last contexts"
    for sub, sae_dir in saes:
        sae, _ = load_sae(sae_dir)
        reader = LatentReader(model, sae, sub.hookpoint, int(tokenizer.pad_token_id))
        browser = browse(reader, tokenizer, examples, num_latents, first)
        browser.source = {
            "model": cfg.model.model,
            "dataset": cfg.data.dataset,
            "split": split,
            "context_length": cfg.context_length,
            "hookpoint": sub.hookpoint,
            "max_texts": num_examples,
        }
        yield browser
