"""`assay sae train`: sparse autoencoders (or transcoders) on a model's activations, then each one's
feature browser (OUT/features.json, what `assay report` shows).

The command's config extends the library's `SaeTrainConfig` by the two browser options (a
subclass, not a nested field: the run folder's config.json is then the command's own config,
so `assay replay OUT` rebuilds it as it is, browser options included).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from assay.core.console import note, say
from assay.core.distributed import Distributed
from assay.core.errors import AssayError
from assay.core.runs import (
    DONE_FILE,
    config_from_dict,
    config_to_dict,
    final_location,
    load_run_config,
    read_json,
)
from assay.sae.config import SaeTrainConfig
from assay.sae.features import FEATURES_FILE, browse_sae_runs
from assay.sae.train import sae_specs, train_sae


@dataclass
class SaeTrainCommandConfig(SaeTrainConfig):
    """Train SAEs (or transcoders) on a model's activations, then each one's feature browser."""

    browser_latents: int = 32
    """Latents in the feature browser written to OUT/features.json: the first live ones by index
    (an unbiased sample); 0 writes no browser."""
    browser_examples: int = 200
    """Held-out texts (--eval_split of --dataset, each cut to --context_length) read to find each
    browser latent's top contexts and every latent's density."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.browser_latents < 0 or self.browser_examples < 1:
            raise AssayError("--browser_latents must be >= 0 and --browser_examples positive")


def browser_files(cfg: SaeTrainConfig) -> list[Path]:
    """OUT/features.json, or with several SAEs (--hookpoints, --sweep_*) one in each SAE's folder."""
    return [Path(cfg.out) / name / FEATURES_FILE for name, _ in sae_specs(cfg)]


def write_feature_browser(cfg: SaeTrainConfig, latents: int = 32, examples: int = 200) -> list[Path]:
    """Compute the browser of each SAE of the finished run in cfg.out and write its features.json
    (rank 0); returns the files written.

    The SAEs are trained and saved whatever happens here: a browser that cannot be made (e.g. the
    held-out split does not exist) is a note, and the report says the run has no features.json.
    """
    out = Path(cfg.out)
    if latents == 0 or not Distributed.current().is_main:
        return []
    saes = [(sub, out / name) for name, sub in sae_specs(cfg)]
    written = []
    try:
        for (_, folder), browser in zip(saes, browse_sae_runs(saes, latents, examples, cfg.runtime.device)):
            browser.save(folder / FEATURES_FILE)
            written.append(folder / FEATURES_FILE)
            live = int((browser.fired > 0).sum())
            say(
                f"feature browser: {len(browser.features)} latents on {browser.examples} held-out texts "
                f"({live:,} of {len(browser.fired):,} latents fired) in {folder / FEATURES_FILE}"
            )
    except AssayError as e:
        note(f"feature browser not written ({e}); the SAE itself is saved in {out}")
    return written


def ensure_feature_browser(sae_dir: Path | str, latents: int = 32, examples: int = 200) -> Path | None:
    """Write SAE_DIR/features.json for a finished `assay sae train` run that has none (e.g. the
    demo's SAE stage, which calls the library); a run that has one is left as it is."""
    out = Path(sae_dir)
    if (out / FEATURES_FILE).exists():
        return out / FEATURES_FILE
    saved = load_run_config(out)
    if saved.get("command") != "sae train" or not (out / DONE_FILE).exists():
        raise AssayError(f"{out} is not a finished `assay sae train` run")
    cfg = config_from_dict(SaeTrainConfig, saved["config"])
    files = browser_files(cfg)
    if all(f.exists() for f in files):
        return files[0]
    written = write_feature_browser(cfg, latents, examples)
    return written[0] if written else None


def _browser_pending(cfg: SaeTrainCommandConfig) -> bool:
    """A finished run of this very config whose browser was never written (interrupted after the
    SAE was saved): rerunning the command writes the browser alone."""
    out = Path(cfg.out)
    if cfg.overwrite or cfg.browser_latents == 0 or all(f.exists() for f in browser_files(cfg)):
        return False
    if not (out / DONE_FILE).exists():
        return False
    saved = dict(load_run_config(out).get("config") or {})
    wanted = config_to_dict(cfg)
    saved.pop("overwrite", None), wanted.pop("overwrite", None)
    return saved == wanted


def format_summary(summary: dict[str, Any]) -> str:
    """A few readable lines: training figures, then the held-out splice metrics (per SAE)."""
    if "saes" in summary:
        blocks = [f"{name}:\n{format_summary(s)}" for name, s in summary["saes"].items()]
        return "\n".join(
            [*blocks, f"{len(blocks)} SAEs from one pass at {summary['tokens_per_s']:,.0f} tokens/s"]
        )
    nan = float("nan")
    where = summary["hookpoint"]
    if "hookpoint_out" in summary:
        where = f"{where} -> {summary['hookpoint_out']} (transcoder)"
    lines = [
        f"SAE {summary['architecture']} {summary['d_in']}x{summary['d_sae']} at {where} "
        f"({summary['precision']}): {summary['tokens']:,} tokens at {summary['tokens_per_s']:,.0f} tokens/s",
        f"  train (last batch)     FVU {summary.get('fvu', nan):.4f}  L0 {summary.get('l0', nan):.1f}"
        f"  dead {summary.get('dead_fraction', nan):.1%}",
    ]
    if "eval/ce_clean" in summary:
        lines.append(
            f"  held-out               FVU {summary['eval/fvu']:.4f}  L0 {summary['eval/l0']:.1f}  "
            f"CE clean {summary['eval/ce_clean']:.3f}  spliced {summary['eval/ce_spliced']:.3f}  "
            f"zero {summary['eval/ce_zero']:.3f}  score {summary['eval/ce_loss_score']:.3f}  "
            f"KL {summary['eval/kl']:.4f}"
        )
    return "\n".join(lines)


def run(cfg: SaeTrainCommandConfig) -> dict[str, Any]:
    """Train (the library's `train_sae` writes OUT), print the summary, then write the browser."""
    if _browser_pending(cfg):
        note(f"{cfg.out} holds this finished run without its feature browser: writing the browser only")
        summary: dict[str, Any] = read_json(Path(cfg.out) / "summary.json")
    else:
        summary = train_sae(cfg)
        say(format_summary(summary))
        saved = "SAELens format: cfg.json + sae_weights.safetensors; metrics.jsonl"
        say(f"saved to {final_location(cfg.out)} ({saved})")
    write_feature_browser(cfg, cfg.browser_latents, cfg.browser_examples)
    return summary


Config = SaeTrainCommandConfig
