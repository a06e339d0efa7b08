"""Save and load SAEs in the format SAELens (and sae-dashboard, Neuronpedia tools) load.

A folder with:
  cfg.json                 architecture, d_in, d_sae, dtype, device, apply_b_dec_to_input,
                           normalize_activations ("none": normalisation is folded in),
                           k (topk), d_out (transcoders), metadata {model_name, hook_name,
                           context_size, ..., hook_name_out (transcoders)}
  sae_weights.safetensors  W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_out],
                           b_dec [d_out], threshold [d_sae] (JumpReLU-type)
  sparsity.safetensors     `sparsity`: log10 feature densities [d_sae] (optional)

Each architecture names what it is saved as (`saelens_name`): relu -> "standard", topk ->
"topk", batchtopk, matryoshka and jumprelu -> "jumprelu" (BatchTopK-type SAEs become a
JumpReLU with their learned global threshold, as SAELens saves them). A transcoder is saved as
SAELens's "transcoder" (ReLU) or "jumprelu_transcoder", with apply_b_dec_to_input false.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from assay.core.errors import AssayError, first_line
from assay.core.paths import as_path
from assay.core.runs import new_folder, read_json, write_json
from assay.sae.architectures import REGISTRY, Architecture, saved_as
from assay.sae.architectures.jumprelu import MIN_THRESHOLD
from assay.sae.config import SaeArchConfig
from assay.sae.model import SparseAutoencoder

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
SPARSITY_FILE = "sparsity.safetensors"
SAE_FILES = (CFG_FILE, WEIGHTS_FILE, SPARSITY_FILE)
SAELENS_FORMAT_VERSION = "6.0.0"  # the cfg.json layout written here (SAELens >= 6)
TRANSCODERS = {"standard": "transcoder", "jumprelu": "jumprelu_transcoder"}  # SAELens 6 has no TopK one


def saved_architecture(sae: SparseAutoencoder) -> str:
    """The cfg.json `architecture` an SAE is saved as (an AssayError where SAELens has none)."""
    name = sae.rule.saelens_name
    if not sae.transcoder:
        return name
    if name not in TRANSCODERS:
        raise AssayError(
            f"SAELens has no {sae.arch.architecture} transcoder; train it with --architecture "
            "batchtopk (k per token on average, saved as a JumpReLU transcoder), relu or jumprelu"
        )
    return TRANSCODERS[name]


def save_sae(
    folder: Path | str,
    sae: SparseAutoencoder,
    metadata: dict[str, Any] | None = None,
    log_densities: torch.Tensor | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Write `sae` (normalisation folded in first when needed) in SAELens format into `folder`.

    `folder` must be new or empty, or, with `overwrite=True`, an SAE saved there before by
    `save_sae`; any other file or folder is refused. The SAE is written beside it and renamed
    into place, so `folder` never holds half an SAE. `metadata` goes into cfg.json's metadata
    (SAELens reads `hook_name`, `model_name`, `context_size`).
    """
    folder = as_path(folder, "save_sae's folder")
    _check_what_is_saved(sae, metadata, log_densities)
    check_destination(folder, overwrite)
    with new_folder(folder) as tmp:
        write_sae_files(tmp, sae, metadata or {}, log_densities)
    return folder


def _check_what_is_saved(sae: Any, metadata: Any, log_densities: Any) -> None:
    """save_sae's arguments, refused in one line before anything is written."""
    if not isinstance(sae, SparseAutoencoder):
        raise AssayError(f"save_sae saves an assay SparseAutoencoder, not a {type(sae).__name__}")
    if not isinstance(metadata, dict | None):
        raise AssayError(f"save_sae's metadata must be a dict (or None), not a {type(metadata).__name__}")
    shape = list(log_densities.shape) if isinstance(log_densities, torch.Tensor) else None
    if log_densities is not None and shape != [sae.d_sae]:
        got = shape if shape is not None else type(log_densities).__name__
        raise AssayError(
            f"save_sae's log_densities must be a tensor [{sae.d_sae}] (log10 densities), not {got}"
        )
    saved_architecture(sae)  # SAELens has no TopK transcoder


