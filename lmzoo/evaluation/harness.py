"""An EleutherAI lm-eval model on lmzoo's scoring functions and generation engine: `LmzooLM(lmzoo.load(...))`.

The command line and the model registered as "lmzoo" (which reads a workdir from `--model_args`) are
`lmzoo.cli.harness`: `python -m lmzoo.cli.harness run --model lmzoo --model_args workdir=runs/gpt2 ...`.

Requests are tokenized as lm-eval's HF backend does (trailing context spaces move to the continuation; a
decoder's continuation is the whole text's ids after the context's; an empty context becomes EOS; an
encoder-decoder's context is encoded with EOS appended), so a checkpoint exported to HF
(`python -m lmzoo.cli.export`) scores the same through both.
"""

import collections

import jax
from lm_eval.api.model import LM

from lmzoo import decoding
from lmzoo.evaluation import scoring
from lmzoo.models import kinds
from lmzoo.serving import engine


class LmzooLM(LM):
    """lm-eval's LM interface over a loaded lmzoo checkpoint (`lmzoo.load`: model, params, tokenizer).

    batch_size: requests scored or sampled per compiled call ("auto" and None: 16). max_gen_toks: the most tokens
    `generate_until` samples (256).
    """

    def __init__(self, loaded, batch_size: int | str | None = 16, max_gen_toks: int = 256):
        super().__init__()
        model, params = kinds.generative(loaded.model, loaded.params)  # a PPO policy: its decoder
        if kinds.kind_of(model) not in (kinds.DECODER, kinds.ENCODER_DECODER):
            raise ValueError(
                f"lm-eval needs a decoder (gpt2, llama) or an encoder-decoder (seq2seq); this run is {type(model).__name__}"
            )
        self.model, self.params, self.tokenizer = model, params, loaded.tokenizer
        self.batch_size = 16 if batch_size in (None, "auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.is_seq2seq = kinds.kind_of(self.model) == kinds.ENCODER_DECODER

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer).__name__

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if self.is_seq2seq:
            return self.tokenizer.encode(context) + [self.tokenizer.eos_id], self.tokenizer.encode(continuation)
        if not context:
            return [self.tokenizer.eos_id], self.tokenizer.encode(continuation)
        context_ids = self.tokenizer.encode(context)
        return context_ids, self.tokenizer.encode(context + continuation)[len(context_ids) :]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*request.args) for request in requests]
        totals, greedy = scoring.loglikelihoods(
            self.model, self.params, pairs, batch_size=self.batch_size, pad_id=self.tokenizer.pad_id or 0
        )
        return [(float(t), bool(g)) for t, g in zip(totals, greedy, strict=True)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return [
            scoring.rolling_loglikelihood(
                self.model,
                self.params,
                self.tokenizer.encode(request.args[0]),
                prefix_id=self.tokenizer.eos_id,
                batch_size=self.batch_size,
            )
            for request in requests
        ]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample and a temperature) continuations cut before the first `until` string.
        A decoder's requests run through the generation engine (continuous batching over `batch_size` slots, each
        with its own settings); an encoder-decoder's, grouped by settings, as left-padded batches through
        `decoding.sample_seq2seq`."""
        if not self.is_seq2seq:
            return self._generate_continuously([request.args for request in requests])
        groups = collections.defaultdict(list)
        for index, request in enumerate(requests):
            context, kwargs = request.args
            groups[repr(sorted(kwargs.items()))].append((index, context, kwargs))
        outputs = [""] * len(requests)
        for members in groups.values():
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                texts = self._generate([context for _, context, _ in chunk], chunk[0][2])
                for (index, _, _), text in zip(chunk, texts, strict=True):
                    outputs[index] = text
        return outputs

    def _settings(self, kwargs: dict) -> tuple[list[str], int, float]:
        """(until strings, max new tokens, temperature) of one request's generation kwargs."""
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
        return until, max_new, temperature

    def _generate_continuously(self, requests: list[tuple[str, dict]]) -> list[str]:
        eos = self.tokenizer.eos_id
        batch = []
        for context, kwargs in requests:
            until, max_new, temperature = self._settings(kwargs)
            keep = scoring.prompt_room(self.model, max_new, "max_gen_toks")
            prompt = tuple((self.tokenizer.encode(context) or [eos])[-keep:])
            seed = int(kwargs.get("seed", 0))
            batch.append(engine.Request(prompt, max_new, temperature, seed=seed, stop=tuple(s for s in until if s)))
        length = min(self.model.config.max_len, max(len(r.prompt) + r.max_tokens for r in batch))
        generator = engine.Engine(
            *kinds.decoding_form(self.model, self.params),
            slots=self.batch_size,
            length=length,
            eos_ids=(eos,),
            pad_id=self.tokenizer.pad_id or 0,
            vocab_size=self.tokenizer.vocab_size,
            tokenizer=self.tokenizer,
        )
        return [ticket.outputs[0].text for ticket in generator.generate(batch)]

    def _generate(self, contexts: list[str], kwargs: dict) -> list[str]:
        until, max_new, temperature = self._settings(kwargs)
        eos, pad = self.tokenizer.eos_id, self.tokenizer.pad_id or 0
        stops = tuple(tuple(ids) for ids in (self.tokenizer.encode(s) for s in until) if ids)
        settings = dict(
            max_new_tokens=max_new,
            temperature=temperature,
            eos_id=eos,
            stop_sequences=stops,
            pad_id=pad,
            vocab_size=self.tokenizer.vocab_size,
        )
        rows = [self.tokenizer.encode(c) + [eos] for c in contexts]
        keep = scoring.prompt_room(self.model, max_new, "max_gen_toks")
        prompts, mask = scoring.generation_prompts(rows, keep=keep, pad_id=pad, left=False)
        rng = jax.random.key(int(kwargs.get("seed", 0)))
        samples = decoding.sample_seq2seq(self.model, self.params, prompts, mask, rng, **settings)
        tokens, keep_mask = jax.device_get((samples.tokens, samples.mask))
        return [
            decoding.reply_text(self.tokenizer, row, mask, until) for row, mask in zip(tokens, keep_mask, strict=True)
        ]
