"""The model card (``README.md``) of an exported model, written from the checkpoint and its
evaluation report: what it was trained on, its size, what it scores on held-out DNA beside the
best Markov chain, what context gives it, the recall probe, how to use it and where it stops."""

from __future__ import annotations

from pathlib import Path

from megabase.eval.bins import unit_words
from megabase.model.presets import PRESETS, get_preset


def _preset_of(cfg) -> str:
    mine = cfg.model_dict()
    for name in PRESETS:
        if get_preset(name).model_dict() == mine:
            return f"`{name}`"
    return "custom (no preset has exactly these fields; see `megabase` in config.json)"


def _bits(entry: dict | None) -> str:
    if not entry or entry.get("bits_per_base") is None:
        return "-"
    lo, hi = (entry.get("bits_per_base_ci") or [None, None])[:2]
    ci = f" ({lo:.4f}-{hi:.4f})" if lo is not None and hi is not None else ""
    return f"{entry['bits_per_base']:.4f}{ci}"


def _evaluation(report: dict, path: Path) -> list[str]:
    o = report["overall"]
    lines = ["## Held-out evaluation", "",
             f"From `{path}` ({report.get('n_windows', '?')} windows, {o.get('n_tokens', 0):,} scored "
             f"bases; bits/base with a 95% bootstrap CI over {unit_words(report.get('ci_unit'))}).",
             "",
             "| | bits/base | unique | repeat |", "|---|---|---|---|",
             f"| this model | {_bits(o)} | {_bits(o.get('unique'))} | {_bits(o.get('repeat'))} |"]
    for name, b in sorted(report.get("baselines", {}).items(),
                          key=lambda kv: kv[1]["overall"]["bits_per_base"] or 9)[:3]:
        bo = b["overall"]
        lines.append(f"| {name} | {_bits(bo)} | {_bits(bo.get('unique'))} | {_bits(bo.get('repeat'))} |")
    ref = report.get("copy_reference")
    if ref:
        lines.append(f"| copy model + Markov mix | {_bits(ref['overall'])} | "
                     f"{_bits(ref['overall'].get('unique'))} | {_bits(ref['overall'].get('repeat'))} |")
    best = report.get("best_baseline")
    if best:
        delta = o["bits_per_base"] - best["bits_per_base"]
        lines += ["", f"Against the best Markov chain ({best['name']}): {delta:+.4f} bits/base."]
    for limit, rows in report.get("context_gain", {}).items():
        gains = [r for r in rows if r["all"]["gain_bits_per_base"] is not None]
        if gains:
            lines += ["", f"What context beyond ~{int(limit):,} bases gives (the same bases scored "
                      f"with context cut to {int(limit):,}; positive: the model uses it; paired CI):", "",
                      "| prior context | gain, bits/base | CI |", "|---|---|---|"]
            for r in gains:
                lo, hi = r["all"]["ci"]
                ci = f"{lo:+.4f} to {hi:+.4f}" if lo is not None else "-"
                lines.append(f"| {r['context_lo']:,}-{r['context_hi']:,} | "
                             f"{r['all']['gain_bits_per_base']:+.4f} | {ci} |")
    probe = report.get("probe")
    if probe:
        lines += ["", "Recall probe (a held-out stretch copied later into the same window: does the "
                  "model predict the second copy better?):", "",
                  "| distance | first copy | second copy | DSA layers hold the aligned key (chance) |",
                  "|---|---|---|---|"]
        for p in probe:
            rates = p.get("dsa_hit_rate")  # one per DSA layer; None without DSA layers
            chance = p.get("chance_hit_rate")
            held = "-" if not rates else " / ".join(f"{r:.0%}" for r in rates) + (
                "" if chance is None else f" ({chance:.0%})")
            lines.append(f"| {p['distance']:,} | {p['first_copy_bits_per_base']:.3f} | "
                         f"{p['second_copy_bits_per_base']:.3f} | {held} |")
    return lines