def check_destination(folder: Path, overwrite: bool) -> None:
    """Refuse a file, a folder save_sae did not write, or (without `overwrite`) an earlier SAE."""
    if folder.exists() and not folder.is_dir():
        raise AssayError(f"{folder} is a file; give save_sae a folder to write the SAE into")
    if not folder.exists() or not any(folder.iterdir()):
        return
    foreign = sorted(p.name for p in folder.iterdir() if p.name not in SAE_FILES)
    if foreign or not _saved_by_assay(folder):
        what = foreign[0] if foreign else f"a {CFG_FILE}"
        raise AssayError(
            f"{folder} holds {what} that save_sae did not write; it replaces only an SAE it saved: "
            "choose a new or empty folder"
        )
    if not overwrite:
        raise AssayError(f"{folder} already holds an SAE; pass overwrite=True to replace it")


def _saved_by_assay(folder: Path) -> bool:
    """Whether `folder` holds an SAE this module wrote (its cfg.json names an assay architecture)."""
    try:
        cfg = read_json(folder / CFG_FILE)
    except AssayError:
        return False
    return isinstance(cfg, dict) and "assay_architecture" in (cfg.get("metadata") or {})


def write_sae_files(
    folder: Path,
    sae: SparseAutoencoder,
    metadata: dict[str, Any],
    log_densities: torch.Tensor | None = None,
) -> None:
    """Write the SAE's files into `folder`, an existing folder the caller writes atomically (a
    run folder's `.part`, save_sae's temporary folder)."""
    arch = saved_architecture(sae)
    if float(sae.act_scale) != 1.0 or float(sae.out_scale) != 1.0:
        sae = sae.folded()
    weights = {
        "W_enc": sae.W_enc.detach().float().contiguous(),
        "b_enc": sae.b_enc.detach().float().contiguous(),
        "W_dec": sae.W_dec.detach().float().contiguous(),
        "b_dec": sae.b_dec.detach().float().contiguous(),
    }
    if sae.rule.saved_threshold:
        weights["threshold"] = sae.threshold().detach().float().contiguous()
    save_file({k: v.cpu() for k, v in weights.items()}, str(folder / WEIGHTS_FILE))
    cfg: dict[str, Any] = {
        "architecture": arch,
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": not sae.transcoder,
        "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {
            "sae_lens_version": SAELENS_FORMAT_VERSION,
            **metadata,
            "assay_architecture": sae.arch.architecture,
        },
    }
    if sae.transcoder:
        cfg["d_out"] = sae.d_out
    cfg.update(sae.rule.save_fields())
    write_json(folder / CFG_FILE, cfg)
    if log_densities is not None:
        save_file(
            {"sparsity": log_densities.detach().float().cpu().contiguous()}, str(folder / SPARSITY_FILE)
        )


def load_sae(folder: Path | str) -> tuple[SparseAutoencoder, dict[str, Any]]:
    """An SAE folder in SAELens format (ours or SAELens's own) -> (SAE, its metadata).

    The SAE works on raw activations (act_scale 1). Metadata always has `hook_name` and
    `context_size` keys (None when the folder does not say). A BatchTopK-type SAE loads as the
    JumpReLU it was saved as; a transcoder loads with `transcoder` set and its `d_out`.
    """
    folder = as_path(folder, "load_sae's folder")
    if not (folder / CFG_FILE).exists() or not (folder / WEIGHTS_FILE).exists():
        raise AssayError(f"{folder} is not an SAE folder (needs {CFG_FILE} and {WEIGHTS_FILE})")
    cfg = _read_cfg(folder)
    arch_cls, transcoder = _our_architecture(cfg)
    d_in, d_sae = _size(cfg, "d_in", folder), _size(cfg, "d_sae", folder)
    d_out = _size(cfg, "d_out", folder) if transcoder else None
    try:
        kwargs = arch_cls.config_from_saved(cfg)
    except AssayError as e:
        raise AssayError(f"{folder}: {e}") from None
    if arch_cls.keeps_k and kwargs["k"] > d_sae:
        raise AssayError(f"{folder}: {CFG_FILE}'s k {kwargs['k']} exceeds its d_sae ({d_sae} latents)")
    arch_cfg = SaeArchConfig(architecture=arch_cls.name, d_sae=d_sae, **kwargs)
    sae = SparseAutoencoder(d_in, d_sae, arch_cfg, d_out=d_out)
    _load_weights(sae, _read_safetensors(folder / WEIGHTS_FILE), cfg, folder)
    return sae.eval(), _metadata(cfg)


