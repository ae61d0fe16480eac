"""A worker's failure reaches the user as one line naming the worker (its traceback only with WAN_ACCEL_DEBUG=1),
an unusable --device is an input error (exit 2, one line) for every command that takes it, one problem gives one
message (no warning or report line before the error about the same thing), and importing the pack loads no torch."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from wan_accel.app.ranks.parallel import run_ranks
from wan_accel.cli import main
from wan_accel.model.seq_parallel import ParallelError
from wan_accel.profiling.explain import ExplainError, explain_in_subprocess

import rank_failures


def test_a_rank_that_raises_is_one_line_naming_the_rank(monkeypatch):
    monkeypatch.delenv("WAN_ACCEL_DEBUG", raising=False)
    with pytest.raises(ParallelError) as info:
        run_ranks(rank_failures.raises_on, 2, (1, "the value is bad\nsee the second line"), timeout_s=120)
    text = str(info.value)
    assert "\n" not in text and "Traceback" not in text, text
    assert "rank 1 of 2" in text and "ValueError: the value is bad see the second line" in text, text


def test_debug_shows_the_rank_traceback(monkeypatch):
    monkeypatch.setenv("WAN_ACCEL_DEBUG", "1")
    with pytest.raises(ParallelError) as info:
        run_ranks(rank_failures.raises_on, 2, (1, "the value is bad"), timeout_s=120)
    first, _, rest = str(info.value).partition("\n")
    assert "rank 1 of 2" in first and "ValueError: the value is bad" in first
    assert "Traceback" in rest and "rank_failures.py" in rest, rest


@pytest.mark.parametrize("debug", ["", "1"])
def test_explain_worker_failure_is_one_line(monkeypatch, debug):
    monkeypatch.setenv("WAN_ACCEL_DEBUG", debug)
    with pytest.raises(ExplainError) as info:
        explain_in_subprocess("json:loads", kwargs={"s": "{not json"}, timeout=300)
    first, _, rest = str(info.value).partition("\n")
    assert "explain worker of json:loads failed: JSONDecodeError" in first, first
    assert ("Traceback" in rest) == bool(debug), rest


@pytest.mark.parametrize("argv", [["doctor", "--device", "foo"], ["doctor", "--device", "cuda:99"],
                                  ["bench", "sampler", "--device", "npu"], ["bench", "compile", "--device", "cuda:99"],
                                  ["bench", "play", "--device", "tpu"],
                                  ["bench", "sampler", "--world-size", "2", "--device", "gpu"],
                                  ["check-reference", ".", "--device", "foo"],
                                  ["check-reference", ".", "--device", "cuda:99"],
                                  ["generate", "--device", "foo"], ["generate", "--device", "cuda:99"],
                                  ["profile", "--device", "cuda:99"]])
def test_an_unusable_device_is_one_input_error(argv, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device"), err


def test_an_unknown_doctor_feature_is_one_input_error(capsys):
    assert main(["doctor", "--device", "cpu", "--feature", "no.such.feature"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --feature") and "no.such.feature" in err[0], err


# ------------------------------------------------------------------------------------------ importing is cheap
def test_importing_the_pack_and_its_nodes_loads_no_torch():
    code = ("import sys, wan_accel, wan_accel.nodes, wan_accel.cli\n"
            "print(len(wan_accel.NODE_CLASS_MAPPINGS), dict(wan_accel.nodes.IMPORT_ERRORS),\n"
            "      sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count, errors, heavy = out.stdout.strip().split(" ", 2)
    assert int(count) > 10 and errors == "{}", out.stdout
    assert heavy == "[]", f"importing the pack loaded {heavy}"


# ------------------------------------------------------------------------------------------ rank pool workers
def _failing_pool():
    from wan_accel.app.jobs.handle import TINY_NAME
    from wan_accel.app.ranks.pool import RankPool
    spec = {"source": TINY_NAME, "dtype": "no-such-dtype", "precision": "float32", "attention": "auto",
            "num_heads": None}
    return RankPool(2, spec, ["cpu", "cpu"], timeout_s=120, load_timeout_s=300)


@pytest.mark.parametrize("debug", ["", "1"])
def test_a_rank_pool_worker_that_raises_is_one_line_naming_the_rank(monkeypatch, debug):
    monkeypatch.setenv("WAN_ACCEL_DEBUG", debug)
    pool = _failing_pool()
    with pytest.raises(ParallelError) as info:
        pool.start(None)                        # rank 1 raises while loading its model
    first, _, rest = str(info.value).partition("\n")
    assert "failed on rank 1 of 2: ValueError: dtype must be one of" in first and "no-such-dtype" in first, first
    assert ("Traceback" in rest and "handle.py" in rest) == bool(debug), rest
    assert not pool.procs and not pool.running           # the worker was stopped, nothing left behind


# ------------------------------------------------------------------------------------------ explain targets
FACTORIES = """
def broken():
    raise RuntimeError("the factory is broken")
