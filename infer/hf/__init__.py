"""megabase models where genomics ML people already work: a checkpoint as a Hugging Face model
folder (``megabase export-model``) that ``transformers`` loads with ``trust_remote_code``."""

from .export import ExportResult, export_model

__all__ = ["ExportResult", "export_model"]
