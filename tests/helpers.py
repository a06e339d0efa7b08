"""Builders the tests share: tiny random models and tokenizers made in code (no downloads),
synthetic examples and texts, the torchrun launcher. Fixtures built on them live in conftest.py;
test files import from here, never from each other."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from assay.attribution.collector import GradientCollector, linear_modules
from assay.attribution.kfac import ModuleFactors
from assay.core.precision import PrecisionPolicy
from assay.lm.data import Examples, collate
from assay.lm.losses import example_losses
from assay.sae.config import SaeArchConfig
from assay.sae.model import SparseAutoencoder

ROOT = Path(__file__).resolve().parents[1]
FP32 = PrecisionPolicy.resolve("fp32", "cpu")
F64 = torch.float64

# ---- texts ------------------------------------------------------------------------------------
SAMPLE_TEXTS = [
    "X:1\nT:The Kesh\nM:6/8\nK:G\nGAG GAB|ABA ABd|edd gdd|edB dBA|",
    "To be, or not to be, that is the question.",
    "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune.",
    "X:2\nT:Drowsy Maggie\nM:4/4\nK:Edor\nE2BE dEBE|E2BE AFDF|",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "All the world's a stage, and all the men and women merely players.",
]


def write_word_texts(path: Path, count: int, max_words: int) -> Path:
    """`count` random texts of 3..max_words-1 words as jsonl (seeded): varied lengths in one file."""
    rng = np.random.default_rng(0)
    words = "the king queen folk tune jig reel air of to and a in my love".split()
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"text": " ".join(rng.choice(words, rng.integers(3, max_words)))}) + "\n")
    return path


NOTES = "ABcdefgab"
WORDS = "the king and queen of night walk slowly over fields where rivers run under cold grey skies".split()


def tune(rng: np.random.Generator) -> str:
    bars = ["".join(rng.choice(list(NOTES), size=4)) + "2" for _ in range(4)]
    return "X:1\nK:D\n|" + "|".join(bars) + "|]"


def prose(rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, size=12)) + "."


# ---- tokenizer and models ---------------------------------------------------------------------
def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained in a second on SAMPLE_TEXTS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SAMPLE_TEXTS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML chat template (SmolLM2's and Qwen's format, without a default system turn)."""


def make_chat_tokenizer():
    """`make_tokenizer` with ChatML's two special tokens and its chat template."""
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_llama(seed: int = 0, **config: Any) -> nn.Module:
    """A 2-layer random Llama small enough for exact gradient checks (eval mode); keyword
    arguments override `LLAMA_DEFAULTS` (e.g. `vocab_size=len(tokenizer)`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA_DEFAULTS, **config})).eval()


MOE_SIZES = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def tiny_moe(kind: str = "mixtral", seed: int = 0) -> nn.Module:
    """A 2-layer random mixture of experts (mixtral, qwen3_moe or olmoe) of four experts, two
    per token (eval mode)."""
    import transformers as tf  # the model classes import slowly; only MoE tests need them

    config, model = {
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
    }[kind]
    experts = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    torch.manual_seed(seed)
    sizes = dict(intermediate_size=48, head_dim=8, max_position_embeddings=128)
    return model(config(**MOE_SIZES, **experts, **sizes)).eval()


def tiny_gpt2(seed: int = 0, **config: Any) -> nn.Module:
    """A 2-layer random GPT-2 (Conv1D projections; eval mode); keyword arguments override the
    config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    defaults = dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    return GPT2LMHeadModel(GPT2Config(**{**defaults, **config})).eval()


