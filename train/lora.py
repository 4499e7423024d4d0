"""LoRA adapters on a looped LM through peft (`train/shared_kv.py --lora-rank R`): the single-GPU
option of issue 58. The base weights stay frozen (no gradients, no optimizer state: what makes
Huginn-3.5B fit one GPU); the adapters of the shared block are shared by every loop step, as its
weights are. The saved model has the adapters merged in, so the engine loads a plain folder."""
from __future__ import annotations

from torch import nn

from looplm.cli import UserError

# every attention and MLP projection of both architectures (Ouro names each; Huginn fuses q/k/v
# into attn.Wqkv and gate/up into mlp.fc, and calls both output projections `proj`)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "Wqkv", "fc", "proj")


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, dropout: float = 0.0) -> list[str]:
    """Injects rank-`rank` adapters (B initialised to zero: the model's outputs are unchanged) on
    TARGETS, freezes every other parameter, and returns the adapters' parameter names."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise UserError("--lora-rank needs peft (pip install peft)") from e
    if rank < 1:
        raise UserError(f"--lora-rank {rank}: must be >= 1 (0: no LoRA)")
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, lora_dropout=dropout,
                     target_modules=list(TARGETS))
    inject_adapter_in_model(cfg, model)
    names = [n for n, _ in model.named_parameters() if ".lora_" in n]
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    return names


def merge_lora(model: nn.Module) -> nn.Module:
    """Folds every adapter into its base weight and puts the plain base layer back in its place."""
    from peft.tuners.lora import LoraLayer
    for name, mod in list(model.named_modules()):
        if isinstance(mod, LoraLayer):
            mod.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, mod.get_base_layer())
    return model
