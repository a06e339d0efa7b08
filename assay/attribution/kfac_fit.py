"""Fitting K-FAC / EK-FAC factors with hooks: covariances, eigenbases, the eigenvalue correction.

Pass 1 (`FactorCollector` without bases): a forward hook adds Σ_t a_t a_tᵀ of each linear
module's (unpadded) input tokens; a tensor hook on the module's output adds Σ_t g_t g_tᵀ of the
output gradients in the backward. Pass 2 (EK-FAC, with the eigenbases of pass 1): the hooks
rotate a and g into the eigenbases first, so the per-example gradient in eigen-coordinates is
one batched product, Q_Gᵀ ∇W_n Q_A = Σ_t (Q_Gᵀ g_t)(Q_Aᵀ a_t)ᵀ, squared and summed over examples.
The full per-example gradient is never formed in the original basis.

Which labels (the Fisher). `loss_fn` decides. With the data's labels (e.g. `example_losses`)
the factors are the *empirical* Fisher's; with labels drawn from the model's own predictive
distribution (`SampledLmLosses`, `SampledCrossEntropy`) they are the *true* Fisher's, an
unbiased estimate of the Gauss–Newton matrix for a softmax cross-entropy, which is kronfluence's
default (`use_empirical_fisher=False`) and Grosse et al.'s choice: it does not depend on how well
the model already fits each label, so well-fit examples do not vanish from the curvature.
Measured on LDS (a 4-class MLP, 200 training examples, 40 queries, 48 retrainings on random
halves, two data seeds; EK-FAC, damping 0.1): empirical 0.46 / 0.50, sampled 0.45 / 0.51 (one
draw per example) and 0.47 / 0.51 (eight draws): a tie. The empirical Fisher is then the better
default for the command line: deterministic (a rerun, a resumed or a sharded build fits the
same factors), and for LMs it runs through `example_losses`' chunked head instead of holding
the [tokens, vocabulary] logits that sampling needs.

Precision: the forward and backward run under the policy's autocast; every hook casts a and g
to fp32 explicitly and accumulates with autocast off (never in bf16, which counts exactly only
to 256); fp16 scales the loss and divides the gradient statistics by the scale² in fp32,
retrying a batch at a smaller scale on overflow. Eigendecompositions run in fp64.

Like the gradient collector, every parameter has requires_grad=False while fitting (no weight
gradient GEMMs, no `.grad`); a hooked output that does not require grad becomes a leaf that
does, so the backward still reaches every hooked module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from assay.attribution.batches import batch_examples, check_batches, check_losses, model_device, to_device
from assay.attribution.collector import (
    DEFAULT_MODULES,
    FP16_INITIAL_SCALE,
    FP16_MAX_RETRIES,
    Objective,
    linear_modules,
)
from assay.attribution.kfac import (
    BLOCK_SIZE,
    Kind,
    KronFactors,
    ModuleFactors,
    SideBasis,
    decompose,
    side_blocks,
)
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.precision import STATS_DTYPE, PrecisionPolicy, check_finite, full_precision
from assay.core.progress import Progress
from assay.lm.hooks import is_conv1d
from assay.lm.losses import token_losses
from assay.lm.moe import ExpertLinear

LogitsFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
"""(model, batch) -> [B, C] logits of a classifier."""
Bases = dict[str, tuple[SideBasis, SideBasis]]  # module -> (input side, output side)


def _sides(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or Conv1D."""
    rows, cols = (int(d) for d in module.weight.shape)  # type: ignore[union-attr]
    return (rows, cols) if is_conv1d(module) else (cols, rows)


