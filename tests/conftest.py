"""Shared fixtures: the real tokenizer, tiny random models of each architecture, the real model.

Tests never reach a hub (HF_HUB_OFFLINE=1); the default model's GGUF is fetched by ``make setup``
(``python -m stencil.engine.models.default_model``), and converted here once into the transformers
directory the tests compare against (``reference_model``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Subprocesses started with cwd at the repository root must not import its folders as top-level
# packages (kernels/ would shadow Hugging Face's `kernels`, which transformers imports).
os.environ.setdefault("PYTHONSAFEPATH", "1")
if not os.path.exists("/dev/nvidia0"):
    # Triton kernels run through its interpreter on CPU; the flag must be set before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import HealthCheck, settings

# Property tests draw the same examples on every run and every machine, as under CI (Hypothesis
# loads a derandomized profile when it sees a CI variable): what passes here passes there. A
# random draw once found, in CI only, a nested-quantifier text that hung a backtracking oracle.
settings.register_profile("stencil", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("stencil")

from reference_model import converted_default_model

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (fetched and converted once if missing)."""
    return converted_default_model()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def make_tiny_model_dir(out: Path, tokenizer_dir: Path, arch: str = "llama", seed: int = 0,
                        **overrides) -> Path:
    """Save a tiny randomly initialised model of ``arch`` with the real tokenizer into ``out``.

    Architectures: "llama" (SmolLM-like, tied embeddings), "qwen2" (qkv bias), "qwen3" (q/k norm).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        common.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "qwen2":
        common.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      tie_word_embeddings=False)
    elif arch == "qwen3":
        common.update(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    else:
        raise ValueError(arch)
    common.update(overrides)
    config = AutoConfig.for_model(arch, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is tiny (std 0.02); scale up so logits are far from uniform and argmax is stable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3 if "embed" in name else 0.15)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), default_model_dir, "llama")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, default_model_dir):
    """Build a tiny model dir of a given architecture: ``factory("qwen3")``."""
    cache: dict = {}

    def factory(arch: str = "llama", **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model_dir(tmp_path_factory.mktemp(f"tiny-{arch}"),
                                             default_model_dir, arch, **overrides)
        return cache[key]

    return factory


def shared_corpora() -> Path | None:
    """``../shared/corpora`` when present (a user's clone has none)."""
    p = SHARED / "corpora"
    return p if p.exists() else None


@pytest.fixture(scope="session")
def stencil_wheel(tmp_path_factory) -> Path:
    """The wheel of this tree (its tracked and untracked-but-not-ignored files, copied: no stale
    build/), built without network by the test environment's setuptools."""
    work = tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (work / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, work / "src" / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(work / "dist"), str(work / "src")], check=True, capture_output=True)
    (built,) = (work / "dist").glob("stencil_serve-*.whl")
    return built


@pytest.fixture(scope="session")
def family_model_factory(tmp_path_factory, default_model_dir):
    """A tiny random model carrying a real chat template and its family's special tokens
    (``tests/real_templates.py``), built once per arguments:
    ``factory("Qwen-Qwen3-0.6B", ["<think>", "</think>", "<tool_call>", "</tool_call>"])``.
    Skipped where the templates cannot be fetched."""
    from real_templates import family_model_dir, real_template

    cache: dict = {}

    def factory(template_name: str, special_tokens=(), eos_token: str | None = None,
                bos_token: str | None = None) -> Path:
        key = (template_name, tuple(special_tokens), eos_token, bos_token)
        if key not in cache:
            cache[key] = family_model_dir(tmp_path_factory.mktemp("family"), default_model_dir,
                                          real_template(template_name), list(special_tokens),
                                          eos_token, bos_token)
        return cache[key]

    return factory
