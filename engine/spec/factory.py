"""The proposer a `SpeculativeConfig` names. Each method's module is imported only when
chosen; a method whose proposer is not part of this build is a startup error."""

from __future__ import annotations

import importlib
import importlib.util

from plait.engine.spec.config import SpeculativeConfig
from plait.engine.spec.proposer import Proposer
from plait.engine.spec.target import TargetModel

# method -> (module under plait.engine.spec, class): the class is built as Class(config),
# draft_model's as Class(config, target)
_BUILT_ELSEWHERE = {
    "suffix": ("suffix", "SuffixProposer"),
    "draft_model": ("draft_model", "DraftModelProposer"),
}


class ProposerUnavailable(ValueError):
    """The configured method has no proposer in this build."""


def check_available(config: SpeculativeConfig) -> None:
    """Raise ProposerUnavailable now (at startup, before the model loads) when
    `config.method` has no proposer module in this build; imports nothing heavy."""
    if config.method == "ngram":
        return
    module_name, _ = _BUILT_ELSEWHERE[config.method]
    if importlib.util.find_spec(f"plait.engine.spec.{module_name}") is None:
        raise ProposerUnavailable(_unavailable(config.method, module_name))


def _unavailable(method: str, module_name: str) -> str:
    return (f"speculative config: method {method!r} is not available in this build "
            f"(no plait.engine.spec.{module_name}); use method 'ngram'")


def make_proposer(config: SpeculativeConfig, target: TargetModel | None = None) -> Proposer:
    """The proposer for `config.method`. ngram is built here; the others are classes in
    their own module (_BUILT_ELSEWHERE): `Class(config)`, and for draft_model
    `Class(config, target)`, which runs the draft with the target's engine config and
    refuses a draft of another vocabulary (engine/spec/target.py). `target` is required
    for draft_model. Raises ProposerUnavailable when that module or class does not
    exist."""
    if config.method == "ngram":
        from plait.engine.spec.ngram import NgramProposer

        return NgramProposer(*config.lookup_window)
    module_name, class_name = _BUILT_ELSEWHERE[config.method]
    try:
        module = importlib.import_module(f"plait.engine.spec.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"plait.engine.spec.{module_name}":
            raise
        raise ProposerUnavailable(_unavailable(config.method, module_name)) from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ProposerUnavailable(f"speculative config: method {config.method!r} is not "
                                  f"available in this build (no {class_name})")
    if config.method == "draft_model":
        if target is None:
            raise ValueError("draft_model needs the target model (make_proposer's target)")
        proposer: Proposer = cls(config, target)
    else:
        proposer = cls(config)
    return proposer
