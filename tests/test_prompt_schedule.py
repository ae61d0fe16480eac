"""Prompt schedules: the text form (round trip, errors naming the line), validation against a run's chunks, and the
contexts they give (mixes, linear and spherical blends) against hand formulas."""
import math

import pytest
import torch

from wan_accel.model.tiny import tiny_text_embedding
from wan_accel.sampling.prompts import SLERP_PARALLEL_COS, Entry, PromptSchedule, blend

EPS = torch.finfo(torch.float32).eps

TEXT = """# a walk
0: a cat walks in the garden

6: the cat starts to run (blend 2)
9: a red fox :0.7 | snow falls :0.3 (blend 3, slerp)
12: the cat sleeps: at noon (blend 0)
"""


def test_parse_reads_every_form():
    s = PromptSchedule.parse(TEXT)
    assert [e.chunk for e in s.entries] == [0, 6, 9, 12]
    assert s.entries[0].parts == (("a cat walks in the garden", 1.0),)
    assert (s.entries[1].blend, s.entries[1].mode) == (2, "linear")
    assert s.entries[2].parts == (("a red fox", 0.7), ("snow falls", 0.3))
    assert (s.entries[2].blend, s.entries[2].mode) == (3, "slerp")
    assert s.entries[3].parts == (("the cat sleeps: at noon", 1.0),) and s.entries[3].blend == 0
    assert s.texts() == ["a cat walks in the garden", "the cat starts to run", "a red fox", "snow falls",
                         "the cat sleeps: at noon"]


def test_to_text_round_trips_and_is_canonical():
    s = PromptSchedule.parse(TEXT)
    text = s.to_text()
    assert PromptSchedule.parse(text) == s
    assert PromptSchedule.parse(text).to_text() == text
    assert "#" not in text and "\n\n" not in text
    odd = PromptSchedule.parse("0: a :0.1 | b :0.2 | c :3e-5\n1: x (blend 4, SLERP)")
    assert PromptSchedule.parse(odd.to_text()) == odd
    assert PromptSchedule.parse("0: one prompt").to_text() == "0: one prompt\n"


@pytest.mark.parametrize("text, line, words", [
    ("1: late start", 1, "chunk 0"),
    ("0: a\nx: b", 2, "not an integer"),
    ("0: a\n3: b\n3: c", 3, "strictly increase"),
    ("0: a\n3: b\n2: c", 3, "does not come after"),
    ("0: a :nan | b :1", 1, "finite number > 0"),
    ("0: a\n1: b :inf | c", 2, "finite number > 0"),
    ("0: a\n1: b :0 | c :1", 2, "finite number > 0"),
    ("0: a\n1: b :-1 | c :1", 2, "finite number > 0"),
    ("0: a\n1: b :lots | c", 2, "not a number"),
    ("0: a\n1: b | | c", 2, "empty"),
    ("0: a\n1:   ", 2, "empty"),
    ("0: a\n1: b (blend 2, cubic)", 2, "blend mode"),
    ("0: a\n1: b (blend two)", 2, "not an integer"),
    ("0: a\n1: b (blend -1)", 2, "must be >= 0"),
    ("0: a (blend 2)", 1, "no earlier prompt"),
    ("0: a\nno colon here", 2, "<chunk>: <prompt>"),
    ("0: a\n-2: b", 2, ">= 0"),
])
def test_errors_name_the_line_and_the_fix(text, line, words):
    with pytest.raises(ValueError) as exc:
        PromptSchedule.parse(text)
    msg = str(exc.value)
    assert f"line {line}" in msg and words in msg, msg


def test_empty_schedule_is_refused():
    for text in ("", "# only a comment\n\n"):
        with pytest.raises(ValueError, match="no entries"):
            PromptSchedule.parse(text)


def test_validate_against_the_run():
    s = PromptSchedule.parse("0: a\n2: b\n4: c")
    assert s.validate(5) is s
    with pytest.raises(ValueError, match="switches at chunk 4 but the run has chunks 0..3"):
        s.validate(4)
    with pytest.raises(ValueError, match=r"chunks 0\.\.1; use chunks below 2"):
        s.validate(2)


def test_constructed_schedules_are_checked_too():
    with pytest.raises(ValueError, match="chunk 0"):
        PromptSchedule((Entry(1, (("a", 1.0),)),))
    with pytest.raises(ValueError, match="strictly increase"):
        PromptSchedule((Entry(0, (("a", 1.0),)), Entry(0, (("b", 1.0),))))
    with pytest.raises(ValueError, match="finite number > 0"):
        PromptSchedule((Entry(0, (("a", math.inf),)),))
    with pytest.raises(ValueError, match="line break"):
        PromptSchedule((Entry(0, (("two\nlines", 1.0),)),))


