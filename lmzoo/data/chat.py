"""Conversations (`messages` lists, the format trl and HF datasets use) rendered through a checkpoint's own chat
template into token ids, with a loss mask that is 1 exactly on the tokens of assistant turns.

Rows, one per .jsonl(.gz) line or parquet row (trl's conversational formats):

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}   a conversation
    {"chosen": [messages], "rejected": [messages]}         a preference pair; the prompt is their common first messages
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}      a preference pair, its prompt given

The template is the checkpoint's (`chat_template.jinja`, else `chat_template` in `tokenizer_config.json`, as
transformers reads a folder), rendered as transformers' `apply_chat_template` renders it: in jinja2's
`ImmutableSandboxedEnvironment` (a template read from a file runs no code of its own: attribute access into Python
internals is refused), with trim_blocks and lstrip_blocks, loop controls, a `tojson` that does not escape HTML,
`raise_exception`, and tokenizer_config.json's special tokens (bos_token, eos_token, ...) as variables. One change:
`strftime_now` formats a fixed day, 26 Jul 2024 (Llama 3.1's own fallback when it has none), not today, so a template
that prints the date (Llama 3.1, gpt-oss) gives the same tokens for the same rows every day.

The assistant mask. A template with `{% generation %}` blocks marks the assistant's text itself: what transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)` reads, and so trl's SFT `assistant_only_loss`, which
refuses templates without them. Most checkpoints' templates (Llama 3, Qwen 2.5, Mistral) have none; for those, an
assistant message k is the text that rendering messages[:k + 1] adds to rendering messages[:k] with the generation
prompt: its content and the template's end of turn, without the role header that the generation prompt holds. This
needs each of those renders to begin the whole conversation's; a template that rewrites earlier turns (Qwen3 drops
the reasoning of past turns) is refused, naming the row, and needs `{% generation %}` blocks. Text spans become
tokens as in transformers: a token is masked in when its characters overlap an assistant span (the offsets of an HF
tokenizer's encoding; any other tokenizer encodes the text span by span, which are the whole text's ids for byte and
char tokenizers).

Preference pairs become the strings trl's DPO builds (`maybe_extract_prompt`, `maybe_apply_chat_template`): the
prompt rendered with the generation prompt, and each reply the rest of the rendered prompt ⊕ reply.
"""

import datetime
import functools
import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import ml_collections
import numpy as np

from lmzoo import storage, tokenizers
from lmzoo.data import comparisons, sources, transforms

Message = Mapping[str, Any]
SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
TEMPLATE_FILE, TOKENIZER_CONFIG = "chat_template.jinja", "tokenizer_config.json"
ROW_FIELDS = ("messages", "prompt", "chosen", "rejected")
ROW_FORMS = (
    '{"messages": [{"role": ..., "content": ...}, ...]}, a preference pair {"chosen": [...], "rejected": [...]} '
    'with an optional "prompt": [...], or a prompt alone {"prompt": [...]} (sampled from by ppo, grpo and rloo)'
)
# What a {% generation %} block's output is wrapped in while rendering: Unicode noncharacters, which no text holds.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
TEMPLATE_DAY = datetime.datetime(2024, 7, 26)  # what strftime_now formats: rendering does not depend on the day


class Conversation(NamedTuple):
    """One row: `prompt` messages, then `chosen` ones (and, for a preference pair, `rejected` ones instead).

    A `messages` row is cut before its last assistant message (the prompt is what the held-out split hashes) and has
    no `rejected`; a prompt-only row has no `chosen` either (empty). `where` names the file and row in errors."""

    prompt: tuple[Message, ...]
    chosen: tuple[Message, ...]
    rejected: tuple[Message, ...] | None
    where: str


def holds_conversations(raw: Sequence) -> bool:
    """Whether a split's raw examples are chat rows (else HH-RLHF `comparisons.Comparison` strings)."""
    return bool(raw) and isinstance(raw[0], Conversation)


