"""megabase.model: config dataclasses and presets, KDA / DSA / MoE layers, the hybrid LM (DESIGN.md, Model)."""
