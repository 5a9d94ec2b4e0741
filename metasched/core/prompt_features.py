"""What a framework knows of a prompt before its first turn, as features for the
remaining-work predictor (:mod:`metasched.core.predictor`, design ``gbm``).

A prompt is its text and metadata (:class:`PromptInfo`: repository, language). Its
features: the log length of its text in characters and in lines, its count of code
blocks, a hashed bag of words (scikit-learn's ``HashingVectorizer``, stateless) cut to a
few dimensions by a truncated SVD fitted on the training prompts, and its repository as
a category (the training repositories' codes; an unseen one is missing). The text is
read as given: nothing is downloaded, no model is loaded.

Needs scikit-learn (the ``predict`` extra: ``pip install metasched[predict]``).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from metasched.errors import ConfigError

N_HASH = 2**14  # hashed vocabulary
N_SVD = 8  # dimensions kept of the hashed bag of words
NAMES = ("log_chars", "log_lines", "code_blocks", *(f"bow{i}" for i in range(N_SVD)), "repo")


@dataclass(frozen=True, slots=True)
class PromptInfo:
    """A prompt's text and metadata (None: unknown)."""

    text: str | None = None
    repo: str | None = None
    language: str | None = None


def read_prompts(path: str | Path) -> dict[str, PromptInfo]:
    """The prompts file of a trace (JSONL, gzipped where the name ends in ``.gz``: one
    object a line with ``prompt`` and optional ``text``, ``repo``, ``language``)."""
    name = str(path)
    opener = gzip.open if name.endswith(".gz") else open
    out: dict[str, PromptInfo] = {}
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    out[str(d["prompt"])] = PromptInfo(d.get("text"), d.get("repo"),
                                                       d.get("language"))
                except (ValueError, KeyError, TypeError, AttributeError):
                    raise ConfigError(f"{name}:{lineno}", "not a prompt line (a JSON object "
                                      "with \"prompt\")") from None
    except (OSError, EOFError) as e:
        raise ConfigError(name, f"cannot read prompts ({e})") from None
    return out


def _vectorizer():
    try:
        from sklearn.feature_extraction.text import HashingVectorizer
    except ImportError:
        raise ConfigError("predictor", "the gbm design needs scikit-learn and LightGBM: "
                          "pip install 'metasched[predict]'") from None
    return HashingVectorizer(n_features=N_HASH, alternate_sign=False, norm="l2",
                             token_pattern=r"(?u)\b[A-Za-z_][A-Za-z0-9_]+\b")


@dataclass(slots=True)
class PromptFeaturizer:
    """Fitted on training prompts (:meth:`fit`); :meth:`row` of any prompt."""

    components: np.ndarray  # (N_SVD, N_HASH) of the truncated SVD
    repos: dict[str, int]
    cache: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def fit(cls, infos: Iterable[PromptInfo]) -> PromptFeaturizer:
        """Fit the SVD and the repository codes on ``infos`` (the training prompts)."""
        from sklearn.decomposition import TruncatedSVD

        infos = list(infos)
        texts = [i.text or "" for i in infos]
        x = _vectorizer().transform(texts)
        k = min(N_SVD, x.shape[0] - 1)
        comp = np.zeros((N_SVD, N_HASH))
        if k >= 1 and x.nnz:  # no text (a sampled profile's prompts): no dimensions
            comp[:k] = TruncatedSVD(n_components=k, random_state=0).fit(x).components_
        repos = sorted({i.repo for i in infos if i.repo})
        return cls(comp, {r: j for j, r in enumerate(repos)})

    def row(self, key: str, info: PromptInfo | None) -> np.ndarray:
        """The features (``NAMES``) of prompt ``key`` (nan where unknown)."""
        got = self.cache.get(key)
        if got is not None:
            return got
        out = np.full(len(NAMES), np.nan)
        if info is not None and info.text:
            t = info.text
            out[0] = math.log1p(len(t))
            out[1] = math.log1p(t.count("\n"))
            out[2] = t.count("```") // 2
            out[3:3 + N_SVD] = (_vectorizer().transform([t]) @ self.components.T).ravel()
        if info is not None and info.repo in self.repos:
            out[-1] = self.repos[info.repo]
        self.cache[key] = out
        return out


__all__ = ["NAMES", "PromptFeaturizer", "PromptInfo", "read_prompts"]
