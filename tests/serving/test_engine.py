"""The generation engine: greedy output equal to `decoding.generate` for every decoder family (scanned, grouped-query,
sliding-window, mixture of experts, LoRA merged), continuous batching (a finished slot takes the next request at
the next chunk boundary), prefix sharing (one prefill for n samples), per-request settings, stops, cancellation, a
thread of its own, and the checks on bad requests."""

import functools
import json
import pathlib
import subprocess
import sys
import threading

import flax.linen as nn
import jax
import numpy as np
import pytest

from lmzoo import decoding, models, testing
from lmzoo.lora import transform as lora_transform
from lmzoo.serving import engine, slots
from tests.serving import engine_devices
from tests.test_decoding import randomized

LENGTH = 40
TINY_LLAMA = dict(
    vocab_size=61,
    max_len=LENGTH,
    emb_dim=24,
    num_heads=3,
    num_kv_heads=1,
    head_dim=10,
    num_layers=2,
    mlp_dim=40,
)


def build(name, **fields):
    model = models.build_model(name, fields)
    params = nn.unbox(model.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"])
    return model, randomized(params, seed=3)


def prompts(vocab, lengths=(5, 3, 9, 1, 7, 12, 4), seed=0):
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(0, vocab, size=n)) for n in lengths]


def greedy_reference(model, params, prompt, max_tokens):
    return greedy_references(model, params, [prompt], [max_tokens])[0]


def greedy_references(model, params, prompts, max_tokens):
    """`decoding.generate`'s greedy replies to `prompts` (one left-padded batch), each cut to its max_tokens."""
    width = max(map(len, prompts))
    tokens = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(tokens)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    replies = decoding.generate(
        model, params, tokens, prompt_mask=mask, rng=jax.random.key(0), max_new_tokens=max(max_tokens), temperature=0.0
    )
    return [[int(t) for t in reply[:n]] for reply, n in zip(np.asarray(replies), max_tokens, strict=True)]


FAMILIES = {
    "gpt2": ("gpt2", dict(testing.TINY_GPT2, max_len=LENGTH, vocab_size=53)),
    "llama_scanned": ("llama", dict(TINY_LLAMA, scan_layers=True)),
    "mistral_window": ("llama", dict(TINY_LLAMA, sliding_window=6)),
    "moe": ("llama", dict(TINY_LLAMA, num_experts=4, experts_per_token=2, shared_expert_mlp_dim=16)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_generate_with_slots_reused(family):
    """Seven prompts through 3 slots, 4 steps a chunk: slots are refilled while others decode, and every reply is
    `decoding.generate`'s, token for token."""
    name, fields = FAMILIES[family]
    model, params = build(name, **fields)
    eng = engine.Engine(model, params, slots=3, chunk=4, length=LENGTH)
    requests = [engine.Request(p, max_tokens=3 + 2 * i, temperature=0.0) for i, p in enumerate(prompts(53))]
    tickets = eng.generate(requests)
    expected = greedy_references(model, params, [r.prompt for r in requests], [r.max_tokens for r in requests])
    assert [t.outputs[0].tokens for t in tickets] == expected
    assert all(t.outputs[0].finish_reason == "length" for t in tickets)
    assert eng.stats["slot_fills"] == 7 and eng.stats["prefilled_prompts"] == 7


def test_lora_merged_params_decode_as_their_base_plus_adapters():
    name, fields = FAMILIES["llama_scanned"]
    model, params = build(name, **fields)
    config = lora_transform.LoraConfig(targets="query|value", rank=2, alpha=4.0)
    boxed = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 8), np.int32))["params"]
    adapters = randomized(nn.unbox(lora_transform.init_adapters(jax.random.key(1), boxed, config)), seed=5, std=0.3)
    merged = lora_transform.merge(params, adapters, config)
    prompt = prompts(53)[2]
    ticket = engine.Engine(model, merged, slots=2, chunk=4).generate([engine.Request(prompt, 8, 0.0)])[0]
    assert ticket.outputs[0].tokens == greedy_reference(model, merged, prompt, 8)
    assert ticket.outputs[0].tokens != greedy_reference(model, params, prompt, 8)