def is_chat_file(path: str) -> bool:
    """A parquet file, or a .jsonl(.gz) whose first row has `messages` or a list of messages as `chosen` or `prompt`."""
    name = storage.path(path).name
    if name.endswith(".parquet"):
        return True
    if not name.endswith((".jsonl", ".jsonl.gz")):
        return False
    row = sources.first_json_row(path)
    return isinstance(row, dict) and (
        "messages" in row or isinstance(row.get("chosen"), list) or isinstance(row.get("prompt"), list)
    )


def _rows(path: str) -> Iterator[tuple[str, dict]]:
    """(where, row) of each .jsonl(.gz) line or parquet row; row N is the Nth record (blank lines are not rows)."""
    file = storage.path(path)
    if not file.name.endswith(SUFFIXES):
        raise ValueError(f"{file}: chat rows are read from {', '.join(SUFFIXES)} files")
    if file.name.endswith(".parquet"):
        with storage.open_read(file) as f:
            table = sources._parquet(file, f)
            columns = [name for name in table.schema_arrow.names if name in ROW_FIELDS]
            number = 0
            for batch in table.iter_batches(columns=columns, batch_size=256):
                for row in batch.to_pylist():
                    number += 1
                    yield f"{file}: row {number}", row
        return
    fix = f"each row needs {ROW_FORMS}"
    for number, row in enumerate(sources.iter_jsonl(file, (), fix), start=1):
        yield f"{file}: row {number}", row


def _messages(value: Any, field: str, where: str) -> tuple[Message, ...]:
    if isinstance(value, str):
        raise ValueError(
            f"{where}: {field!r} is a string, not a list of messages; HH-RLHF dialogues (strings) are read from "
            ".jsonl(.gz) files whose every row is one"
        )
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        raise ValueError(f"{where}: {field!r} must be a list of messages, each an object with a string 'role'")
    return tuple(value)


def _assistant_turns(messages: Sequence[Message]) -> list[int]:
    return [k for k, message in enumerate(messages) if message["role"] == "assistant"]


def _roles(messages: Sequence[Message]) -> list[str]:
    return [message["role"] for message in messages]


def conversation(row: dict, where: str) -> Conversation:
    """The Conversation of one row; ValueError naming `where` for a row of no known form or without an assistant turn."""
    if row.get("messages") is not None:
        messages = _messages(row["messages"], "messages", where)
        turns = _assistant_turns(messages)
        if not turns:
            raise ValueError(
                f"{where}: no assistant turn in 'messages' (roles {_roles(messages)}); the loss is on assistant turns "
                "only, so a conversation without one teaches nothing"
            )
        return Conversation(messages[: turns[-1]], messages[turns[-1] :], None, where)
    if row.get("chosen") is None and row.get("rejected") is None and row.get("prompt") is not None:
        return Conversation(_messages(row["prompt"], "prompt", where), (), None, where)  # trl's prompt-only form
    if row.get("chosen") is None or row.get("rejected") is None:
        present = sorted(k for k, v in row.items() if v is not None)
        raise ValueError(
            f"{where}: no 'messages' (nor 'chosen' and 'rejected', nor 'prompt') field; it has {present}. Each row is "
            f"{ROW_FORMS}"
        )
    chosen, rejected = (_messages(row[field], field, where) for field in ("chosen", "rejected"))
    if row.get("prompt") is not None:
        prompt = _messages(row["prompt"], "prompt", where)
    else:  # trl's maybe_extract_prompt: the messages both replies open with
        shared = next(
            (k for k, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b),
            min(len(chosen), len(rejected)),
        )
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    for field, reply in (("chosen", chosen), ("rejected", rejected)):
        if not _assistant_turns(reply):
            raise ValueError(
                f"{where}: no assistant turn in the {field} reply (roles {_roles(reply)} after the prompt's "
                f"{_roles(prompt)}); each reply of a pair is the assistant's"
            )
    return Conversation(prompt, chosen, rejected, where)


