"""Named model sizes shared by every family, and the training defaults that go with them.

One table: a family's config is built from a preset's dimensions, so the AR baseline and a latent family of the
same preset have the same backbone width, depth and attention layout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """Backbone dimensions (Llama's, SwiGLU `intermediate_size`) plus the training defaults that suit them (each
    overridable in `TrainConfig`: packed `seq_len`, per-device `batch_size`, peak `learning_rate`, ...).

    `name`: the table key. Families look up their scale-dependent settings by it, so a preset derived with
    `dataclasses.replace(PRESETS["small"], seq_len=128)` keeps the `small` settings.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    seq_len: int
    batch_size: int
    learning_rate: float
    warmup_steps: int
    max_steps: int
    name: str = "custom"


PRESETS: dict[str, Preset] = {
    # Unit tests: seconds on a laptop CPU.
    "tiny": Preset(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176,
        max_position_embeddings=512, rope_theta=10000.0,
        seq_len=64, batch_size=8, learning_rate=3e-3, warmup_steps=5, max_steps=50, name="tiny",
    ),
    # CPU benchmarks: ~2.85M non-embedding parameters (4.95M with a 4k vocabulary, untied).
    "small": Preset(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=672,
        max_position_embeddings=2048, rope_theta=10000.0,
        seq_len=256, batch_size=16, learning_rate=2e-3, warmup_steps=30, max_steps=300, name="small",
    ),
    # GPU runs (documented, not exercised in CI): ~85M non-embedding parameters.
    "base": Preset(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048,
        max_position_embeddings=4096, rope_theta=10000.0,
        seq_len=1024, batch_size=32, learning_rate=6e-4, warmup_steps=1000, max_steps=50000, name="base",
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
