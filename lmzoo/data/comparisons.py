"""Preference comparisons (Anthropic HH-RLHF format) as reward-model and SFT arrays.

Each .jsonl(.gz) line is `{"chosen": dialogue, "rejected": dialogue}`; the two dialogues share
every turn but the last assistant reply. The shared prefix, up to and including the last
"\n\nAssistant:", is the prompt, and the two remainders are the responses.

Token layout: prompt ⊕ response ⊕ EOS, right-padded. A long prompt keeps its end (the latest
turns) and a long response its start, and each side keeps at least half the window when the
other is long. The EOS closes every sequence, so the reward model reads its score there, as it
does on policy samples stopped at EOS.
"""

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from lmzoo import storage
from lmzoo.data import transforms

ASSISTANT_TURN = "\n\nAssistant:"


class Comparison(NamedTuple):
    prompt: str
    chosen: str
    rejected: str


class RankedResponses(NamedTuple):
    """K responses to one prompt; smaller rank = preferred, equal ranks are ties."""

    prompt: str
    responses: tuple[str, ...]
    ranks: tuple[int, ...]


def split_comparison(chosen: str, rejected: str, marker: str = ASSISTANT_TURN) -> Comparison | None:
    """(prompt, chosen reply, rejected reply), split after the last `marker`; None if the prefixes differ.

    Raises ValueError when a dialogue has no marker."""
    cuts = [text.rfind(marker) for text in (chosen, rejected)]
    if min(cuts) < 0:
        raise ValueError(f"no {marker!r} turn in the {'chosen' if cuts[0] < 0 else 'rejected'} dialogue")
    (chosen_cut, rejected_cut) = (cut + len(marker) for cut in cuts)
    if chosen[:chosen_cut] != rejected[:rejected_cut]:
        return None
    return Comparison(chosen[:chosen_cut], chosen[chosen_cut:], rejected[rejected_cut:])


def _parse_line(line: str) -> tuple[str, str]:
    row = json.loads(line)
    if not isinstance(row, dict) or not all(isinstance(row.get(key), str) for key in ("chosen", "rejected")):
        raise ValueError('expected an object with string fields "chosen" and "rejected"')
    return row["chosen"], row["rejected"]


def read_comparisons(path: str, marker: str = ASSISTANT_TURN) -> list[Comparison]:
    """Comparisons from a .jsonl or .jsonl.gz file, in file order.

    Malformed lines raise ValueError naming the file and line. Pairs whose dialogues differ before
    the last `marker` (no shared prompt) are skipped with a warning listing their lines.
    """
    file = os.fspath(storage.path(path))
    if not storage.exists(file):
        raise FileNotFoundError(f"comparisons file {file!r} does not exist")
    comparisons, unshared = [], []
    with storage.open_read(file, text=True) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                comparison = split_comparison(*_parse_line(line), marker)
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{file}:{line_number}: {e}") from e
            if comparison is None:
                unshared.append(line_number)
            else:
                comparisons.append(comparison)
    if unshared:
        logging.warning(
            "%s: skipped %d pairs whose dialogues differ before the last %r (lines %s)",
            file,
            len(unshared),
            marker,
            unshared,
        )
    return comparisons


def split_heldout(
    comparisons: Sequence[Comparison], fraction: float, seed: int = 0
) -> tuple[list[Comparison], list[Comparison]]:
    """(train, held out): a comparison is held out when a hash of (seed, prompt) falls below `fraction`.

    Deterministic and independent of file order; comparisons sharing a prompt land on the same side. A prompt of chat
    messages (`lmzoo.data.chat.Conversation`) is hashed as its JSON with sorted keys.
    """
    train, heldout = [], []
    for comparison in comparisons:
        prompt = comparison.prompt
        key = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)
        digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
        (heldout if int.from_bytes(digest[:8], "big") / 2**64 < fraction else train).append(comparison)
    return train, heldout


def as_ranked(comparison: Comparison) -> RankedResponses:
    """K = 2: the chosen response ranked above the rejected one."""
    return RankedResponses(comparison.prompt, (comparison.chosen, comparison.rejected), (0, 1))


