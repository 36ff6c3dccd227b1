"""Paths of the bundled tiny SDAR pair and held-out prompts (see tools/TRAINING.md)."""
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
DEFAULT_TARGET = ASSETS / "tiny-sdar-target"
DEFAULT_DRAFT = ASSETS / "tiny-sdar-draft"
HELDOUT_PROMPTS = ASSETS / "heldout_prompts.jsonl"
