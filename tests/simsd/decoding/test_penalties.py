"""vLLM's presence, frequency and repetition penalties (simsd.decoding.penalties).

* the rule on logits against vLLM's formula, by hand and from vLLM's description in float64;
* which tokens count at a block-diffusion step: the earlier blocks' output and the tokens revealed
  in the state denoised (not MASK, not the prompt tail; the prompt for repetition);
* vanilla decoding with penalties held to the independent reference decoder
  (tests/reference_decoder.py, greedy, every strategy);
* the ranges (vLLM's) refused by name; a request without penalties builds nothing.
"""
import math

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, vanilla_generate
from simsd.config.fields import StepSampling
from simsd.config.vocabulary import ParamError
from simsd.decoding.penalties import TokenHistory, penalize_
from tests.reference_decoder import penalized, reference_generate
from tests.simsd.decoding.test_reference_decoder import PROMPT_LENGTHS, THRESHOLD, ck, path, prompt_of, ref  # noqa: F401

MASK = 7


def history(prompt, earlier, first=0, L=4):
    h = TokenHistory.start(prompt, first, L, MASK, "cpu")
    for block in earlier:
        h = h.after(torch.tensor(block))
    return h


def test_by_hand():
    """vLLM's formula on one row, worked out by hand. Prompt [9, 9, 9, 9, 9, 1] (B = 4: the tail
    [9, 1] opens the first block), first block [9, 1, 2, 2] (output 2, 2), state [2, 3, MASK,
    MASK] of the second: the output so far holds 2 three times and 3 once; repetition 2 on the
    prompt's and the output's tokens (1, 2, 3, 9), then frequency 0.5 per count, presence 1."""
    h = history([9, 9, 9, 9, 9, 1], [[9, 1, 2, 2]], first=2)
    assert h.tokens.tolist() == [MASK, MASK, 2, 2]  # the tail is not output: counted as MASK
    state = torch.tensor([[2, 3, MASK, MASK]])
    x = torch.tensor([[[4.0, 4.0, 4.0, -4.0, 4.0, 4.0, 0.0, -math.inf, 1.0, 1.0]]])
    p = StepSampling(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=2.0)
    got = penalize_(x.clone(), state, [h], p)[0, 0].tolist()
    want = [4.0, 4 / 2, 4 / 2 - 0.5 * 3 - 1, -4 * 2 - 0.5 * 1 - 1, 4.0, 4.0, 0.0, -math.inf, 1.0, 1 / 2]
    assert got == want
    # the same state in the first block, where positions 0 and 1 are the prompt tail: no output yet
    h0 = history([9, 9, 9, 9, 9, 1], [], first=2)
    got = penalize_(x.clone(), state, [h0], p)[0, 0].tolist()
    assert got == [4.0, 4 / 2, 4.0, -4.0, 4.0, 4.0, 0.0, -math.inf, 1.0, 1 / 2]


@pytest.mark.parametrize("pen", [(0.7, 0.0, 1.0), (0.0, -1.3, 1.0), (0.0, 0.0, 1.7), (0.0, 0.0, 0.6),
                                 (-2.0, 2.0, 1.25)])
def test_equals_vllms_formula(pen):
    """Random logits, several states and histories: penalize_ equals vLLM's formula written out in
    float64 (tests/reference_decoder.penalized) to float32 rounding, each state with its own
    counts (the states of one history counted apart)."""
    g = torch.Generator().manual_seed(0)
    V = 12
    prompt = [3, 4, 4, 10]
    h1, h2 = history(prompt, [[1, 2, 2, 11]], first=1), history(prompt, [])
    states = torch.tensor([[2, MASK, MASK, 5], [2, 6, 6, MASK], [MASK] * 4, [0, 0, MASK, 1]])
    hs = [h1, h1, h2, h2]
    logits = torch.randn(4, 3, V, generator=g) * 3
    logits[..., MASK] = -math.inf
    p = StepSampling(presence_penalty=pen[0], frequency_penalty=pen[1], repetition_penalty=pen[2])
    got = penalize_(logits.clone(), states, hs, p)
    earlier = {id(h1): [2, 2, 11], id(h2): []}  # h1's block had the prompt tail at position 0
    for n in range(4):
        output = earlier[id(hs[n])] + [t for t in states[n].tolist() if t != MASK]
        for q in range(3):
            want = penalized(logits[n, q], prompt, output, *pen)
            torch.testing.assert_close(got[n, q].double(), want, rtol=0, atol=1e-5)