def _fit(
    prompt: list[int], responses: list[list[int]], max_len: int, eos_id: int, prompt_budget: int = 0
) -> tuple[int, list[list[int]]]:
    """(prompt ids kept, prompt ⊕ response ⊕ EOS of at most max_len ids for each response); one prompt cut for all,
    its end kept: as much of it as leaves room for the longest response (at least max_len // 2 ids), or with a
    prompt_budget P > 0 at most P ids, each response ⊕ EOS then at most max_len - P."""
    if prompt_budget:
        prompt_len, reply_room = min(len(prompt), prompt_budget), max_len - prompt_budget
    else:
        longest = max(len(r) for r in responses) + 1
        prompt_len = min(len(prompt), max(max_len - longest, max_len // 2))
        reply_room = max_len - prompt_len
    kept = prompt[len(prompt) - prompt_len :]
    return prompt_len, [kept + r[: reply_room - 1] + [eos_id] for r in responses]


def reward_model_arrays(
    groups: Sequence[RankedResponses],
    encode: Callable[[str], list[int]],
    *,
    max_len: int,
    max_responses: int,
    pad_id: int,
    eos_id: int,
    prompt_budget: int = 0,
) -> dict[str, np.ndarray]:
    """Ranked groups -> "tokens" [N, K, max_len] int32 (prompt ⊕ response ⊕ EOS, right-padded with pad_id),
    "ranks" [N, K] int32 and "valid" [N, K] bool, K = max_responses (groups with fewer responses are padded).
    prompt_budget P > 0: every prompt cut to its last P ids and every response ⊕ EOS to max_len - P (`_fit`)."""
    if pad_id == eos_id:
        raise ValueError("pad_id must differ from eos_id: the score is read at the EOS, the last non-pad token")
    tokens = np.full((len(groups), max_responses, max_len), pad_id, np.int32)
    ranks = np.zeros((len(groups), max_responses), np.int32)
    valid = np.zeros((len(groups), max_responses), bool)
    for i, group in enumerate(groups):
        k = len(group.responses)
        if not 1 <= k <= max_responses or len(group.ranks) != k:
            raise ValueError(
                f"group {i} has {k} responses and {len(group.ranks)} ranks; need 1..{max_responses} of each, equal"
            )
        _, sequences = _fit(encode(group.prompt), [encode(r) for r in group.responses], max_len, eos_id, prompt_budget)
        for j, ids in enumerate(sequences):
            tokens[i, j, : len(ids)] = ids
        ranks[i, :k], valid[i, :k] = group.ranks, True
    return {"tokens": tokens, "ranks": ranks, "valid": valid}


def sft_arrays(
    comparisons: Sequence[Comparison], encode: Callable[[str], list[int]], *, max_len: int, pad_id: int, eos_id: int
) -> dict[str, np.ndarray]:
    """Next-token examples prompt -> chosen response, in the causal LM batch format.

    Returns "inputs", "targets", "weights", "segment_ids", "positions" [N, max_len]: targets are
    inputs shifted by one, weights are 1 only where the target is a response token or its EOS,
    segment_ids 1 on real tokens and 0 on padding.
    """
    out = {
        "inputs": np.full((len(comparisons), max_len), pad_id, np.int32),
        "targets": np.full((len(comparisons), max_len), pad_id, np.int32),
        "weights": np.zeros((len(comparisons), max_len), np.float32),
        "segment_ids": np.zeros((len(comparisons), max_len), np.int32),
        "positions": np.zeros((len(comparisons), max_len), np.int32),
    }
    for i, comparison in enumerate(comparisons):
        prompt_len, (sequence,) = _fit(encode(comparison.prompt), [encode(comparison.chosen)], max_len + 1, eos_id)
        n = len(sequence) - 1
        out["inputs"][i, :n], out["targets"][i, :n] = sequence[:-1], sequence[1:]
        out["segment_ids"][i, :n], out["positions"][i, :n] = 1, np.arange(n)
        out["weights"][i, max(prompt_len - 1, 0) : n] = (
            1.0  # targets[t] = sequence[t + 1]: the response from t = prompt_len − 1
        )
    return out


def read_splits(
    path: str, heldout_fraction: float, seed: int = 0, read: Callable[[str], list] = read_comparisons
) -> dict[str, list[Comparison]]:
    """{"train", "validation"}: the comparisons of `path` (as `read` reads them) split by `split_heldout` (every stage
    splits alike)."""
    train, heldout = split_heldout(read(path), heldout_fraction, seed)
    if not train or not heldout:
        raise ValueError(
            f"{path}: {len(train)} training and {len(heldout)} held-out comparisons with heldout_fraction="
            f"{heldout_fraction}; both sides need at least one (use more data or change config.objective.heldout_fraction)"
        )
    return {"train": train, "validation": heldout}


def pack_examples(examples: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """Rows of `sft_arrays` (one example each, right-padded) packed first-fit, longest first, into as few rows as fit.

    Every array is [N, L] -> [M, L]; inside a row the examples get segment ids 1, 2, ... (attention and
    positions stay within an example), and padding keeps segment id 0, weight 0 and `pad_id`."""
    lengths = examples["segment_ids"].sum(axis=1)
    width = examples["inputs"].shape[1]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        fit = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if fit is None:
            rows.append([])
            room.append(width)
            fit = len(rows) - 1
        rows[fit].append(int(i))
        room[fit] -= int(lengths[i])
    packed = {k: np.zeros((len(rows), width), v.dtype) for k, v in examples.items()}
    packed["inputs"][:], packed["targets"][:] = pad_id, pad_id
    for r, members in enumerate(rows):
        start = 0
        for segment, i in enumerate(members, 1):
            n = int(lengths[i])
            for key in ("inputs", "targets", "weights", "positions"):
                packed[key][r, start : start + n] = examples[key][i, :n]
            packed["segment_ids"][r, start : start + n] = segment
            start += n
    return packed


def prompt_arrays(
    prompts: Sequence[str], encode: Callable[[str], list[int]], *, prompt_len: int, pad_id: int
) -> dict[str, np.ndarray]:
    """Prompts left-padded to prompt_len (a long one keeps its end): "prompts" [N, prompt_len] int32 and
    "prompt_mask" [N, prompt_len] int32, 1 on real tokens, so every response starts at column prompt_len."""
    tokens = np.full((len(prompts), prompt_len), pad_id, np.int32)
    mask = np.zeros((len(prompts), prompt_len), np.int32)
    for i, prompt in enumerate(prompts):
        ids = encode(prompt)[-prompt_len:]
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens; every prompt needs at least one")
        tokens[i, prompt_len - len(ids) :], mask[i, prompt_len - len(ids) :] = ids, 1
    return {"prompts": tokens, "prompt_mask": mask}


def response_end_id(tokenizer) -> int:
    """The token closing every prompt ⊕ response: the tokenizer's <eos>, or an encoder vocabulary's [SEP]."""
    end = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.sep_id
    if end is None or end == tokenizer.pad_id:
        raise ValueError("the tokenizer needs an <eos> (or [SEP]) id distinct from <pad> to close each response")
    return end


def sft_rows(raw: list[Comparison], tokenizer, *, seq_len: int, vocab_size: int, where: str) -> dict[str, np.ndarray]:
    """Packed rows [M, seq_len] of prompt -> chosen reply examples ("inputs", "targets", "weights", "segment_ids",
    "positions"); ids outside the model's vocab_size are an error naming `where`."""
    if tokenizer.eos_id is None or tokenizer.pad_id is None or tokenizer.pad_id == tokenizer.eos_id:
        raise ValueError(
            "SFT needs a tokenizer with distinct <eos> and <pad> ids (e.g. config.data.tokenizer.kind='byte')"
        )
    examples = sft_arrays(raw, tokenizer.encode, max_len=seq_len, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
    transforms.check_token_ids(examples["inputs"], vocab_size, where=where)
    return pack_examples(examples, tokenizer.pad_id)
