"""Profile requests on model handles, and the profile nodes (called directly, outside ComfyUI)."""
from __future__ import annotations

import ast
import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from wan_accel.nodes import profile_nodes
from wan_accel.nodes.profile_nodes import WanAccelProfile, WanAccelProfileNative, WanAccelProfileReport
from wan_accel.profiling import history
from wan_accel.profiling.session import (ProfileRequest, attach_profile_request, get_profile_request,
                                         maybe_profile)


def tiny_work(scale):
    with torch.profiler.record_function("tiny_work"):
        return torch.ones(4) * scale


def _trace_names(report):
    return [e.get("name") for e in json.load(open(report.trace_path))["traceEvents"]]


def test_request_profiles_exactly_the_next_n_calls(tmp_path):
    req = ProfileRequest(runs=2, out_dir=tmp_path, name="samp")
    handle = attach_profile_request({"model": "m"}, req)
    outs = [maybe_profile(handle, tiny_work, s) for s in (1.0, 2.0, 3.0)]
    assert [o[0].item() for o in outs] == [1.0, 2.0, 3.0]  # results pass through unchanged
    assert len(req.reports) == 2 and req.remaining == 0 and not req.pending
    assert len({r.trace_path for r in req.reports}) == 2  # one trace per run
    assert "tiny_work" in _trace_names(req.latest) and "samp/run0" in _trace_names(req.latest)
    assert req.latest.result is None  # reports do not keep outputs alive
    # each report went to the metrics history (beside the test's limit cache)
    recs = history.read(kind="profile")
    assert len(recs) == 2 and recs[0]["label"] == "samp"


def test_maybe_profile_without_request_just_calls():
    assert maybe_profile(None, tiny_work, 5.0)[0].item() == 5.0
    assert maybe_profile({"model": 1}, tiny_work, 6.0)[0].item() == 6.0


@dataclasses.dataclass
class DataHandle:
    model: object
    profile: object = None


@dataclasses.dataclass
class ExtraHandle:
    model: object
    compile_settings: object = None
    extra: dict = dataclasses.field(default_factory=dict)


class PlainHandle:
    def __init__(self):
        self.model = "m"


def test_attach_never_mutates_the_input_handle():
    req = ProfileRequest()
    d = {"model": 1}
    assert get_profile_request(attach_profile_request(d, req)) is req and "profile" not in d
    dh = DataHandle(model=1)
    new = attach_profile_request(dh, req)
    assert new.profile is req and dh.profile is None and new.model is dh.model
    ph = PlainHandle()
    new = attach_profile_request(ph, req)
    assert get_profile_request(new) is req and get_profile_request(ph) is None
    assert get_profile_request(attach_profile_request(new, None)) is None


def test_request_in_extra_survives_later_dataclass_replace():
    req = ProfileRequest()
    h = ExtraHandle(model=1, extra={"keep": 1})
    new = attach_profile_request(h, req)
    assert h.extra == {"keep": 1} and new.extra["keep"] == 1
    later = dataclasses.replace(new, compile_settings={"mode": "default"})  # e.g. a compile node downstream
    assert get_profile_request(later) is req
    assert get_profile_request(attach_profile_request(later, None)) is None and "profile" in later.extra


def test_real_model_handle_carries_a_request():
    handle_mod = pytest.importorskip("wan_accel.app.jobs.handle", reason="the model library is not in this build")
    req = ProfileRequest()
    h = handle_mod.ModelHandle(model=torch.nn.Linear(2, 2), source="x", dtype=torch.float32, precision="float32")
    new = attach_profile_request(h, req)
    assert get_profile_request(new) is req and get_profile_request(h) is None and new.model is h.model


def test_window_mode_collects_calls_into_one_trace_and_closes_early(tmp_path):
    req = ProfileRequest(runs=5, out_dir=tmp_path, name="win", history=False)
    assert copy.deepcopy(req) is req  # shared across ComfyUI's deep-copied model options
    for s in (1.0, 2.0):
        req.step(tiny_work, s)
    assert req.pending and req.latest is None and "window open" in req.text()
    report = req.finish()
    assert report is req.latest and report.runs == 2
    assert _trace_names(report).count("tiny_work") == 2
    assert req.step(tiny_work, 3.0)[0].item() == 3.0 and len(req.reports) == 1  # nothing more profiled


def test_window_mode_closes_after_n_calls(tmp_path):
    req = ProfileRequest(runs=2, out_dir=tmp_path, name="win2", history=False)
    for s in (1.0, 2.0, 3.0):
        req.step(tiny_work, s)
    assert len(req.reports) == 1 and req.latest.runs == 2 and req.finish() is None


def test_a_raising_run_is_not_swallowed_and_the_request_stays_usable(tmp_path):
    req = ProfileRequest(runs=2, out_dir=tmp_path, history=False)

    def bad():
        raise RuntimeError("sampler failed")

    with pytest.raises(RuntimeError, match="sampler failed"):
        req.run(bad)
    assert req.run(tiny_work, 2.0)[0].item() == 2.0 and len(req.reports) == 1


