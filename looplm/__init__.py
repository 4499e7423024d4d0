"""Looped language models (Ouro- and Huginn-style): config, layers, checkpoint IO, exit criteria."""
from .config import LoopConfig
from .exits import ExitPolicy, ExitTracker
from .io import build_model, load_pretrained, load_tokenizer, resolve_dtype, save_pretrained
from .model import LoopedLM, LoopOutput
from .presets import PRESETS, preset_config, tiny_model

__all__ = ["LoopConfig", "ExitPolicy", "ExitTracker", "LoopedLM", "LoopOutput", "build_model", "load_pretrained",
           "load_tokenizer", "save_pretrained", "resolve_dtype", "PRESETS", "preset_config", "tiny_model"]
