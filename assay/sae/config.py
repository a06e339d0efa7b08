"""Configs of `assay sae train` and `assay sae eval`: pure data, validation only.

Precision is a string (never a torch.dtype), so a config is plain JSON and a run can be
replayed from its saved `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import tyro

from assay.core.config import DataConfig, ModelSource, RuntimeConfig, refuse_non_finite
from assay.core.errors import AssayError
from assay.sae.architectures import architecture_class, names

ARCHITECTURES: tuple[str, ...] = names()
"""Every registered architecture (one file each under assay/sae/architectures/)."""
Architecture = Annotated[str, tyro.conf.arg(metavar="{" + ",".join(ARCHITECTURES) + "}")]
DecoderInit = Literal["auto", "unit", "small"]
OPTIMIZERS: tuple[str, ...] = ("auto", "adam", "signum")
FP16_REFUSAL = (
    "--precision fp16 is not supported for SAE training: it degraded SAE training badly and its "
    "loss scaling makes runs fragile; use --precision bf16 (fp32's exponent range) or fp32"
)


@dataclass
class SaeArchConfig:
    """The SAE itself: architecture, width and sparsity."""

    LEGACY_DEFAULTS: ClassVar[dict[str, object]] = {
        "decoder_init": "small",
        "jumprelu_threshold_lr": 1.0,
        "aux_straight_through": False,
    }
    """Saved configs from before --decoder_init trained with the small start, from before
    --jumprelu_threshold_lr with thresholds at the weights' learning rate, and from before
    --aux_straight_through with AuxK behind the ReLU's gradient."""

    architecture: Architecture = "topk"
    """relu (ReLU + L1), topk (exactly k latents per token), batchtopk (k per token on average
    over the batch; saved as JumpReLU), jumprelu (learned thresholds, L0 penalty), matryoshka
    (Matryoshka BatchTopK: nested prefixes of the latents each reconstruct the input; saved as
    JumpReLU)."""
    d_sae: int | None = None
    """Number of latents (default: --expansion_factor times the activation width)."""
    expansion_factor: int = 16
    """Latents per activation dimension, used when --d_sae is not given."""
    k: int = 32
    """Active latents per token for topk / batchtopk / matryoshka."""
    l1_coefficient: float = 5.0
    """Weight of the L1 penalty (relu), on activations times decoder row norms."""
    l0_coefficient: float = 1.0
    """Weight of the L0 penalty (jumprelu)."""
    jumprelu_bandwidth: float = 0.05
    """Width of the rectangle kernel of JumpReLU's straight-through threshold gradient."""
    jumprelu_init_threshold: float = 0.01
    """Initial JumpReLU threshold (on normalised activations)."""
    jumprelu_threshold_lr: float = 10.0
    """JumpReLU's thresholds learn at this multiple of the learning rate (1: as SAELens). Adam
    moves a parameter by about its learning rate per step whatever its gradient's size, so a
    larger --l0_coefficient cannot hurry thresholds that start at 0.01 and must reach the
    firing pre-activations' scale; at the weights' rate that takes hundreds of steps with L0 in
    the thousands. 10 recovered the most true features on the synthetic benchmark
    (docs/BENCHMARKS.md)."""
    aux_k: int | None = None
    """Latents the AuxK loss revives per token (topk/batchtopk; default k, so it costs what the
    main code does; Gao et al. use d_in / 2, which measured no better here: docs/BENCHMARKS.md)."""
    aux_coefficient: float = 1 / 32
    """Weight of the AuxK loss against dead latents (0 switches it off)."""
    aux_straight_through: bool = True
    """AuxK's gradient reaches the dead latents it picks straight through the ReLU, so a latent
    whose pre-activations have all fallen below 0 can revive: its pre-activation rises on the
    tokens whose residual lies along its decoder row (its value stays relu(pre) = 0, so the row
    itself moves once the latent fires). Behind the ReLU (--no_aux_straight_through, Gao et
    al.'s AuxK) such a latent gets no gradient and stays dead, as nearly all of the latents
    still dead after 256 steps in docs/BENCHMARKS.md were."""
    decoder_init: DecoderInit = "auto"
    """unit: decoder rows of norm 1, kept at norm 1 through training (the gradient along each
    row is removed and rows are renormalised after every step), encoder = the decoder's
    transpose, scaled (except jumprelu) so the first batch's reconstruction has the
    least-squares scale (Gao et al., sparsify). small: decoder rows of norm --decoder_init_norm,
    encoder = its transpose, norms free (the ReLU/L1 recipe). auto: unit for topk/batchtopk/matryoshka,
    small for relu/jumprelu (chosen by measurement; docs/BENCHMARKS.md). The default learning
    rate follows the start."""
    decoder_init_norm: float = 0.1
    """Initial norm of each decoder row with --decoder_init small (the encoder is its transpose)."""
    matryoshka_widths: list[int] | None = None
    """matryoshka: the nested level widths (strictly increasing; d_sae is added as the last
    level). Default: d_sae / 16, / 8, / 4, / 2, d_sae."""
    sparse_kernels: bool = True
    """topk/batchtopk/matryoshka: decode with a sparse gather (embedding_bag) and a sparse encoder
    backward instead of dense matmuls (chosen by measurement; see docs/BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        architecture_class(self.architecture)  # an AssayError naming the choices
        refuse_non_finite(self)
        if self.d_sae is not None and self.d_sae <= 0:
            raise AssayError(f"--d_sae must be positive, got {self.d_sae}")
        if self.expansion_factor <= 0 or self.k <= 0:
            raise AssayError("--expansion_factor and --k must be positive")
        if architecture_class(self.architecture).keeps_k and self.d_sae is not None and self.k > self.d_sae:
            raise AssayError(f"--k {self.k} exceeds the SAE's {self.d_sae} latents (--d_sae)")
        if self.aux_k is not None and self.aux_k <= 0:
            raise AssayError(f"--aux_k must be positive, got {self.aux_k}")
        if min(self.l1_coefficient, self.l0_coefficient, self.aux_coefficient) < 0:
            raise AssayError("sparsity and aux coefficients must be >= 0")
        if self.decoder_init not in ("auto", "unit", "small"):
            raise AssayError("--decoder_init must be one of auto, unit, small")
        if self.jumprelu_threshold_lr <= 0:
            raise AssayError(f"--jumprelu_threshold_lr must be positive, got {self.jumprelu_threshold_lr}")
        if self.decoder_init_norm <= 0:
            raise AssayError(f"--decoder_init_norm must be positive, got {self.decoder_init_norm}")
        widths = self.matryoshka_widths or []
        if any(w <= 0 for w in widths) or any(b <= a for a, b in zip(widths, widths[1:])):
            raise AssayError(f"--matryoshka_widths must be positive and increasing, got {widths}")
        if self.d_sae is not None and widths and widths[-1] > self.d_sae:
            raise AssayError(f"--matryoshka_widths must not exceed --d_sae {self.d_sae}, got {widths}")

    @property
    def unit_decoder(self) -> bool:
        """Whether decoder rows start, and stay, at unit norm (--decoder_init resolved)."""
        if self.decoder_init == "auto":
            return architecture_class(self.architecture).unit_decoder_default
        return self.decoder_init == "unit"


@dataclass
class SaeTrainConfig:
    """Train sparse autoencoders (or transcoders) on a language model's activations: one module, or
    several and several widths / k from one pass of the model."""

    LEGACY_DEFAULTS: ClassVar[dict[str, object]] = {"optimizer": "adam", "signum_encoder_step": 2**-0.5}
    """Saved configs from before --optimizer trained with Adam, and from before
    --signum_encoder_step with every architecture's encoder at 1/sqrt(2) (`assay replay` keeps
    both)."""

    out: tyro.conf.Positional[str]
    """Output folder: the SAE in SAELens format, metrics.jsonl, checkpoints, summary.json."""
    model: tyro.conf.OmitArgPrefixes[ModelSource] = field(default_factory=ModelSource)
    data: tyro.conf.OmitArgPrefixes[DataConfig] = field(default_factory=lambda: DataConfig("shakespeare"))
    runtime: tyro.conf.OmitArgPrefixes[RuntimeConfig] = field(
        default_factory=lambda: RuntimeConfig(precision="fp32")
    )
    sae: tyro.conf.OmitArgPrefixes[SaeArchConfig] = field(default_factory=SaeArchConfig)
    hookpoint: str = "model.layers.2"
    """HF module name whose output is the activation (a tuple output gives its first element);
    a transcoder's input."""
    hookpoint_out: str | None = None
    """Train a transcoder: predict this module's output from --hookpoint's output, e.g. an MLP's
    input and output (Llama: --hookpoint model.layers.2.post_attention_layernorm --hookpoint_out
    model.layers.2.mlp). Splice metrics replace this module's output with the prediction. Saved
    as SAELens's transcoder (relu) or jumprelu_transcoder (jumprelu, batchtopk, matryoshka);
    topk is refused (SAELens has no TopK transcoder)."""
    hookpoints: list[str] = field(default_factory=list)
    """Train one SAE per module named here, all from the same forward passes of the model (the
    activations of every hookpoint are captured at once), each into OUT/HOOKPOINT/. Combines with
    --sweep_d_sae and --sweep_k (one SAE per combination). Default: --hookpoint alone."""
    sweep_d_sae: list[int] = field(default_factory=list)
    """Train one SAE per width named here from the same pass (OUT/HOOKPOINT-dWIDTH/)."""
    sweep_k: list[int] = field(default_factory=list)
    """Train one SAE per k named here from the same pass (OUT/HOOKPOINT-kK/; topk-type)."""
    training_tokens: int = 2_000_000
    """Tokens (activation vectors) to train on."""
    batch_tokens: int = 4096
    """Activation vectors per SAE step."""
    context_length: int = 128
    """Tokens per context the LM reads (documents are packed and cut into contexts)."""
    buffer_batches: int = 16
    """Shuffling buffer size in batches: each batch mixes tokens of this many batches' contexts."""
    lm_batch_contexts: int = 32
    """Contexts per language-model forward while streaming activations."""
    optimizer: Literal["auto", "adam", "signum"] = "auto"
    """auto, adam or signum. signum: schedule-free sign-SGD (Defazio et al.'s averaging around
    sign updates; sparsify's default); the SAE is evaluated and saved at the averaged point.
    auto: signum with the unit decoder start (topk/batchtopk by default; fixed-size sign steps
    suit rows of fixed norm), adam otherwise (chosen by measurement at 4,096-token batches; at
    1,024, adam measured better; docs/BENCHMARKS.md)."""
    signum_momentum: float = 0.98
    """signum: the interpolation beta of y = beta x + (1 - beta) z (sparsify: 0.95; 0.98 with
    --signum_average_power 1 measured better at 3 of 4 settings, docs/BENCHMARKS.md)."""
    signum_average_power: float = 1.0
    """signum: step k enters the average x with weight k^power * lr_max^2 (sparsify: 0, a plain
    average; 1 weighs recent steps more and, with beta 0.98, measured better)."""
    signum_encoder_step: float | None = None
    """signum: W_enc's steps are its size relative to W_dec's at the start times this (sign
    steps move every weight by the same amount whatever its size). Default per architecture:
    1/sqrt(2) for topk, sqrt(2) for batchtopk and matryoshka (measured: docs/BENCHMARKS.md)."""
    learning_rate: float | None = None
    """Learning rate (default: C / sqrt(d_sae / 16384), Gao et al.'s width scaling; adam: C =
    3.2e-3 for the unit decoder start and 8e-4 for the small one; signum: C = 7e-3, its encoder
    stepping in proportion to its size: docs/sae.md)."""
    lr_warmup_steps: int | None = None
    """Linear learning-rate warm-up from 0 (default: 50 steps with adam, 0 with signum)."""
    lr_decay_fraction: float | None = None
    """Final fraction of steps over which the learning rate decays linearly to 0 (default: 0.2
    with adam, 0 with signum, whose averaging replaces the decay)."""
    l1_warmup_fraction: float = 0.05
    """Fraction of steps over which the L1/L0 coefficient ramps up from 0 (relu, jumprelu)."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this (0: off)."""
    dead_window_tokens: int = 1_000_000
    """A latent is dead when it has not fired for this many tokens (the reported fraction)."""
    aux_window_tokens: int | None = None
    """The AuxK loss trains latents that have not fired for this many tokens (topk-type).
    Default: 16,384 with signum and batches of >= 4,096 tokens (fewer dead latents and a better
    FVU there from 100 steps on), --dead_window_tokens otherwise (a short window killed latents
    with smaller batches and Adam; docs/BENCHMARKS.md)."""
    metrics_every: int = 20
    """Steps between lines of metrics.jsonl."""
    eval_every: int = 0
    """Steps between splice evaluations on held-out text (0: only at the end)."""
    eval_split: str = "eval"
    """Held-out split of --dataset for splice evaluations and the feature browser."""
    eval_dataset: str | None = None
    """Held-out data instead of --eval_split of --dataset (a file is read whole). A single --dataset
    file has no splits: without this, its last --eval_contexts contexts are held out and never
    trained on."""
    eval_contexts: int = 32
    """Held-out contexts per splice evaluation."""
    checkpoint_every: int = 200
    """Steps between checkpoints (0: none; resume by rerunning the same command)."""
    autocast_lm: bool = False
    """Run the language model's forward under bf16 autocast too (with --precision bf16)."""
    compile: bool = False
    """torch.compile the SAE's dense forward (relu/jumprelu, or --no-sparse_kernels)."""
    compile_lm: bool = False
    """torch.compile the language model as well."""
    cache_activations: str | None = None
    """Folder of cached activations: written on first use, read back by later runs."""
    wandb: bool = False
    """Also log metrics to Weights & Biases (works with WANDB_MODE=offline)."""
    wandb_project: str = "assay-sae"
    """W&B project name."""
    overwrite: bool = False
    """Replace a finished run in OUT."""

    def __post_init__(self) -> None:
        check_sae_precision(self.runtime.precision)
        refuse_non_finite(self)
        for name in (
            "training_tokens",
            "batch_tokens",
            "context_length",
            "buffer_batches",
            "lm_batch_contexts",
            "metrics_every",
        ):
            if getattr(self, name) <= 0:
                raise AssayError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise AssayError(f"--learning_rate must be positive, got {self.learning_rate}")
        for name in ("grad_clip", "eval_every", "checkpoint_every", "eval_contexts"):
            if getattr(self, name) < 0:
                raise AssayError(f"--{name} must be >= 0 (0: off), got {getattr(self, name)}")
        outputs = [] if self.hookpoint_out is None else [self.hookpoint_out]
        if any(not name.strip() for name in [self.hookpoint, *self.hookpoints, *outputs]):
            raise AssayError("--hookpoint must name a module, e.g. model.layers.2")
        if self.training_tokens < self.batch_tokens:
            raise AssayError("--training_tokens must be at least --batch_tokens")
        if self.optimizer not in OPTIMIZERS:
            raise AssayError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not 0 < self.signum_momentum <= 1 or self.signum_average_power < 0:
            raise AssayError("--signum_momentum must lie in (0, 1] and --signum_average_power be >= 0")
        if self.signum_encoder_step is not None and not self.signum_encoder_step > 0:
            raise AssayError(f"--signum_encoder_step must be positive, got {self.signum_encoder_step}")
        if min(self.dead_window_tokens, self.aux_window) <= 0:
            raise AssayError("--dead_window_tokens and --aux_window_tokens must be positive")
        if self.lr_warmup_steps is not None and self.lr_warmup_steps < 0:
            raise AssayError("--lr_warmup_steps must be >= 0")
        if not 0 <= self.decay_fraction <= 1 or not 0 <= self.l1_warmup_fraction <= 1:
            raise AssayError("--lr_decay_fraction and --l1_warmup_fraction must lie in [0, 1]")
        if self.autocast_lm and self.runtime.precision == "fp32":
            raise AssayError("--autocast_lm needs --precision bf16")
        several = bool(self.hookpoints or self.sweep_d_sae or self.sweep_k)
        if several and self.hookpoint_out:
            raise AssayError("a transcoder (--hookpoint_out) trains alone: drop --hookpoints/--sweep_*")
        if several and self.wandb:
            raise AssayError("--wandb logs one SAE; train several (--hookpoints/--sweep_*) without it")
        if min([*self.sweep_d_sae, *self.sweep_k, 1]) <= 0:
            raise AssayError("--sweep_d_sae and --sweep_k must be positive")
        cache = self.cache_activations
        if cache is not None and Path(cache).exists() and not Path(cache).is_dir():  # before the LM loads
            raise AssayError(f"--cache_activations {cache} is a file; give a folder for the activation cache")

    @property
    def total_steps(self) -> int:
        return self.training_tokens // self.batch_tokens

    @property
    def optimizer_name(self) -> str:
        """adam or signum (--optimizer auto resolved by architecture)."""
        if self.optimizer != "auto":
            return self.optimizer
        return "signum" if self.sae.unit_decoder else "adam"

    @property
    def warmup_steps(self) -> int:
        """--lr_warmup_steps, or the optimizer's default."""
        if self.lr_warmup_steps is not None:
            return self.lr_warmup_steps
        return 0 if self.optimizer_name == "signum" else 50

    @property
    def decay_fraction(self) -> float:
        """--lr_decay_fraction, or the optimizer's default."""
        if self.lr_decay_fraction is not None:
            return self.lr_decay_fraction
        return 0.0 if self.optimizer_name == "signum" else 0.2

    @property
    def aux_window(self) -> int:
        """--aux_window_tokens, or the default for the architecture, optimizer and batch size."""
        if self.aux_window_tokens is not None:
            return self.aux_window_tokens
        return default_aux_window(
            self.sae.architecture, self.optimizer_name, self.batch_tokens, self.dead_window_tokens
        )