@pytest.fixture(scope="module")
def gpt2():
    name, fields = FAMILIES["gpt2"]
    return build(name, **fields)


def test_a_finished_slot_takes_the_next_request_at_the_next_boundary(gpt2):
    """Two slots: a short request and a long one start; the third waits and starts as soon as the short one
    ends, while the long one still runs (a static batch would wait for the longest row)."""
    model, params = gpt2
    eng = engine.Engine(model, params, slots=2, chunk=4)
    first_tokens_at = {}

    def record(name):
        def on_update(ticket):
            first_tokens_at.setdefault(name, eng.stats["chunks"])

        return on_update

    short, long, waiting = prompts(53, (4, 6, 5))
    tickets = {
        name: eng.submit(engine.Request(prompt, max_tokens, 0.0), on_update=record(name))
        for name, prompt, max_tokens in (("short", short, 2), ("long", long, 30), ("waiting", waiting, 5))
    }
    finished_at = {}
    while not all(t.done for t in tickets.values()):
        eng.step()
        for name, ticket in tickets.items():
            if ticket.done:
                finished_at.setdefault(name, eng.stats["chunks"])
    # The short row's slot freed mid-chunk ends that chunk early (work is waiting); the next one admits it.
    assert first_tokens_at["waiting"] == finished_at["short"] + 1
    assert finished_at["waiting"] < finished_at["long"]
    assert eng.stats["slot_fills"] == 3
    for name, (prompt, max_tokens) in {"long": (long, 30), "waiting": (waiting, 5)}.items():
        assert tickets[name].outputs[0].tokens == greedy_reference(model, params, prompt, max_tokens)


def test_a_chunk_runs_on_until_the_waiting_request_has_all_its_slots(gpt2):
    """Three slots busy and a request of n = 2 waiting: the first slot to free does not end the chunk (the request
    could not start in it), the second does, and the next boundary admits both samples."""
    model, params = gpt2
    eng = engine.Engine(model, params, slots=3, chunk=8)
    first, second, long, waiting = prompts(53, (4, 6, 5, 3))
    for prompt, max_tokens in ((first, 2), (second, 5), (long, 30)):
        eng.submit(engine.Request(prompt, max_tokens, 0.0))
    pair = eng.submit(engine.Request(waiting, 3, 0.0, n=2))
    eng.step()
    assert (eng.stats["chunks"], eng.stats["decode_steps"], eng.stats["slot_fills"]) == (1, 5, 3)
    eng.step()
    assert eng.stats["slot_fills"] == 5 and pair.done
    assert pair.outputs[0].tokens == pair.outputs[1].tokens == greedy_reference(model, params, waiting, 3)


def test_n_samples_share_one_prefill_and_a_seed_fixes_them(gpt2):
    model, params = gpt2
    prompt = prompts(53)[5]
    eng = engine.Engine(model, params, slots=4, chunk=4)
    request = engine.Request(prompt, max_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=7, n=4)
    first = eng.generate([request])[0]
    assert eng.stats["prefilled_prompts"] == 1 and eng.stats["slot_fills"] == 4
    samples = [o.tokens for o in first.outputs]
    assert len({tuple(s) for s in samples}) > 1  # different samples of one prefilled prompt
    # The same seed gives the same samples, whatever slots and neighbours they run with.
    crowded = engine.Engine(model, params, slots=3, chunk=3)
    others = [engine.Request(p, max_tokens=6, temperature=1.0, seed=1) for p in prompts(53, (2, 8))]
    again = crowded.generate([*others, engine.Request(prompt, 10, 1.0, 20, 0.9, seed=7, n=3)])[-1]
    assert [o.tokens for o in again.outputs] == samples[:3]
    for output in first.outputs:
        assert len(output.log_probs) == len(output.tokens) and all(p <= 0 for p in output.log_probs)


