"""`litqlora download`: fetch a Hugging Face checkpoint (weights, config, tokenizer) with huggingface_hub."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lit_qlora.base.errors import UserError

# Where the bundled SmolLM2 is converted on first use (lit_qlora.export.gguf_import): every command's default checkpoint.
DEFAULT_CHECKPOINT = Path("checkpoints/SmolLM2-135M-Instruct")

# What a fine-tune needs; skips other frameworks' weights and large extras. `chat_template.jinja`: where recent
# checkpoints keep the chat template instead of tokenizer_config.json (gpt-oss).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "chat_template.jinja"]
# Weights for other runtimes in a subfolder, which "*.safetensors" matches too: gpt-oss's original/ (the reference
# checkpoint of OpenAI's own code, as large as the weights; Llama 3's original/ holds .pth files).
IGNORE_PATTERNS = ["original/*"]


class DownloadError(UserError, RuntimeError):
    """Raised with a one-line explanation when the Hub cannot be reached or refuses the request."""


def download(repo_id: str, out_dir: Optional[Path] = None, token: Optional[str] = None,
             revision: Optional[str] = None) -> Path:
    """Download REPO_ID from the Hugging Face Hub into OUT_DIR (default checkpoints/REPO_ID).

    Args:
        repo_id: A Hub model id such as HuggingFaceTB/SmolLM2-135M-Instruct.
        out_dir: Destination directory.
        token: Hub token for gated models (or set HF_TOKEN).
        revision: Branch, tag or commit.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    out_dir = Path(out_dir) if out_dir is not None else Path("checkpoints") / repo_id
    try:
        path = snapshot_download(repo_id, local_dir=out_dir, allow_patterns=ALLOW_PATTERNS,
                                 ignore_patterns=IGNORE_PATTERNS, token=token, revision=revision)
    except GatedRepoError:
        raise DownloadError(f"{repo_id} is gated: accept its license on the Hub and pass --token (or set HF_TOKEN).") from None
    except RepositoryNotFoundError:
        raise DownloadError(f"{repo_id} was not found on the Hugging Face Hub (or it is private: pass --token).") from None
    except Exception as e:  # connection errors, offline mode, timeouts: all mean the same thing to the user
        raise DownloadError(
            f"Could not download {repo_id} from the Hugging Face Hub ({type(e).__name__}): this machine seems to be "
            "offline. Copy a Hugging Face model directory here instead, or convert a GGUF file with "
            "`litqlora convert_gguf FILE --out_dir DIR` (`litqlora convert_gguf smollm2` uses the bundled SmolLM2)."
        ) from None
    return Path(path)
