"""Sequence-parallel ranks: worker processes started for a job, and the pool the ComfyUI node keeps."""