def test_categorical_draws_each_id_at_its_probability_and_never_a_masked_one():
    """`slots.categorical` (the inverse CDF): over 40,000 draws a row, each id's frequency is within 5 standard errors of
    its softmax probability, and an id of -inf logit (masked ones first, last and between) is never drawn."""
    draws = 40_000
    logits = np.array(
        [
            [-np.inf, 0.0, 1.0, -np.inf, 2.0, -0.5, -np.inf],  # masked ids around and between the drawn ones
            [3.0, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf],  # one id holds all the mass
            [-np.inf, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf, 0.0],  # the last id holds all the mass
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -4.0],
        ],
        np.float32,
    )
    rows = np.repeat(logits, draws, axis=0)
    uniform = jax.random.uniform(jax.random.key(7), (len(rows),))
    ids = np.asarray(jax.jit(slots.categorical)(uniform, rows)).reshape(len(logits), draws)
    probabilities = np.asarray(jax.nn.softmax(logits, axis=-1))
    for row, p in enumerate(probabilities):
        counts = np.bincount(ids[row], minlength=len(p)) / draws
        assert not counts[p == 0].any(), (row, counts)
        np.testing.assert_array_less(np.abs(counts - p), 5 * np.sqrt(p * (1 - p) / draws) + 1e-9)


def test_greedy_and_sampled_requests_share_a_chunk(gpt2):
    model, params = gpt2
    greedy_prompt, sampled_prompt = prompts(53, (6, 6), seed=4)
    eng = engine.Engine(model, params, slots=2, chunk=8)
    greedy, sampled = eng.generate(
        [engine.Request(greedy_prompt, 12, 0.0), engine.Request(sampled_prompt, 12, 1.5, top_k=3, seed=2)]
    )
    assert greedy.outputs[0].tokens == greedy_reference(model, params, greedy_prompt, 12)
    logits = model.apply({"params": params}, np.asarray([sampled_prompt]))[0, -1]
    assert sampled.outputs[0].tokens[0] in np.argsort(np.asarray(logits))[-3:]  # top_k=3 held for that row


def test_log_probs_are_those_of_decoding_sample(gpt2):
    model, params = gpt2
    prompt = prompts(53)[0]
    ticket = engine.Engine(model, params, slots=1, chunk=4).generate([engine.Request(prompt, 6, 0.0)])[0]
    reference = decoding.sample(
        model, params, np.asarray([prompt]), np.ones((1, len(prompt)), np.int32), jax.random.key(0),
        max_new_tokens=6, temperature=0.0,
    )  # fmt: skip
    np.testing.assert_allclose(ticket.outputs[0].log_probs, np.asarray(reference.log_probs[0]), atol=1e-5)


def test_stop_ids_eos_and_stop_strings(gpt2):
    model, params = gpt2
    prompt = prompts(53)[3]
    free_run = greedy_reference(model, params, prompt, 12)
    stop_at = free_run[4]
    eng = engine.Engine(model, params, slots=2, chunk=4, eos_ids=(stop_at,))
    ticket = eng.generate([engine.Request(prompt, 12, 0.0)])[0]
    assert ticket.outputs[0].tokens == free_run[: free_run.index(stop_at) + 1]
    assert ticket.outputs[0].finish_reason == "stop"
    other = next(t for t in free_run if t != stop_at)
    by_request = engine.Engine(model, params, slots=2, chunk=4).generate(
        [engine.Request(prompt, 12, 0.0, stop_ids=(other,))]
    )[0]
    assert by_request.outputs[0].tokens[-1] == other and by_request.outputs[0].finish_reason == "stop"

    class Letters:
        """A tokenizer whose token t is the letter chr(97 + t % 26)."""

        def decode(self, ids):
            return "".join(chr(97 + t % 26) for t in ids)

    text = Letters().decode(free_run)
    stop = text[5:7]
    eng = engine.Engine(model, params, slots=2, chunk=4, tokenizer=Letters())
    ticket = eng.generate([engine.Request(prompt, 12, 0.0, stop=(stop,))])[0]
    assert ticket.outputs[0].text == text[: text.index(stop)]
    assert ticket.outputs[0].finish_reason == "stop"
    assert len(ticket.outputs[0].tokens) < 12  # its slot stopped at the chunk that matched
    assert not eng.busy