# ---- examples and reference gradients ---------------------------------------------------------
def random_examples(lengths: list[int], seed: int = 0, loss_start: list[int] | None = None) -> Examples:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 128, size=sum(lengths)).astype(np.int32)
    return Examples(
        ids=np.arange(len(lengths), dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        tokens=tokens,
        loss_start=np.asarray(loss_start or [1] * len(lengths), dtype=np.int64),
    )


def autograd_grads(model: nn.Module, examples: Examples, names: list[str]) -> list[dict[str, torch.Tensor]]:
    """Reference: each example alone (no padding), its summed loss, `.grad` of each weight."""
    refs = []
    for i in range(len(examples)):
        batch = collate(examples, np.array([i]), pad_id=0, pad_to=int(examples.lengths[i]))
        model.zero_grad(set_to_none=True)
        example_losses(model, batch).sum().backward()
        refs.append({n: model.get_submodule(n).weight.grad.detach().clone() for n in names})
    return refs


def collect_all(model, examples, positions, projector, policy=FP32, patterns=("!*lm_head",), **kw):
    modules = linear_modules(model, patterns)
    batch = collate(examples, positions, pad_id=0, **kw)
    with GradientCollector(model, modules, projector, policy) as col:
        grads, losses = col.gradients(batch, example_losses)
    return col, grads, losses


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---- torchrun ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(*args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """Launch `args` under torchrun on this machine (gloo, one thread per rank)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", *args]
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun passes SIGTERM on to its ranks: a hung job leaves none behind
            proc.communicate(timeout=60)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def ok(proc: subprocess.CompletedProcess) -> None:
    """The job succeeded; else each rank's last traceback lines (torchrun's own summary, which
    follows them, names only exit codes), then the tail of stderr."""
    if proc.returncode == 0:
        return
    lines = proc.stderr.splitlines()
    ranks = sorted({ln.split("]", 1)[0] for ln in lines if ln.startswith("[rank")})
    per_rank = ["\n".join([ln for ln in lines if ln.startswith(r + "]")][-12:]) for r in ranks]
    raise AssertionError("\n\n".join([*per_rank, proc.stderr[-2000:]]))


def write_many(folder: Path) -> Path:
    """13 texts of varied length: an odd count, so ranks get uneven shares of batches."""
    return write_word_texts(folder / "many.jsonl", 13, 30)


# ---- distributed runs compared with one process ------------------------------------------------
BUILD_FLAGS = [
    "--precision", "fp32", "--projection_dim", "4", "--token_batch_size", "48",
    "--normalizer", "adafactor", "--normalizer_samples", "8", "--preconditioner", "trackstar",
    "--threads", "1",  # the reference in this process and the torchrun workers: same GEMM blocking
]  # fmt: skip


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


FINETUNE_FLAGS = [
    "--precision", "fp32", "--effective_batch_size", "4", "--micro_batch_size", "1",
    "--learning_rate", "1e-3", "--eval_split", "", "--log_every", "1", "--save_every", "2",
    "--attention", "eager",
]  # fmt: skip


def finetune_one(folder: Path, model_dir: Path, data: Path) -> tuple[Path, list[str]]:
    """(the 1-process run, its arguments): 4 steps of effective batch 4 over 13 examples."""
    from assay.cli import main

    args = ["--model", str(model_dir), "--dataset", str(data), *FINETUNE_FLAGS]
    assert main(["finetune", str(folder / "one"), *args]) == 0
    return folder / "one", args


def assert_same_training(one: Path, two: Path) -> None:
    """Same loss curve and gradient norms (fp32 noise), same saved weights and Adam moments."""
    from safetensors.torch import load_file

    m1, m2 = metrics(one), metrics(two)
    assert len(m1) == len(m2) == 6  # step 0, steps 1-4, final
    for a, b in zip(m1[1:5], m2[1:5], strict=True):
        assert a["step"] == b["step"]
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-6)
    assert max(a["grad_norm"] for a in m1[1:5]) > 1.0  # --max_grad_norm 1 clipped: clipping is compared
    assert m2[-1]["train_loss"] == pytest.approx(m1[-1]["train_loss"], rel=1e-5)
    for name in ("model/model.safetensors", "optimizer_state.safetensors"):
        w1, w2 = load_file(str(one / name)), load_file(str(two / name))
        assert set(w1) == set(w2)
        for key, value in w1.items():
            torch.testing.assert_close(w2[key], value, rtol=1e-4, atol=1e-5)
    assert not (two / "checkpoint").exists()


# ---- a small classifier for curvature checks ---------------------------------------------------
def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(12, 32, bias=False), nn.Tanh(), nn.Linear(32, 16, bias=False), nn.Tanh(), nn.Linear(16, 4)
    )


def ce_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")  # [B]


def classifier_data(n: int = 96, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=gen)
    x = torch.randn(4, 12, generator=gen)[y] * 2 + torch.randn(n, 12, generator=gen)
    return [{"x": x[i : i + 16], "y": y[i : i + 16]} for i in range(0, n, 16)]


def kron_solve(mf: ModuleFactors, kind: str, grads: torch.Tensor, delta: float) -> torch.Tensor:
    """(H + δI)⁻¹ vec(∇W) with H formed explicitly as a dense Kronecker-structured matrix, fp64."""
    qg, qa = (torch.block_diag(*[q.to(F64) for q in s.vectors]) for s in (mf.g, mf.a))
    basis = torch.kron(qg, qa)  # columns: eigenvectors of G ⊗ A, vec row-major over (out, in)
    h = (basis * mf.eigenvalues(kind).to(F64).reshape(-1)) @ basis.T  # type: ignore[arg-type]
    rhs = grads.to(F64).reshape(grads.shape[0], -1).T
    x = torch.linalg.solve(h + delta * torch.eye(h.shape[0], dtype=F64), rhs)
    return x.T.reshape(grads.shape)


# ---- interruptions ----------------------------------------------------------------------------
def interrupt_on(monkeypatch: Any, module: Any, name: str, call: int) -> None:
    """Make the `call`-th call of `module.name` raise KeyboardInterrupt, as a kill at that point
    would stop the run there (the tests then rerun the command and compare)."""
    real, calls = getattr(module, name), {"n": 0}

    def dies(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(module, name, dies)


# ---- sparse autoencoders --------------------------------------------------------------------
def make_sae(
    arch: str, d_in: int = 16, d_sae: int = 128, k: int = 4, seed: int = 0, **kw
) -> SparseAutoencoder:
    """A small SAE of `arch` (SaeArchConfig fields in kw), seeded, with biases and an encoder
    scale away from their starts."""
    torch.manual_seed(seed)
    sae = SparseAutoencoder(d_in, d_sae, SaeArchConfig(architecture=arch, k=k, **kw))  # type: ignore[arg-type]
    with torch.no_grad():  # non-trivial biases so every term of the maths is exercised
        sae.b_dec.normal_(0, 0.3)
        sae.b_enc.normal_(0, 0.1)
        sae.W_enc.mul_(10)
    return sae
