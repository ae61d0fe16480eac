"""Play sessions (Matrix-Game-2 play mode): one chunk per step, a registry with a cap and an idle reaper."""