def _read_cfg(folder: Path) -> dict[str, Any]:
    """cfg.json, with one line naming the field for what no SAELens folder holds."""
    path = folder / CFG_FILE
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise AssayError(f"{path} is not an SAE config: a JSON object, not a {type(cfg).__name__}")
    if not isinstance(cfg.get("architecture", "standard"), str):
        raise AssayError(
            f"{path}: architecture must be a name (topk, jumprelu, ...), got {cfg['architecture']!r}"
        )
    if not isinstance(cfg.get("metadata") or {}, dict):
        raise AssayError(f"{path}: metadata must be a JSON object, got {cfg['metadata']!r}")
    if cfg.get("normalize_activations", "none") not in ("none", False, None):
        raise AssayError(
            f"{folder}: normalize_activations={cfg['normalize_activations']!r} is not supported; "
            "fold the normalisation into the weights first"
        )
    return cfg


def _size(cfg: dict[str, Any], key: str, folder: Path) -> int:
    """A width cfg.json must give as a positive integer (d_in, d_sae, a transcoder's d_out)."""
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        got = f"got {value!r}" if key in cfg else "it is missing"
        raise AssayError(f"{folder / CFG_FILE}: {key} must be a positive integer; {got}")
    return value


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a damaged or truncated file is one line."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise AssayError(f"{path} is not a readable safetensors file ({first_line(e)})") from None


def _our_architecture(cfg: dict[str, Any]) -> tuple[type[Architecture], bool]:
    """(our architecture class, whether a transcoder) for a saved cfg.json."""
    name = cfg.get("architecture", "standard")
    if name == "standard" and cfg.get("activation_fn", cfg.get("activation_fn_str")) == "topk":
        name = "topk"  # SAELens < 6 wrote TopK as standard + activation_fn topk
    inverse = {v: k for k, v in TRANSCODERS.items()}
    transcoder = name in inverse
    arch_cls = saved_as(inverse.get(name, name))
    if arch_cls is None:
        readable = [n for c in REGISTRY.values() for n in c.loads_from] + list(TRANSCODERS.values())
        raise AssayError(f"SAE architecture {name!r} is not supported ({', '.join(readable)})")
    return arch_cls, transcoder


def _load_weights(
    sae: SparseAutoencoder, weights: dict[str, torch.Tensor], cfg: dict[str, Any], folder: Path
) -> None:
    expected = {
        "W_enc": (sae.d_in, sae.d_sae),
        "b_enc": (sae.d_sae,),
        "W_dec": (sae.d_sae, sae.d_out),
        "b_dec": (sae.d_out,),
    }
    with torch.no_grad():
        for name, shape in expected.items():
            if name not in weights or tuple(weights[name].shape) != shape:
                raise AssayError(f"{folder}: {WEIGHTS_FILE} lacks {name} of shape {list(shape)}")
            getattr(sae, name).copy_(weights[name].float())
        if not sae.transcoder and not cfg.get("apply_b_dec_to_input", True):
            # pre = x @ W_enc + b_enc  ==  (x - b_dec) @ W_enc + (b_enc + b_dec @ W_enc)
            sae.b_enc.add_(sae.b_dec @ sae.W_enc)
        sae.rule.after_load(sae, cfg)
        if sae.rule.learned_threshold:
            if "threshold" not in weights:
                raise AssayError(f"{folder}: a jumprelu SAE needs `threshold` in {WEIGHTS_FILE}")
            sae.jumprelu_threshold.copy_(weights["threshold"].float().clamp_min(MIN_THRESHOLD))


def _metadata(cfg: dict[str, Any]) -> dict[str, Any]:
    meta = dict(cfg.get("metadata") or {})
    for key, old in (("hook_name", "hook_point"), ("model_name", None), ("context_size", None)):
        if meta.get(key) is None:
            meta[key] = cfg.get(key, cfg.get(old) if old else None)
    return meta


def load_log_densities(folder: Path | str) -> torch.Tensor | None:
    """log10 feature densities saved beside an SAE, if any."""
    path = as_path(folder, "load_log_densities's folder") / SPARSITY_FILE
    return _read_safetensors(path).get("sparsity") if path.exists() else None
