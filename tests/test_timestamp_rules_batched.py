"""The batched timestamp-rule processor (mmcpu/whisper_timestamps.py) against the per-rule formulation it replaced
(mmcpu_dev.bench.tsrules.PerRuleReference, kept verbatim): the same output logits, bit for bit, on random batches.

Each batch mixes declined rows (no rules) with timestamped rows in shuffled request slots; the histories cover the
first step, after one timestamp, after a pair, text, a lone closing timestamp, decreasing timestamps, the end
token, stray special tokens, forced text at every position and past its end, with max_initial from 0 to beyond the
timestamps. Logits: normal noise with -inf entries, rows of ties (coarsely rounded values), rows where the
timestamps dominate, and rows tuned so that the timestamps' total mass sits within 1e-8..1e-4 of the best text
token (the near-ties the batched form hands to openai-whisper's log-probability arithmetic).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams

from mmcpu.whisper_timestamps import NUM_TIMESTAMPS, TIE_TOLERANCE, WhisperTimestamps, request_args
from mmcpu_dev.bench.tsrules import TINY_EN, PerRuleReference, batch

TOY = {"timestamp_begin": 100, "eot": 50, "no_timestamps": 99, "vocab": 100 + NUM_TIMESTAMPS + 3}


def history(rng: random.Random, ids: dict[str, int], text: list[int] | None) -> tuple[list[int], int]:
    """A prompt and generated tokens: a rule-abiding walk (timestamps in pairs, rising), cut anywhere, sometimes
    broken (a falling timestamp, the end, a special token, a stray text token)."""
    tb, eot = ids["timestamp_begin"], ids["eot"]
    prompt = [rng.randrange(eot + 1, tb) for _ in range(rng.randint(1, 4))]
    out: list[int] = []
    t = rng.randint(0, 50)
    queue = list(text) if text is not None else [rng.randrange(eot) for _ in range(rng.randint(0, 12))]
    out.append(tb + t)
    while queue and rng.random() < 0.95:
        for _ in range(rng.randint(1, 4)):
            if queue:
                out.append(queue.pop(0))
        t = min(t + rng.randint(0, 200), NUM_TIMESTAMPS - 1)
        out.append(tb + t)
        if rng.random() < 0.6:
            t = min(t + rng.randint(0, 3), NUM_TIMESTAMPS - 1)
            out.append(tb + t)
    out = out[: rng.randint(0, len(out))]  # the step: anywhere, the first one included
    roll = rng.random()
    if out and roll < 0.1:
        out.append(tb + rng.randint(0, max(t - 1, 0)))  # a falling timestamp
    elif out and roll < 0.15:
        out.append(eot)
    elif roll < 0.2:
        out.append(rng.choice([ids["no_timestamps"], rng.randrange(eot + 1, tb)]))
    elif roll < 0.25:
        out.append(rng.randrange(eot))  # text not in the forced text (a row over- or mis-forced)
    return prompt + out, len(prompt)


def logits_for(rng: random.Random, ids: dict[str, int], n: int) -> torch.Tensor:
    tb, vocab = ids["timestamp_begin"], ids["vocab"]
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn((n, vocab), generator=gen) * rng.choice([1.0, 3.0, 10.0])
    for i in range(n):
        kind = rng.random()
        if kind < 0.2:
            x[i] = (x[i] * 2).round() / 2  # ties
        elif kind < 0.35:
            x[i, tb:] += rng.uniform(2, 8)  # timestamps likely
        if rng.random() < 0.3:
            x[i, torch.rand(vocab, generator=gen) < 0.1] = float("-inf")
    return x


def tune_near_tie(logits: torch.Tensor, allowed: torch.Tensor, tb: int, rng: random.Random) -> None:
    """Shift the timestamp logits of each row so that their total mass over what the rules allow lands within
    1e-8..1e-4 of the best allowed text token."""
    for i in range(logits.shape[0]):
        masked = logits[i].masked_fill(~allowed[i], float("-inf"))
        stamps, text = masked[tb : tb + NUM_TIMESTAMPS], masked[:tb]
        if not (torch.isfinite(stamps).any() and torch.isfinite(text).any()):
            continue
        gap = float(text.max() - torch.logsumexp(stamps, 0))
        logits[i, tb : tb + NUM_TIMESTAMPS] += gap + rng.choice([-1, 1]) * 10 ** rng.uniform(-8, -4)


def run(seed: int, ids: dict[str, int]) -> tuple[int, int]:
    rng = random.Random(seed)
    tb, eot, no_ts = ids["timestamp_begin"], ids["eot"], ids["no_timestamps"]
    n = rng.randint(1, 9)
    max_num_reqs = n + rng.randint(0, 4)
    slots = rng.sample(range(max_num_reqs), n)
    rows, params = [], []
    for _ in range(n):
        if rng.random() < 0.2:
            rows.append(([1, 2, rng.randrange(eot)], 2))
            params.append(SamplingParams())  # declined
            continue
        text = [rng.randrange(eot) for _ in range(rng.randint(0, 6))] if rng.random() < 0.4 else None
        rows.append(history(rng, ids, text))
        max_initial = rng.choice([0.0, 0.02, 0.5, 1.0, 40.0])
        params.append(SamplingParams(extra_args=request_args(tb, eot, no_ts, max_initial, text)))
    states, ctx = batch([h for h, _ in rows], [p for _, p in rows], slots, max_num_reqs)
    new, ref = WhisperTimestamps(None, states), PerRuleReference(None, states)
    for s, p in zip(slots, params, strict=True):
        assert new.add_request(s, p) == ref.add_request(s, p)
    logits = logits_for(rng, ids, n)
    if rng.random() < 0.5:  # near-ties: tuned on the rules' masking of these very logits
        probe = torch.zeros_like(logits)
        probe[:, :tb] = 1e4  # text far likelier: no forcing, the rules' masking alone
        allowed = torch.isfinite(ref.apply(probe, ctx)) & torch.isfinite(logits)
        tune_near_tie(logits, allowed, tb, rng)
    before = logits.clone()
    want = ref.apply(logits.clone(), ctx)
    got = new.apply(logits.clone(), ctx)
    active = [i for i, p in enumerate(params) if p.extra_args]
    for i in range(n):
        if i not in active:
            assert torch.equal(got[i], before[i]), (seed, i, "a declined row changed")
    assert torch.equal(got, want), (seed, (got != want).any(dim=1).nonzero().squeeze(1).tolist())
    forced_rows = sum(bool(torch.isinf(want[i, :tb]).all() and torch.isfinite(want[i, tb:]).any()) for i in active)
    return len(active), forced_rows


@pytest.mark.parametrize("ids", [TOY, TINY_EN], ids=["toy", "tiny.en"])
def test_same_logits_as_the_per_rule_form(ids: dict[str, int]):
    seeds = range(200 if ids is TOY else 30)
    rows = forced = 0
    for seed in seeds:
        a, f = run(seed, ids)
        rows, forced = rows + a, forced + f
    assert rows > len(seeds) and forced > 0  # timestamped rows, and some of them forced to a timestamp


def test_every_rule_is_reached():
    """The random histories reach each rule: counted on the per-row state the batched form derives."""
    seen: set[str] = set()
    rng = random.Random(7)
    tb = TOY["timestamp_begin"]
    for _ in range(300):
        text = [rng.randrange(TOY["eot"]) for _ in range(rng.randint(0, 6))] if rng.random() < 0.5 else None
        h, p = history(rng, TOY, text)
        gen = h[p:]
        stamps = [t for t in gen if t >= tb]
        if not gen:
            seen.add("first")
        elif gen[-1] >= tb and (len(gen) < 2 or gen[-2] >= tb):
            seen.add("pair" if len(gen) >= 2 else "one timestamp")
        elif gen[-1] >= tb:
            seen.add("lone closing")
        if any(b < a for a, b in zip(stamps, stamps[1:], strict=False)):
            seen.add("decreasing")
        if TOY["eot"] in gen:
            seen.add("end")
        if text is not None:
            done = sum(t < TOY["eot"] for t in gen)
            seen.add("forced, all came" if done >= len(text) else "forced, some left")
    assert seen == {
        "first",
        "one timestamp",
        "pair",
        "lone closing",
        "decreasing",
        "end",
        "forced, all came",
        "forced, some left",
    }


def test_forced_text_at_every_position():
    """Forced text, the step at each of its positions (with and without a pair before it): the same logits."""
    tb, eot, no_ts = TOY["timestamp_begin"], TOY["eot"], TOY["no_timestamps"]
    text = [5, 6, 7, 8]
    full = [tb + 3, 5, 6, tb + 40, tb + 40, 7, 8, tb + 90]
    for cut in range(len(full) + 1):
        h = [1, 2, 3, *full[:cut]]
        states, ctx = batch([h, h], [3, 3], [1, 0])
        new, ref = WhisperTimestamps(None, states), PerRuleReference(None, states)
        for proc in (new, ref):
            proc.add_request(1, SamplingParams(extra_args=request_args(tb, eot, no_ts, text=text)))
            proc.add_request(0, SamplingParams(extra_args=request_args(tb, eot, no_ts)))
        logits = torch.randn((2, TOY["vocab"]), generator=torch.Generator().manual_seed(cut))
        assert torch.equal(new.apply(logits.clone(), ctx), ref.apply(logits.clone(), ctx)), cut


@pytest.mark.parametrize("scale", [1.0, 30.0, 1000.0])
def test_logit_and_log_probability_forms_agree_far_inside_the_tolerance(scale: float):
    """Where exactness rests: the batched form compares logsumexp(timestamp logits) with the best text logit; the
    reference compares the same two on log-probabilities (each minus the row's log-normaliser, rounded apart). A
    decision can only differ when the two differences straddle zero, so rows within TIE_TOLERANCE (relative) of a
    tie are decided the reference's way. Here the gap between the two forms stays below a hundredth of it."""
    tb = TINY_EN["timestamp_begin"]
    gen = torch.Generator().manual_seed(int(scale))
    x = torch.randn((64, TINY_EN["vocab"]), generator=gen) * scale
    x[:, tb:] += torch.rand((64, 1), generator=gen) * scale
    a = torch.logsumexp(x[:, tb:], dim=-1)
    b = x[:, :tb].max(dim=-1).values
    lp = torch.log_softmax(x, dim=-1)
    a_ref = torch.logsumexp(lp[:, tb:], dim=-1)
    b_ref = lp[:, :tb].max(dim=-1).values
    err = ((a - b) - (a_ref - b_ref)).abs().double()
    bound = TIE_TOLERANCE * (1 + a.abs() + b.abs()).double()
    assert (err < bound / 100).all(), float((err / bound).max())


def test_refuses_a_layout_other_than_whispers():
    with pytest.raises(ValueError, match="eot"):
        WhisperTimestamps.validate_params(SamplingParams(extra_args=request_args(50, 100, 99)))


def test_bench_batch_builder_matches_the_runner_layout():
    """The benchmark's and these tests' batch: row i in slot slots[i], the input token at pos, not yet committed."""
    states, ctx = batch([[1, 2, 3], [4, 5]], [2, 1], [3, 0], max_num_reqs=5)
    assert ctx.expanded_idx_mapping.tolist() == [3, 0] and ctx.pos.tolist() == [2, 1]
    assert ctx.input_ids.tolist() == [3, 5] and states.all_token_ids.gpu[3, :2].tolist() == [1, 2]
    assert np.array_equal(ctx.idx_mapping_np, [3, 0]) and states.prompt_len.gpu.tolist() == [1, 0, 0, 2, 0]