def test_neutral_values_are_off():
    assert not StepSampling().penalized and not SamplingParams(temperature=1.0).penalized
    assert SamplingParams(presence_penalty=0.1).penalized and SamplingParams(repetition_penalty=0.9).penalized


@pytest.mark.parametrize("name,bad", [("presence_penalty", 2.5), ("presence_penalty", -2.01),
                                      ("frequency_penalty", -3), ("frequency_penalty", math.inf),
                                      ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
                                      ("repetition_penalty", math.inf), ("repetition_penalty", math.nan)])
def test_ranges_are_vllms(name, bad):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{name: bad})
    assert e.value.param == name and name in str(e.value)


def test_bounds_accepted():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3)
    SamplingParams(presence_penalty=2.0, frequency_penalty=-2.0, repetition_penalty=100.0)


def test_a_request_without_penalties_counts_nothing():
    """No history, no penalty op: the step of a request without penalties is the one it was."""
    from simsd.decoding.step import Step
    cfg = DecodeConfig(block_length=4, max_new_tokens=8)
    step = Step(torch.tensor([MASK] * 4), 0, cfg, MASK)
    logits = torch.randn(1, 4, 96)
    assert step.history is None
    Step.run_batch([step], logits.clone())  # no history needed
    pen = DecodeConfig(block_length=4, max_new_tokens=8, sampling=StepSampling(presence_penalty=1.0))
    with pytest.raises(ValueError, match="token history"):
        Step.run_batch([Step(torch.tensor([MASK] * 4), 0, pen, MASK)], logits.clone())


@pytest.mark.parametrize("strategy", ["sequential", "static", "dynamic", "entropy"])
@pytest.mark.parametrize("pen", [(1.5, 0.0, 1.0), (0.0, 0.8, 1.0), (0.0, 0.0, 2.0), (0.5, 0.5, 1.5)])
def test_vanilla_with_penalties_equals_reference(ck, ref, strategy, pen):  # noqa: F811
    """Greedy vanilla decoding with penalties gives the independent reference's tokens (its own
    counting of the output so far, float64), B = 4 and 8 with multi-token steps and prompt tails;
    the penalties change the tokens (the test would not see them ignored)."""
    changed = 0
    for n, (B, steps) in zip(PROMPT_LENGTHS, ((4, 4), (8, 4), (4, 2), (8, 8))):
        prompt = prompt_of(n)
        kw = dict(block_length=B, steps=steps, strategy=strategy, threshold=THRESHOLD.get(strategy),
                  max_new_tokens=2 * B + 3)
        want = reference_generate(ref, prompt, **kw, stop_ids=[], presence_penalty=pen[0],
                                  frequency_penalty=pen[1], repetition_penalty=pen[2])
        sampling = StepSampling(presence_penalty=pen[0], frequency_penalty=pen[1], repetition_penalty=pen[2])
        cfg = DecodeConfig(block_length=B, steps=steps, strategy=strategy, threshold=THRESHOLD.get(strategy),
                           max_new_tokens=2 * B + 3, sampling=sampling)
        got = vanilla_generate(ck.model, prompt, cfg, ck.mask_token_id, [])
        assert got.token_ids == want.token_ids, (n, B, steps)
        plain = vanilla_generate(ck.model, prompt, DecodeConfig(block_length=B, steps=steps, strategy=strategy,
                                                                threshold=THRESHOLD.get(strategy),
                                                                max_new_tokens=2 * B + 3), ck.mask_token_id, [])
        changed += plain.token_ids != got.token_ids
    assert changed


@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_json_response_format_is_refused_in_every_mode(mode):
    """The Python API refuses a JSON response_format by name whatever the mode (no constrained
    decoding); {"type": "text"} is the default, plain text."""
    from simsd import LLM
    assert SamplingParams(response_format={"type": "text"}) == SamplingParams()
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
        with pytest.raises(ParamError, match="no structured output") as e:
            SamplingParams(response_format=fmt)
        assert e.value.param == "response_format"
    llm = LLM(mode=mode, batch_size=1, scheduler_thread=False)
    with pytest.raises(ParamError) as e:
        llm.generate("hi", SamplingParams(max_tokens=4, response_format={"type": "json_object"}))
    assert e.value.param == "response_format"
    llm.shutdown()