class FactorCollector:
    """Context manager: hooks on enter, hooks removed and `requires_grad` restored on exit.

    Without `bases` it accumulates the per-block sums Σ a aᵀ and Σ g gᵀ (keys "NAME|a|k",
    "NAME|g|k") and their token counts; with `bases` the EK-FAC sums Σ_n (Q_Gᵀ ∇W_n Q_A)²
    ("NAME|lambda") and the example count. Results are in `sums` (fp32) and `counts`.
    """

    def __init__(
        self,
        model: nn.Module,
        modules: dict[str, nn.Module],
        policy: PrecisionPolicy,
        block_size: int = BLOCK_SIZE,
        bases: Bases | None = None,
    ):
        self.model, self.modules, self.policy, self.bases = model, modules, policy, bases
        self.blocks = {n: tuple(side_blocks(s, block_size) for s in _sides(m)) for n, m in modules.items()}
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self._batch: dict[str, torch.Tensor] = {}
        self._batch_counts: dict[str, int] = {}
        self._mask: torch.Tensor | None = None
        self._mask_count = 0
        self._saved: dict[tuple[str, int], torch.Tensor] = {}
        self._calls: dict[str, int] = {}
        self._done: dict[str, int] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._requires_grad: dict[str, bool] = {}
        self._routed = {n for n, m in modules.items() if isinstance(m, ExpertLinear)}  # MoE experts
        self._routed_counts: dict[tuple[str, int], int] = {}  # an expert's tokens, for its g side

    def __enter__(self) -> FactorCollector:
        self._requires_grad = {n: p.requires_grad for n, p in self.model.named_parameters()}
        for p in self.model.parameters():
            p.requires_grad_(False)  # no weight-gradient GEMMs, no .grad
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(partial(self._forward_hook, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for n, p in self.model.named_parameters():
            p.requires_grad_(self._requires_grad.get(n, p.requires_grad))
        self._reset_batch()

    # --- hooks ------------------------------------------------------------------------------
    def _tokens(self, x: torch.Tensor, routed: bool = False) -> tuple[torch.Tensor, int]:
        """[B, ..., f] -> ([B, T, f] fp32 with padded tokens zeroed, number of unpadded tokens).

        `routed` (an MoE expert, `assay.lm.moe`): the tokens are those sent to the expert, the
        rows that are not all zero, so its factors are means over its own tokens."""
        x = x.detach().reshape(x.shape[0], -1, x.shape[-1]).to(STATS_DTYPE)  # explicit cast, no graph
        mask = self._mask
        if mask is not None and mask.shape == x.shape[:2]:
            x = x * mask[:, :, None]
            count = self._mask_count
        else:
            count = x.shape[0] * x.shape[1]
        return x, int((x != 0).any(dim=-1).sum()) if routed else count

    def _add(self, key: str, value: torch.Tensor) -> None:
        prev = self._batch.get(key)
        self._batch[key] = value if prev is None else prev + value

    def _add_grams(self, name: str, side: str, x: torch.Tensor, count: int) -> None:
        """Σ_t x_t x_tᵀ of [B, T, f] per diagonal block of the side."""
        flat = x.reshape(-1, x.shape[-1])  # [B·T, f]
        for k, sl in enumerate(self.blocks[name][0 if side == "a" else 1]):
            part = flat[:, sl]
            self._add(f"{name}|{side}|{k}", part.T @ part)
        self._batch_counts[f"{name}|{side}"] = self._batch_counts.get(f"{name}|{side}", 0) + count

    def _forward_hook(self, name: str, module: nn.Module, inputs: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return None
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        with full_precision(self.policy.device):
            a, count = self._tokens(inputs[0], name in self._routed)  # [B, T, in]
            if name in self._routed:
                self._routed_counts[(name, call)] = count
            if self.bases is None:
                self._add_grams(name, "a", a, count)
            else:
                self._saved[(name, call)] = self.bases[name][0].to_eigen(a)  # Q_Aᵀ a_t
        out = output
        if not out.requires_grad:
            out = out.detach().requires_grad_(True)  # a leaf, so backward reaches this layer
        out.register_hook(partial(self._backward_hook, name, call))
        return out if out is not output else None

    def _backward_hook(self, name: str, call: int, grad: torch.Tensor) -> None:
        with full_precision(self.policy.device):
            g, count = self._tokens(grad)  # [B, T, out]
            if name in self._routed:  # the tokens sent to the expert (the last one's g is 0)
                count = self._routed_counts.pop((name, call))
            if self.bases is None:
                self._add_grams(name, "g", g, count)
                return
            g = self.bases[name][1].to_eigen(g)  # Q_Gᵀ g_t
            rotated = torch.bmm(g.transpose(1, 2), self._saved.pop((name, call)))  # [B, out, in]
            prev = self._pending.get(name)
            self._pending[name] = rotated if prev is None else prev + rotated  # a layer called twice
            self._done[name] = self._done.get(name, 0) + 1
            if self._done[name] == self._calls[name]:
                self._finish(name)

    def _finish(self, name: str) -> None:
        """Square the example's whole gradient (all calls summed) and add it to Λ's sum."""
        rotated = self._pending.pop(name)
        self._add(f"{name}|lambda", rotated.square().sum(dim=0))

    # --- one batch --------------------------------------------------------------------------
    def step(self, batch: dict[str, torch.Tensor], objective: Objective) -> torch.Tensor:
        """Run one batch forward and backward, adding its statistics; returns [B] fp32 objective values."""
        scale = FP16_INITIAL_SCALE if self.policy.uses_loss_scaling else 1.0
        for _ in range(FP16_MAX_RETRIES):
            values = self._attempt(batch, objective, scale)
            finite = all(bool(torch.isfinite(v).all()) for v in self._batch.values())
            if finite or not self.policy.uses_loss_scaling:
                break
            scale /= 16.0
        check_finite(values, "per-example losses", self.policy)
        for key, value in self._batch.items():
            check_finite(value, f"K-FAC statistics of {key.split('|')[0]}", self.policy)
            value = value / scale**2 if scale != 1.0 and "|a|" not in key else value  # g enters squared
            self.sums[key] = value if key not in self.sums else self.sums[key] + value
        for key, n in self._batch_counts.items():
            self.counts[key] = self.counts.get(key, 0) + n
        self.counts["examples"] = self.counts.get("examples", 0) + int(values.shape[0])
        self._reset_batch()
        return values

    def _attempt(self, batch: dict[str, torch.Tensor], objective: Objective, scale: float) -> torch.Tensor:
        self._reset_batch()
        mask = batch.get("attention_mask")
        self._mask = None if mask is None else mask.to(STATS_DTYPE)
        self._mask_count = 0 if mask is None else int(mask.sum())
        with torch.enable_grad(), self.policy.autocast():
            values = check_losses(objective(self.model, batch), batch)  # [B]
        values = values.to(STATS_DTYPE)
        if not values.requires_grad:
            raise AssayError("the objective does not depend on any of the K-FAC modules")
        (values.sum() * scale).backward()
        for name in list(self._pending):
            self._finish(name)  # a call whose output never reached the loss
        return values.detach()

    # --- over processes ----------------------------------------------------------------------
    def expected_keys(self) -> dict[str, tuple[int, int]]:
        """Every sum this pass fills, with its shape, in a fixed order (the same on every rank)."""
        keys = {}
        for name, (in_blocks, out_blocks) in self.blocks.items():
            if self.bases is not None:
                keys[f"{name}|lambda"] = (out_blocks[-1].stop, in_blocks[-1].stop)
                continue
            for side, blocks in (("a", in_blocks), ("g", out_blocks)):
                for k, sl in enumerate(blocks):
                    keys[f"{name}|{side}|{k}"] = (sl.stop - sl.start, sl.stop - sl.start)
        return keys

    def all_reduce(self, dist: Distributed) -> None:
        """Sum the statistics over processes (each fitted on its own shard of the batches).

        A rank that saw no batch contributes zeros, so all ranks join the same collectives.
        """
        if not dist.active:
            return
        for key, shape in self.expected_keys().items():
            if key not in self.sums:
                self.sums[key] = torch.zeros(shape, dtype=STATS_DTYPE, device=self.policy.device)
            dist.all_reduce_(self.sums[key])
        names = sorted(
            {k for k in self.counts} | {f"{n}|{s}" for n in self.blocks for s in "ag"} | {"examples"}
        )
        totals = dist.sum_scalars(*(self.counts.get(k, 0) for k in names))
        self.counts = {k: int(round(v)) for k, v in zip(names, totals)}

    def _reset_batch(self) -> None:
        self._batch, self._batch_counts = {}, {}
        self._saved, self._calls, self._done, self._pending = {}, {}, {}, {}
        self._mask = None


# --- fitting ----------------------------------------------------------------------------------------
def _run(
    collector: FactorCollector,
    batches: Iterable[dict[str, torch.Tensor]],
    loss_fn: Objective,
    dist: Distributed | None,
    desc: str,
) -> None:
    total = sum(batch_examples(b) or 0 for b in batches) if isinstance(batches, Sequence) else 0
    main = dist is None or dist.is_main
    with collector, Progress(total, desc, enabled=main and total > 0) as bar:
        for batch in batches:
            collector.step(to_device(batch, collector.policy.device), loss_fn)
            mask = batch.get("attention_mask")
            bar.update(batch_examples(batch) or 0, int(mask.sum()) if mask is not None else 0)
    if dist is not None:
        collector.all_reduce(dist)
    if not collector.counts.get("examples"):
        raise AssayError("no batches to fit K-FAC factors on")


def _refuse_unreached(collector: FactorCollector) -> None:
    """One line naming the modules a first pass saw no tokens of on one side: never called, or
    their output never reaches the loss. Their factors would be undefined (0/0), so they are
    refused rather than guessed; their gradients are 0, so leaving them out changes no score."""
    unreached = [
        name
        for name in collector.blocks
        if not all(collector.counts.get(f"{name}|{side}", 0) for side in "ag")
    ]
    if unreached:
        named = ", ".join(unreached[:3]) + (f" and {len(unreached) - 3} more" if len(unreached) > 3 else "")
        raise AssayError(
            f"no tokens or no gradient reached the K-FAC modules {named} in these batches: never called, "
            "or their output never reaches the loss (an unused head, an expert no token was routed to); "
            f"leave them out, e.g. modules=('!{unreached[0]}', ...)"
        )


def covariance_bases(collector: FactorCollector) -> Bases:
    """The fp64 eigendecompositions (stored fp32) of a finished first pass's A and G."""
    _refuse_unreached(collector)
    bases: Bases = {}
    for name, (in_blocks, out_blocks) in collector.blocks.items():
        sides = []
        for side, blocks in (("a", in_blocks), ("g", out_blocks)):
            sums = [collector.sums[f"{name}|{side}|{k}"] for k in range(len(blocks))]
            sides.append(decompose(sums, collector.counts.get(f"{name}|{side}", 0)))
        bases[name] = (sides[0], sides[1])
    return bases


def fit_kfac(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    loss_fn: Objective,
    kind: Kind = "ekfac",
    modules: str | tuple[str, ...] | dict[str, nn.Module] = DEFAULT_MODULES,
    precision: str | PrecisionPolicy = "fp32",
    block_size: int = BLOCK_SIZE,
    dist: Distributed | None = None,
) -> KronFactors:
    """K-FAC factors (and, for "ekfac", the eigenvalue correction) of `loss_fn` over `batches`.

    `loss_fn(model, batch) -> [B]` per-example losses, each summed over its tokens (the
    collector's Objective); its labels choose the Fisher (see the module docstring). `batches`
    is iterated twice for EK-FAC: pass a list (or any re-iterable collection), not a generator.
    `modules`: glob patterns as for the index (default: every trainable linear layer but the
    head) or the modules themselves. Padding tokens (attention_mask 0) contribute nothing.
    A chosen module that gets no tokens or no gradient from the batches (never called, or its
    output never reaches the loss) is refused, naming it: exclude it with `modules`.
    Under torchrun pass `dist` and each process's own shard of the batches: the sums are
    reduced over processes after each pass, so every rank ends with the same factors.
    """
    if kind not in ("kfac", "ekfac"):
        raise AssayError(f"unknown K-FAC kind {kind!r}; choose kfac or ekfac")
    check_batches(batches)
    if kind == "ekfac" and iter(batches) is batches:
        raise AssayError("EK-FAC reads the batches twice: pass a list of batches, not an iterator")
    device = model_device(model)
    policy = (
        precision if isinstance(precision, PrecisionPolicy) else PrecisionPolicy.resolve(precision, device)
    )
    chosen = modules if isinstance(modules, dict) else linear_modules(model, modules)
    first = FactorCollector(model, chosen, policy, block_size)
    _run(first, batches, loss_fn, dist, "K-FAC factors")
    bases = covariance_bases(first)
    examples = first.counts["examples"]
    corrected: dict[str, torch.Tensor] = {}
    if kind == "ekfac":
        second = FactorCollector(model, chosen, policy, block_size, bases)
        _run(second, batches, loss_fn, dist, "EK-FAC eigenvalues")
        examples = second.counts["examples"]
        corrected = {n: second.sums[f"{n}|lambda"] / examples for n in chosen if f"{n}|lambda" in second.sums}
    factors = {
        n: ModuleFactors(bases[n][0], bases[n][1], corrected.get(n), is_conv1d(m)) for n, m in chosen.items()
    }
    fisher = getattr(loss_fn, "fisher", "empirical")
    return KronFactors(kind, factors, fisher, block_size, examples)


# --- objectives with sampled labels (the true Fisher) -------------------------------------------------
class _Sampler:
    """A seeded torch.Generator per device: the same seed draws the same labels on a rerun."""

    fisher = "sampled"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, C] logits -> [N] classes drawn from softmax(logits), computed in fp32."""
        gen = self._generators.get(logits.device)
        if gen is None:
            gen = self._generators[logits.device] = torch.Generator(logits.device).manual_seed(self.seed)
        with full_precision(logits.device):
            probs = torch.softmax(logits.detach().to(STATS_DTYPE), dim=-1)
            return torch.multinomial(probs, 1, generator=gen)[:, 0]


class SampledLmLosses(_Sampler):
    """Causal-LM objective for the true Fisher: [B] summed token losses against next tokens drawn
    from the model's own predictive distribution (at positions whose real label is kept).

    Uses the model's full logits ([B, T, V] at once), unlike `example_losses`' chunked head.
    """

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        b, t, v = logits.shape
        labels = batch["labels"].clone()
        drawn = self.draw(logits[:, :-1].reshape(-1, v)).view(b, t - 1)  # position t predicts t + 1
        keep = labels[:, 1:] != -100
        labels[:, 1:] = torch.where(keep, drawn, labels[:, 1:])
        with full_precision(logits.device):
            return token_losses(logits, labels).sum(dim=1)


class SampledCrossEntropy(_Sampler):
    """Classifier objective for the true Fisher: cross-entropy against classes drawn from the
    model's softmax. `logits_fn(model, batch) -> [B, C]` gives the logits."""

    def __init__(
        self, logits_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor], seed: int = 0
    ):
        super().__init__(seed)
        self.logits_fn = logits_fn

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.logits_fn(model, batch)  # [B, C]
        drawn = self.draw(logits)
        with full_precision(logits.device):
            return F.cross_entropy(logits.to(STATS_DTYPE), drawn, reduction="none")