def test_text_is_decoded_incrementally_as_a_whole_decode_would(gpt2):
    """Each chunk decodes only its new tokens (beside the previous chunk's), yet the text equals one decode of all of
    them: for characters split over tokens and chunks, and for a decode that drops a leading space."""
    model, params = gpt2

    class Pieces:
        """Tokens of UTF-8 fragments: half a euro sign, its last byte, or " a"; a leading space is dropped (as
        sentencepiece does)."""

        def decode(self, ids):
            pieces = (b"\xe2\x82", b"\xac", b" a")
            return b"".join(pieces[t % 3] for t in ids).decode("utf-8", errors="replace").removeprefix(" ")

    (prompt,) = prompts(53, (6,), seed=4)
    eng = engine.Engine(model, params, slots=2, chunk=3, tokenizer=Pieces())
    outputs = eng.generate([engine.Request(prompt, 30, 1.0, seed=5, n=2)])[0].outputs
    for output in outputs:
        assert len(output.tokens) == 30 and output.text == Pieces().decode(output.tokens)
    assert "\u20ac" in outputs[0].text + outputs[1].text and "\ufffd" in outputs[0].text + outputs[1].text


def test_cancel_frees_the_slot_and_waiting_work_runs(gpt2):
    model, params = gpt2
    first, second = prompts(53, (5, 5), seed=9)
    eng = engine.Engine(model, params, slots=1, chunk=2)
    running = eng.submit(engine.Request(first, 30, 0.0))
    queued = eng.submit(engine.Request(second, 4, 0.0))
    eng.step()
    assert len(running.outputs[0].tokens) == 2 and not queued.outputs[0].tokens  # queued, not dropped
    running.cancel()
    while not queued.done:
        eng.step()
    assert running.outputs[0].finish_reason == "cancelled" and len(running.outputs[0].tokens) == 2
    assert queued.outputs[0].tokens == greedy_reference(model, params, second, 4)


def test_a_thread_of_its_own_serves_concurrent_submitters(gpt2):
    model, params = gpt2
    eng = engine.Engine(model, params, slots=2, chunk=4)
    eng.start()
    try:
        batch = prompts(53, (3, 4, 5, 6, 7))
        results = {}

        def client(i):
            ticket = eng.submit(engine.Request(batch[i], 5, 0.0))
            assert ticket.wait(timeout=120)
            results[i] = ticket.outputs[0].tokens

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(batch))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        eng.stop()
    assert [results[i] for i in range(len(batch))] == greedy_references(model, params, batch, [5] * len(batch))


def test_served_a_request_arriving_mid_chunk_gets_its_first_token_after_short_chunks(gpt2):
    """On its own thread, with a slot free or a request yet to sample, the engine decodes chunks of short_chunk
    steps: a request arriving while another decodes comes back with its first token alone, not after a chunk of 16
    steps (which would hand back its 8 tokens at once)."""
    model, params = gpt2
    running_prompt, late_prompt = prompts(53, (3, 4), seed=11)
    eng = engine.Engine(model, params, slots=2, chunk=16, short_chunk=1)
    started, first_update = threading.Event(), {}
    eng.start()
    try:
        running = eng.submit(engine.Request(running_prompt, 36, 0.0), on_update=lambda ticket: started.set())
        assert started.wait(timeout=120)
        late = eng.submit(
            engine.Request(late_prompt, 8, 0.0),
            on_update=lambda ticket: first_update.setdefault("tokens", len(ticket.outputs[0].tokens)),
        )
        assert late.wait(timeout=120) and running.wait(timeout=120)
    finally:
        eng.stop()
    assert first_update["tokens"] == 1
    assert late.outputs[0].tokens == greedy_reference(model, params, late_prompt, 8)
    assert running.outputs[0].tokens == greedy_reference(model, params, running_prompt, 36)
    with pytest.raises(ValueError, match=r"short_chunk=0 must lie in \[1, chunk=16\]"):
        engine.Engine(model, params, slots=2, chunk=16, short_chunk=0)


