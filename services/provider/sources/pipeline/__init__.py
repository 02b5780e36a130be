"""``pipeline://FILE.toml``: a source followed by transform stages, each with its queue metrics and a
control hook. :mod:`.stages` (the stage contract, the source stage, queues) → :mod:`.transforms` (the
stage types) → :mod:`.engine` (the running :class:`Pipeline`) → :mod:`.factory` (the file → stages)."""

from .engine import Pipeline, find_stage, pipeline_stats, stage_control
from .factory import build_pipeline, open_pipeline

__all__ = ["Pipeline", "build_pipeline", "find_stage", "open_pipeline", "pipeline_stats", "stage_control"]