def model_card(cfg, counts: dict, meta: dict, checkpoint: Path, report: dict | None,
               report_path: Path | None) -> str:
    regions = meta.get("regions") or {}
    data = meta.get("data") or {}
    kinds = cfg.layer_kinds
    lines = [
        "---", "library_name: transformers", "tags: [dna, genomics, megabase, causal-lm]",
        "pipeline_tag: text-generation", "---", "",
        f"# megabase model: {meta.get('run', checkpoint.name)}", "",
        "A DNA language model trained with megabase (one token per base, "
        "hybrid Kimi Delta Attention / DeepSeek Sparse Attention layers with Mixture-of-Experts "
        "FFNs), exported for `transformers`.", "",
        "## Training", "",
        f"- checkpoint: `{checkpoint}` (step {meta.get('step', '?')})",
        f"- training regions: {', '.join(regions.get('train', [])) or 'not recorded'}",
        f"- held-out regions: {', '.join(regions.get('eval', [])) or 'not recorded'}",
        f"- token store: `{data.get('store', 'not recorded')}`",
        f"- window length: {meta.get('window_length', 'not recorded')}",
        f"- preset: {_preset_of(cfg)}; {cfg.n_layers} layers ({kinds}: K = KDA, D = DSA, "
        f"A = attention), width {cfg.d_model}, {cfg.n_experts} experts ({cfg.experts_per_token} "
        "active) + a shared one",
        f"- parameters: {counts['total']:,} total, {counts['active']:,} active per base", "",
    ]
    if report is not None:
        lines += _evaluation(report, report_path) + [""]
    else:
        lines += ["## Held-out evaluation", "",
                  "No evaluation report was found for this checkpoint (run `megabase evaluate` and "
                  "export again with `--report`): nothing here says how well it predicts DNA.", ""]
    lines += [
        "## Use", "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "tok = AutoTokenizer.from_pretrained(PATH, trust_remote_code=True)",
        "model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True).eval()",
        'ids = tok("ACGTNNacgt", return_tensors="pt").input_ids      # <sep> A C G T N N A C G T',
        "logp = model(ids).logits.log_softmax(-1)                       # next-base log-probs",
        "torch.manual_seed(0); out = model.generate(ids, max_new_tokens=100, do_sample=True, top_k=0)",
        "```", "",
        "- Tokens: `A C G T N <pad> <sep>` = 0..6; any case and every IUPAC code are accepted "
        "(ambiguity codes and gaps become `N`); a sequence starts with `<sep>`. Logits are over the "
        "four bases (`[B, T, 4]`, indices = the token ids of A/C/G/T).",
        "- Text is DNA only: the tokenizer adds `<sep>` and `<pad>` itself, and `<sep>`/`<pad>` "
        "written in the text are refused (not DNA), never read as special tokens. `N` is a base, "
        "not an unknown token: `decode(ids, skip_special_tokens=True)` keeps every `N`.",
        "- `AutoModelForSequenceClassification` adds a linear head on the mean of the final hidden "
        "states over a sequence's bases; pad on the right.",
        "- Batches of short sequences (fine-tuning, embedding windows): pass "
        "`canonical_tiles=False` to `from_pretrained`, several times faster; the default keeps "
        "megabase's canonical row tiles, so log-probs equal megabase's to the last bit, at the "
        "cost of padding each expert's rows to 1,024.",
        "- `hidden_states[i]` (with `output_hidden_states=True`) is the residual stream after "
        "block i, as `megabase embed --layer i` gives it.",
        "- The model code travels in this folder (`megabase_sources.py`): no megabase install is "
        "needed. On a CPU with a C compiler its C kernels build on first use; without one the "
        "PyTorch forms run (much slower, and equal to fp32 round-off only: where that flips a "
        "sparse-attention top-k choice, a base's log-prob moves by up to ~3e-3).", "",
        "## Intended use and limits", "",
        "- For research on DNA sequence modelling: per-base likelihoods, zero-shot variant "
        "effects, embeddings, sampling, fine-tuning on sequence tasks.",
        "- It knows only the sequence it was trained on (the regions above); it is not a model of "
        "other species, of RNA or protein, or of function, and generated sequence is not a "
        "design that was tested anywhere.",
        "- Likelihoods here are of this model's training distribution: repeats are predicted far "
        "better than unique sequence, and a region like the training data scores better than one "
        "that is not.",
        "- Long contexts cost memory linear in the length on the streaming path (`generate`); a "
        "single forward over a megabase window needs the memory megabase documents for it.", "",
    ]
    return "\n".join(lines)