def test_lanes_decode_side_by_side_as_one_lane_does(gpt2):
    """Four slots in two lanes: nine requests (greedy, and sampled n = 2 by seed) run in both lanes at once, each
    reply what one lane of four slots gives, greedy ones `decoding.generate`'s token for token."""
    model, params = gpt2
    greedy_prompts = prompts(53, (5, 3, 9, 1, 7, 12, 4), seed=2)
    requests = [engine.Request(p, max_tokens=2 + 3 * i, temperature=0.0) for i, p in enumerate(greedy_prompts)]
    requests += [engine.Request(p, 9, 1.0, top_k=5, seed=s, n=2) for s, p in enumerate(prompts(53, (4, 6), seed=3))]
    laned = engine.Engine(model, params, slots=4, chunk=3, lanes=2)
    assert [lane.slots for lane in laned.lanes] == [2, 2]
    replies = [[o.tokens for o in t.outputs] for t in laned.generate(requests)]
    one_lane = engine.Engine(model, params, slots=4, chunk=3, lanes=1)
    assert replies == [[o.tokens for o in t.outputs] for t in one_lane.generate(requests)]
    expected = greedy_references(model, params, greedy_prompts, [r.max_tokens for r in requests[:7]])
    assert [r[0] for r in replies[:7]] == expected
    assert all(np.asarray(lane.state.generated).max() > 0 for lane in laned.lanes)  # both lanes decoded
    assert laned.stats["slot_fills"] == 11 and laned.stats["prefilled_prompts"] == 9 and not laned.busy


def test_lanes_serve_concurrent_submitters_and_a_failing_lane_fails_every_ticket(gpt2, monkeypatch):
    model, params = gpt2
    eng = engine.Engine(model, params, slots=4, chunk=4, lanes=2)
    batch = prompts(53, (3, 4, 5, 6, 7, 8), seed=6)
    eng.start()
    try:
        tickets = [eng.submit(engine.Request(p, 5, 0.0)) for p in batch]
        assert all(t.wait(timeout=120) for t in tickets)
    finally:
        eng.stop()
    assert [t.outputs[0].tokens for t in tickets] == greedy_references(model, params, batch, [5] * len(batch))

    def lost():
        raise RuntimeError("the device is gone")

    # Two requests of n = 2 queued, then the threads started: lane 0 (two slots) can take one only, so the failing
    # lane steps for the other; the request running in the healthy lane ends with the error too.
    monkeypatch.setattr(eng.lanes[1], "step", lost)
    tickets = [eng.submit(engine.Request(p, 30, 0.0, n=2)) for p in batch[:2]]
    eng.start()
    try:
        assert all(t.wait(timeout=120) for t in tickets)
    finally:
        eng.stop()
    for ticket in tickets:
        assert [o.finish_reason for o in ticket.outputs] == ["error", "error"]
        assert "the device is gone" in str(ticket.error)
    with pytest.raises(RuntimeError, match="the engine has failed"):
        eng.submit(engine.Request(batch[0], 3, 0.0))
    monkeypatch.setattr(engine._Lane, "step", lambda lane: lost())
    with pytest.raises(RuntimeError, match="the device is gone"):  # generate raises a lane's error
        engine.Engine(model, params, slots=4, chunk=4, lanes=2).generate([engine.Request(p, 5, 0.0) for p in batch])