SHORT_AUX_MIN_BATCH = 4096
"""The smallest batch (tokens) at which an architecture's short AuxK window applies."""


def default_aux_window(architecture: str, optimizer: str, batch_tokens: int, dead_window: int) -> int:
    """AuxK's default window in tokens: the architecture's short window under signum with batches
    of >= SHORT_AUX_MIN_BATCH tokens (the TopK kinds: 16,384), else the dead-latent window (measured:
    docs/BENCHMARKS.md)."""
    short = architecture_class(architecture).aux_window_default
    if short is not None and optimizer == "signum" and batch_tokens >= SHORT_AUX_MIN_BATCH:
        return min(short, dead_window)
    return dead_window


def check_sae_precision(name: str) -> None:
    """SAE training runs fp32 or bf16 autocast; fp16 and bf16 weights are refused."""
    if name == "fp16":
        raise AssayError(FP16_REFUSAL)
    if name == "bf16-pure":
        raise AssayError(
            "--precision bf16-pure is not supported for SAEs: parameters and Adam state stay fp32"
        )


@dataclass
class SaeModelSource(ModelSource):
    """The language model an SAE is spliced into."""

    model: str = ""
    """A local Hugging Face model folder, a hub id, a PEFT adapter folder or an alias (assay-tiny,
    smollm2-135m). Default: the model the SAE was trained on (its cfg.json's model_name)."""


