"""Module hooks as context managers: registered on enter, always removed on exit."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from assay.core.errors import AssayError
from assay.lm.padding import forward_inputs


def get_module(model: nn.Module, name: str) -> nn.Module:
    """The submodule called `name`, with the available names in the error.

    Under a PEFT wrapper `name` may also be the base model's own (`model.layers.2`, as an SAE's
    hookpoint names it), which the wrapper calls `base_model.model.model.layers.2`.
    """
    with contextlib.suppress(AttributeError):
        return model.get_submodule(name)
    base = getattr(model, "get_base_model", None)
    if callable(base):
        with contextlib.suppress(AttributeError):
            return base().get_submodule(name)
    raise AssayError(f"model has no module {name!r}{_module_hint(model, name)}")


def _module_hint(model: nn.Module, name: str) -> str:
    """The names a mistyped `name` may have meant: its parent's children (`model.layers.9` of a
    4-layer model: model.layers.0 … model.layers.3), else modules of the same last name."""
    parent, _, _ = name.rpartition(".")
    with contextlib.suppress(AttributeError):
        children = [f"{parent}.{child}" for child, _ in model.get_submodule(parent).named_children()]
        if len(children) > 5:
            return f"; {parent} holds {children[0]} … {children[-1]} ({len(children)})"
        if children:
            return f"; {parent} holds {', '.join(children)}"
    close = [n for n, _ in model.named_modules() if n.split(".")[-1] == name.split(".")[-1]][:5]
    return f"; similar: {', '.join(close)}" if close else ""


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D: a linear layer whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None


def is_linear(module: nn.Module) -> bool:
    """An `nn.Linear` or a Conv1D (an addmm, so autocast treats it as a matmul too)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def match_modules(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    """Names matching the glob patterns; a pattern starting with `!` excludes."""
    include = [p for p in patterns if not p.startswith("!")] or ["*"]
    exclude = [p[1:] for p in patterns if p.startswith("!")]
    return [
        n
        for n in names
        if any(fnmatch.fnmatchcase(n, p) for p in include)
        and not any(fnmatch.fnmatchcase(n, p) for p in exclude)
    ]


@contextmanager
def forward_hooks(
    modules: dict[str, nn.Module], hook: Callable[[str, nn.Module, Any, Any], Any]
) -> Iterator[None]:
    """Call `hook(name, module, inputs, output)` after each module's forward.

    A hook that returns a value replaces the module's output (used to splice an SAE in).
    """
    handles = [
        m.register_forward_hook(lambda mod, inp, out, _n=name: hook(_n, mod, inp, out))
        for name, m in modules.items()
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class StopForward(Exception):
    """Raised from a hook to skip the rest of a forward pass once the wanted layer has run."""


def output_tensor(output: Any) -> torch.Tensor:
    """The hidden-state tensor of a module output (decoder layers return tuples)."""
    return output[0] if isinstance(output, tuple) else output


def capture_output(
    model: nn.Module, hookpoint: str, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, T, d] output of module `hookpoint` on input_ids [B, T]; the forward stops right after it.

    The one way assay reads a layer's output (SAE activations, latent queries, the feature
    browser). The autograd graph is kept unless the caller runs it under torch.no_grad(). The
    padding mask is left out where no real token's output depends on it (`assay.lm.padding`).
    """
    module = get_module(model, hookpoint)
    got: list[torch.Tensor] = []

    def grab(_name: str, _mod: nn.Module, _inp: Any, out: Any) -> None:
        got.append(output_tensor(out))
        raise StopForward

    with forward_hooks({hookpoint: module}, grab), contextlib.suppress(StopForward):
        model(**{**forward_inputs(model, input_ids, attention_mask), "use_cache": False})
    if not got:
        raise AssayError(f"module {hookpoint!r} did not run in the model's forward")
    return got[0]