def test_default_lanes_are_one_a_core_on_a_cpu_each_of_eight_slots_or_more(gpt2, monkeypatch):
    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert [engine.default_lanes(s) for s in (64, 24, 20, 9, 4)] == [4, 3, 2, 1, 1]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    assert engine.default_lanes(64, mesh) == 4  # a one-device mesh runs as no mesh (several: test_sharded_on_a_mesh...)
    model, params = gpt2
    with pytest.raises(ValueError, match="lanes=3: must divide the 4 slots evenly"):
        engine.Engine(model, params, slots=4, lanes=3)
    with pytest.raises(ValueError, match=r"n=3: must be between 1 and the 2 slots of a lane \(the engine's 4 slots"):
        engine.Engine(model, params, slots=4, lanes=2).check(engine.Request((1, 2), n=3))


@pytest.mark.parametrize(
    "request_fields, message",
    [
        (dict(prompt=tuple(range(40))), "the prompt has 40 tokens; this model's context is 40 tokens"),
        (dict(prompt=(1,) * 30, max_tokens=11), "exceed the context of 40 tokens: ask for at most 10 tokens"),
        (dict(temperature=-0.5), "temperature=-0.5: must be >= 0"),
        (dict(top_p=1.5), r"top_p=1.5: must be in \(0, 1\]"),
        (dict(top_p=0.0), r"top_p=0.0: must be in \(0, 1\]"),
        (dict(n=3), "n=3: must be between 1 and the engine's 2 slots"),
        (dict(prompt=(1, 60)), r"token ids outside \[0, 53\)"),
        (dict(prompt=()), "the prompt is empty"),
        (dict(stop=("x",)), "stop strings need an engine with a tokenizer"),
    ],
)
def test_bad_requests_are_refused_before_any_work(gpt2, request_fields, message):
    model, params = gpt2
    eng = engine.Engine(model, params, slots=2)
    with pytest.raises(ValueError, match=message):
        eng.submit(engine.Request(**{"prompt": (1, 2), **request_fields}))
    assert not eng.busy


def test_sharded_on_a_mesh_replies_as_on_one_device():
    """4 simulated devices, params sharded over data 2 x tensor 2, the engine entering the mesh itself."""
    job = {"prompts": [[1, 2, 3], [5, 6, 7, 8, 9], [10], [11, 12], [13, 14, 15, 16, 17, 18]], "max_tokens": 6}
    script = pathlib.Path(__file__).with_name("engine_devices.py")
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(job)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    sharded = printed["replies"]
    # A mesh of several devices runs one program at a time: one lane. Without a mesh the engine runs on one device
    # however many are listed: as many lanes as in this one-device process (one a core).
    assert printed["default_lanes"] == {"mesh": 1, "no_mesh": engine.default_lanes(64)}
    model, _, params = engine_devices.build()
    requests = [engine.Request(tuple(p), job["max_tokens"], 0.0) for p in job["prompts"]]
    single = engine.Engine(model, params, slots=4, chunk=4).generate(requests)
    assert sharded == [t.outputs[0].tokens for t in single]
    assert len({tuple(s) for s in sharded}) == len(sharded)


def test_prefill_reads_the_head_at_the_last_position_alone():
    """`slots.prefill`'s first-token logits equal the full forward's at each prompt's last position, and its compiled
    program computes no [n·P, V] logits (a released vocabulary's would be most of a long prompt's prefill)."""
    model, params = build("llama", **dict(TINY_LLAMA, vocab_size=67))
    tokens = np.array([[0, 0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7]], np.int32)
    mask = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], np.int32)
    prefill = jax.jit(functools.partial(slots.prefill, model, length=LENGTH))
    _, logits, position = prefill(params, tokens, mask)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    full = model.apply({"params": params}, tokens, positions=positions, segment_ids=mask)
    np.testing.assert_allclose(logits, full[:, -1], atol=1e-5)
    np.testing.assert_array_equal(position, [5, 7])
    program = prefill.lower(params, tokens, mask).compile().as_text()
    assert f"[{tokens.size},67]" not in program and "[2,7,67]" not in program
