"""Where the project's shipped files live: the repository, configs, model configs and tokenizers."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"
MODELS_DIR = CONFIGS_DIR / "models"
TOKENIZER_FILE = CONFIGS_DIR / "tokenizer" / "tokenizer.json"
VOCAB_SIZE = 49152
DEFAULT_TOKENIZER = "code-49k"
# name -> (shipped file, vocabulary size); the same recipe and special tokens, only the size differs
TOKENIZERS = {
    DEFAULT_TOKENIZER: (TOKENIZER_FILE, VOCAB_SIZE),
    "code-8k": (CONFIGS_DIR / "tokenizer" / "code-8k" / "tokenizer.json", 8192),
}
