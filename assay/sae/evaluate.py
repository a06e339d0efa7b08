"""Splice evaluation: how much of the model's behaviour an SAE's reconstruction keeps.

On held-out contexts, three forwards per batch: clean; with the hookpoint's output
replaced by the SAE's reconstruction (spliced); with it replaced by zeros (ablated).
  CE clean / spliced / zero-ablated: mean next-token cross-entropy (nats)
  CE loss score = (CE_zero - CE_spliced) / (CE_zero - CE_clean)   (1: perfect, 0: as bad as zeros)
  KL = mean over positions of KL(p_clean || p_spliced)
Reconstruction metrics (MSE, FVU, L0, ...) come from the same activations.
`assay sae eval` runs this on any SAE folder in SAELens format.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from assay.core.errors import AssayError
from assay.core.precision import full_precision
from assay.core.runs import write_json
from assay.lm.data import load_examples
from assay.lm.hooks import forward_hooks, get_module, output_tensor
from assay.lm.losses import token_losses
from assay.lm.models import load_model, load_tokenizer, setup_runtime
from assay.sae.activations import pack_contexts
from assay.sae.config import SaeEvalConfig
from assay.sae.ground_truth import BatchTopKEncoding, ground_truth_metrics, load_ground_truth
from assay.sae.metrics import ReconstructionStats
from assay.sae.model import SparseAutoencoder
from assay.sae.saelens_format import load_sae

METRIC_ORDER = (
    "mcc",
    "f1",
    "f1_chance",
    "ce_clean",
    "ce_spliced",
    "ce_zero",
    "ce_loss_score",
    "kl",
    "fvu",
    "explained_variance",
    "mse",
    "l0",
)


def replace_output(output: Any, new: torch.Tensor) -> Any:
    """The module output with its hidden-state tensor replaced (same tuple structure)."""
    if isinstance(output, tuple):
        return (new, *output[1:])
    return new


class _Splicer:
    """Forward hook: records the activation (clean), or swaps in the reconstruction / zeros.

    A transcoder reads its input at `hook_in` and replaces (or, clean, is scored against) the
    output of `hook_out`; an SAE has hook_in == hook_out.
    """

    def __init__(self, sae: SparseAutoencoder, stats: ReconstructionStats, hook_in: str, hook_out: str):
        self.sae, self.stats, self.mode = sae, stats, "clean"
        self.hook_in, self.hook_out = hook_in, hook_out
        self.x: torch.Tensor | None = None  # [B, T, d_in] a transcoder's input of this forward

    def __call__(self, name: str, _mod: Any, _inp: Any, out: Any) -> Any:
        h = output_tensor(out)  # [B, T, d]
        width = self.sae.d_out if name == self.hook_out else self.sae.d_in  # an SAE's d_out is its d_in
        if h.shape[-1] != width:  # an SAE of another model (or hookpoint): one line, not a shape error
            raise AssayError(
                f"{name} gives {h.shape[-1]}-wide activations where the SAE has {width}: "
                "evaluate it on the model and hookpoint it was trained on (--model, --hookpoint)"
            )
        if name != self.hook_out:  # a transcoder's input: kept for its output hook
            self.x = h
            return None
        if self.mode == "zero":
            return replace_output(out, torch.zeros_like(h))
        x_in = h if self.hook_in == self.hook_out else self.x
        assert x_in is not None, "the transcoder's input hook runs before its output hook"
        with full_precision(h.device):  # the SAE runs in fp32 for evaluation
            x = x_in.reshape(-1, x_in.shape[-1]).float() * self.sae.act_scale
            z = self.sae.encode(x)
            x_hat = self.sae.decode(z) / self.sae.out_scale
        if self.mode == "clean":
            self.stats.update(h.reshape(-1, h.shape[-1]).float(), x_hat, z)
            return None
        return replace_output(out, x_hat.reshape(h.shape).to(h.dtype))


@torch.no_grad()
def splice_metrics(
    model: Any,
    sae: SparseAutoencoder,
    hookpoint: str,
    contexts: np.ndarray,
    batch_contexts: int = 8,
    lm_region: Any = None,
    hookpoint_out: str | None = None,
) -> dict[str, float]:
    """CE clean/spliced/zero, CE loss score, KL and reconstruction metrics on contexts [n, T].

    A transcoder (hookpoint_out given) replaces hookpoint_out's output with its prediction from
    hookpoint's output; zero-ablation zeroes hookpoint_out's output.
    """
    device = next(model.parameters()).device
    hook_out = hookpoint_out or hookpoint
    stats = ReconstructionStats(sae.d_out, sae.d_sae)
    splicer = _Splicer(sae, stats, hookpoint, hook_out)
    sums = {"ce_clean": 0.0, "ce_spliced": 0.0, "ce_zero": 0.0, "kl": 0.0}
    n_targets = n_positions = 0
    modules = {name: get_module(model, name) for name in dict.fromkeys([hookpoint, hook_out])}
    with forward_hooks(modules, splicer):
        for i in range(0, len(contexts), batch_contexts):
            ids = torch.from_numpy(contexts[i : i + batch_contexts]).to(device)  # [B, T]
            logp = {}
            for mode in ("clean", "spliced", "zero"):
                splicer.mode = mode
                with lm_region or contextlib.nullcontext():
                    logits = model(input_ids=ids).logits
                with full_precision(device):
                    sums[f"ce_{mode}"] += float(token_losses(logits, ids).sum())
                    if mode != "zero":
                        logp[mode] = F.log_softmax(logits.float(), dim=-1)  # [B, T, V]
            kl = (logp["clean"].exp() * (logp["clean"] - logp["spliced"])).sum(-1)  # [B, T]
            sums["kl"] += float(kl.sum())
            n_targets += ids.shape[0] * (ids.shape[1] - 1)
            n_positions += ids.numel()
    out = {k: v / max(n_targets, 1) for k, v in sums.items() if k != "kl"}
    out["kl"] = sums["kl"] / max(n_positions, 1)
    gap = out["ce_zero"] - out["ce_clean"]
    out["ce_loss_score"] = (out["ce_zero"] - out["ce_spliced"]) / gap if abs(gap) > 1e-12 else float("nan")
    return {**out, **stats.result()}


def metrics_path(cfg: SaeEvalConfig) -> Path:
    """Where eval.json goes; an existing one is refused before any work unless --overwrite (the
    metrics of an earlier evaluation are results too)."""
    out = Path(cfg.out) if cfg.out else Path(cfg.sae_dir) / "eval.json"
    if out.is_dir():
        raise AssayError(f"--out {out} is a folder; give the file to write the metrics to")
    if out.exists() and not _earlier_evaluation(out):
        raise AssayError(
            f"{out} exists and is not the metrics of an earlier `assay sae eval`, so assay "
            "leaves it alone: choose another --out FILE"
        )
    if out.exists() and not cfg.overwrite:
        raise AssayError(
            f"{out} holds an earlier evaluation's metrics; pass --overwrite to replace them or --out FILE"
        )
    return out


def _earlier_evaluation(path: Path) -> bool:
    """Whether `path` is an eval.json this command wrote (a JSON object naming its SAE)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(record, dict) and "sae" in record


