"""Whole jobs: generate (text-to-video and Matrix-Game-2), model handles, reference checks, previews, profiling
targets."""