_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def hh_messages(dialogue: str) -> list[dict[str, str]]:
    """An HH-RLHF dialogue ("\\n\\nHuman: ...\\n\\nAssistant: ...", `comparisons`' format) as messages, each turn's
    text stripped; ValueError for text before the first turn."""
    before, *turns = _HH_TURN.split(dialogue)  # the text before the first marker, then role, text, role, text...
    if before.strip():
        raise ValueError(f"an HH-RLHF dialogue starts with '\\n\\nHuman:'; this one with {before[:40]!r}")
    pairs = zip(turns[::2], turns[1::2], strict=True)
    return [{"role": _HH_ROLES[role], "content": text.strip()} for role, text in pairs]


def hh_rows(comparison: comparisons.Comparison) -> tuple[dict, dict]:
    """An HH-RLHF comparison as chat rows: the conversation {"messages": prompt ⊕ chosen reply} and the preference
    pair {"prompt": messages, "chosen": [reply], "rejected": [reply]}, whose prompt the held-out split hashes alike."""
    prompt = hh_messages(comparison.prompt.removesuffix(comparisons.ASSISTANT_TURN))
    chosen, rejected = (
        [{"role": "assistant", "content": reply.strip()}] for reply in (comparison.chosen, comparison.rejected)
    )
    return {"messages": prompt + chosen}, {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def read_conversations(path: str) -> list[Conversation]:
    """The Conversation of every row of a .jsonl(.gz) or parquet file, in file order."""
    if not storage.exists(path):
        raise FileNotFoundError(f"chat file {str(path)!r} does not exist")
    return [conversation(row, where) for where, row in _rows(path)]


def texts(raw: Sequence[Conversation]) -> list[str]:
    """The string contents of every message (what a tokenizer trained on the run's data would read)."""
    return [
        m["content"]
        for c in raw
        for m in (*c.prompt, *c.chosen, *(c.rejected or ()))
        if isinstance(m.get("content"), str)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Templates


@functools.cache
def _environment():
    """A sandboxed jinja2 environment set up as transformers sets up its own for chat templates."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ImportError(
            "chat rows are rendered with jinja2: pip install jinja2==3.1.6 (3.1.6 or later: older releases have "
            "known sandbox escapes)"
        ) from None
    if tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        raise ImportError(f"jinja2 {jinja2.__version__} has known sandbox escapes; pip install jinja2==3.1.6")

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: its output wrapped in _OPEN ... _CLOSE, found and removed later."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_wrap"), [], [], body).set_lineno(lineno)

        def _wrap(self, caller):
            return _OPEN + caller() + _CLOSE

    class Namespace(jinja2.utils.Namespace):
        """namespace() refusing underscore names, as transformers' (no route to Python internals through it)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = TEMPLATE_DAY.strftime
    environment.globals["namespace"] = Namespace
    environment.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    return environment


def _special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... of a tokenizer_config.json (a string, or an added token's {"content": ...})."""
    found = {}
    for key, value in tokenizer_config.items():
        if key.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            found[key] = value
    return found


class ChatTemplate:
    """A chat template compiled in the sandbox: `render` gives the text and the spans of its `{% generation %}`
    blocks, `assistant_spans` the character spans of the assistant turns (see the module docstring)."""

    def __init__(self, text: str, source: str, special_tokens: Mapping[str, str] | None = None):
        environment = _environment()  # first: without jinja2 installed, the error says how to install it
        import jinja2

        self.text, self.source, self.special_tokens = text, source, dict(special_tokens or {})
        self.has_generation = bool(_GENERATION_TAG.search(text))
        try:
            self._compiled = environment.from_string(text)
        except jinja2.TemplateError as e:
            raise ValueError(f"{source}: the chat template does not compile: {e}") from None

    def render(
        self, messages: Sequence[Message], *, where: str, add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """(text, [start, end) of each `{% generation %}` block's output); ValueError naming `where` and this
        template when it fails to render."""
        try:
            wrapped = self._compiled.render(
                **self.special_tokens,
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # a template raises what it likes: raise_exception, a TypeError, a SecurityError
            raise ValueError(
                f"{where}: the chat template of {self.source} fails to render this row: {type(e).__name__}: {e}"
            ) from None
        pieces, spans, length, start = re.split(f"([{_OPEN}{_CLOSE}])", wrapped), [], 0, None
        for piece in pieces:
            if piece == _OPEN and start is None:
                start = length
            elif piece == _CLOSE and start is not None:
                spans.append((start, length))
                start = None
            elif piece in (_OPEN, _CLOSE):
                raise ValueError(
                    f"{where}: unmatched or nested {{% generation %}} blocks (or U+FDD0/U+FDD1 in a message)"
                )
            else:
                length += len(piece)
        return wrapped.replace(_OPEN, "").replace(_CLOSE, ""), spans

    def assistant_spans(self, messages: Sequence[Message], *, where: str) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the [start, end) character spans of its assistant turns)."""
        text, spans = self.render(messages, where=where)
        if not self.has_generation:
            spans = []
            for k in _assistant_turns(messages):
                before, _ = self.render(messages[:k], where=where, add_generation_prompt=True)
                through, _ = self.render(messages[: k + 1], where=where)
                if not (through.startswith(before) and text.startswith(through)):
                    raise ValueError(
                        f"{where}: the chat template of {self.source} does not render message {k + 1} (assistant) as "
                        "an extension of the messages before it, so its text cannot be told apart: give the template "
                        "{% generation %} blocks around the assistant's text (config.objective.chat_template)"
                    )
                spans.append((len(before), len(through)))
        if not any(end > start for start, end in spans):
            raise ValueError(
                f"{where}: the chat template of {self.source} renders no assistant text for this row"
                + (" (its {% generation %} blocks are never reached)" if self.has_generation else "")
            )
        return text, spans


def load_template(path: str) -> ChatTemplate:
    """The chat template at `path`: a folder (its chat_template.jinja, else tokenizer_config.json's chat_template), a
    tokenizer_config.json or a .jinja file. Special tokens come from the tokenizer_config.json there or beside it."""
    where = storage.path(path)
    if not storage.exists(where):
        raise FileNotFoundError(f"chat template {str(path)!r} does not exist (config.objective.chat_template)")
    folder = where if not storage.is_file(where) else where.parent
    config_file = where if where.name == TOKENIZER_CONFIG else folder / TOKENIZER_CONFIG
    tokenizer_config = json.loads(storage.read_text(config_file)) if storage.is_file(config_file) else {}
    if not isinstance(tokenizer_config, dict):
        raise ValueError(f"{config_file}: not a JSON object")
    if storage.is_file(where) and where.name != TOKENIZER_CONFIG:
        return ChatTemplate(storage.read_text(where), str(where), _special_tokens(tokenizer_config))
    if where == folder and storage.is_file(folder / TEMPLATE_FILE):
        return ChatTemplate(
            storage.read_text(folder / TEMPLATE_FILE), str(folder / TEMPLATE_FILE), _special_tokens(tokenizer_config)
        )
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"{where}: no chat template (neither {TEMPLATE_FILE} nor a 'chat_template' string in {TOKENIZER_CONFIG}); "
            "set config.objective.chat_template to a tokenizer_config.json, a .jinja file or the folder holding one"
        )
    return ChatTemplate(template, str(config_file), _special_tokens(tokenizer_config))


def template_for(config: ml_collections.ConfigDict, hf_folder: Callable[[str], str]) -> ChatTemplate:
    """The run's chat template: config.objective.chat_template, else the one beside the run's tokenizer.json
    (config.data.tokenizer.path of kind hf_json; with kind init_from, the folder of init_from="hf:NAME", which
    `hf_folder` resolves as weights read it)."""
    explicit = config.objective.get("chat_template", "")
    if explicit:
        return load_template(explicit)
    spec, init_from = config.data.tokenizer, config.get("init_from") or ""
    if spec.kind == "hf_json" and spec.get("path"):
        return load_template(str(storage.path(spec.path).parent))
    if spec.kind == "init_from" and init_from.startswith("hf:"):
        return load_template(hf_folder(init_from.removeprefix("hf:")))
    raise ValueError(
        f"config.data.path={config.data.path!r} holds chat rows, rendered through a chat template, and the run's "
        f"tokenizer (config.data.tokenizer.kind={spec.kind!r}) has no folder to read one from: set "
        "config.objective.chat_template to a tokenizer_config.json, a chat_template.jinja or the folder holding one"
    )


def run_template(config: ml_collections.ConfigDict, tokenizer: tokenizers.Tokenizer) -> ChatTemplate:
    """The chat template of a trained run (`eval.py --chat`, the export): config.objective.chat_template where it names
    one, else the one its tokenizer came with (an HF checkpoint's chat_template.jinja or tokenizer_config.json, saved
    with the run's tokenizer)."""
    explicit = config.objective.get("chat_template", "")
    if explicit:
        return load_template(explicit)
    text = getattr(tokenizer, "chat_template", None)
    if text:
        tokenizer_config = tokenizer.files.get(TOKENIZER_CONFIG) or {}
        return ChatTemplate(text, "the run's tokenizer (its checkpoint's template)", _special_tokens(tokenizer_config))
    raise ValueError(
        f"the run has no chat template: config.objective has no chat_template and its tokenizer "
        f"(config.data.tokenizer.kind={config.data.tokenizer.kind!r}) came with none (an HF checkpoint's "
        f"{TEMPLATE_FILE} or {TOKENIZER_CONFIG})"
    )


def user_turn(template: ChatTemplate, prompt: str) -> tuple[str, str]:
    """(the text a model continues to answer `prompt` as the user's turn: the template's rendering of it with the
    generation prompt, the text that ends the assistant's turn in this template, e.g. "<|eot_id|>"), the second
    read off the rendering of a reply: what follows the reply's content, stripped of whitespace ("" where the
    template adds nothing)."""
    where = "the prompt"
    messages = [{"role": "user", "content": prompt}]
    text, _ = template.render(messages, where=where, add_generation_prompt=True)
    reply = "\ufdd2"  # a noncharacter, found again in the rendering
    whole, _ = template.render([*messages, {"role": "assistant", "content": reply}], where=where)
    end = whole[whole.index(reply) + 1 :].strip() if reply in whole else ""
    return text, end


def check_template(config: ml_collections.ConfigDict, hf_folder: Callable[[str], str]) -> None:
    """Reads the run's chat template when config.data.path holds chat rows, so that a missing or broken template fails
    when the config is checked, before any model is built."""
    path = config.data.path
    if path and storage.is_file(path) and is_chat_file(path):
        template_for(config, hf_folder)


# ---------------------------------------------------------------------------------------------------------------------
# Tokens


def _encode_spans(
    tokenizer: tokenizers.Tokenizer, text: str, spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """(ids of `text`, 1 on each token whose characters overlap a span)."""
    if isinstance(tokenizer, tokenizers.HFTokenizer):
        encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
        starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)  # an empty token covers its start
        mask = np.zeros(len(offsets), bool)
        for start, end in spans:
            mask |= (starts < end) & (ends > start)
        return list(encoding.ids), mask.astype(int).tolist()
    cuts = sorted({0, len(text), *(c for span in spans for c in span if 0 <= c <= len(text))})
    ids, mask = [], []
    for start, end in zip(cuts[:-1], cuts[1:], strict=True):
        piece = tokenizer.encode(text[start:end])
        inside = any(s <= start < e for s, e in spans)
        ids += piece
        mask += [int(inside)] * len(piece)
    return ids, mask


def tokenize(
    template: ChatTemplate, tokenizer: tokenizers.Tokenizer, messages: Sequence[Message], *, where: str
) -> tuple[list[int], list[int]]:
    """(token ids of the rendered conversation, 1 on the tokens of its assistant turns): transformers'
    `apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)` "input_ids"
    and "assistant_masks" for a template with `{% generation %}` blocks."""
    text, spans = template.assistant_spans(messages, where=where)
    return _encode_spans(tokenizer, text, spans)


def sft_rows(
    raw: Sequence[Conversation],
    template: ChatTemplate,
    tokenizer: tokenizers.Tokenizer,
    *,
    seq_len: int,
    vocab_size: int,
    where: str,
) -> dict[str, np.ndarray]:
    """Packed rows [M, seq_len] ("inputs", "targets", "weights", "segment_ids", "positions", as
    `comparisons.sft_rows`) of each conversation (a pair's prompt ⊕ chosen reply), weighted where the target is an
    assistant token. A conversation longer than seq_len + 1 tokens keeps its start (trl's max_length); one whose
    assistant tokens all fall past the cut is skipped, with a count."""
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0  # padding is neither attended to nor weighted
    shape = (len(raw), seq_len)
    out = {
        "inputs": np.full(shape, pad, np.int32),
        "targets": np.full(shape, pad, np.int32),
        "weights": np.zeros(shape, np.float32),
        "segment_ids": np.zeros(shape, np.int32),
        "positions": np.zeros(shape, np.int32),
    }
    kept, cut = [], []
    for c in raw:
        if not c.chosen:
            raise ValueError(
                f"{c.where}: a prompt-only row; sft trains on replies: a 'messages' conversation or a preference pair"
            )
        ids, mask = tokenize(template, tokenizer, c.prompt + c.chosen, where=c.where)
        ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
        if not any(mask[1:]):
            cut.append(c.where)
            continue
        i, n = len(kept), len(ids) - 1
        out["inputs"][i, :n], out["targets"][i, :n], out["weights"][i, :n] = ids[:-1], ids[1:], mask[1:]
        out["segment_ids"][i, :n], out["positions"][i, :n] = 1, np.arange(n)
        kept.append(i)
    if cut:
        logging.warning(
            "sft, %s: skipped %d of %d conversations with no assistant token in their first data.seq_len + 1 = %d "
            "tokens (%s%s)",
            where,
            len(cut),
            len(raw),
            seq_len + 1,
            ", ".join(cut[:3]),
            ", ..." if len(cut) > 3 else "",
        )
    if not kept:
        raise ValueError(
            f"sft, {where}: no conversation has an assistant token within data.seq_len + 1 = {seq_len + 1} tokens"
        )
    out = {key: value[: len(kept)] for key, value in out.items()}
    transforms.check_token_ids(out["inputs"], vocab_size, where=where)
    transforms.check_token_ids(out["targets"], vocab_size, where=where)
    return comparisons.pack_examples(out, pad)


def rendered_comparisons(raw: Sequence[Conversation], template: ChatTemplate) -> list[comparisons.Comparison]:
    """Preference pairs as (prompt, chosen reply, rejected reply) strings, as trl's DPO renders them: the prompt with
    the generation prompt, each reply what rendering prompt ⊕ reply adds to it."""
    out = []
    for c in raw:
        if c.rejected is None:
            form = "'messages'" if c.chosen else "prompt-only"
            raise ValueError(
                f"{c.where}: a {form} row; preference training reads pairs: "
                '{"chosen": [messages], "rejected": [messages]} (and an optional "prompt": [messages])'
            )
        prompt, _ = template.render(c.prompt, where=c.where, add_generation_prompt=True)
        replies = []
        for field, reply in (("chosen", c.chosen), ("rejected", c.rejected)):
            whole, _ = template.render(c.prompt + reply, where=c.where)
            if not whole.startswith(prompt):
                raise ValueError(
                    f"{c.where}: the chat template of {template.source} renders the prompt (with its generation "
                    f"prompt) as text that does not begin the rendered prompt and {field} reply, so the reply cannot "
                    "be cut from it"
                )
            replies.append(whole[len(prompt) :])
        out.append(comparisons.Comparison(prompt, *replies))
    return out