# ------------------------------------------------------------------ nodes
def test_wan_profile_node_then_report_node(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside ComfyUI traces go under the working directory
    handle = {"model": "causal"}
    (out,) = WanAccelProfile().apply(handle, runs=1, output_subfolder="traces")
    assert "profile" not in handle and get_profile_request(out) is not None

    pending = WanAccelProfileReport().show(causal_model=out)
    assert "no profiled run yet" in pending["result"][0]

    maybe_profile(out, tiny_work, 1.0)  # what the sampler node does
    shown = WanAccelProfileReport().show(causal_model=out, after={"samples": 0})
    text = shown["result"][0]
    assert shown["ui"]["text"] == [text]
    assert text.startswith("Wan profile: wan_sampler") and "trace" in text
    assert Path(get_profile_request(out).latest.trace_path).parent == tmp_path / "traces"

    (off,) = WanAccelProfile().apply(out, enabled=False)
    assert get_profile_request(off) is None
    assert WanAccelProfile.IS_CHANGED(enabled=False) == "off"
    with pytest.raises(ValueError, match="plain folder name"):
        WanAccelProfile().apply(handle, output_subfolder="../outside")


class FakePatcher:
    """The parts of ComfyUI's ModelPatcher the native node uses."""

    def __init__(self):
        self.wrappers, self.callbacks, self.attachments = {}, {}, {}
        self.model_options = {"transformer_options": {}}

    def clone(self):
        n = FakePatcher()
        n.wrappers = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in self.wrappers.items()}
        n.callbacks = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in self.callbacks.items()}
        n.attachments = dict(self.attachments)
        n.model_options = copy.deepcopy(self.model_options)
        return n

    def add_wrapper_with_key(self, kind, key, fn):
        self.wrappers.setdefault(kind, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, kind, key):
        self.wrappers.get(kind, {}).pop(key, None)

    def add_callback_with_key(self, kind, key, fn):
        self.callbacks.setdefault(kind, {}).setdefault(key, []).append(fn)

    def remove_callbacks_with_key(self, kind, key):
        self.callbacks.get(kind, {}).pop(key, None)

    def set_attachments(self, key, value):
        self.attachments[key] = value

    def get_attachment(self, key):
        return self.attachments.get(key)

    def apply_model(self, x):  # what BaseModel.apply_model does with its wrappers
        fns = [f for per_key in self.wrappers.get("apply_model", {}).values() for f in per_key]
        call = lambda v: tiny_work(v)  # noqa: E731
        for w in reversed(fns):
            call = (lambda w, inner: (lambda v: w(inner, v)))(w, call)
        return call(x)

    def cleanup(self):
        for per_key in self.callbacks.get("on_cleanup", {}).values():
            for fn in per_key:
                fn(self)


def test_native_profile_node_wraps_the_next_model_calls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = FakePatcher()
    (patched,) = WanAccelProfileNative().apply(base, model_calls=3)
    assert patched is not base and base.wrappers == {} and base.attachments == {}
    for s in (1.0, 2.0):
        assert patched.apply_model(s)[0].item() == s
    patched.cleanup()  # sampling ended after 2 of 3 calls: the window closes
    text = WanAccelProfileReport().show(model=patched)["result"][0]
    assert text.startswith("Wan profile: wan_native") and "2 profiled run(s)" in text
    req = profile_nodes._native_request(patched)
    assert _trace_names(req.latest).count("tiny_work") == 2
    assert patched.apply_model(5.0)[0].item() == 5.0 and len(req.reports) == 1

    (again,) = WanAccelProfileNative().apply(patched, model_calls=1)  # re-applying replaces, never stacks
    assert len(again.wrappers["apply_model"][profile_nodes.WRAPPER_KEY]) == 1
    assert "no profile request" in WanAccelProfileReport().show(model=FakePatcher())["result"][0]
    assert "Connect" in WanAccelProfileReport().show()["result"][0]


def test_node_definitions_follow_the_pack_conventions():
    for name, cls in profile_nodes.NODE_CLASS_MAPPINGS.items():
        assert name in profile_nodes.NODE_DISPLAY_NAME_MAPPINGS
        assert cls.CATEGORY == "wan_accel/profile" and cls.DESCRIPTION and cls.RETURN_NAMES
        spec = cls.INPUT_TYPES()
        for section in spec.values():
            for inp, (_, opts) in section.items():
                assert opts.get("tooltip"), f"{name}.{inp} has no tooltip"
    assert WanAccelProfileReport.OUTPUT_NODE is True
    # nothing heavy at module top level (ComfyUI imports every node module at startup)
    tree = ast.parse(Path(profile_nodes.__file__).read_text())
    top_imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in top_imports)


def test_a_report_failure_never_loses_the_run_result(tmp_path, monkeypatch):
    from wan_accel.profiling import runner

    def broken_finish(self):
        raise OSError("disk full")

    monkeypatch.setattr(runner.ProfileSession, "finish", broken_finish)
    req = ProfileRequest(runs=1, out_dir=tmp_path, history=False)
    assert req.run(tiny_work, 4.0)[0].item() == 4.0
    assert req.latest is None and "disk full" in req.text()
    assert not runner.profiler_busy()