@dataclass
class SaeEvalConfig:
    """Reconstruction and splice metrics of a saved SAE (ours or any SAELens-format folder)."""

    sae_dir: tyro.conf.Positional[str]
    """Folder with cfg.json and sae_weights.safetensors."""
    model: tyro.conf.OmitArgPrefixes[SaeModelSource] = field(default_factory=SaeModelSource)
    data: tyro.conf.OmitArgPrefixes[DataConfig] = field(
        default_factory=lambda: DataConfig("shakespeare", split="eval")
    )
    runtime: tyro.conf.OmitArgPrefixes[RuntimeConfig] = field(
        default_factory=lambda: RuntimeConfig(precision="fp32")
    )
    hookpoint: str | None = None
    """Module to splice into (default: the SAE's own hook name from cfg.json); a transcoder's
    input module."""
    hookpoint_out: str | None = None
    """A transcoder's output module, whose output its prediction replaces (default: cfg.json's
    metadata hook_name_out)."""
    context_length: int | None = None
    """Tokens per context (default: the SAE's training context size)."""
    eval_contexts: int = 64
    """Held-out contexts to evaluate on."""
    out: str | None = None
    """Write eval.json here (default: SAE_DIR/eval.json)."""
    overwrite: bool = False
    """Replace an eval.json that is already there (otherwise refused: pass --out for another file)."""
    ground_truth: str | None = None
    """Score against known features instead of splicing into a model: a ground-truth file
    (safetensors: feature_vectors, eval_acts, eval_fires; bench/bench_sae_synthetic.py writes
    one) gives MCC, F1, precision, recall, L0, FVU and the dead fraction (docs/sae.md)."""
    ground_truth_batch: int = 4096
    """Evaluation samples per batch with --ground_truth (the B of --batch_topk's k·B)."""
    batch_topk: int | None = None
    """With --ground_truth: encode by batch top-k with this k, the k·B largest activations of each
    evaluation batch, instead of the SAE's saved rule: how BatchTopK and Matryoshka SAEs train,
    and how SynthSAEBench scores them (its published figures; set it to their training k)."""

    def __post_init__(self) -> None:
        check_sae_precision(self.runtime.precision)
        if self.eval_contexts <= 0 or (self.context_length is not None and self.context_length <= 0):
            raise AssayError("--eval_contexts and --context_length must be positive")
        if self.ground_truth_batch <= 0 or (self.batch_topk is not None and self.batch_topk <= 0):
            raise AssayError("--ground_truth_batch and --batch_topk must be positive")
        if self.batch_topk is not None and not self.ground_truth:
            raise AssayError("--batch_topk scores against known features: pass --ground_truth FILE too")
