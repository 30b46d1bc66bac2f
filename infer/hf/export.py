"""``megabase export-model``: a checkpoint as a Hugging Face model folder.

The folder loads with ``transformers``' ``Auto*`` classes and ``trust_remote_code=True`` on a
machine without megabase: ``config.json`` (``auto_map``, the megabase model fields),
``model.safetensors`` (the weights under ``model.``), the tokenizer (``tokenizer_config.json``,
``vocab.json``), the wrapper code (``template/``: configuration, modeling, tokenization, the
loader of the carried code) with megabase's own model code in ``megabase_sources.py``
(:mod:`.vendor`), ``generation_config.json``, a model card (``README.md``, :mod:`.card`) and
``megabase_export.json`` (where it came from). The folder is built beside ``out`` and renamed into
place; ``out`` must be absent, empty or an earlier export.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from megabase.data import InputError

TEMPLATE = Path(__file__).with_name("template")
MARKER = "megabase_export.json"
CODE = ("configuration_megabase.py", "modeling_megabase.py", "tokenization_megabase.py",
        "megabase_code.py")
SYMBOLS = ["A", "C", "G", "T", "N", "<pad>", "<sep>"]


@dataclass
class ExportResult:
    out: Path
    checkpoint: Path
    report: Path | None
    parameters: dict[str, int]
    files: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def check_export_dir(out: Path) -> Path:
    """``out`` is absent, an empty folder or an earlier export; anything else is refused (never
    replace what megabase did not write)."""
    if out.exists() and not out.is_dir():
        raise InputError("exists and is not a folder; choose another {out}", out, options=("out",))
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise InputError(f"holds files megabase export-model did not write (no {MARKER}); "
                         "choose an empty or new {out}", out, options=("out",))
    return out


def find_report(checkpoint: Path) -> Path | None:
    """The evaluation report of this checkpoint in its run folder (``runs/NAME/eval/report.json``
    whose ``checkpoint`` is this one), if there is one."""
    for folder in (checkpoint.parent.parent, checkpoint.parent, checkpoint):
        path = folder / "eval" / "report.json"
        if path.is_file():
            try:
                report = json.loads(path.read_text())
            except ValueError:
                continue
            if Path(report.get("checkpoint", "")).resolve() == checkpoint.resolve():
                return path
    return None


def _config_json(model_fields: dict, d_model: int, n_layers: int) -> dict:
    return {
        "model_type": "megabase",
        "architectures": ["MegabaseForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_megabase.MegabaseConfig",
            "AutoModel": "modeling_megabase.MegabaseModel",
            "AutoModelForCausalLM": "modeling_megabase.MegabaseForCausalLM",
            "AutoModelForSequenceClassification": "modeling_megabase.MegabaseForSequenceClassification",
        },
        "megabase": model_fields,
        "vocab_size": len(SYMBOLS), "hidden_size": d_model, "num_hidden_layers": n_layers,
        "pad_token_id": 5, "bos_token_id": 6, "eos_token_id": None,
        "tie_word_embeddings": False, "use_cache": False, "torch_dtype": "float32",
    }


def _tokenizer_json() -> dict:
    return {
        "tokenizer_class": "MegabaseTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_megabase.MegabaseTokenizer", None]},
        "bos_token": "<sep>", "pad_token": "<pad>", "unk_token": "N", "add_bos_token": True,
        "padding_side": "right", "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
    }


def export_model(checkpoint: str | Path, out: str | Path,
                 report: str | Path | None = None) -> ExportResult:
    """Write the Hugging Face folder ``out`` for ``checkpoint`` (a checkpoint or a run folder);
    ``report``: the evaluation report the model card quotes (default: the run's own report of
    this checkpoint, if any)."""
    from safetensors.torch import save_file

    from megabase.data.atomic import building_dir
    from megabase.model import parameter_counts, read_checkpoint_config
    from megabase.pipeline.checkpointing import resolve_checkpoint

    from ..common import load_model
    from .card import model_card
    from .vendor import sources, sources_module

    started = time.perf_counter()
    out = check_export_dir(Path(out))
    ckpt = Path(resolve_checkpoint(checkpoint))
    model = load_model(ckpt)
    meta = read_checkpoint_config(ckpt)
    report_path = Path(report) if report is not None else find_report(ckpt)
    report_data = None
    if report_path is not None:
        try:
            report_data = json.loads(report_path.read_text())
        except FileNotFoundError:
            raise InputError("no such file", report_path, options=("report",)) from None
        except ValueError as exc:
            raise InputError(f"is not a megabase report (not JSON: {exc})", report_path) from None
        if "overall" not in report_data:
            raise InputError("is not a megabase evaluation report (no 'overall')", report_path)
    cfg = model.cfg
    counts = parameter_counts(cfg)
    package, files = sources()
    with building_dir(out, mode=0o755) as tmp:
        state = {f"model.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(
            _config_json(cfg.model_dict(), cfg.d_model, cfg.n_layers), indent=1) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 6, "pad_token_id": 5, "eos_token_id": None, "do_sample": True,
             "top_k": 0, "temperature": 1.0}, indent=1) + "\n")
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_json(), indent=1) + "\n")
        (tmp / "special_tokens_map.json").write_text(json.dumps(
            {"bos_token": "<sep>", "pad_token": "<pad>", "unk_token": "N"}, indent=1) + "\n")
        (tmp / "vocab.json").write_text(json.dumps(SYMBOLS) + "\n")
        for name in CODE:
            shutil.copyfile(TEMPLATE / name, tmp / name)
        (tmp / "megabase_sources.py").write_text(sources_module(package, files))
        (tmp / "README.md").write_text(model_card(cfg, counts, meta, ckpt, report_data, report_path))
        (tmp / MARKER).write_text(json.dumps({
            "checkpoint": str(ckpt.resolve()), "checkpoint_sha256": meta.get("sha256", {}),
            "report": None if report_path is None else str(report_path.resolve()),
            "code_package": package, "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            indent=1) + "\n")
    names = sorted(p.name for p in out.iterdir())
    return ExportResult(out, ckpt, report_path, counts, {n: str(out / n) for n in names},
                        time.perf_counter() - started)