"""


@pytest.mark.parametrize("target", ["no_colon_here", "no_such_module_here:factory", "explain_factories:nope"])
def test_an_explain_target_that_cannot_be_loaded_is_one_input_error(target, tmp_path, monkeypatch, capsys):
    (tmp_path / "explain_factories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "--device", "cpu", "--explain-only", "--explain-target", target]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --explain-target: ") and target in lines[0], err
    assert not out


@pytest.mark.parametrize("debug", ["", "1"])
def test_a_failed_explain_run_is_one_run_error(debug, tmp_path, monkeypatch, capsys):
    (tmp_path / "explain_factories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)                 # a target beside the user, as `python -m` imports it
    monkeypatch.setenv("WAN_ACCEL_DEBUG", debug)
    argv = ["profile", "--device", "cpu", "--explain-only", "--explain-target", "explain_factories:broken"]
    if debug:                                   # the whole story: the command's traceback and the worker's
        with pytest.raises(ExplainError) as info:
            main(argv)
        assert "Traceback" in str(info.value) and "explain_factories.py" in str(info.value)
        return
    assert main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0] == ("error: explain worker of explain_factories:broken failed: RuntimeError: the factory is "
                        "broken"), lines


# ------------------------------------------------------------------------------------------ one problem, one message
def test_too_few_gpus_for_the_parallel_bench_is_one_input_error():
    import torch

    from wan_accel.bench import parallel
    from wan_accel.app.validate import UsageError
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    parser = argparse.ArgumentParser()
    parallel.add_arguments(parser)
    with pytest.raises(UsageError, match=r"--world-size 2 .*CUDA device"):
        parallel.run(parser.parse_args(["--world-size", "2", "--device", "cuda"]))


@pytest.mark.parametrize("argv, option", [(["profile", "--device", "cpu", "--preset", "nope"], "--preset"),
                                          (["generate", "--preset", "nope"], "--preset"),
                                          (["check-reference", "no_such_folder"], "DIR"),
                                          (["check-reference", ".", "--tol", "-1"], "--tol")])
def test_a_bad_value_is_one_line_before_any_work(argv, option, tmp_path, capsys):
    if argv[0] == "generate":
        argv = argv + ["--out", str(tmp_path / "run")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option}"), err
    assert not out


@pytest.mark.parametrize("action", ["clear", "prune-stale"])
def test_an_unwritable_cache_is_one_error_for_the_commands_that_write_it(action, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(blocker / "limits.json"))     # its folder is a file
    assert main(["cache", action]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the limit cache") and "cannot be written" in lines[0], err


def test_plotting_an_empty_history_is_one_error(tmp_path, capsys):
    code = main(["report", "--history", str(tmp_path / "none.jsonl"), "--plot", str(tmp_path / "plot.png")])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    # without matplotlib that is the one error (exit 1); with it, the empty history (exit 2)
    assert code in (1, 2) and len(lines) == 1 and lines[0].startswith("error: "), err
    assert not out and not (tmp_path / "plot.png").exists()


# ------------------------------------------------------------------- node inputs ComfyUI's own checks let through
class _DecodeVAE:
    """A Wan-like VAE for the decode node: [B, 16, T, h, w] -> [B, (T-1)*4+1, 8h, 8w, 3]."""

    def decode(self, latent):
        import torch

        b, _, t, h, w = latent.shape
        return torch.zeros(b, (t - 1) * 4 + 1, h * 8, w * 8, 3)


def _bad_latents():
    import torch

    return [({}, "holds no latent tensor"),
            ({"samples": None}, "holds no latent tensor"),
            ({"samples": torch.zeros(1, 16, 0, 4, 8)}, "is empty"),
            ({"samples": torch.zeros(1, 16, 3, 4, 8, dtype=torch.int64)}, "not a floating latent"),
            ({"samples": torch.full((1, 16, 3, 4, 8), float("nan"))}, "NaN or infinite"),
            ({"samples": torch.zeros(1, 16, 3, 4, 8).index_fill(2, torch.tensor([1]), float("inf"))}, "NaN or infinite")]


@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("node", ["preview", "decode", "mg2_start"])
def test_a_bad_latent_is_one_value_error_naming_the_input(node, case):
    from wan_accel.nodes.memory_nodes import NODE_CLASS_MAPPINGS as memory_nodes
    from wan_accel.nodes.mg2_nodes import model_space_start
    from wan_accel.nodes.preview_nodes import WanAccelLatentPreview

    latent, reason = _bad_latents()[case]
    call, name = {"preview": (lambda: WanAccelLatentPreview().preview(latent, 1), "samples"),
                  "decode": (lambda: memory_nodes["WanAccelChunkedVAEDecode"]().decode(latent, _DecodeVAE(), 0, 2), "samples"),
                  "mg2_start": (lambda: model_space_start(latent), "start_latent")}[node]
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value).startswith(name) and reason in str(info.value), str(info.value)


def test_a_latent_of_the_wrong_family_names_the_channels():
    import torch

    from wan_accel.nodes.preview_nodes import WanAccelLatentPreview

    with pytest.raises(ValueError, match=r"samples has 4 channels but 16 are needed"):
        WanAccelLatentPreview().preview({"samples": torch.zeros(1, 4, 3, 4, 8)}, 1)   # an SD latent
    (images,) = WanAccelLatentPreview().preview({"samples": torch.zeros(1, 16, 3, 4, 8)}, 1)
    assert images.shape == (3, 4, 8, 3)


@pytest.mark.parametrize("name, reason", [("a\x00b", "control character"), ("sub/x\ny", "control character"),
                                          ("x" * 300, "longer than 255 bytes"), ("\ud800", "cannot be written")])
def test_file_name_inputs_refuse_what_no_file_system_takes(tmp_path, name, reason):
    from wan_accel.nodes.comfy.comfy_files import resolve_inside
    from wan_accel.nodes.profile_nodes import _out_dir

    with pytest.raises(ValueError, match=f"^output_subfolder .*{reason}"):
        _out_dir(name)
    with pytest.raises(ValueError, match=f"^file .*{reason}"):
        resolve_inside(tmp_path, name + ".safetensors", input_name="file", folder_label="the input folder")
    assert _out_dir("x" * 255).name == "x" * 255                        # the longest name a folder may have


@pytest.mark.parametrize("shift", [float("nan"), float("inf"), -float("inf")])
def test_causal_sigmas_refuse_a_non_finite_shift(shift):
    from wan_accel.nodes.native_nodes import WanCausalSigmas

    with pytest.raises(ValueError, match="^shift must be a finite number"):
        WanCausalSigmas().get_sigmas("custom", "1000,500", shift, True)
    with pytest.raises(ValueError, match="^steps: timestep nan"):
        WanCausalSigmas().get_sigmas("custom", "1000,nan", 5.0, True)
    (sigmas,) = WanCausalSigmas().get_sigmas("self_forcing", "1000,750,500,250", shift, True)  # preset: shift unused
    assert sigmas.isfinite().all() and sigmas[-1] == 0


def test_apply_compile_on_a_model_of_another_family_is_a_value_error():
    import torch

    from wan_accel.nodes.compile_nodes import ApplyCompileNativeWan

    class _Inner(torch.nn.Module):               # a MODEL whose diffusion model has no Wan blocks (an SD UNet)
        def __init__(self):
            super().__init__()
            self.diffusion_model = torch.nn.Sequential(torch.nn.Linear(2, 2))

    class _Patcher:
        def __init__(self):
            self.model, self.model_options = _Inner(), {"transformer_options": {}}

        def clone(self):
            return _Patcher()

        def get_model_object(self, name):
            obj = self.model
            for part in name.split("."):
                obj = getattr(obj, part)
            return obj

    with pytest.raises(ValueError, match=r"^Apply Compile \(native Wan\): .*model.blocks"):
        ApplyCompileNativeWan().apply(_Patcher())


@pytest.mark.parametrize("script", ["../../etc/x", "a\x00b", "1e999", "W*0", "mouse(nan,0)*4"])
def test_a_bad_game_actions_script_names_the_widget(script):
    from wan_accel.nodes.mg2_nodes import GameActions
    from wan_accel.sampling.actions_script import ActionScriptError

    with pytest.raises(ActionScriptError, match=r"^script: "):
        GameActions().build(script, "universal")


def _comfy_output(tmp_path, monkeypatch):
    """folder_paths as ComfyUI has it: get_save_image_path refuses a prefix leading out with a bare Exception."""
    import os
    import sys
    import types

    out = tmp_path / "output"
    out.mkdir()

    def get_save_image_path(prefix, output_dir):
        subfolder, name = os.path.split(os.path.normpath(prefix))
        full = os.path.join(output_dir, subfolder)
        if os.path.commonpath((output_dir, os.path.abspath(full))) != output_dir:
            raise Exception("Saving image outside the output folder is not allowed.")
        return full, name, 1, subfolder, prefix

    monkeypatch.setitem(sys.modules, "folder_paths", types.SimpleNamespace(
        get_output_directory=lambda: str(out), get_save_image_path=get_save_image_path))
    return out


@pytest.mark.parametrize("prefix, reason", [("../escape/play", "climbs out"), ("{abs}/play", "absolute path"),
                                            ("a\x00b/play", "control character"), ("x" * 300, "longer than 255"),
                                            ("", "is empty"), ("sub/../../play", "climbs out")])
def test_play_save_prefix_stays_in_the_output_folder(tmp_path, monkeypatch, prefix, reason):
    import threading
    import types

    import torch

    from wan_accel.nodes import play_nodes

    out = _comfy_output(tmp_path, monkeypatch)
    play = types.SimpleNamespace(lock=threading.Lock(), latent_video=lambda: torch.zeros(1, 3, 16, 2, 2),
                                 script_file=lambda: "W*4\n", seed=1, kept={})
    monkeypatch.setattr(play_nodes, "_registry", lambda: types.SimpleNamespace(get=lambda s: play))
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=f"^filename_prefix .*{reason}"):
        play_nodes.MatrixGame2PlaySave().save("s", prefix.format(abs=tmp_path / "elsewhere"), "webp")
    assert sorted(p for p in tmp_path.rglob("*")) == before and list(out.iterdir()) == []