def _trained_on(cfg: SaeEvalConfig, meta: dict[str, Any]) -> str:
    """The model an SAE's cfg.json says it was trained on (the default --model)."""
    name = meta.get("model_name")
    if not name:
        raise AssayError(
            f"{cfg.sae_dir}/cfg.json names no model_name; pass --model (the model it was trained on)"
        )
    return str(name)


def _against_ground_truth(cfg: SaeEvalConfig, sae: SparseAutoencoder, path: str, out: Path) -> dict[str, Any]:
    """MCC, F1 and the rest against the known features of `path` (eval.json written)."""
    k = cfg.batch_topk
    metrics = ground_truth_metrics(
        sae if k is None else BatchTopKEncoding(sae, k), load_ground_truth(path), cfg.ground_truth_batch
    )
    rule = {} if k is None else {"batch_topk": k, "batch": cfg.ground_truth_batch}
    write_json(out, {"sae": str(cfg.sae_dir), "ground_truth": path, **rule, **metrics})
    how = "" if k is None else f", encoded by batch top-k (k = {k})"
    return {"about": f"SAE {cfg.sae_dir} against the features of {path}{how}", **metrics}


def evaluate_sae(cfg: SaeEvalConfig) -> dict[str, Any]:
    """Load an SAE folder, splice it into the model (or score it against a ground-truth file),
    save the metrics (eval.json) and return them with what was measured (`"about"`)."""
    sae, meta = load_sae(cfg.sae_dir)
    if cfg.hookpoint_out and not sae.transcoder:
        raise AssayError(f"--hookpoint_out is for transcoders; {cfg.sae_dir} is an SAE: drop it")
    out = metrics_path(cfg)
    if cfg.ground_truth:
        return _against_ground_truth(cfg, sae, cfg.ground_truth, out)
    hookpoint = cfg.hookpoint or meta.get("hook_name")
    if not hookpoint:
        raise AssayError(f"{cfg.sae_dir}/cfg.json names no hook; pass --hookpoint MODULE_NAME")
    context_length = int(cfg.context_length or meta.get("context_size") or 128)
    device, policy = setup_runtime(cfg.runtime)
    source = cfg.model if cfg.model.model else dataclasses.replace(cfg.model, model=_trained_on(cfg, meta))
    tokenizer = load_tokenizer(source)
    _, examples = load_examples(cfg.data, tokenizer)
    contexts = pack_contexts(examples.tokens, context_length)[: cfg.eval_contexts]
    model = load_model(source, policy, cfg.runtime.attention)
    hookpoint_out = (cfg.hookpoint_out or meta.get("hook_name_out")) if sae.transcoder else None
    if sae.transcoder and not hookpoint_out:
        raise AssayError(
            f"{cfg.sae_dir} is a transcoder whose cfg.json names no hook_name_out; pass --hookpoint_out"
        )
    for name in (hookpoint, hookpoint_out):
        if name:
            get_module(model, name)  # fail early with the module list
    metrics = splice_metrics(
        model, sae.to(device), hookpoint, contexts, lm_region=policy.autocast(), hookpoint_out=hookpoint_out
    )
    metrics.update(eval_tokens=int(contexts.size), context_length=context_length)
    write_json(out, {"sae": str(cfg.sae_dir), "model": source.model, "hookpoint": hookpoint, **metrics})
    about = (
        f"SAE {cfg.sae_dir} at {hookpoint} on {cfg.data.dataset}:{cfg.data.split} ({contexts.size:,} tokens)"
    )
    return {"about": about, **metrics}