def _emb(*texts, length=5, dim=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    return {t: torch.randn(1, length, dim, generator=g).to(dtype) for t in texts}


def test_mix_is_the_normalised_weighted_sum():
    emb = _emb("a", "b", "c")
    s = PromptSchedule.parse("0: a :2 | b :1 | c :1")
    ctx = s.contexts(emb, 1)[0]
    want = emb["a"] * 0.5 + emb["b"] * 0.25 + emb["c"] * 0.25
    torch.testing.assert_close(ctx, want, rtol=0, atol=4 * EPS * want.abs().max().item())
    assert not torch.equal(ctx, emb["a"])


def test_blend_steps_reach_the_new_prompt_after_n_chunks():
    emb = _emb("a", "b")
    s = PromptSchedule.parse("0: a\n2: b (blend 4)")
    ctx = s.contexts(emb, 8)
    assert ctx[0] is ctx[1] and torch.equal(ctx[0], emb["a"])
    for j in range(4):
        alpha = (j + 1) / 4
        want = (1 - alpha) * emb["a"] + alpha * emb["b"]
        torch.testing.assert_close(ctx[2 + j], want, rtol=0, atol=4 * EPS)
    assert torch.equal(ctx[5], emb["b"]) and ctx[5] is ctx[6] is ctx[7]
    assert s.switch_chunks(8) == [2, 3, 4, 5]


def test_a_switch_during_a_blend_starts_from_the_blended_context():
    emb = _emb("a", "b", "c")
    s = PromptSchedule.parse("0: a\n1: b (blend 4)\n2: c (blend 2)")
    ctx = s.contexts(emb, 5)
    mid = 0.75 * emb["a"] + 0.25 * emb["b"]
    torch.testing.assert_close(ctx[1], mid, rtol=0, atol=4 * EPS)
    torch.testing.assert_close(ctx[2], 0.5 * mid + 0.5 * emb["c"], rtol=0, atol=8 * EPS)
    assert torch.equal(ctx[3], emb["c"]) and s.switch_chunks(5) == [1, 2, 3]


def test_repeated_prompt_is_no_switch_and_hard_switch_is_one():
    s = PromptSchedule.parse("0: a\n2: a\n3: b")
    assert s.switch_chunks(5) == [3]
    ctx = s.contexts(_emb("a", "b"), 5)
    assert ctx[0] is ctx[2] and ctx[3] is ctx[4]


def test_slerp_matches_the_hand_formula_per_row():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 6, 16, generator=g), torch.randn(2, 6, 16, generator=g)
    for alpha in (0.25, 0.5, 0.9):
        got = blend(a, b, alpha, "slerp")
        a64, b64 = a.double(), b.double()
        cos = (a64 * b64).sum(-1, keepdim=True) / (a64.norm(dim=-1, keepdim=True) * b64.norm(dim=-1, keepdim=True))
        w = torch.acos(cos)
        want = torch.sin((1 - alpha) * w) / torch.sin(w) * a64 + torch.sin(alpha * w) / torch.sin(w) * b64
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=0, atol=64 * EPS * scale)
        lin = (1 - alpha) * a + alpha * b
        assert (got - lin).abs().max() > 100 * EPS * scale      # slerp is not the linear blend


def test_slerp_falls_back_to_linear_for_parallel_and_zero_rows():
    a = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])
    b = torch.tensor([[[2.0, 4.0, 6.0], [1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]]])
    got = blend(a, b, 0.3, "slerp")
    want = 0.7 * a + 0.3 * b
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=4 * EPS)
    assert SLERP_PARALLEL_COS < 1


def test_linear_blend_is_the_hand_formula_and_modes_are_checked():
    a, b = _emb("a", "b").values()
    torch.testing.assert_close(blend(a, b, 0.2), 0.8 * a + 0.2 * b, rtol=0, atol=2 * EPS)
    with pytest.raises(ValueError, match="blend mode"):
        blend(a, b, 0.5, "cubic")


def test_contexts_keep_the_dtype_and_pad_shorter_embeddings():
    emb = _emb("a", length=3, dtype=torch.bfloat16) | _emb("b", length=5, dtype=torch.bfloat16)
    s = PromptSchedule.parse("0: a :1 | b :1")
    ctx = s.contexts(emb, 1)[0]
    assert ctx.dtype == torch.bfloat16 and ctx.shape == (1, 5, 8)
    want = (0.5 * torch.cat([emb["a"].float(), torch.zeros(1, 2, 8)], 1) + 0.5 * emb["b"].float()).bfloat16()
    assert torch.equal(ctx, want)
    with pytest.raises(ValueError, match="no text embedding"):
        PromptSchedule.parse("0: a\n1: zzz").contexts(emb, 2)


def test_tiny_text_embedding_is_deterministic_per_text():
    a = tiny_text_embedding("a cat", 32, 64)
    assert a.shape == (1, 32, 64) and a.dtype == torch.float32
    assert torch.equal(a, tiny_text_embedding("a cat", 32, 64))
    assert not torch.equal(a, tiny_text_embedding("a dog", 32, 64))
