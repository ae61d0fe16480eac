"""``python -m wan_accel nodes [--markdown]``: list the ComfyUI nodes of the pack."""
from __future__ import annotations


def _run(args) -> int:
    from ..nodes import IMPORT_ERRORS, NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from ..nodes.comfy.reference import render_node_reference

    if args.markdown:
        print(render_node_reference())
    else:
        for key, cls in sorted(NODE_CLASS_MAPPINGS.items(), key=lambda kv: (kv[1].CATEGORY, kv[0])):
            print(f"{cls.CATEGORY:24s} {NODE_DISPLAY_NAME_MAPPINGS.get(key, key):30s} -> {', '.join(cls.RETURN_TYPES)}")
    for name, err in IMPORT_ERRORS.items():
        print(f"node module {name} failed to import: {err}")
    return 1 if IMPORT_ERRORS else 0


def register(sub) -> None:
    p = sub.add_parser("nodes", help="list the ComfyUI nodes of the pack")
    p.add_argument("--markdown", action="store_true", help="print the node reference (docs/nodes.md)")
    p.set_defaults(func=_run)
