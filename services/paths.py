"""Where the bundled demo models live (no heavy imports: the CLI and the gateway use this)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO_ROOT / "models" / "demo-target"
DEMO_DRAFT = REPO_ROOT / "models" / "demo-draft"
DTYPE_NAMES = ("bfloat16", "float16", "float32")
