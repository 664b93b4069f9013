"""The OpenAI-compatible server (lmzoo/cli/serve.py) on 127.0.0.1, driven by the clients people use: the `openai`
Python client (completions, chat completions, streaming, n > 1, errors), lm-eval's `local-completions`
(generate_until and loglikelihood through echo + logprobs) and `local-chat-completions`, and raw HTTP where a client
hides what is checked (malformed JSON, the stream's `[DONE]`, a client that disconnects mid-stream).

One server, in this process, serves a tiny trained byte-level run with a ChatML template (--chat_template) to the
module; the command line itself serves a tiny Llama 3 checkpoint folder (--init_from=hf:) in a process of its own,
which SIGTERM stops."""

import asyncio
import concurrent.futures
import dataclasses
import http.client
import importlib.util
import json
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from lmzoo import testing
from lmzoo.cli import serve
from lmzoo.train import loop

openai = pytest.importorskip("openai", reason="pip install -r requirements-test.txt")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT = "the quick brown fox jumps over the lazy dog.\n" * 60
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONTEXT = 128
SLOTS = 2


class Running:
    """A `serve.Server` listening on a free port, its event loop on a thread of this process."""

    def __init__(self, server: serve.Server):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), self.loop).result()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = server.served.name
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
        """(status, JSON body) of a POST with `body` as it is (bytes) or as JSON."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request("POST", path, data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        status, payload = response.status, json.loads(response.read() or b"null")
        connection.close()
        return status, payload


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "corpus.txt").write_text(TEXT)
    (tmp / "chatml.jinja").write_text(CHATML)
    config = testing.tiny_config(sample_tokens=0)
    config.data.source, config.data.path = "local", str(tmp / "corpus.txt")
    config.data.tokenizer = {"kind": "byte"}
    config.model.max_len = CONTEXT
    loop.train_and_evaluate(config, str(tmp / "run"))
    served = serve.load_run(str(tmp / "run"), chat_template=str(tmp / "chatml.jinja"))
    running = Running(serve.Server(served, slots=SLOTS, chunk=8))
    yield running
    running.close()


def greedy(running: Running, prompt, max_tokens: int = 12, **extra):
    return running.client.completions.create(
        model=running.name, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra
    )


def test_models_and_health(running):
    [card] = running.client.models.list().data
    assert card.id == running.name and card.owned_by == "lmzoo" and card.max_model_len == CONTEXT
    connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=10)
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200


def test_completion_counts_and_greedy_samples(running):
    first = greedy(running, "the quick", n=2)
    assert [c.index for c in first.choices] == [0, 1]
    assert first.choices[0].text == first.choices[1].text == greedy(running, "the quick").choices[0].text
    assert first.choices[0].finish_reason == "length"
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len("the quick"), 24)
    several = greedy(running, ["the quick", "hi"], max_tokens=4)
    assert len(several.choices) == 2 and several.usage.prompt_tokens == 11
    assert greedy(running, [104, 105], max_tokens=4).choices[0].text == several.choices[1].text  # "hi" as token ids


def test_seeded_samples_repeat_and_differ_across_n(running):
    def sample(seed):
        reply = running.client.completions.create(
            model=running.name,
            prompt="the",
            max_tokens=16,
            temperature=1.0,
            top_p=0.9,
            n=2,
            seed=seed,
            extra_body={"top_k": 50},
        )
        return [c.text for c in reply.choices]

    first = sample(7)
    assert first == sample(7) and first[0] != first[1] and first != sample(8)


def test_stop_string_ends_the_text_and_its_tokens(running):
    whole = greedy(running, "a lazy", max_tokens=16, logprobs=0).choices[0]
    stop = whole.text[5:7]
    assert whole.text.isascii(), whole.text  # a byte a character: the token count below is a character count
    cut = greedy(running, "a lazy", max_tokens=16, stop=[stop]).choices[0]
    assert cut.text == whole.text[: whole.text.index(stop)] and cut.finish_reason == "stop"
    # the tokens the engine's chunk sampled past the stop string are not counted (nor reported)
    usage = greedy(running, "a lazy", max_tokens=16, stop=stop).usage
    assert usage.completion_tokens == whole.text.index(stop) + len(stop)


def test_logprobs_and_echo_score_the_prompt_as_the_engine_samples(running):
    generated = greedy(running, "the quick", max_tokens=6, logprobs=2).choices[0].logprobs
    assert len(generated.tokens) == 6 and all(len(top) >= 2 for top in generated.top_logprobs)
    for token, value, top in zip(generated.tokens, generated.token_logprobs, generated.top_logprobs, strict=True):
        assert top[token] == value and max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the top token
    text = "the quick" + "".join(generated.tokens)
    echoed = greedy(running, text, max_tokens=0, echo=True, logprobs=1).choices[0]
    assert echoed.text == text and echoed.logprobs.token_logprobs[0] is None
    assert echoed.logprobs.text_offset[:3] == [0, 1, 2] and len(echoed.logprobs.tokens) == len(text)
    # the forward pass over the whole text gives the log-probs the engine's decode steps gave its tokens
    assert echoed.logprobs.token_logprobs[-6:] == pytest.approx(generated.token_logprobs, abs=1e-4)


def test_streamed_text_is_the_whole_text(running):
    whole = greedy(running, "the lazy", max_tokens=20).choices[0].text
    events = list(
        running.client.completions.create(
            model=running.name,
            prompt="the lazy",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(e.choices[0].text for e in events if e.choices) == whole
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].usage.completion_tokens == 20
    # on the wire: server-sent events ending with [DONE]
    connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=60)
    body = {"model": running.name, "prompt": "the lazy", "max_tokens": 3, "stream": True, "n": 2, "temperature": 0}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.getheader("Content-Type").startswith("text/event-stream")
    lines = [line for line in response.read().decode().split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert {json.loads(line[6:])["choices"][0]["index"] for line in lines[:-1]} == {0, 1}


def test_chat_renders_the_template_and_streams(running):
    messages = [{"role": "user", "content": "hello"}]
    reply = running.client.chat.completions.create(
        model=running.name, messages=messages, max_tokens=8, temperature=0, n=2, logprobs=True, top_logprobs=2
    )
    rendered = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert reply.usage.prompt_tokens == len(rendered) and len(reply.choices) == 2
    assert (
        reply.choices[0].message.role == "assistant"
        and reply.choices[0].message.content == reply.choices[1].message.content
    )
    assert len(reply.choices[0].logprobs.content) == reply.usage.completion_tokens // 2
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 2
    stream = running.client.chat.completions.create(
        model=running.name, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    status, tokens = running.post("/tokenize", {"messages": messages})
    assert status == 200 and tokens["count"] == len(rendered)


@pytest.mark.parametrize(
    "body, status, says",
    [
        ({"prompt": "x" * 200}, 400, "the prompt has 200 tokens; this model's context is 128"),
        ({"prompt": "x" * 100, "max_tokens": 60}, 400, "ask for at most 28 tokens"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
        ({"prompt": "x", "temperature": -0.5}, 400, "temperature=-0.5: must be >= 0"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p=0.0: must be in (0, 1]"),
        ({"prompt": "x", "top_p": 1.5}, 400, "top_p=1.5: must be in (0, 1]"),
        ({"prompt": "x", "temperature": "hot"}, 400, "'temperature' must be a number"),
        ({"prompt": "x", "n": SLOTS + 1}, 400, f"n={SLOTS + 1}: must be between 1 and the engine's {SLOTS} slots"),
        ({"prompt": "x", "max_tokens": 0}, 400, "'max_tokens' must be at least 1"),
        ({"prompt": "x", "presence_penalty": 0.5}, 400, "'presence_penalty' is not supported"),
        ({"prompt": []}, 400, "'prompt' must be"),
        ({"prompt": [[1, 2], [300]]}, 400, "token ids outside [0, 258)"),
        (b'{"prompt": "x",', 400, "not valid JSON"),
        (b'["x"]', 400, "must be a JSON object"),
    ],
)
def test_bad_completions_get_an_openai_error(running, body, status, says):
    got, payload = running.post("/v1/completions", body if isinstance(body, bytes) else {"model": running.name, **body})
    assert got == status and says in payload["error"]["message"], payload
    assert payload["error"]["code"] == status and payload["error"]["type"]


def test_bad_chat_and_the_openai_client_error(running):
    got, payload = running.post("/v1/chat/completions", {"messages": [{"content": "hi"}]})
    assert got == 400 and "messages[0] must be an object with a string 'role'" in payload["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="this model's context is 128 tokens"):
        running.client.chat.completions.create(model=running.name, messages=[{"role": "user", "content": "y" * 150}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        running.client.completions.create(model="another", prompt="x")


def test_more_requests_than_slots_wait_their_turn(running):
    fills = running.server.engine.stats["slot_fills"]
    with concurrent.futures.ThreadPoolExecutor(3 * SLOTS) as pool:
        replies = list(pool.map(lambda k: greedy(running, f"{k} the", max_tokens=24), range(3 * SLOTS)))
    assert [r.choices[0].finish_reason for r in replies] == ["length"] * 3 * SLOTS
    assert all(r.usage.completion_tokens == 24 for r in replies)
    assert running.server.engine.stats["slot_fills"] - fills == 3 * SLOTS


def test_a_client_gone_mid_stream_frees_its_slot(running, monkeypatch):
    engine = running.server.engine
    step = engine.step

    def slow_step():  # a chunk every 50 ms: the request would run for a second without the cancel
        step()
        time.sleep(0.05)

    monkeypatch.setattr(engine, "step", slow_step)
    cancelled, steps = running.server.cancelled, engine.stats["decode_steps"]
    connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=60)
    body = {"model": running.name, "prompt": "the", "max_tokens": 120, "stream": True, "temperature": 0}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    sock = connection.sock
    response = connection.getresponse()
    while not response.readline().startswith(b"data: "):  # the first event: the request holds a slot
        pass
    sock.shutdown(socket.SHUT_RDWR)
    response.close()
    connection.close()
    deadline = time.monotonic() + 20
    while (engine.busy or running.server.cancelled == cancelled) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert running.server.cancelled == cancelled + 1 and not engine.busy
    assert engine.stats["decode_steps"] - steps < 120  # stopped early: its slot freed at a chunk boundary
    monkeypatch.undo()
    assert greedy(running, "the", max_tokens=4).choices[0].finish_reason == "length"


def test_tokenizer_endpoints_and_a_model_without_a_template(running):
    status, info = running.post("/detokenize", {"tokens": [104, 105]})
    assert status == 200 and info["prompt"] == "hi"
    connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=10)
    connection.request("GET", "/tokenizer_info")
    info = json.loads(connection.getresponse().read())
    assert info["chat_template"] == CHATML and info["model_max_length"] == CONTEXT
    assert info["eos_token"] is None  # the byte tokenizer's <eos> is no text that encodes back to it
    served = dataclasses.replace(running.server.served, template=None, no_template="the run has none")
    other = Running(serve.Server(served, slots=SLOTS, chunk=8))
    try:
        status, payload = other.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert (
            status == 400
            and "has no chat template (the run has none); restart the server with --chat_template"
            in (payload["error"]["message"])
        )
    finally:
        other.close()


def test_a_failed_engine_answers_500_not_silence(running, monkeypatch):
    other = Running(serve.Server(running.server.served, slots=SLOTS, chunk=8))  # the same programs: compiled already
    try:

        def lost():
            raise RuntimeError("the device is gone")

        for lane in other.server.engine.lanes:  # each steps on a thread of its own
            monkeypatch.setattr(lane, "step", lost)
        status, payload = other.post("/v1/completions", {"prompt": "the", "max_tokens": 4})
        assert status == 500 and "the device is gone" in payload["error"]["message"]
        connection = http.client.HTTPConnection("127.0.0.1", other.port, timeout=10)
        connection.request("GET", "/health")
        assert connection.getresponse().status == 503
    finally:
        other.close()


def test_lm_eval_local_completions(running):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=f"{running.url}/v1/completions", model=running.name, max_length=CONTEXT, max_gen_toks=10
    )
    assert lm.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize: no tokenizer files needed
    contexts = ["the quick", "a lazy dog"]
    requests = [
        Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 10}), k) for k, c in enumerate(contexts)
    ]
    expected = [greedy(running, c, max_tokens=10, stop=["\n\n"]).choices[0].text for c in contexts]
    assert lm.generate_until(requests) == expected
    # loglikelihood: echo + logprobs; a greedy continuation is greedy, with the engine's log-probs
    generated = greedy(running, "the quick", max_tokens=5, logprobs=0).choices[0]
    other = "the quick" + " zz"
    results = lm.loglikelihood(
        [
            Instance("loglikelihood", {}, ("the quick", generated.text), 0),
            Instance("loglikelihood", {}, (other, "!"), 1),
        ]
    )
    assert results[0][0] == pytest.approx(sum(generated.logprobs.token_logprobs), abs=1e-3) and results[0][1]
    echoed = greedy(running, other + "!", max_tokens=0, echo=True, logprobs=1).choices[0].logprobs
    assert results[1][0] == pytest.approx(echoed.token_logprobs[-1], abs=1e-5)


def test_lm_eval_local_chat_completions(running):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalChatCompletion

    lm = LocalChatCompletion(base_url=f"{running.url}/v1/chat/completions", model=running.name, max_gen_toks=6)
    questions = ["hello", "what is a fox?"]
    contexts = [lm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    requests = [
        Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 6}), k) for k, c in enumerate(contexts)
    ]
    expected = [
        running.client.chat.completions.create(
            model=running.name, messages=[{"role": "user", "content": q}], max_tokens=6, temperature=0, stop=["\n\n"]
        )
        .choices[0]
        .message.content
        for q in questions
    ]
    assert lm.generate_until(requests) == expected


def test_cli_user_errors_are_one_line(capsys):
    for argv, says in (
        ([], "give --workdir=RUN (a train.py run) or --init_from=hf:FOLDER"),
        (["--workdir=/nonexistent/run"], "/nonexistent/run/config.json not found"),
        (["--init_from=/models/x"], "give hf:FOLDER"),
        (["--workdir=run", "--slots=0"], "--slots=0: must be at least 1"),
        (["--workdir=run", "--slots=16", "--lanes=3"], "--lanes=3: must divide --slots=16 evenly"),
        (["--workdir=run", "--lanes=0"], "--lanes=0: must be at least 1"),
        (["--workdir=run", "--port=many"], "argument --port: invalid int value"),
    ):
        with pytest.raises(SystemExit) as exit_:
            serve.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and says in err, err


def _llama3_folder():
    spec = importlib.util.spec_from_file_location("llama3_folder", ROOT / "tests" / "convert" / "llama3_folder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_serves_a_checkpoint_folder_and_stops_on_sigterm(tmp_path):
    """A Llama 3 Instruct-like folder whose model always says <|end_of_text|>, its generation_config's second eos id:
    the reply to a chat (through the folder's template) ends at once, at the end of its turn."""
    folder = tmp_path / "llama3"
    folder.mkdir()
    _llama3_folder().write_folder(folder, says="<|end_of_text|>")
    command = [sys.executable, "-m", "lmzoo.cli.serve", f"--init_from=hf:{folder}", "--port=0", "--slots=2"]
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        printed = []
        for line in child.stdout:  # the conversion's report, then where it serves
            printed.append(line)
            if line.startswith("serving "):
                break
        assert printed and printed[-1].startswith("serving "), "".join(printed) + log.read_text()
        url = printed[-1].split(" on ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=str(folder), messages=[{"role": "user", "content": "Hello, how are you today?"}], max_tokens=20
        )
        assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == ""
        assert reply.usage.completion_tokens == 1
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
