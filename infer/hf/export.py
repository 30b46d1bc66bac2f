"""``megabase export-model``: a checkpoint as a Hugging Face model folder.

The folder loads with ``transformers``' ``Auto*`` classes and ``trust_remote_code=True`` on a
machine without megabase: ``config.json`` (``auto_map``, the megabase model fields),
``model.safetensors`` (the weights under ``model.``), the tokenizer (``tokenizer_config.json``,
``vocab.json``), the wrapper code (``template/``: configuration, modeling, tokenization, the
loader of the carried code) with megabase's own model code in ``megabase_sources.py``
(:mod:`.vendor`), ``generation_config.json``, a model card (``README.md``, :mod:`.card`) and
``megabase_export.json`` (where it came from, and the sha256 of each file megabase wrote).

The folder is built beside ``out`` and moved into place. ``out`` must be absent, empty or an
earlier export; over an earlier export only megabase's own files (:data:`OWN`) are replaced, each
by a rename, and everything else (an adapter, a fine-tune's ``checkpoint-500/``) stays. One of
megabase's files that the user changed since it was written is not replaced: the export is
refused, naming it. One writer at a time (a lock beside ``out``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from megabase.core.atomic import building_dir, file_sha256, naming
from megabase.core.locks import holding
from megabase.data import InputError
from megabase.model import parameter_counts, read_checkpoint_config
from megabase.model.checkpoint import WEIGHTS, resolve_checkpoint, save_safetensors, weights_sha256

from ..common import load_model
from .card import model_card
from .vendor import sources, sources_module


TEMPLATE = Path(__file__).with_name("template")
MARKER = "megabase_export.json"
CODE = ("configuration_megabase.py", "modeling_megabase.py", "tokenization_megabase.py",
        "megabase_code.py")
SYMBOLS = ["A", "C", "G", "T", "N", "<pad>", "<sep>"]
# every file export-model writes; the marker goes in last, so it describes a complete folder
OWN = ("model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json",
       "special_tokens_map.json", "vocab.json", *CODE, "megabase_sources.py", "README.md", MARKER)


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


def _recorded_files(out: Path) -> dict[str, str] | None:
    """megabase's files in the earlier export ``out``: name -> the sha256 its marker recorded;
    None for an export from before markers recorded them (each of :data:`OWN` is then taken as
    megabase's, unchecked: those exports wrote exactly these names)."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        marker = None
    if not isinstance(marker, dict):
        raise InputError(f"{MARKER} is damaged (not a JSON object): nothing says which files "
                         "megabase wrote; move the folder away or choose another {out}", out,
                         options=("out",))
    files = marker.get("files")
    if not isinstance(files, dict):
        return None
    # plain names only: the marker is a file anyone can edit, and these names get removed
    return {k: v for k, v in files.items()
            if isinstance(v, str) and k not in ("", ".", "..") and "/" not in k and "\0" not in k}


def _install_over(tmp: Path, out: Path) -> None:
    """Move the export built in ``tmp`` into ``out``. Over an earlier export, megabase's own
    files are replaced one by one (the marker last) and the earlier export's files that this one
    does not write are removed; anything else stays. A file of one of those names that is
    neither what megabase wrote there nor what replaces it is the user's (edited or added): the
    export is refused, naming it, before anything moves. (After a crash between two renames,
    rerunning the same export finds each file as it was or as it will be, and completes.)"""
    if not out.exists() or not any(out.iterdir()):
        os.replace(tmp, out)
        return
    recorded = _recorded_files(out)
    new = json.loads((tmp / MARKER).read_text())["files"]
    ours = set(OWN) if recorded is None else set(recorded)
    for name in sorted((ours | set(new)) - {MARKER}):
        path = out / name
        if not (path.exists() or path.is_symlink()):
            continue
        if path.is_symlink() or not path.is_file():
            mine = False
        else:
            digest = file_sha256(path)
            mine = digest == new.get(name) or (
                name in ours if recorded is None else recorded.get(name) == digest)
        if not mine:
            raise InputError("is not the file megabase export-model wrote there (changed or "
                             "added since): exporting again would replace it; move it away "
                             "first, or choose another {out}", path, options=("out",))
    for name in OWN:
        os.replace(tmp / name, out / name)
    for name in ours - set(OWN):  # an earlier version's file that this one no longer writes
        (out / name).unlink(missing_ok=True)
    tmp.rmdir()


def _scored_this(report: dict, checkpoint: Path) -> tuple[bool, str]:
    """Whether ``report`` scored ``checkpoint``: ``(same, why not)``. Identity is the weights'
    sha256 (``checkpoint_sha256``, which ``megabase evaluate`` records), so a moved or copied
    folder still matches and another checkpoint written to the same path does not. A report
    from before that field is matched by the checkpoint it names: the same folder, or one
    whose weights are the same."""
    mine = weights_sha256(checkpoint)
    scored = report.get("checkpoint")
    recorded = report.get("checkpoint_sha256")
    if isinstance(recorded, str):
        return recorded == mine, f"it scored other weights ({scored or 'a checkpoint unnamed'})"
    if not isinstance(scored, str) or not scored:
        return False, "it names no checkpoint, so nothing says it is this model's"
    path = Path(scored)
    if path.resolve() == checkpoint.resolve():
        return True, ""
    if not (path / WEIGHTS).is_file():
        return False, (f"it scored {scored}, which is not there any more, and records no "
                       "checksum of its weights to tell whether it is this checkpoint")
    try:
        same = weights_sha256(path) == mine
    except InputError:
        same = False
    return same, f"it scored another checkpoint, {scored}"


def find_report(checkpoint: Path) -> Path | None:
    """The evaluation report of this checkpoint in its run folder (``runs/NAME/eval/report.json``
    as ``megabase run`` writes it, ``runs/NAME/eval/step-N/report.json`` as ``evaluate`` of a run's
    checkpoint does, or ``CHECKPOINT/eval/report.json``) that scored this checkpoint, if any."""
    for path in (checkpoint.parent.parent / "eval" / checkpoint.name / "report.json",
                 *(folder / "eval" / "report.json"
                   for folder in (checkpoint.parent.parent, checkpoint.parent, checkpoint))):
        if path.is_file():
            try:
                report = json.loads(path.read_text())
            except ValueError:
                continue
            if isinstance(report, dict) and _scored_this(report, checkpoint)[0]:
                return path
    return None


def read_report(path: Path, checkpoint: Path) -> dict:
    """The evaluation report at ``path``, refused in one line unless it is a megabase report
    of ``checkpoint`` (the model card quotes its numbers as this model's)."""
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError("no such file", path, options=("report",)) from None
    except ValueError as exc:
        raise InputError(f"is not a megabase report (not JSON: {exc})", path) from None
    if not isinstance(report, dict) or "overall" not in report:
        raise InputError("is not a megabase evaluation report (no 'overall')", path)
    same, why = _scored_this(report, checkpoint)
    if not same:
        raise InputError(f"is not a report of {checkpoint}: {why}; its numbers are not this "
                         "model's. Pass this checkpoint's own report ({report}), from "
                         "`megabase evaluate` of it", path, options=("report",))
    return report


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
        # no unk_token: N is a base (an unknown token would be dropped by skip_special_tokens)
        "bos_token": "<sep>", "pad_token": "<pad>", "add_bos_token": True,
        "padding_side": "right", "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
    }


