"""Node "Limit Cache": shows (and on explicit confirmation clears) the pack's limit cache."""
from __future__ import annotations

from .comfy import FreshNode, check_choice

NAMESPACE_CHOICES = ["all", "operator", "compile", "memory", "sampler", "doctor"]


def render_cache_text(namespace: str = "all", all_machines: bool = False, cache=None) -> str:
    """Readable text of the cache contents (library-side helper so the node stays thin)."""
    import json

    from ..cache import LimitCache, count_entries

    cache = cache or LimitCache()
    ns = None if namespace == "all" else namespace
    rows = cache.entries(ns, all_fingerprints=all_machines)
    fp = cache.fingerprint
    lines = [f"limit cache: {cache.path}",
             f"machine: {fp['gpu']} [{fp['device']} {fp['capability']}], torch {fp['torch']}, triton {fp['triton']}"]
    lines += [f"WARNING: {note}" for note in cache.notices()]
    if not rows:
        lines.append("(no entries" + (f" in '{ns}'" if ns else "") + ")")
        return "\n".join(lines)
    current = None
    for r in rows:
        if r["namespace"] != current:
            current = r["namespace"]
            count = sum(1 for x in rows if x["namespace"] == current)
            lines.append(f"\n[{current}] {count_entries(count)}")
        value = json.dumps(r["value"], sort_keys=True)
        if len(value) > 160:
            value = value[:157] + "..."
        lines.append(f"  {r['key']}  (hits {r['hits']}): {value}")
    return "\n".join(lines)


class WanAccelLimitCache(FreshNode):   # always re-read the cache
    DESCRIPTION = ("Shows the limit cache shared by every wan_accel feature: best kernel configs, compile "
                   "artifacts, learned memory limits, sampler capabilities. Clearing needs the confirm switch.")
    CATEGORY = "wan_accel"
    FUNCTION = "run"
    OUTPUT_NODE = True
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)

    INPUTS = {"required": {
        "namespace": (NAMESPACE_CHOICES, {"default": "all",
                                          "tooltip": "Which part of the cache to show (or clear)."}),
        "action": (["show", "clear"], {"default": "show",
                                      "tooltip": "show lists entries; clear removes the chosen namespace "
                                                 "(only when confirm_clear is on)."}),
        "confirm_clear": ("BOOLEAN", {"default": False,
                                      "tooltip": "Safety switch: clearing happens only when this is on."}),
        "all_machines": ("BOOLEAN", {"default": False,
                                     "tooltip": "Also list entries measured on other GPUs or other "
                                                "torch/triton versions (never applied here)."}),
    }}

    def run(self, namespace="all", action="show", confirm_clear=False, all_machines=False):
        from ..cache import LimitCache, count_entries

        cache = LimitCache()
        header = ""
        if action == "clear":
            if not confirm_clear:
                header = "Nothing cleared: turn on confirm_clear to clear.\n"
            else:
                check_choice("namespace", namespace, NAMESPACE_CHOICES)
                n = cache.clear(None if namespace == "all" else namespace)
                header = f"Cleared {count_entries(n)} from {namespace}.\n"
        text = header + render_cache_text(namespace, all_machines, cache)
        return {"ui": {"text": [text]}, "result": (text,)}


NODE_CLASS_MAPPINGS = {"WanAccelLimitCache": WanAccelLimitCache}
NODE_DISPLAY_NAME_MAPPINGS = {"WanAccelLimitCache": "Limit Cache"}