def export_model(checkpoint: str | Path, out: str | Path,
                 report: str | Path | None = None) -> ExportResult:
    """Write the Hugging Face folder ``out`` for ``checkpoint`` (a checkpoint or a run folder);
    ``report``: the evaluation report the model card quotes, which must be of this checkpoint
    (default: the run's own report of this checkpoint, if any)."""


    started = time.perf_counter()
    out = check_export_dir(Path(out))
    ckpt = Path(resolve_checkpoint(checkpoint))
    model = load_model(ckpt)
    meta = read_checkpoint_config(ckpt)
    report_path = Path(report) if report is not None else find_report(ckpt)
    report_data = None if report_path is None else read_report(report_path, ckpt)
    cfg = model.cfg
    counts = parameter_counts(cfg)
    package, files = sources()
    texts = {
        "config.json": _config_json(cfg.model_dict(), cfg.d_model, cfg.n_layers),
        "generation_config.json": {"bos_token_id": 6, "pad_token_id": 5, "eos_token_id": None,
                                   "do_sample": True, "top_k": 0, "temperature": 1.0},
        "tokenizer_config.json": _tokenizer_json(),
        "special_tokens_map.json": {"bos_token": "<sep>", "pad_token": "<pad>"},
    }
    # errors name out (or out/<file>), not its lock or temporary (core.atomic.naming)
    with naming(out), holding(out, "this export folder"), \
            building_dir(out, install=_install_over, mode=0o755) as tmp:
        check_export_dir(out)  # again, now that this process is its one writer
        state = {f"model.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_safetensors(state, tmp / "model.safetensors", metadata={"format": "pt"})
        written = {name: json.dumps(data, indent=1) + "\n" for name, data in texts.items()}
        written["vocab.json"] = json.dumps(SYMBOLS) + "\n"
        written["megabase_sources.py"] = sources_module(package, files)
        written["README.md"] = model_card(cfg, counts, meta, ckpt, report_data, report_path)
        for name, text in written.items():
            with naming(tmp / name):
                (tmp / name).write_text(text)
        for name in CODE:
            shutil.copyfile(TEMPLATE / name, tmp / name)
        with naming(tmp / MARKER):
            (tmp / MARKER).write_text(json.dumps({
                "checkpoint": str(ckpt.resolve()), "checkpoint_sha256": meta.get("sha256", {}),
                "report": None if report_path is None else str(report_path.resolve()),
                "code_package": package, "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": {name: file_sha256(tmp / name) for name in OWN if name != MARKER}},
                indent=1) + "\n")
    return ExportResult(out, ckpt, report_path, counts, {n: str(out / n) for n in sorted(OWN)},
                        time.perf_counter() - started)
